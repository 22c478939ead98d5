"""``etcslurm coordinator start|stop|url|grant RUN_DIR`` — a bundled Redis for a run directory.

Why a command: operators (and the sbatch templates) need a coordinator that outlives
the workers, on a known port with a private password, without writing a Redis config by
hand.  ``start`` leaves the server running detached and prints its URL; the password stays
in ``RUN_DIR/redis.password`` (0600).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "coordinator",
        help="start/stop a bundled Redis coordinator for a run directory, print its URL",
        description=(
            "Run a private, password-protected redis-server for a run directory "
            "(bound to 127.0.0.1 unless --bind). The password is written 0600 to "
            "RUN_DIR/redis.password."
        ),
    )
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    s = sub.add_parser("start", help="start the server (detached) and print its URL")
    s.add_argument("run_dir", metavar="RUN_DIR")
    s.add_argument("--bind", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 for multi-node)")
    s.add_argument("--port", type=int, default=0, help="TCP port (default: a free one)")
    s.add_argument("--persist", action="store_true",
                   help="keep an append-only file so a restarted server keeps the run's keys")
    s.add_argument("--redis-server", default=None, help="redis-server binary to run")
    s.add_argument("--ready-timeout", type=float, default=15.0, help="seconds to wait for it")
    s.add_argument("--foreground", action="store_true",
                   help="stay in the foreground; stop the server on Ctrl-C/SIGTERM")
    s.add_argument("--json", action="store_true", help="print the state as JSON")
    s.set_defaults(func=_start)
    t = sub.add_parser("stop", help="stop the server of RUN_DIR")
    t.add_argument("run_dir", metavar="RUN_DIR")
    t.set_defaults(func=_stop)
    u = sub.add_parser("url", help="print the URL of RUN_DIR's server")
    u.add_argument("run_dir", metavar="RUN_DIR")
    u.add_argument("--with-password", action="store_true",
                   help="include the password in the URL (keep it out of logs)")
    u.set_defaults(func=_url)
    g = sub.add_parser(
        "grant",
        help="create a per-run ACL user that may only touch that run's keys; print its URL",
    )
    g.add_argument("run_dir", metavar="RUN_DIR")
    g.add_argument("run_id", metavar="RUN_ID")
    g.set_defaults(func=_grant)


def _check_port(port: int) -> None:
    from etcslurm.errors import UsageError

    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be 0..65535, got {port}")


def _start(args: argparse.Namespace) -> int:
    from etcslurm.coord.server import BundledRedis, read_state, running_state

    _check_port(args.port)
    state = running_state(args.run_dir)
    if state is not None:  # else no or stale state file: start a new one
        sys.stderr.write(f"coordinator already running for {args.run_dir}\n")
        print(json.dumps(state) if args.json else state["url"])
        return 0
    srv = BundledRedis(
        args.run_dir, host=args.bind, port=args.port, persist=args.persist,
        executable=args.redis_server, ready_timeout=args.ready_timeout,
        detached=not args.foreground,
    ).start()
    if args.json:
        print(json.dumps(read_state(args.run_dir)))
    else:
        print(srv.url)
    sys.stdout.flush()
    if args.foreground:
        done = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: done.set())
        try:
            while not done.wait(1.0):
                if srv.proc is None or srv.proc.poll() is not None:
                    sys.stderr.write(f"etcslurm: redis-server exited; log {srv.log_file}\n")
                    return 1
        finally:
            srv.stop()
    return 0


def _stop(args: argparse.Namespace) -> int:
    from etcslurm.coord.server import stop_detached
    from etcslurm.errors import UsageError

    try:
        stopped = stop_detached(args.run_dir)
    except UsageError:  # no state file: nothing to stop, which is what was asked
        stopped = False
    if stopped:
        print(f"stopped coordinator of {args.run_dir}")
    else:
        print(f"coordinator of {args.run_dir} was not running")
    return 0


def _url(args: argparse.Namespace) -> int:
    from etcslurm.coord.client import read_password_file, with_password
    from etcslurm.coord.server import read_state

    state = read_state(args.run_dir)
    url = str(state["url"])
    if args.with_password:
        url = with_password(url, read_password_file(str(state["password_file"])))
    print(url)
    return 0


def _grant(args: argparse.Namespace) -> int:
    from pathlib import Path

    from etcslurm.coord.acl import grant_run_user
    from etcslurm.coord.client import connect, redact, with_password
    from etcslurm.coord.server import read_state, write_private

    state = read_state(args.run_dir)
    admin = connect(str(state["url"]), str(state["password_file"]))
    user, password = grant_run_user(admin, args.run_id)
    admin.close()
    pw_file = Path(args.run_dir) / f"{user}.password"
    write_private(pw_file, password + "\n")
    sys.stderr.write(f"password of {user} written to {pw_file} (mode 0600)\n")
    print(redact(with_password(str(state["url"]), password, username=user)).replace(":***", ""))
    return 0
