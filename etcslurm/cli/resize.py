"""``etcslurm resize``: ask a running run for another layout, or to drain workers.

    etcslurm resize --run r1 --to tp1pp1dp2 --redis redis://:pw@host:port/0
    etcslurm resize --run r1 --drain w3 --drain w4
    etcslurm resize --run r1 --to auto          # back to the automatic choice

The request is checked here against the run's spec (the model's divisibility, the global
batch, TP inside a node) and membership, then queued in the coordinator; the run's leader
carries it out at the next step boundary (or ignores it with an ``error`` event when the
workers available then cannot play it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "resize",
        help="change a running run's layout or drain workers at the next step boundary",
        description="Queue a change request for a running run: a new layout (--to), workers "
        "to take out of the world (--drain), or both. The run's leader carries it out at the "
        "next step boundary.",
    )
    p.add_argument("--run", required=True, metavar="RUN", help="the run id")
    p.add_argument("--to", metavar="LAYOUT",
                   help="the layout to resize to, e.g. tp1pp1dp2 (auto: the automatic choice)")
    p.add_argument("--drain", action="append", default=[], metavar="WORKER",
                   help="a worker id (w3) to take out of the world; repeatable")
    p.add_argument("--reason", default="", help="free text shown in the run's event log")
    p.add_argument("--redis", metavar="URL",
                   help="coordinator URL redis://[:PASSWORD@]HOST:PORT/DB "
                        "(default: $ETCSLURM_REDIS_URL, else the run directory's coordinator)")
    p.add_argument("--password-file", metavar="FILE",
                   help="file (mode 0600) with the password when the URL has none")
    p.add_argument("--run-dir", metavar="DIR",
                   help="run directory holding coordinator.json (default: $ETCSLURM_RUN_DIR or .)")
    p.add_argument("--json", action="store_true", help="print the queued request as JSON")
    p.set_defaults(func=run)


def check_layout(text: str, spec: dict[str, Any], live_workers: int) -> str:
    """The canonical layout text of ``text`` if this run can train in it; else UsageError."""
    from etcslurm.core.layout import ParallelConfig
    from etcslurm.core.models import GPTSpec
    from etcslurm.errors import LayoutError, UsageError
    from etcslurm.runtime.generation import LayoutSettings, layout_problems

    if text == "auto":
        return text
    try:
        cfg = ParallelConfig.parse(text)
    except LayoutError as exc:
        raise UsageError(f"--to: {exc}") from None
    try:
        settings = LayoutSettings(
            spec=GPTSpec.from_json(spec["model"]), optimizer=str(spec.get("optimizer", "adam")),
            global_batch=int(spec["global_batch"]), micro_batch=int(spec["micro_batch"]),
            gpus_per_node=int(spec["gpus_per_node"]), staging_bytes=0)
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"the run's stored spec is not one etcslurm can check a layout "
                         f"against ({type(exc).__name__}: {exc})") from None
    problems = layout_problems(settings, cfg)
    if problems:
        raise UsageError(f"--to {cfg}: {'; '.join(problems)}")
    if cfg.world_size > live_workers:
        raise UsageError(f"--to {cfg} needs {cfg.world_size} workers; the run has "
                         f"{live_workers} live")
    return str(cfg)


def run(args: argparse.Namespace) -> int:
    from etcslurm.coord.coordinator import GONE, Coordinator
    from etcslurm.coord.records import ChangeRequest
    from etcslurm.errors import UsageError
    from etcslurm.monitor.source import open_client, pick_run

    if args.to is None and not args.drain:
        raise UsageError("nothing to do: give --to LAYOUT and/or --drain WORKER")
    with open_client(args.redis, args.run_dir, args.password_file) as client:
        run_id = pick_run(client, args.run)  # one-line error when there is no such run
        coord = Coordinator(client, run_id)
        spec = coord.run_spec()
        if spec is None:
            raise UsageError(f"run {run_id!r} has no spec in the coordinator (not started)")
        members = coord.members()
        live = {w for w, i in members.items() if i.get("alive") and i.get("state") != GONE}
        to = None if args.to is None else check_layout(args.to.strip().lower(), spec, len(live))
        drain = tuple(dict.fromkeys(args.drain))
        for wid in drain:
            if wid not in members:
                known = ", ".join(list(members)[:10]) or "none"
                raise UsageError(f"--drain {wid}: no such worker in run {run_id} "
                                 f"(workers: {known})")
            if wid not in live:
                raise UsageError(f"--drain {wid}: worker is already gone")
        req = ChangeRequest(to=to, drain=drain, by="operator", ts=time.time(),
                            reason=args.reason)
        coord.request_change(req)
    if args.json:
        json.dump({"run": run_id, "request": req.to_json()}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    what = [f"layout {to}"] if to else []
    if drain:
        what.append(f"drain {', '.join(drain)}")
    print(f"queued for run {run_id}: {'; '.join(what)} (applied at the next step boundary)")
    return 0
