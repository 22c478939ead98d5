"""Fault scenarios: each runs a real elastic run with one fault injected and returns a
measured :class:`Row`.

Every scenario is a real ``etcslurm demo`` run (worker processes, bundled or given Redis,
megatron-core on gloo) with one fault injected from the launcher's tick hook; where a
window must be widened (a pause before the new world forms, after the first round of a
state exchange) the workers are ``python -m etcslurm.testing.worker --faults JSON``
(:mod:`etcslurm.testing.faults`), never settings the product reads.

The run, its tracker and the measured row are :mod:`etcslurm.testing.fault_harness`'s.
``tests/test_faults.py`` runs them small and asserts on the rows;
``benchmarks/fault_matrix.py`` runs them all and prints the table (the list of scenarios
and the columns are in its docstring).
"""

from __future__ import annotations

import contextlib
import re
import signal
import time
from pathlib import Path
from typing import Any

from etcslurm.coord.client import connect
from etcslurm.errors import EtcslurmError
from etcslurm.local.launcher import (
    LocalRun,
    run_demo,
)
from etcslurm.redis_host.server import BundledRedis
from etcslurm.testing.fault_harness import (
    COLLECTIVE_TIMEOUT,
    DEAD_AFTER,
    Row,
    Tracker,
    at_step,
    faults,
    hold_for_joiner,
    kill_rank,
    record,
    release_when_joined,
    run_scenario,
    scenario_options,
)


def kill_worker(redis_url: str, pw: str | None, run_dir: Path, steps: int,
                reference: dict[int, float] | None) -> Row:
    opts = scenario_options(redis_url, pw, run_dir, steps)
    return run_scenario("SIGKILL non-leader rank (dp3)", opts,
                at_step(3, lambda run, t: kill_rank(run, run.record.world - 1)), reference)


def kill_leader(redis_url: str, pw: str | None, run_dir: Path, steps: int,
                reference: dict[int, float] | None) -> Row:
    opts = scenario_options(redis_url, pw, run_dir, steps)
    return run_scenario("SIGKILL leader (rank 0, dp3)", opts,
                at_step(3, lambda run, t: kill_rank(run, 0)), reference)


def preempt_during_migration(redis_url: str, pw: str | None, run_dir: Path, steps: int,
                             reference: dict[int, float] | None) -> Row:
    """4 workers; at step 2 one is preempted; as soon as that resize is published (the
    state is moving) a second worker gets SIGUSR2: it must leave at the next boundary."""
    opts = scenario_options(redis_url, pw, run_dir, steps, workers=4, schedule="2:leave=1")

    def inject(run: LocalRun, tracker: Tracker) -> None:
        rec = record(run)
        if rec is None or int(rec["generation"]) < 1:
            return
        # the new world's highest rank: a survivor of generation 1, mid-migration
        if kill_rank(run, int(rec["world"]) - 1, signal.SIGUSR2):
            tracker.fault_ts = time.time()
            tracker.done = True

    row = run_scenario("SIGUSR2 during a migration (2 resizes back to back)", opts, inject, reference)
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
    opts = scenario_options(redis_url, pw, run_dir, max(steps, 12), schedule="1:join=1",
                    **faults(migration_delay=2.0, **hold_for_joiner(run_dir)))

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

    row = run_scenario("SIGKILL of a receiving rank mid-migration", opts,
               release_when_joined(inject, run_dir), reference)
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
    opts = scenario_options(redis_url, pw, run_dir, max(steps, 12), schedule="1:join=1",
                    staging_mb=0.5,
                    **faults(migration_delay=3.0, **hold_for_joiner(run_dir)))
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

    row = _recovered_after(run_scenario(name, opts, release_when_joined(inject, run_dir), reference), 2)
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
    opts = scenario_options(redis_url, pw, run_dir, max(steps, 12), schedule="1:join=1",
                    **faults(**hold_for_joiner(run_dir)))
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

    row = _recovered_after(run_scenario("joiner taken in that never arrives (hangs)", opts,
                                release_when_joined(inject, run_dir), reference), 2)
    row.detail = {"stalled": stalled}
    return row


def kill_during_rebuild(redis_url: str, pw: str | None, run_dir: Path, steps: int,
                        reference: dict[int, float] | None) -> Row:
    """4 workers, one preempted at step 2 (dp4 → dp3); while the new world forms and
    builds its model (before the exchange; members pause 3 s there), new rank 1 gets
    SIGKILL.  Nobody has committed the new generation and the leaver is still there, so
    all fall back to the old state and plan again without the dead: dp4 − leaver − dead
    = dp2."""
    opts = scenario_options(redis_url, pw, run_dir, max(steps, 8), workers=4, schedule="2:leave=1",
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

    return _recovered_after(run_scenario("SIGKILL of a new member while the new world forms", opts,
                                 inject, reference), 2)


def redis_unreachable(redis_url: str | None, pw: str | None, run_dir: Path, steps: int,
                      reference: dict[int, float] | None, outage: float = 30.0) -> Row:
    """The coordinator's Redis hangs (SIGSTOP: connections open but nothing answers, like
    a network partition) for ``outage`` seconds after step 2, with the runtime's default
    ``dead_after`` / ``collective_timeout`` (10 s): training must go on meanwhile."""
    server = BundledRedis(run_dir / "redis").start()
    try:
        opts = scenario_options(server.url, str(server.password_file), run_dir, max(steps, 12),
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

        row = run_scenario(f"Redis unreachable {outage:g} s (hung, default timeouts)", opts,
                   at_step(2, action), reference, server)
        if window and row.result is not None:
            during = [e for e in row.events if e["type"] == "step"
                      and window["start"] <= e["ts"] <= window["end"]]
            after = [e for e in row.events if e["type"] == "step" and e["ts"] > window["start"]]
            row.recover_s = round(after[0]["ts"] - window["start"], 2) if after else None
            back = [e["data"] for e in row.events if e["type"] == "coordinator.back"]
            row.detail = {"steps_during_outage": len(during), "outage_s": outage,
                          "coordinator_back": back}
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
        opts = scenario_options(server.url, str(server.password_file), run_dir, steps,
                        dead_after=max(DEAD_AFTER, outage + 10),
                        collective_timeout=max(COLLECTIVE_TIMEOUT, outage + 15))

        def action(run: LocalRun, tracker: Tracker) -> bool:
            tracker.fault_ts = time.time()
            server.restart(down_s=outage)
            return True

        name = f"Redis down {outage:g} s" if outage else "Redis restarted"
        row = run_scenario(name, opts, at_step(3, action), reference, server)
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
    opts = scenario_options(redis_url, pw, run_dir, steps,
                    **faults(raise_={"step": 3, "error": "ValueError"}))
    row = run_scenario("ValueError in the step on every rank", opts, lambda run, t: None, None)
    row.outcome = "stopped" if row.error else row.outcome
    return row


def oom_on_one_rank(redis_url: str, pw: str | None, run_dir: Path, steps: int,
                    reference: dict[int, float] | None) -> Row:
    """3 workers; rank 2 runs out of memory at step 3: that worker ends with its
    traceback, the other two recover without it and finish the run."""
    opts = scenario_options(redis_url, pw, run_dir, steps,
                    **faults(raise_={"step": 3, "error": "OutOfMemoryError", "ranks": [2]}))
    row = run_scenario("out of memory on one rank", opts, lambda run, t: None, reference)
    if row.result is not None and len(row.result.losses) == steps:
        row.outcome = "completed without it"
    return row


def lost_pieces(redis_url: str, pw: str | None, run_dir: Path, steps: int,
                reference: dict[int, float] | None) -> Row:
    """dp2 with the distributed optimizer: the killed rank's optimizer shard has no replica."""
    opts = scenario_options(redis_url, pw, run_dir, steps, workers=2, optimizer="distributed")
    row = run_scenario("SIGKILL, no replica (distributed optimizer)", opts,
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
    opts = scenario_options(redis_url, pw, run_dir, max(steps, 8), workers=2, optimizer="distributed",
                    checkpoint_every=2, min_step_seconds=1.0)
    row = run_scenario("SIGKILL, no replica, periodic checkpoints (distributed optimizer)", opts,
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
    opts = scenario_options(redis_url, pw, run_dir, steps, workers=1)
    return dict(run_demo(opts).losses)


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
        opts = scenario_options(url, pw_file, run_dir, max(steps, 10), workers=4,
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

        row = run_scenario("SIGKILL of the coordinator's primary (3 sites, Sentinel)", opts,
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
