"""Leaving drained and reserved nodes without a cluster: scontrol's recorded outputs
(``tests/data/slurm``, from the local cluster), the release rule, the watcher thread and
its node-local file, and the trap's notice path (the one a preemption signal takes)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from etcslurm.job.drain import (
    NodeInfo,
    NodeWatcher,
    Release,
    parse_node,
    parse_reservations,
    release_of,
)
from etcslurm.job.environment import SlurmEnvironment, parse_slurm_time
from etcslurm.job.signals import SignalTrap

DATA = Path(__file__).resolve().parent / "data" / "slurm"


def recorded(name: str) -> str:
    return (DATA / name).read_text()


def test_node_states_and_reasons_from_scontrol() -> None:
    draining = parse_node(recorded("show-node-draining.txt"))
    assert draining == NodeInfo("n2", "MIXED+DRAIN", "maintenance test")
    assert draining.flags == {"MIXED", "DRAIN"}
    idle = parse_node(recorded("show-node-idle.txt"))
    assert idle is not None and idle.state == "IDLE" and idle.reason is None
    assert parse_node("") is None
    assert parse_node("Node n9 not found") is None


def test_reservations_from_scontrol() -> None:
    resv = {r.name: r for r in parse_reservations(recorded("show-reservation.txt"))}
    assert sorted(resv) == ["later", "maint", "now"]
    assert resv["maint"].nodes == ("n3", "n4") and resv["maint"].state == "INACTIVE"
    assert "MAINT" in resv["maint"].flags
    assert resv["now"].state == "ACTIVE" and resv["now"].nodes == ("n2",)
    assert resv["maint"].start - resv["now"].start == 300  # recorded 5 min apart
    assert parse_reservations("No reservations in the system\n") == []


def test_release_rule() -> None:
    resv = parse_reservations(recorded("show-reservation.txt"))
    now = parse_slurm_time("2026-12-03T17:34:31")  # when the output was recorded
    idle = NodeInfo("n3", "IDLE")
    # n3: the maint reservation starts in 300 s: outside a 90-s lead, inside a 600-s one
    assert release_of(idle, resv, "n3", now, lead=90) is None
    soon = release_of(idle, resv, "n3", now, lead=600)
    assert soon == Release("reservation maint starts at 17:39:31", 300.0)
    # the job's own reservation is never a reason to leave
    assert release_of(idle, resv, "n3", now, lead=600, own=["maint"]) is None
    # n2 is inside a reservation that already began: leave at once
    assert release_of(NodeInfo("n2", "IDLE"), resv, "n2", now, lead=90).budget == 0.0
    # a reservation that is over is not one
    assert release_of(idle, resv, "n3", now + 3600, lead=90) is None
    # n1's starts in 2 h
    assert release_of(NodeInfo("n1", "IDLE"), resv, "n1", now, lead=90) is None
    # drained / failing nodes, whatever the reservations
    drain = release_of(parse_node(recorded("show-node-draining.txt")), [], "n2", now, lead=90)
    assert drain == Release("draining (maintenance test)", 90)
    assert release_of(NodeInfo("n4", "ALLOCATED+FAIL"), [], "n4", now, 60).reason == "failing"
    assert release_of(NodeInfo("n4", "MIXED+COMPLETING"), [], "n4", now, 60) is None


def test_watcher_notifies_once_and_shares_with_the_node(tmp_path: Path) -> None:
    answers: list = [(NodeInfo("n2", "MIXED"), []), None,
                     (NodeInfo("n2", "MIXED+DRAIN", "disk"), [])]
    asked: list[str] = []

    def ask(name: str):
        asked.append(name)
        return answers.pop(0) if answers else (NodeInfo("n2", "MIXED+DRAIN", "disk"), [])

    got: list[tuple[str, float | None]] = []
    share = tmp_path / "release.json"
    clock = [1000.0]
    poller = NodeWatcher("n2", lambda r, b: got.append((r, b)), interval=5, lead=60,
                         share=share, ask=ask, clock=lambda: clock[0])
    assert poller.check() is None  # healthy
    assert poller.check() is None  # slurmctld did not answer: try again later
    assert poller.check() == Release("draining (disk)", 60)
    assert poller.check() == Release("draining (disk)", 60)  # once only
    assert got == [("draining (disk)", 60)] and asked == ["n2"] * 3
    # another worker on the node reads the file (no slurmctld call), budget aged by then
    other: list = []
    clock[0] += 15
    reader = NodeWatcher("n2", lambda r, b: other.append((r, b)), interval=5, share=share,
                         poll=False, ask=lambda n: pytest.fail("a reader asked slurmctld"),
                         clock=lambda: clock[0])
    assert reader.check() == Release("draining (disk)", 45.0) and other == [("draining (disk)", 45.0)]
    poller.stop()
    assert not share.exists()


def test_watcher_thread_runs_until_stopped(tmp_path: Path) -> None:
    got: list = []
    watcher = NodeWatcher("n1", lambda r, b: got.append(r), interval=0.05, ask=lambda n: (
        NodeInfo("n1", "IDLE+DRAIN"), []), share=tmp_path / "r.json").start()
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        time.sleep(0.02)
    watcher.stop()
    assert got == ["draining"]


def test_watcher_for_a_job() -> None:
    env = SlurmEnvironment.from_env({"SLURM_JOB_ID": "42", "SLURMD_NODENAME": "n3",
                                     "SLURM_LOCALID": "1", "ETCSLURM_SIGNAL_LEAD": "120",
                                     "SLURM_JOB_RESERVATION": "mine", "SLURM_RESTART_COUNT": "2"})
    w = NodeWatcher.for_job(env, lambda r, b: None)
    assert w is not None and (w.name, w.lead, w.own, w.poll) == ("n3", 120.0, ("mine",), False)
    assert w.share.name == "etcslurm-release-42.2-n3.json"
    assert NodeWatcher.for_job(SlurmEnvironment.from_env({}), lambda r, b: None) is None
    off = SlurmEnvironment.from_env({"SLURM_JOB_ID": "1", "SLURMD_NODENAME": "n1",
                                     "ETCSLURM_NODE_WATCH_S": "0"})
    assert NodeWatcher.for_job(off, lambda r, b: None) is None


def test_a_notice_takes_the_signal_path() -> None:
    events = []
    trap = SignalTrap(("USR2",), end_time=time.time() + 30, callback=events.append)

    class Watcher:
        started = stopped = 0

        def start(self) -> None:
            Watcher.started += 1

        def stop(self) -> None:
            Watcher.stopped += 1

    trap.watchers.append(Watcher())
    with trap:
        assert Watcher.started == 1
        trap.notify("draining (maintenance)", 90)
        assert trap.received
    assert Watcher.stopped == 1
    (ev,) = events
    assert ev.signal == "RELEASE" and ev.reason == "draining (maintenance)"
    assert ev.budget == pytest.approx(30, abs=1)  # capped by the job's end time
    assert trap.fallback() is False  # a notice is no signal to hand on
