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
redis-outage              the coordinator unreachable for ``--outage`` seconds mid-run
lost-pieces               SIGKILL with the distributed optimizer (no replica of the
                          killed rank's optimizer shard): a clean stop, exit 5
corrupt-message           one received migration buffer flipped (executor hook): the
                          checksum catches it and MigrationError names the piece
========================  ==============================================================

Columns: *outcome* (what the run did), *recover s* (fault injected → the next
generation's ``migration.done`` event, i.e. training can go on), *bytes lost* (the
``missing_bytes`` of every published plan: state with no surviving holder), *loss*
(max |loss − reference|, the reference being a one-worker run that never resized).
The test-suite (tests/test_faults.py) runs the same scenarios and asserts on them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from etcslurm.coord.client import connect
from etcslurm.coord.coordinator import Coordinator
from etcslurm.coord.server import BundledRedis
from etcslurm.errors import EtcslurmError
from etcslurm.runtime.launcher import LOSS_TOLERANCE, DemoOptions, DemoResult, LocalRun, run_demo

#: fault detection knobs used by the scenarios: the runtime's defaults (10 s each).  Lower
#: values detect sooner but, on an overloaded host, a starved heartbeat thread makes a live
#: worker look dead (measured: dead_after=4 s at load 90 on 2 cores evicted a survivor)
DEAD_AFTER = 10.0
COLLECTIVE_TIMEOUT = 10.0


@dataclass
class Row:
    """One measured line of the matrix (plus what the tests assert on)."""

    fault: str
    outcome: str = "?"
    recover_s: float | None = None
    bytes_lost: int | None = None
    max_loss_diff: float | None = None
    error: str | None = None
    result: DemoResult | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    fault_ts: float | None = None
    run_id: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"fault": self.fault, "outcome": self.outcome, "recover_s": self.recover_s,
                "bytes_lost": self.bytes_lost, "max_loss_diff": self.max_loss_diff,
                "error": self.error, "run_id": self.run_id,
                "exit_codes": self.result.exit_codes if self.result else None,
                "generations": [
                    {k: r.get(k) for k in ("generation", "kind", "from", "to", "step", "dead",
                                           "leaving", "reason")}
                    for _, r in sorted(self.records.items())]}


class Tracker:
    """The launcher's tick hook: keeps every published record and injects the fault."""

    def __init__(self, inject: Callable[[LocalRun, Tracker], None]) -> None:
        self.inject = inject
        self.records: dict[int, dict[str, Any]] = {}
        self.fault_ts: float | None = None
        self.done = False

    def __call__(self, run: LocalRun) -> None:
        if run.record is not None:
            self.records.setdefault(int(run.record["generation"]), run.record)
        if not self.done:
            self.inject(run, self)


def kill_rank(run: LocalRun, rank: int, sig: int = signal.SIGKILL) -> bool:
    """Send ``sig`` to the process of ``rank`` in the current generation."""
    assert run.record is not None
    for a in run.record["assignment"]:
        wp = run.by_worker.get(a["worker"])
        if a["rank"] == rank and wp is not None and wp.proc.poll() is None:
            wp.signalled_at = time.time()
            wp.killed = sig == signal.SIGKILL
            wp.proc.send_signal(sig)
            return True
    return False


def _options(redis_url: str | None, password_file: str | None, run_dir: Path, steps: int,
             **kw: Any) -> DemoOptions:
    base: dict[str, Any] = dict(
        workers=3, steps=steps, schedule="", redis=redis_url, password_file=password_file,
        run_id=f"fault-{uuid.uuid4().hex[:8]}", run_dir=str(run_dir), global_batch=12,
        reference=False, dead_after=DEAD_AFTER, collective_timeout=COLLECTIVE_TIMEOUT,
        timeout=480.0, keep_keys_s=60.0,
    )
    base.update(kw)
    return DemoOptions(**base)


def _events(url: str, password_file: str | None, run_id: str) -> list[dict[str, Any]]:
    with contextlib.suppress(EtcslurmError):
        client = connect(url, password_file, retry_deadline=10)
        try:
            return Coordinator(client, run_id).read_events("0", block_ms=0, count=100000)
        finally:
            client.close()
    return []


def _finish(row: Row, opts: DemoOptions, tracker: Tracker, reference: dict[int, float] | None,
            fault_gen: int = 1) -> Row:
    """Fill the measured columns from the events and records of the run."""
    row.records = tracker.records
    row.fault_ts = tracker.fault_ts
    row.bytes_lost = sum(int((r.get("plan_stats") or {}).get("missing_bytes") or 0)
                         for r in tracker.records.values())
    done = [e for e in row.events if e["type"] == "migration.done"
            and int(e["data"].get("gen", -1)) >= fault_gen]
    if tracker.fault_ts is not None and done:
        row.recover_s = round(done[0]["ts"] - tracker.fault_ts, 2)
    if row.result is not None and reference:
        common = sorted(set(row.result.losses) & set(reference))
        if common:
            row.max_loss_diff = max(abs(row.result.losses[s] - reference[s]) for s in common)
    return row


def _run(name: str, opts: DemoOptions, inject: Callable[[LocalRun, Tracker], None],
         reference: dict[int, float] | None, server: BundledRedis | None = None) -> Row:
    tracker = Tracker(inject)
    row = Row(name, run_id=str(opts.run_id))
    url = opts.redis or (server.url if server else None)
    pw = opts.password_file
    try:
        row.result = run_demo(opts, on_tick=tracker)
    except EtcslurmError as exc:
        row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    if url is None:  # a bundled Redis of run_demo: gone with the run
        row.events = []
    else:
        row.events = _events(url, pw, str(opts.run_id))
    _finish(row, opts, tracker, reference)
    r = row.result
    if r is not None and r.losses and len(r.losses) == opts.steps and row.error is None:
        ok = row.max_loss_diff is None or row.max_loss_diff <= LOSS_TOLERANCE
        row.outcome = "completed" + ("" if ok else " (LOSS MISMATCH)")
    else:
        row.outcome = "failed"
    return row


# ---------------------------------------------------------------------- scenarios
def at_step(step: int, action: Callable[[LocalRun, Tracker], bool]) -> Callable[[LocalRun, Tracker], None]:
    """Run ``action`` once the run has finished ``step`` steps (once)."""

    def inject(run: LocalRun, tracker: Tracker) -> None:
        if run.step >= step and run.record is not None and action(run, tracker):
            tracker.fault_ts = tracker.fault_ts or time.time()
            tracker.done = True

    return inject


def kill_worker(redis_url: str, pw: str | None, run_dir: Path, steps: int,
                reference: dict[int, float] | None) -> Row:
    opts = _options(redis_url, pw, run_dir, steps)
    return _run("SIGKILL non-leader rank (dp3)", opts,
                at_step(3, lambda run, t: kill_rank(run, run.record["world"] - 1)), reference)


def kill_leader(redis_url: str, pw: str | None, run_dir: Path, steps: int,
                reference: dict[int, float] | None) -> Row:
    opts = _options(redis_url, pw, run_dir, steps)
    return _run("SIGKILL leader (rank 0, dp3)", opts,
                at_step(3, lambda run, t: kill_rank(run, 0)), reference)


def preempt_during_migration(redis_url: str, pw: str | None, run_dir: Path, steps: int,
                             reference: dict[int, float] | None) -> Row:
    """4 workers; at step 2 one is preempted; as soon as that resize is published (the
    state is moving) a second worker gets SIGUSR2: it must leave at the next boundary."""
    opts = _options(redis_url, pw, run_dir, steps, workers=4, schedule="2:leave=1")

    def inject(run: LocalRun, tracker: Tracker) -> None:
        rec = run.record
        if rec is None or int(rec["generation"]) < 1:
            return
        # the new world's highest rank: a survivor of generation 1, mid-migration
        if kill_rank(run, int(rec["world"]) - 1, signal.SIGUSR2):
            tracker.fault_ts = time.time()
            tracker.done = True

    row = _run("SIGUSR2 during a migration (2 resizes back to back)", opts, inject, reference)
    # recovered = the signalled worker's own resize (generation 2) is done
    done = [e for e in row.events if e["type"] == "migration.done"
            and int(e["data"].get("gen", -1)) >= 2]
    row.recover_s = round(done[0]["ts"] - row.fault_ts, 2) if done and row.fault_ts else None
    return row


def kill_receiver_mid_migration(redis_url: str, pw: str | None, run_dir: Path, steps: int,
                                reference: dict[int, float] | None) -> Row:
    """3 workers; a 4th joins; while its replica is being sent to it (workers pause 2 s
    inside the migration to widen the window) it gets SIGKILL: the senders' exchange
    fails, nothing was applied, and the next generation is planned from the old state."""
    opts = _options(redis_url, pw, run_dir, max(steps, 12), schedule="1:join=1;1:killjoiner=1",
                    migration_delay=2.0, min_step_seconds=1.5)

    def inject(run: LocalRun, tracker: Tracker) -> None:
        killed = [wp for wp in run.procs if wp.killed]
        if killed:
            tracker.fault_ts = killed[0].signalled_at
            tracker.done = True

    row = _run("SIGKILL of a receiving rank mid-migration", opts, inject, reference)
    # recovered = the generation planned again from the old state is done
    done = [e for e in row.events if e["type"] == "migration.done"
            and int(e["data"].get("gen", -1)) >= 2]
    row.recover_s = round(done[0]["ts"] - row.fault_ts, 2) if done and row.fault_ts else None
    return row


def redis_restart(redis_url: str | None, pw: str | None, run_dir: Path, steps: int,
                  reference: dict[int, float] | None, outage: float = 0.0) -> Row:
    """A private persistent Redis restarted (``outage`` seconds down) after step 3."""
    server = BundledRedis(run_dir / "redis", persist=True).start()
    try:
        # heartbeats must outlive the outage (their TTL keeps running while Redis is
        # down) and rank 0's boundary poll blocks meanwhile while its peers wait in the
        # boundary all-reduce: both bounds above the outage (see docs/failures.md)
        opts = _options(server.url, str(server.password_file), run_dir, steps,
                        dead_after=max(DEAD_AFTER, outage + 10),
                        collective_timeout=max(COLLECTIVE_TIMEOUT, outage + 15))

        def action(run: LocalRun, tracker: Tracker) -> bool:
            tracker.fault_ts = time.time()
            server._kill()
            if outage:
                time.sleep(outage)
            server._spawn()
            server._wait_ready()
            return True

        name = f"Redis down {outage:g} s" if outage else "Redis restarted"
        row = _run(name, opts, at_step(3, action), reference, server)
        if row.fault_ts is not None and row.result is not None:
            # no generation change is needed: recovered = the next step after the fault
            after = [e for e in row.events if e["type"] == "step" and e["ts"] > row.fault_ts]
            row.recover_s = round(after[0]["ts"] - row.fault_ts, 2) if after else None
        return row
    finally:
        server.stop()


def lost_pieces(redis_url: str, pw: str | None, run_dir: Path, steps: int,
                reference: dict[int, float] | None) -> Row:
    """dp2 with the distributed optimizer: the killed rank's optimizer shard has no replica."""
    opts = _options(redis_url, pw, run_dir, steps, workers=2, optimizer="distributed")
    row = _run("SIGKILL, no replica (distributed optimizer)", opts,
               at_step(2, lambda run, t: kill_rank(run, 1)), None)
    stop = [r for r in row.records.values() if r.get("kind") == "stop"]
    code = re.search(r"exited with code (-?\d+)", row.error or "")
    if stop and code:
        row.outcome = f"stopped, survivor exit {code[1]}: {stop[0]['reason'][:70]}"
        row.bytes_lost = int((stop[0].get("plan_stats") or {}).get("missing_bytes") or 0)
        ends = [e for e in row.events if e["type"] == "generation.start"
                and e["data"].get("kind") == "stop"]
        if ends and row.fault_ts is not None:
            row.recover_s = round(ends[0]["ts"] - row.fault_ts, 2)
    return row


def corrupt_message() -> Row:
    """The executor's checksum on a flipped byte (2 gloo processes, real execute())."""
    from etcslurm.bench.launch import launch

    t0 = time.perf_counter()
    results = launch("etcslurm.bench.synthetic:executor_selftest", 2,
                     {"repeats": 1, "wait": 2}, timeout=240)
    err = results[1]["corrupt_error"] or ""
    row = Row("corrupted migration message", bytes_lost=0)
    row.outcome = ("detected: " + err.split(":", 1)[0] + " naming the piece"
                   if "first piece" in err else f"NOT detected ({err or 'no error'})")
    row.error = err
    row.recover_s = round(time.perf_counter() - t0, 2)  # the whole selftest, not a recovery
    return row


SCENARIOS = {
    "kill-worker": kill_worker,
    "kill-leader": kill_leader,
    "preempt-during-migration": preempt_during_migration,
    "kill-receiver-mid-migration": kill_receiver_mid_migration,
    "redis-restart": redis_restart,
    "redis-outage": None,  # redis_restart with an outage, see main()
    "lost-pieces": lost_pieces,
    "corrupt-message": None,
}


def reference_losses(redis_url: str, pw: str | None, run_dir: Path, steps: int) -> dict[int, float]:
    """A one-worker run that never resizes: what every completed scenario must match."""
    opts = _options(redis_url, pw, run_dir, steps, workers=1)
    return dict(run_demo(opts).losses)


def table(rows: list[Row]) -> str:
    head = ("fault", "outcome", "time to recover", "bytes lost", "max |Δloss|")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            r.fault, r.outcome.replace("|", "/"),
            "-" if r.recover_s is None else f"{r.recover_s:.1f} s",
            "-" if r.bytes_lost is None else str(r.bytes_lost),
            "-" if r.max_loss_diff is None else f"{r.max_loss_diff:.1e}",
        ]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--only", default="", help="comma-separated scenario names")
    p.add_argument("--outage", type=float, default=4.0, help="redis-outage seconds")
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
            else:
                row = SCENARIOS[name](url, pw, d, args.steps, ref)  # type: ignore[misc]
            rows.append(row)
            print(table([row]).splitlines()[-1], file=sys.stderr)
    if args.json:
        print(json.dumps([r.to_json() for r in rows], indent=1))
    else:
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
