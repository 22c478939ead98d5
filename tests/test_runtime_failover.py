"""The elastic runtime through a hard loss of the coordinator's primary.

A replicated coordinator on 127.0.0.1 (a primary + 2 replicas + 3 Sentinels: the
``sites`` fixture of ``tests/test_coord_failover.py``, ``down-after`` 800 ms); a real
4-worker gpt-tiny run connected through the Sentinels (``redis+sentinel://`` URL without
the password + the site's 0600 password file, so no password is on a command line).
Once the run has finished step 3 the primary's ``redis-server`` is SIGKILLed: Sentinel
promotes a replica (the run holds after step 6 until it has), the run goes on, resizes
at step 8 (SIGUSR2 to one worker), and its losses equal a run that never resized.  Every process is stopped by PID (workers by the
launcher, Redis and Sentinels by the fixture).
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from etcslurm.coord.client import CoordClient, connect, sentinel_url
from etcslurm.coord.coordinator import Coordinator
from etcslurm.local.launcher import LOSS_TOLERANCE, DemoOptions, LocalRun, run_demo
from etcslurm.redis_host import failover
from etcslurm.redis_host.sentinel import Site
from etcslurm.testing.fault_harness import Tracker, at_step, faults
from tests import test_coord_failover as coord_failover
from tests.helpers import generation_record, pids_alive
from tests.test_runtime_elastic import _data_positions

#: the three-site fixture (primary + 2 replicas + 3 Sentinels on loopback, stopped by PID)
sites = coord_failover.sites

KILL_AFTER_STEP = 3
HOLD_STEP = 6
FAILOVER_LIMIT_S = 30.0


def _bare_url(sites: list[Site]) -> str:
    """The Sentinel URL without the password (workers get the password file)."""
    return sentinel_url([s.sentinel.address for s in sites],  # type: ignore[union-attr]
                        "etcslurm")


def _password_file(sites: list[Site]) -> str:
    return str(sites[0].redis.password_file)


class FailoverProbe:
    """SIGKILLs the primary's redis-server and measures, from a thread, the time to the
    first successful write through the Sentinels and to the Sentinels naming another
    primary."""

    def __init__(self, client: CoordClient, primary: Site, run_id: str) -> None:
        self.client, self.primary, self.run_id = client, primary, run_id
        self.killed_at: float | None = None
        self.kill_step: int | None = None
        self.first_write_s: float | None = None
        self.promoted_s: float | None = None
        self.new_primary: list[Any] | None = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.topology: dict[str, Any] = {}

    def kill(self, run: LocalRun, _tracker: Tracker) -> bool:
        # the Sentinels must know both replicas (they learn them from the primary's INFO
        # every 10 s) or there is nothing to fail over to; by step 3 they long have
        self.topology = failover.settle(self.client, 3)
        self.kill_step = run.step
        self.killed_at = time.monotonic()
        self.primary.kill_redis()
        self.thread = threading.Thread(target=self._measure, daemon=True)
        self.thread.start()
        return True

    def _measure(self) -> None:
        assert self.killed_at is not None
        old = list(self.primary.address)
        key = f"etcslurm-test:failover-probe:{self.run_id}"
        try:
            self.client.call("failover probe", lambda r: r.set(key, "1", ex=60))
            self.first_write_s = time.monotonic() - self.killed_at
            end = time.monotonic() + 60
            while time.monotonic() < end:
                try:
                    top = failover.topology(self.client)
                    if top["primary"] != old:
                        self.promoted_s = time.monotonic() - self.killed_at
                        self.new_primary = top["primary"]
                        return
                except Exception:  # a Sentinel mid-failover: ask again
                    pass
                time.sleep(0.05)
        except BaseException as exc:  # reported by the test
            self.error = exc


def _data_log_generations(run_dir: Path) -> dict[str, list[int]]:
    """Each worker's generations in the order its data log shows them; asserts that no
    worker's generation goes backwards and that one generation has one layout."""
    layouts: dict[int, set[str]] = defaultdict(set)
    history: dict[str, list[int]] = {}
    for log in sorted(run_dir.glob("data-*.jsonl")):
        gens: list[int] = []
        for line in log.read_text().splitlines():
            e = json.loads(line)
            layouts[e["gen"]].add(e["layout"])
            if gens and e["gen"] < gens[-1]:
                raise AssertionError(f"{log.name}: generation went back from {gens[-1]} to "
                                     f"{e['gen']} at step {e['step']}")
            if not gens or gens[-1] != e["gen"]:
                gens.append(e["gen"])
        history[log.stem] = gens
    assert all(len(v) == 1 for v in layouts.values()), f"two layouts for one generation: {layouts}"
    return history


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(600)
def test_sigkill_of_primary_mid_run_then_resize_matches_reference(sites, run_id, tmp_path,
                                                                 reference):
    url, pw = _bare_url(sites), _password_file(sites)
    client = connect(url, pw, retry_deadline=60)
    probe = FailoverProbe(client, sites[0], run_id)
    tracker = Tracker(at_step(KILL_AFTER_STEP, probe.kill))
    watcher = Coordinator(client, run_id)
    seen: dict[str, Any] = {}

    steps = 12  # the shared reference's length (tests/conftest.py)
    # the steps trained while no primary answers publish nothing, so the launcher, which
    # applies the schedule as steps are published, could see step 8 only once the run is
    # over: the run holds after step HOLD_STEP until the Sentinels have promoted a replica
    promoted = tmp_path / "promoted"
    opts = DemoOptions(workers=4, steps=steps, schedule="8:leave=1", redis=url, password_file=pw,
                       run_id=run_id, run_dir=str(tmp_path), min_step_seconds=1.0,
                       reference=False, keep_keys_s=60,
                       **faults(hold={"step": HOLD_STEP, "file": str(promoted),
                                      "timeout": FAILOVER_LIMIT_S * 2}))

    def tick(run: LocalRun) -> None:
        tracker(run)
        if probe.promoted_s is not None and not promoted.exists():
            promoted.touch()

    t0 = time.monotonic()
    try:
        result = run_demo(opts, on_tick=tick)
    finally:
        if probe.thread is not None:
            probe.thread.join(timeout=90)
    # the coordinator's view, read before the run's keys expire (keep_keys_s)
    seen["events"] = watcher.read_events("0", block_ms=0, count=100000)
    seen["gen"] = watcher.current_generation()
    seen["committed"] = watcher.committed_generation()
    took = time.monotonic() - t0
    print(f"\nrun took {took:.1f} s; primary SIGKILLed after step "
          f"{probe.kill_step}: first write after the kill {probe.first_write_s} s, Sentinels "
          f"named {probe.new_primary} primary after {probe.promoted_s} s "
          f"(down-after {coord_failover.DOWN_MS} ms)")
    print(f"generations: {result.generations}")
    assert probe.error is None, f"failover probe failed: {probe.error!r}"
    assert probe.killed_at is not None and probe.kill_step is not None
    assert probe.topology["primary"] == list(sites[0].address)
    assert probe.kill_step < 8, "the primary must die before the resize"
    assert probe.first_write_s is not None and probe.first_write_s < FAILOVER_LIMIT_S
    assert probe.promoted_s is not None and probe.promoted_s < FAILOVER_LIMIT_S
    assert probe.new_primary in ([list(s.address) for s in sites[1:]])

    # the run completed every step, resized at step 8, and trained like the reference
    assert len(result.losses) == steps, sorted(result.losses)
    gens = result.generations
    assert [(g["generation"], g["kind"], g["to"]) for g in gens] == [
        (0, "start", "tp1pp1dp4"), (1, "resize", "tp1pp1dp3")], gens
    assert len(gens[1]["leaving"]) == 1 and gens[1]["step"] >= 8, gens[1]
    assert all(not g["dead"] for g in gens), "the failover made a live worker look dead"
    assert reference.max_diff(result.losses) <= LOSS_TOLERANCE, result.losses
    assert all(code == 0 for code in result.exit_codes.values()), result.exit_codes
    assert len(result.exit_codes) == 4
    assert pids_alive(result.pids) == [], "no worker process may outlive the run"

    # no generation lost: every worker's data log shows the generations in order, one
    # layout each; the ones still training after the resize went 0 -> 1
    history = _data_log_generations(tmp_path)
    assert len(history) == 4, history
    assert all(h in ([0], [0, 1]) for h in history.values()), history
    assert sum(h == [0, 1] for h in history.values()) == 3, history
    _data_positions(tmp_path, steps, opts.global_batch)
    # the coordinator (the promoted replica) lists generations 0, 1 in order, no gap
    assert "events" in seen, "the coordinator was not read before the run's keys expired"
    starts = [e["data"] for e in seen["events"] if e["type"] == "generation.start"]
    numbers = [int(s["generation"]) for s in starts]
    assert numbers == list(range(len(numbers))), numbers
    assert [(int(s["generation"]), s["kind"]) for s in starts if s["kind"] != "end"] == [
        (0, "start"), (1, "resize")], starts
    assert seen["gen"] is not None and seen["gen"].generation == numbers[-1]
    assert seen["committed"] == 1
    # Tracker saw the same records the workers followed
    assert sorted(tracker.records) == [0, 1]
    client.close()


@pytest.mark.redis
def test_generation_acknowledged_before_the_kill_is_read_by_a_fresh_coordinator(sites, run_id):
    """A generation published (acknowledged by a replica: ``WAIT``) right before the
    primary is SIGKILLed is what a client that connects after the failover reads."""
    url, pw = _bare_url(sites), _password_file(sites)
    client = connect(url, pw, retry_deadline=30)
    failover.settle(client, 3)
    coord = Coordinator(client, run_id)
    wid = coord.register(heartbeat=False)
    assert coord.publish_generation(generation_record(0, "tp1pp1dp1", [wid]))
    coord.commit_generation(0)
    rec1 = generation_record(1, "tp1pp1dp1", [wid], from_layout="tp1pp1dp1")
    assert coord.publish_generation(rec1)
    t0 = time.monotonic()
    sites[0].kill_redis()
    client.close()

    fresh = connect(url, pw, retry_deadline=30)
    try:
        follower = Coordinator(fresh, run_id)
        got = follower.wait_generation(after=0, timeout=30)
        took = time.monotonic() - t0
        print(f"\nSIGKILL -> generation 1 read by a fresh Coordinator: {took:.2f} s")
        assert got.generation == 1 and got.kind == "resize"
        assert got.assignment == rec1.assignment
        assert follower.committed_generation() == 0
        assert wid in follower.members()
        assert failover.topology(fresh)["primary"] != list(sites[0].address)
    finally:
        fresh.close()
