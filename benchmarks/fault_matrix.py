"""Fault injection matrix: run each fault against a real elastic run and print a table.

    python benchmarks/fault_matrix.py [--steps 8] [--only kill-worker,redis-restart] [--json]

Every scenario is a real ``etcslurm demo`` run (worker processes, bundled or given Redis,
megatron-core on gloo) with one fault injected from the launcher's tick hook:

========================  ==============================================================
kill-worker               SIGKILL of a non-leader rank while training (dp >= 2)
kill-leader               SIGKILL of rank 0 (the rank that publishes and polls)
preempt-during-migration  SIGUSR2 to a surviving rank while a resize is in flight;
                          it leaves at the next step boundary: two resizes back to back
redis-restart             the coordinator's redis-server restarted (AOF on) mid-run
redis-outage              redis-server stopped for ``--outage`` seconds, then restarted
redis-unreachable         redis-server hung (SIGSTOP) for ``--unreachable`` (30) seconds,
                          with the default timeouts: training goes on meanwhile
kill-receiver-mid-...     SIGKILL of a joiner while its replica is being sent to it
kill-sender-mid-...       SIGKILL of a sending rank after the first round of a transfer
kill-leader-mid-...       the same for rank 0, the rank that publishes generations
kill-during-rebuild       SIGKILL of a new member after the exchange, while the new world
                          forms (the leaver has not left yet): fall back to the old state
joiner-never-arrives      a joiner taken into a generation hangs (SIGSTOP) before the
                          exchange; later let go, it must find itself out of the run
lost-pieces               SIGKILL with the distributed optimizer (no replica of the
                          killed rank's optimizer shard): a clean stop, exit 5
rollback                  lost-pieces with a periodic checkpoint every 2 steps: the run
                          rolls back to the last complete one on the survivor, goes on
corrupt-message           one received migration buffer flipped (executor hook): the
                          checksum catches it and MigrationError names the piece
kill-coordinator-primary  a replicated coordinator of its own (3 sites, Sentinel); its
                          primary redis-server SIGKILLed mid-run, a preemption later
========================  ==============================================================

Columns: *outcome* (what the run did), *recover s* (fault injected → the next
generation's ``migration.done`` event, i.e. training can go on), *bytes lost* (the
``missing_bytes`` of every published plan: state with no surviving holder), *loss*
(max |loss − reference|, the reference being a one-worker run that never resized).
The scenarios live in ``etcslurm/testing/fault_scenarios.py``; the test-suite
(tests/test_faults.py) runs the same ones and asserts on them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from etcslurm.redis_host.server import BundledRedis
from etcslurm.testing.fault_harness import table
from etcslurm.testing.fault_scenarios import (
    SCENARIOS,
    Row,
    corrupt_message,
    redis_restart,
    redis_unreachable,
    reference_losses,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--only", default="", help="comma-separated scenario names")
    p.add_argument("--outage", type=float, default=4.0, help="redis-outage seconds")
    p.add_argument("--unreachable", type=float, default=30.0,
                   help="redis-unreachable seconds")
    p.add_argument("--run-dir", default=f"runs/fault-matrix-{os.getpid()}")
    p.add_argument("--json", action="store_true")
    p.add_argument("--rows", metavar="FILE",
                   help="only print the table of rows measured by tests/test_faults.py "
                        "(run with FAULT_MATRIX_ROWS=FILE)")
    args = p.parse_args(argv)
    if args.rows:
        rows = [Row(**{k: v for k, v in json.loads(line).items()
                       if k in ("fault", "outcome", "recover_s", "bytes_lost", "max_loss_diff")})
                for line in Path(args.rows).read_text().splitlines() if line.strip()]
        print(table(rows))
        return 0
    names = [n for n in args.only.split(",") if n] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    root = Path(args.run_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    with BundledRedis(root / "coord") as server:
        url, pw = server.url, str(server.password_file)
        ref = None
        if any(n not in ("corrupt-message", "lost-pieces") for n in names):
            print(f"reference run ({args.steps} steps, 1 worker) ...", file=sys.stderr)
            ref = reference_losses(url, pw, root / "reference", args.steps)
        for name in names:
            print(f"{name} ...", file=sys.stderr)
            d = root / name
            if name == "corrupt-message":
                row = corrupt_message()
            elif name == "redis-restart":
                row = redis_restart(None, None, d, args.steps, ref)
            elif name == "redis-outage":
                row = redis_restart(None, None, d, args.steps, ref, outage=args.outage)
            elif name == "redis-unreachable":
                row = redis_unreachable(None, None, d, args.steps, ref,
                                        outage=args.unreachable)
            else:
                row = SCENARIOS[name](url, pw, d, args.steps, ref)  # type: ignore[misc]
            rows.append(row)
            print(table([row]).splitlines()[-1], file=sys.stderr)
            if row.error:  # why a row failed, not only that it did
                print(f"  error: {row.error}", file=sys.stderr)
    if args.json:
        print(json.dumps([r.to_json() for r in rows], indent=1))
    else:
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
