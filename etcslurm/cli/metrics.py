"""``etcslurm metrics``: a Prometheus endpoint for one run, read from its coordinator.

    etcslurm metrics --run r1 --port 9400 [--redis URL] [--bind 0.0.0.0]
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "metrics",
        help="serve a run's metrics for Prometheus (/metrics), read from its coordinator",
        description="Serve http://BIND:PORT/metrics: world size, layout, generation, step, "
        "tokens/s, seconds since the last step, resizes by cause, the last resize's pause "
        "and bytes moved (and ÷ the lower bound), the coordinator's primary and failovers "
        "(docs/metrics.md).  Each scrape reads what is new in the coordinator; nothing is "
        "written.  Runs until Ctrl-C or SIGTERM (exit 0).",
    )
    p.add_argument("--run", metavar="RUN", help="the run (default: the only one on the Redis)")
    p.add_argument("--port", type=int, required=True, help="TCP port (0: a free one)")
    p.add_argument("--bind", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--redis", metavar="URL", help="the coordinator (default: as `monitor`)")
    p.add_argument("--password-file", metavar="FILE", help="the password of a URL without one")
    p.add_argument("--run-dir", metavar="DIR", help="a run directory with coordinator.json")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from etcslurm.errors import UsageError
    from etcslurm.monitor.metrics import RunCollector, serve
    from etcslurm.monitor.source import RunSource, open_client, pick_run

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be 0..65535, got {args.port}")
    client = open_client(args.redis, args.run_dir, args.password_file)
    try:
        run_id = pick_run(client, args.run)
        try:
            server, port = serve(RunCollector(RunSource(client, run_id)), args.port, args.bind)
        except OSError as exc:
            raise UsageError(f"cannot listen on {args.bind}:{args.port}: {exc.strerror}") from None
        print(f"etcslurm metrics of run {run_id} on http://{args.bind}:{port}/metrics", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda *_: stop.set())
        try:
            while not stop.wait(1.0):
                pass
        except KeyboardInterrupt:
            pass
        server.shutdown()
        return 0
    finally:
        client.close()
        sys.stdout.flush()
