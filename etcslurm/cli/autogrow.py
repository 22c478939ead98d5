"""``etcslurm autogrow``: grow a running run into idle nodes by itself, up to a cap.

    etcslurm autogrow run.toml                          # the run file's [autogrow] limits
    etcslurm autogrow run.toml --max-nodes 6 --partition preemptible
    etcslurm autogrow --run r1 --redis URL --partition P --max-nodes 6 [--min-idle 1]
                      [--max-pending 1] [--worker-cmd CMD]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "autogrow",
        help="grow a running run into idle nodes by itself (one-node grow jobs, up to a cap)",
        description="Watch sinfo, squeue and the run's coordinator; submit one-node grow jobs "
        "while the partition has idle nodes and the run is below --max-nodes, at most "
        "--max-pending pending; cancel pending ones that do not start (and back off), "
        "those past the cap, and all of them when the run ends.  Each decision is an "
        "`autogrow` event the monitor shows.  Runs until the run ends (exit 0); SIGTERM "
        "cancels its pending jobs and exits 0.",
    )
    p.add_argument("runfile", nargs="?", metavar="RUN.toml",
                   help="the run file of the run (its [autogrow] table gives the defaults)")
    p.add_argument("--run", help="without a run file: the run id")
    p.add_argument("--redis", default=None,
                   help="the run's coordinator URL (default: the run file's, else "
                        "$ETCSLURM_REDIS_URL)")
    p.add_argument("--partition", default=None,
                   help="the partition whose idle nodes it grows into (a run file: "
                        "[autogrow] or [slurm] partition)")
    p.add_argument("--max-nodes", type=int, default=None,
                   help="the most nodes the run may have, its first job's included")
    p.add_argument("--min-idle", type=int, default=None,
                   help="submit only while at least this many nodes are idle (default 1)")
    p.add_argument("--max-pending", type=int, default=None,
                   help="grow jobs pending at once, at most (default 1)")
    p.add_argument("--interval", type=float, default=None,
                   help="seconds between two looks (default 10)")
    p.add_argument("--start-timeout", type=float, default=None,
                   help="a grow job pending this long is cancelled, and the next waits "
                        "(default 120 s; the wait doubles while jobs do not start)")
    p.add_argument("--backoff", type=float, default=None,
                   help="the first wait after a job that did not start (default 30 s)")
    p.add_argument("--worker-cmd", default=None,
                   help="without a run file: the joining workers' command")
    p.add_argument("--tasks-per-node", type=int, default=None,
                   help="without a run file: tasks (devices) per node (default 1)")
    p.add_argument("--time", default=None, help="without a run file: time limit of a grow job")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a field (repeatable): of the run file, else of grow.sbatch")
    p.add_argument("--workdir", default=".",
                   help="without a run file: where the grow jobs' scripts go")
    p.set_defaults(func=run)


_LIMITS = ("max_nodes", "min_idle", "max_pending", "interval", "start_timeout", "backoff",
           "partition")
_DEFAULTS: dict[str, Any] = {"min_idle": 1, "max_pending": 1, "interval": 10.0,
                             "start_timeout": 120.0, "backoff": 30.0}


def run(args: argparse.Namespace) -> int:
    from etcslurm.cli.submit import report
    from etcslurm.coord.coordinator import Coordinator
    from etcslurm.errors import UsageError
    from etcslurm.monitor.source import open_client, pick_run
    from etcslurm.slurm import autogrow as ag
    from etcslurm.slurm import runfile
    from etcslurm.slurm.submission import DEFAULT_WORKER_CMD, grow
    from etcslurm.slurm.templates import load_template, parse_sets

    flags = {k: getattr(args, k) for k in _LIMITS if getattr(args, k) is not None}
    if args.runfile:
        given = [f for f, v in (("--run", args.run), ("--worker-cmd", args.worker_cmd),
                                ("--time", args.time),
                                ("--tasks-per-node", args.tasks_per_node)) if v]
        if given:
            raise UsageError(f"the run file sets {', '.join(given)}: use --set instead")
        try:
            rf = runfile.load(args.runfile, parse_sets(args.sets))
        except runfile.RunFileError as exc:
            return report(exc.problems)
        limits = {**_DEFAULTS, "partition": rf.slurm.get("partition") or "", **rf.autogrow,
                  **flags}
        run_id = rf.run_id
        url = args.redis or runfile.coordinator_url(rf)
        kwargs = rf.grow_args(load_template("grow"), 1)
        kwargs.pop("redis_url", None)
        kwargs["split"] = False
        worker = rf.worker_cmd
    else:
        if not args.run:
            raise UsageError("give the run file (etcslurm autogrow RUN.toml) or --run RUN")
        import os

        url = args.redis or os.environ.get("ETCSLURM_REDIS_URL")
        if not url:
            raise UsageError("the run's coordinator is unknown: give --redis URL (or set "
                             "ETCSLURM_REDIS_URL)")
        limits = {**_DEFAULTS, **flags}
        run_id = args.run
        kwargs = {"tasks_per_node": args.tasks_per_node or 1, "folder": args.workdir,
                  "time_limit": args.time or "01:00:00", "fields": parse_sets(args.sets)}
        worker = args.worker_cmd or DEFAULT_WORKER_CMD
    if "max_nodes" not in limits:
        raise UsageError("--max-nodes is required (or max_nodes in the run file's [autogrow])")
    if not limits.get("partition"):
        raise UsageError("--partition is required (or partition in the run file)")
    policy = ag.Policy(max_nodes=int(limits["max_nodes"]), min_idle=int(limits["min_idle"]),
                       max_pending=int(limits["max_pending"]),
                       start_timeout=float(limits["start_timeout"]),
                       backoff=float(limits["backoff"]))
    name = ag.job_name(run_id)
    kwargs["partition"] = limits["partition"]
    kwargs["fields"] = {**(kwargs.get("fields") or {}), "job_name": name}

    def submit_one() -> str:
        return grow(run_id, worker=worker, redis_url=url, **{"nodes": 1, **kwargs}).job_id

    client = open_client(url)
    try:
        pick_run(client, run_id)
        loop = ag.Autogrow(Coordinator(client, run_id), ag.Slurm(limits["partition"], name),
                           policy, submit_one, interval=float(limits["interval"]),
                           out=lambda line: print(line, flush=True))
        loop.stop_on_signals()
        return loop.run()
    finally:
        client.close()
        sys.stdout.flush()
