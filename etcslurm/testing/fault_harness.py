"""The harness the fault scenarios share: a run's options and tracker, the fault hooks'
JSON, the measured :class:`Row`, and the loop that runs one scenario and judges it
against the reference (:mod:`etcslurm.testing.fault_scenarios` holds the scenarios)."""

from __future__ import annotations

import contextlib
import json
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from etcslurm.coord.client import connect
from etcslurm.coord.coordinator import Coordinator
from etcslurm.errors import EtcslurmError
from etcslurm.local.launcher import (
    LOSS_TOLERANCE,
    DemoOptions,
    DemoResult,
    LocalRun,
    WorkerFailed,
    run_demo,
)
from etcslurm.redis_host.server import BundledRedis

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
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"fault": self.fault, "outcome": self.outcome, "recover_s": self.recover_s,
                "bytes_lost": self.bytes_lost, "max_loss_diff": self.max_loss_diff,
                "error": self.error, "run_id": self.run_id, "detail": self.detail,
                "exit_codes": self.result.exit_codes if self.result else None,
                "generations": [
                    {k: r.get(k) for k in ("generation", "kind", "from", "to", "step", "dead",
                                           "leaving", "reason")}
                    for _, r in sorted(self.records.items())]}


def record(run: LocalRun) -> dict[str, Any] | None:
    """The run's current generation record in its full readable form (``from``/``to``
    keys, assignment rows, plain worker lists), which is what the scenarios keep and the
    tests assert on; ``None`` before the first."""
    return None if run.record is None else run.record.to_dict()


class Tracker:
    """The launcher's tick hook: keeps every published record and injects the fault."""

    def __init__(self, inject: Callable[[LocalRun, Tracker], None]) -> None:
        self.inject = inject
        self.records: dict[int, dict[str, Any]] = {}
        self.fault_ts: float | None = None
        self.done = False

    def __call__(self, run: LocalRun) -> None:
        rec = record(run)
        if rec is not None:
            self.records.setdefault(int(rec["generation"]), rec)
        if not self.done:
            self.inject(run, self)


def kill_rank(run: LocalRun, rank: int, sig: int = signal.SIGKILL) -> bool:
    """Send ``sig`` to the process of ``rank`` in the current generation."""
    rec = record(run)
    assert rec is not None
    for a in rec["assignment"]:
        wp = run.by_worker.get(a["worker"])
        if a["rank"] == rank and wp is not None and wp.proc.poll() is None:
            wp.signalled_at = time.time()
            wp.killed = sig == signal.SIGKILL
            wp.proc.send_signal(sig)
            return True
    return False


def faults(**spec: Any) -> dict[str, Any]:
    """DemoOptions fields that run the workers with these fault hooks
    (:func:`etcslurm.testing.faults.hooks_from_json` keys, e.g. ``migration_delay=3``;
    ``raise_`` for ``raise``)."""
    if "raise_" in spec:
        spec["raise"] = spec.pop("raise_")
    return {"worker_module": "etcslurm.testing.worker",
            "worker_args": ("--faults", json.dumps(spec, sort_keys=True))}


#: the step after which the joining scenarios hold every rank until their joiner has
#: registered (it is spawned after step 1; :class:`~etcslurm.testing.faults.HoldAfterStep`):
#: the change that takes it in then always comes, and no step needs pacing for it
HOLD_STEP = 2
#: the file (in the run directory) whose existence releases that hold
JOINED_FILE = "joiner-registered"


def hold_for_joiner(run_dir: Path) -> dict[str, Any]:
    """The ``hold`` fault that keeps the run at :data:`HOLD_STEP` until
    :func:`release_when_joined` lets it go."""
    return {"hold": {"step": HOLD_STEP, "file": str(run_dir / JOINED_FILE),
                     "timeout": 240.0}}


def release_when_joined(inject: Callable[[LocalRun, Tracker], None], run_dir: Path,
                         initial: int = 3) -> Callable[[LocalRun, Tracker], None]:
    """``inject``, and the hold of :func:`hold_for_joiner` released once a worker beyond
    the ``initial`` ones has registered (the change that takes it in then always comes)."""
    go = run_dir / JOINED_FILE

    def tick(run: LocalRun, tracker: Tracker) -> None:
        if len(run.by_worker) > initial and not go.exists():
            go.touch()
        inject(run, tracker)

    return tick


def scenario_options(redis_url: str | None, password_file: str | None, run_dir: Path, steps: int,
             **kw: Any) -> DemoOptions:
    base: dict[str, Any] = dict(
        workers=3, steps=steps, schedule="", redis=redis_url, password_file=password_file,
        run_id=f"fault-{uuid.uuid4().hex[:8]}", run_dir=str(run_dir), global_batch=12,
        reference=False, dead_after=DEAD_AFTER, collective_timeout=COLLECTIVE_TIMEOUT,
        timeout=480.0, keep_keys_s=60.0,
    )
    base.update(kw)
    return DemoOptions(**base)


def run_events(url: str, password_file: str | None, run_id: str) -> list[dict[str, Any]]:
    with contextlib.suppress(EtcslurmError):
        client = connect(url, password_file, retry_deadline=10)
        try:
            return Coordinator(client, run_id).read_events("0", block_ms=0, count=100000)
        finally:
            client.close()
    return []


def finish_row(row: Row, opts: DemoOptions, tracker: Tracker, reference: dict[int, float] | None,
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


def run_scenario(name: str, opts: DemoOptions, inject: Callable[[LocalRun, Tracker], None],
                 reference: dict[int, float] | None, server: BundledRedis | None = None) -> Row:
    tracker = Tracker(inject)
    row = Row(name, run_id=str(opts.run_id))
    url = opts.redis or (server.url if server else None)
    pw = opts.password_file
    try:
        row.result = run_demo(opts, on_tick=tracker)
    except EtcslurmError as exc:
        row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        if isinstance(exc, WorkerFailed):
            row.result = exc.result
    if url is None:  # a bundled Redis of run_demo: gone with the run
        row.events = []
    else:
        row.events = run_events(url, pw, str(opts.run_id))
    finish_row(row, opts, tracker, reference)
    r = row.result
    if r is not None and r.losses and len(r.losses) == opts.steps and row.error is None:
        ok = row.max_loss_diff is None or row.max_loss_diff <= LOSS_TOLERANCE
        row.outcome = "completed" + ("" if ok else " (LOSS MISMATCH)")
    else:
        row.outcome = "failed"
    return row


def at_step(step: int, action: Callable[[LocalRun, Tracker], bool]) -> Callable[[LocalRun, Tracker], None]:
    """Run ``action`` once the run has finished ``step`` steps (once)."""

    def inject(run: LocalRun, tracker: Tracker) -> None:
        if run.step >= step and run.record is not None and action(run, tracker):
            tracker.fault_ts = tracker.fault_ts or time.time()
            tracker.done = True

    return inject

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
