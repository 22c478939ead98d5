"""``etcslurm checkpoint``: ask a running run for a checkpoint at its next step boundary.

    etcslurm checkpoint --run r1 --redis redis://:pw@host:port/0

The request is a flag in the coordinator; the run's rank 0 sees it at the next step
boundary, the boundary's all-reduce tells every rank, and they save the run's periodic
checkpoint of that step (megatron-core's asynchronous writer, training goes on) into
``<checkpoint dir>/periodic/iter_NNNNNNN`` -- Megatron-LM's layout, which a plain
megatron-core loop loads with ``--load`` in any layout.  It is complete once that
directory's ``latest_checkpointed_iteration.txt`` names it.  While the world changes at
that boundary, the request waits for the next one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "checkpoint",
        help="ask a running run for a checkpoint at its next step boundary",
        description="Ask a running run to save a checkpoint (Megatron-LM's layout) at its "
        "next step boundary, into its checkpoint directory's periodic/ folder.",
    )
    p.add_argument("--run", required=True, metavar="RUN", help="the run id")
    p.add_argument("--reason", default="", help="free text shown in the run's event log")
    p.add_argument("--redis", metavar="URL",
                   help="coordinator URL redis://[:PASSWORD@]HOST:PORT/DB "
                        "(default: $ETCSLURM_REDIS_URL, else the run directory's coordinator)")
    p.add_argument("--password-file", metavar="FILE",
                   help="file (mode 0600) with the password when the URL has none")
    p.add_argument("--run-dir", metavar="DIR",
                   help="run directory holding coordinator.json (default: $ETCSLURM_RUN_DIR or .)")
    p.add_argument("--json", action="store_true", help="print the request as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from etcslurm.coord.coordinator import Coordinator
    from etcslurm.coord.records import CheckpointRequest
    from etcslurm.errors import UsageError
    from etcslurm.monitor.source import open_client, pick_run

    with open_client(args.redis, args.run_dir, args.password_file) as client:
        run_id = pick_run(client, args.run)  # one-line error when there is no such run
        coord = Coordinator(client, run_id)
        if coord.run_spec() is None:
            raise UsageError(f"run {run_id!r} has no spec in the coordinator (not started)")
        current = coord.current_generation()
        if current is not None and current.kind in ("end", "stop"):
            raise UsageError(f"run {run_id!r} has ended ({current.kind}: {current.reason})")
        req = CheckpointRequest(by="operator", ts=time.time(), reason=args.reason)
        coord.request_checkpoint(req)
    if args.json:
        json.dump({"run": run_id, "request": req.to_json()}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"checkpoint requested for run {run_id} (saved at the next step boundary)")
    return 0
