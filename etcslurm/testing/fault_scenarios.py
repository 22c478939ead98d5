"""Fault scenarios: each runs a real elastic run with one fault injected and returns a
measured :class:`Row`.

Every scenario is a real ``etcslurm demo`` run (worker processes, bundled or given Redis,
megatron-core on gloo) with one fault injected from the launcher's tick hook; where a
window must be widened (a pause before the new world forms, after the first round of a
state exchange) the workers are ``python -m etcslurm.testing.worker --faults JSON``
(:mod:`etcslurm.testing.faults`), never settings the product reads.

``tests/test_faults.py`` runs them small and asserts on the rows;
``benchmarks/fault_matrix.py`` runs them all and prints the table (the list of scenarios
and the columns are in its docstring).
"""

from __future__ import annotations

import contextlib
import json
import re
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


def _hold_for_joiner(run_dir: Path) -> dict[str, Any]:
    """The ``hold`` fault that keeps the run at :data:`HOLD_STEP` until
    :func:`_release_when_joined` lets it go."""
    return {"hold": {"step": HOLD_STEP, "file": str(run_dir / JOINED_FILE),
                     "timeout": 240.0}}


def _release_when_joined(inject: Callable[[LocalRun, Tracker], None], run_dir: Path,
                         initial: int = 3) -> Callable[[LocalRun, Tracker], None]:
    """``inject``, and the hold of :func:`_hold_for_joiner` released once a worker beyond
    the ``initial`` ones has registered (the change that takes it in then always comes)."""
    go = run_dir / JOINED_FILE

    def tick(run: LocalRun, tracker: Tracker) -> None:
        if len(run.by_worker) > initial and not go.exists():
            go.touch()
        inject(run, tracker)

    return tick


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
        if isinstance(exc, WorkerFailed):
            row.result = exc.result
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
                at_step(3, lambda run, t: kill_rank(run, run.record.world - 1)), reference)


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
        rec = record(run)
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
    opts = _options(redis_url, pw, run_dir, max(steps, 12), schedule="1:join=1",
                    **faults(migration_delay=2.0, **_hold_for_joiner(run_dir)))

    def inject(run: LocalRun, tracker: Tracker) -> None:
        # SIGKILL the joiner once it reports received bytes: mid-migration, not before
        rec = run.record
        for ev in run.migration_events:
            data = ev["data"]
            wid = data.get("worker")
            if (rec is None or rec.kind != "resize" or wid not in rec.joining
                    or not data.get("recv")):
                continue
            if _signal_worker(run, wid, signal.SIGKILL):
                tracker.fault_ts = time.time()
                tracker.done = True
                return

    row = _run("SIGKILL of a receiving rank mid-migration", opts,
               _release_when_joined(inject, run_dir), reference)
    # recovered = the generation planned again from the old state is done
    done = [e for e in row.events if e["type"] == "migration.done"
            and int(e["data"].get("gen", -1)) >= 2]
    row.recover_s = round(done[0]["ts"] - row.fault_ts, 2) if done and row.fault_ts else None
    return row


def _worker_of(tracker: Tracker, generation: int, rank: int) -> str | None:
    rec = tracker.records.get(generation)
    for a in (rec or {}).get("assignment", []):
        if a["rank"] == rank:
            return str(a["worker"])
    return None


def _signal_worker(run: LocalRun, worker: str, sig: int) -> bool:
    wp = run.by_worker.get(worker)
    if wp is None or wp.proc.poll() is not None:
        return False
    wp.signalled_at = time.time()
    wp.killed = wp.killed or sig in (signal.SIGKILL, signal.SIGSTOP)
    wp.proc.send_signal(sig)
    return True


def _recovered_after(row: Row, generation: int) -> Row:
    """recover s = fault → ``migration.done`` of the first generation >= ``generation``."""
    done = [e for e in row.events if e["type"] == "migration.done"
            and int(e["data"].get("gen", -1)) >= generation]
    row.recover_s = round(done[0]["ts"] - row.fault_ts, 2) if done and row.fault_ts else None
    return row


def _kill_mid_transfer(redis_url: str, pw: str | None, run_dir: Path, steps: int,
                       reference: dict[int, float] | None, old_rank: int, name: str) -> Row:
    """3 workers; a 4th joins and receives a replica in several rounds (0.5 MiB staging
    cap); once ``old_rank`` of the old world has sent part of its share (its progress
    event after the first round, where the workers pause 3 s), it gets SIGKILL."""
    opts = _options(redis_url, pw, run_dir, max(steps, 12), schedule="1:join=1",
                    staging_mb=0.5,
                    **faults(migration_delay=3.0, **_hold_for_joiner(run_dir)))
    seen: dict[str, Any] = {}

    def inject(run: LocalRun, tracker: Tracker) -> None:
        rec = record(run)
        if rec is None or rec.get("kind") != "resize" or not rec.get("joining"):
            return
        gen = int(rec["generation"])
        victim = _worker_of(tracker, gen - 1, old_rank)
        for ev in run.migration_events:
            d = ev["data"]
            if (ev["type"] == "migration.progress" and d.get("gen") == gen
                    and d.get("worker") == victim and int(d.get("sent") or 0) > 0
                    and victim is not None and _signal_worker(run, victim, signal.SIGKILL)):
                tracker.fault_ts, tracker.done = time.time(), True
                seen.update(sent=d["sent"], total=d["total_send"], worker=victim)
                return

    row = _recovered_after(_run(name, opts, _release_when_joined(inject, run_dir), reference), 2)
    if seen and row.outcome.startswith("completed"):
        row.outcome += (f"; killed after sending {seen['sent']} of {seen['total']} B, "
                        "replanned from the old state")
    row.detail = seen
    return row


def kill_sender_mid_migration(redis_url: str, pw: str | None, run_dir: Path, steps: int,
                              reference: dict[int, float] | None) -> Row:
    return _kill_mid_transfer(redis_url, pw, run_dir, steps, reference, 2,
                              "SIGKILL of a sending rank mid-migration")


def kill_leader_mid_migration(redis_url: str, pw: str | None, run_dir: Path, steps: int,
                              reference: dict[int, float] | None) -> Row:
    return _kill_mid_transfer(redis_url, pw, run_dir, steps, reference, 0,
                              "SIGKILL of the leader (rank 0) mid-migration")


def joiner_never_arrives(redis_url: str, pw: str | None, run_dir: Path, steps: int,
                         reference: dict[int, float] | None) -> Row:
    """3 workers; a 4th registers and is taken into generation 1, then hangs (SIGSTOP)
    before the exchange: the others' rendezvous times out, its heartbeat lapses, and the
    change is planned again without it.  Once that is done it is let go (SIGCONT): it
    must find itself out of the run and not disturb it."""
    opts = _options(redis_url, pw, run_dir, max(steps, 12), schedule="1:join=1",
                    **faults(**_hold_for_joiner(run_dir)))
    stalled: list[str] = []

    def inject(run: LocalRun, tracker: Tracker) -> None:
        rec = record(run)
        if not stalled:
            if rec is not None and rec.get("kind") == "resize" and rec.get("joining"):
                worker = str(rec["joining"][0])
                if _signal_worker(run, worker, signal.SIGSTOP):
                    stalled.append(worker)
                    tracker.fault_ts = time.time()
            return
        if rec is not None and int(rec["generation"]) >= 2 and worker_done(run, 2):
            wp = run.by_worker[stalled[0]]
            wp.killed = False  # from here on it must behave: exit 0 at the end
            wp.proc.send_signal(signal.SIGCONT)
            tracker.done = True

    def worker_done(run: LocalRun, gen: int) -> bool:
        return any(m.get("gen") is not None and int(m["gen"]) >= gen
                   for m in run.result.migrations)

    row = _recovered_after(_run("joiner taken in that never arrives (hangs)", opts,
                                _release_when_joined(inject, run_dir), reference), 2)
    row.detail = {"stalled": stalled}
    return row


def kill_during_rebuild(redis_url: str, pw: str | None, run_dir: Path, steps: int,
                        reference: dict[int, float] | None) -> Row:
    """4 workers, one preempted at step 2 (dp4 → dp3); while the new world forms and
    builds its model (before the exchange; members pause 3 s there), new rank 1 gets
    SIGKILL.  Nobody has committed the new generation and the leaver is still there, so
    all fall back to the old state and plan again without the dead: dp4 − leaver − dead
    = dp2."""
    opts = _options(redis_url, pw, run_dir, max(steps, 8), workers=4, schedule="2:leave=1",
                    **faults(rebuild_delay=3.0))

    def inject(run: LocalRun, tracker: Tracker) -> None:
        rec = record(run)
        if rec is None or int(rec["generation"]) != 1:
            return
        victim = _worker_of(tracker, 1, 1)
        for ev in run.migration_events:
            if (ev["type"] == "migration.rebuild" and ev["data"].get("gen") == 1
                    and ev["data"].get("worker") == victim and victim is not None
                    and _signal_worker(run, victim, signal.SIGKILL)):
                tracker.fault_ts, tracker.done = time.time(), True
                return

    return _recovered_after(_run("SIGKILL of a new member while the new world forms", opts,
                                 inject, reference), 2)


def redis_unreachable(redis_url: str | None, pw: str | None, run_dir: Path, steps: int,
                      reference: dict[int, float] | None, outage: float = 30.0) -> Row:
    """The coordinator's Redis hangs (SIGSTOP: connections open but nothing answers, like
    a network partition) for ``outage`` seconds after step 2, with the runtime's default
    ``dead_after`` / ``collective_timeout`` (10 s): training must go on meanwhile."""
    server = BundledRedis(run_dir / "redis").start()
    try:
        opts = _options(server.url, str(server.password_file), run_dir, max(steps, 12),
                        min_step_seconds=1.0)
        window: dict[str, float] = {}

        def action(run: LocalRun, tracker: Tracker) -> bool:
            assert server.proc is not None
            tracker.fault_ts = window["start"] = time.time()
            server.proc.send_signal(signal.SIGSTOP)
            time.sleep(outage)
            server.proc.send_signal(signal.SIGCONT)
            window["end"] = time.time()
            return True

        row = _run(f"Redis unreachable {outage:g} s (hung, default timeouts)", opts,
                   at_step(2, action), reference, server)
        if window and row.result is not None:
            during = [e for e in row.events if e["type"] == "step"
                      and window["start"] <= e["ts"] <= window["end"]]
            after = [e for e in row.events if e["type"] == "step" and e["ts"] > window["start"]]
            row.recover_s = round(after[0]["ts"] - window["start"], 2) if after else None
            row.detail = {"steps_during_outage": len(during), "outage_s": outage}
            if row.outcome.startswith("completed"):
                row.outcome += (f"; {len(during)} steps trained while it was unreachable, "
                                "their events sent once it answered")
        return row
    finally:
        server.stop()


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
            server.restart(down_s=outage)
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


def step_error_everywhere(redis_url: str, pw: str | None, run_dir: Path, steps: int,
                          reference: dict[int, float] | None) -> Row:
    """3 workers; the training step raises ValueError on every rank at step 3 (a bug in
    the user's step): each worker ends with its traceback, nobody recovers or retries."""
    opts = _options(redis_url, pw, run_dir, steps,
                    **faults(raise_={"step": 3, "error": "ValueError"}))
    row = _run("ValueError in the step on every rank", opts, lambda run, t: None, None)
    row.outcome = "stopped" if row.error else row.outcome
    return row


def oom_on_one_rank(redis_url: str, pw: str | None, run_dir: Path, steps: int,
                    reference: dict[int, float] | None) -> Row:
    """3 workers; rank 2 runs out of memory at step 3: that worker ends with its
    traceback, the other two recover without it and finish the run."""
    opts = _options(redis_url, pw, run_dir, steps,
                    **faults(raise_={"step": 3, "error": "OutOfMemoryError", "ranks": [2]}))
    row = _run("out of memory on one rank", opts, lambda run, t: None, reference)
    if row.result is not None and len(row.result.losses) == steps:
        row.outcome = "completed without it"
    return row


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


def rollback(redis_url: str, pw: str | None, run_dir: Path, steps: int,
             reference: dict[int, float] | None) -> Row:
    """dp2 with the distributed optimizer and a checkpoint every 2 steps: the killed
    rank's optimizer shard has no replica, so the run rolls back to the last complete
    checkpoint on the survivor and completes."""
    opts = _options(redis_url, pw, run_dir, max(steps, 8), workers=2, optimizer="distributed",
                    checkpoint_every=2, min_step_seconds=1.0)
    row = _run("SIGKILL, no replica, periodic checkpoints (distributed optimizer)", opts,
               at_step(5, lambda run, t: kill_rank(run, 1)), reference)
    back = [e for e in row.events if e["type"] == "run.rollback"]
    if back:
        d = back[0]["data"]
        row.detail["rollback"] = d
        row.bytes_lost = 0
        if row.outcome.startswith("completed"):
            row.outcome = (f"rolled back to step {d['step']} ({d['lost_steps']} steps "
                           f"repeated), {row.outcome}")
        if row.fault_ts is not None:
            row.recover_s = round(back[0]["ts"] - row.fault_ts, 2)
    return row


def corrupt_message() -> Row:
    """The executor's checksum on a flipped byte (2 gloo processes, real execute())."""
    from etcslurm.bench.launch import launch

    t0 = time.perf_counter()
    results = launch("etcslurm.testing.synthetic:executor_selftest", 2,
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
    "kill-sender-mid-migration": kill_sender_mid_migration,
    "kill-leader-mid-migration": kill_leader_mid_migration,
    "kill-during-rebuild": kill_during_rebuild,
    "joiner-never-arrives": joiner_never_arrives,
    "redis-restart": redis_restart,
    "redis-outage": None,  # redis_restart with an outage, see main()
    "redis-unreachable": None,  # redis_unreachable, see main()
    "lost-pieces": lost_pieces,
    "rollback": rollback,
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


def kill_coordinator_primary(redis_url: str | None, pw: str | None, run_dir: Path, steps: int,
                             reference: dict[int, float] | None,
                             down_after_ms: int = 1000) -> Row:
    """A replicated coordinator of its own (3 sites on loopback: a primary + 2 replicas +
    3 Sentinels, ``down_after_ms``): the primary's redis-server is SIGKILLed after step 3,
    Sentinel promotes a replica, and the run resizes afterwards (one worker leaves at
    step 6).  ``recover_s``: the kill to the first step event after it."""
    import threading

    from etcslurm.coord.client import sentinel_url
    from etcslurm.redis_host import failover
    from etcslurm.redis_host.sentinel import Site

    started: list[Site] = []
    try:
        primary = Site(run_dir / "coord-s0", down_after_ms=down_after_ms,
                       failover_timeout_ms=3000).start()
        started.append(primary)
        for i in (1, 2):
            started.append(Site(run_dir / f"coord-s{i}", password=primary.password,
                                replica_of=primary.address, down_after_ms=down_after_ms,
                                failover_timeout_ms=3000).start())
        url = sentinel_url([s.sentinel.address for s in started if s.sentinel], "etcslurm")
        pw_file = str(primary.redis.password_file)
        opts = _options(url, pw_file, run_dir, max(steps, 10), workers=4,
                        schedule="6:leave=1", min_step_seconds=1.0)

        probe: dict[str, float] = {}

        def first_write(client: Any, t0: float) -> None:
            # the kill to the first write that succeeds through the Sentinels (the
            # launcher's own client: it retries until the promoted replica answers)
            with contextlib.suppress(EtcslurmError):
                client.call("failover probe", lambda r: r.set(
                    f"etcslurm-test:failover-probe:{opts.run_id}", "1", ex=60))
                probe["failover_s"] = round(time.monotonic() - t0, 2)

        def action(run: LocalRun, tracker: Tracker) -> bool:
            # the Sentinels learn the replicas from the primary's INFO every 10 s
            failover.settle(run.coord.client, 3)
            tracker.fault_ts = time.time()
            t0 = time.monotonic()
            primary.kill_redis()
            threading.Thread(target=first_write, args=(run.coord.client, t0),
                             daemon=True).start()
            return True

        row = _run("SIGKILL of the coordinator's primary (3 sites, Sentinel)", opts,
                   at_step(3, action), reference)
        if row.fault_ts is not None:
            after = [e for e in row.events if e["type"] == "step" and e["ts"] > row.fault_ts]
            row.recover_s = round(after[0]["ts"] - row.fault_ts, 2) if after else None
            with contextlib.suppress(EtcslurmError):
                client = connect(url, pw_file, retry_deadline=10)
                try:
                    row.detail["primary_after"] = failover.topology(client)["primary"]
                finally:
                    client.close()
            row.detail["down_after_ms"] = down_after_ms
            row.detail.update(probe)  # failover_s: the kill to the first write
            gens = [int(e["data"]["generation"]) for e in row.events
                    if e["type"] == "generation.start"]
            row.detail["generations"] = gens
            if row.outcome.startswith("completed") and "failover_s" in probe:
                lost = gens != list(range(len(gens))) or sorted(row.records) != [
                    g for g in gens if g in row.records]
                row.outcome += (f"; promoted replica took writes {probe['failover_s']} s "
                                f"after the kill, {'GENERATIONS LOST' if lost else 'no generation lost'}")
        return row
    finally:
        for site in started:
            site.stop()


SCENARIOS["kill-coordinator-primary"] = kill_coordinator_primary
