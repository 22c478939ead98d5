"""Autogrow without a cluster: squeue/sinfo outputs recorded on the local cluster
(``tests/data/slurm``), the pure decision, and the loop against fake Slurm and coordinator."""

from __future__ import annotations

from pathlib import Path

import pytest

from etcslurm.errors import CoordinatorError, UsageError
from etcslurm.job.environment import parse_slurm_time
from etcslurm.slurm.autogrow import (
    Action,
    Autogrow,
    Job,
    Observation,
    Policy,
    State,
    decide,
    idle_nodes,
    job_name,
    parse_sinfo,
    parse_squeue,
)

DATA = Path(__file__).resolve().parent / "data" / "slurm"
T0 = parse_slurm_time("2026-12-03T17:41:12")  # when the outputs were recorded


def recorded(name: str) -> str:
    return (DATA / name).read_text()


def test_parse_recorded_outputs() -> None:
    jobs = parse_squeue(recorded("squeue-autogrow.txt"))
    assert jobs == [Job("52", "PENDING", (), T0), Job("50", "RUNNING", ("n1",), T0),
                    Job("51", "RUNNING", ("n2", "n3"), T0)]
    assert idle_nodes(parse_sinfo(recorded("sinfo-full.txt"))) == []
    assert parse_sinfo(recorded("sinfo-idle-drained.txt"))["n4"] == "drained"
    assert idle_nodes(parse_sinfo(recorded("sinfo-idle-drained.txt"))) == ["n1", "n2", "n3"]
    assert idle_nodes({"a": "idle*", "b": "idle~", "c": "reserved", "d": "idle"}) == ["d"]
    assert parse_squeue("garbage\n\n") == []


def obs(run: str = "running", nodes: tuple[str, ...] = ("n1",), jobs: tuple[Job, ...] = (),
        idle: int = 3, now: float = T0) -> Observation:
    return Observation(now, run, frozenset(nodes), jobs, idle)


POLICY = Policy(max_nodes=3, min_idle=1, max_pending=1, start_timeout=60, backoff=10,
                backoff_max=40)


def kinds(actions: list[Action]) -> list[tuple[str, int, tuple[str, ...]]]:
    return [(a.kind, a.count, a.jobs) for a in actions]


def test_grows_one_pending_at_a_time_up_to_the_cap() -> None:
    acts, st = decide(obs(), POLICY, State())
    assert kinds(acts) == [("submit", 1, ())]
    # the submitted job is pending: no second one (max_pending 1)
    pending = Job("7", "PENDING", (), T0)
    acts, st = decide(obs(jobs=(pending,), now=T0 + 5), POLICY, st)
    assert acts == []
    # it runs (its worker still starting: its node counts): the next one
    running = Job("7", "RUNNING", ("n2",), T0)
    acts, st = decide(obs(jobs=(running,), idle=2), POLICY, st)
    assert kinds(acts) == [("submit", 1, ())]
    # 3 nodes (1 registered + 2 running jobs): nothing more, though n4 is idle
    acts, _ = decide(obs(jobs=(running, Job("8", "RUNNING", ("n3",), T0)), idle=1), POLICY, st)
    assert acts == []


def test_more_pending_when_allowed_never_past_idle_or_cap() -> None:
    policy = Policy(max_nodes=8, max_pending=3)
    acts, _ = decide(obs(idle=2), policy, State())
    assert kinds(acts) == [("submit", 2, ())]  # 2 idle nodes
    acts, _ = decide(obs(idle=10), policy, State())
    assert kinds(acts) == [("submit", 3, ())]  # max_pending
    acts, _ = decide(obs(idle=10), Policy(max_nodes=3, max_pending=5), State())
    assert kinds(acts) == [("submit", 2, ())]  # the cap: 1 in use + 2
    # min_idle 2: submit only while 2 are idle, and leave... none to spare with 1 idle
    assert decide(obs(idle=1), Policy(max_nodes=8, min_idle=2), State())[0] == []
    assert kinds(decide(obs(idle=2), Policy(max_nodes=8, min_idle=2), State())[0]) == [
        ("submit", 1, ())]


def test_no_idle_node_no_submission_and_no_growth_before_the_run_starts() -> None:
    assert decide(obs(idle=0), POLICY, State())[0] == []
    assert decide(obs(run="waiting", nodes=()), POLICY, State())[0] == []
    # a whole node counts once whatever its workers: the first job's node is in use
    assert kinds(decide(obs(nodes=("n1", "n1")), POLICY, State())[0]) == [("submit", 1, ())]


def test_pending_past_the_cap_are_cancelled_newest_first() -> None:
    a, b = Job("1", "PENDING", (), T0), Job("2", "PENDING", (), T0 + 1)
    # the run grew to 3 meanwhile (a manual grow): every pending job goes
    acts, _ = decide(obs(nodes=("n1", "n2", "n3"), jobs=(a, b)), Policy(3, max_pending=2), State())
    assert kinds(acts) == [("cancel", 0, ("1", "2"))]
    # 2 in use + 2 pending > 3: the newest goes
    acts, _ = decide(obs(nodes=("n1", "n2"), jobs=(a, b), idle=0), Policy(3, max_pending=2),
                     State())
    assert kinds(acts) == [("cancel", 0, ("2",))]


def test_backs_off_when_jobs_do_not_start() -> None:
    stuck = Job("9", "PENDING", (), T0)
    acts, st = decide(obs(jobs=(stuck,), now=T0 + 61), POLICY, State(watching=frozenset({"9"})))
    assert kinds(acts) == [("cancel", 0, ("9",)), ("backoff", 0, ())]
    assert st.failures == 1 and st.backoff_until == T0 + 71
    assert decide(obs(now=T0 + 70), POLICY, st)[0] == []  # still backing off
    acts, _ = decide(obs(now=T0 + 72), POLICY, st)
    assert kinds(acts) == [("submit", 1, ())]
    # a second failure doubles the wait, capped
    _, st3 = decide(obs(jobs=(Job("10", "PENDING", (), T0 + 72),), now=T0 + 200), POLICY,
                    State(failures=3))
    assert st3.backoff_until == T0 + 240  # min(10·2³, 40)
    # a job that started resets the count
    _, st4 = decide(obs(jobs=(Job("11", "RUNNING", ("n2",), T0),)), POLICY,
                    State(failures=3, watching=frozenset({"11"})))
    assert st4.failures == 0 and st4.watching == frozenset()


def test_the_end_cancels_what_is_pending_and_stops() -> None:
    acts, _ = decide(obs(run="ended", jobs=(Job("3", "PENDING", (), T0),
                                            Job("4", "RUNNING", ("n2",), T0))), POLICY, State())
    assert kinds(acts) == [("cancel", 0, ("3",)), ("stop", 0, ())]
    assert kinds(decide(obs(run="ended"), POLICY, State())[0]) == [("stop", 0, ())]


def test_bad_limits_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="--max-nodes must be >= 1"):
        Policy(max_nodes=0)
    with pytest.raises(UsageError, match="--start-timeout must be > 0"):
        Policy(max_nodes=2, start_timeout=0)
    with pytest.raises(UsageError, match="bad run id"):
        job_name("a b")


# ---------------------------------------------------------------------------- the loop
class FakeSlurm:
    partition = "elastic"

    def __init__(self) -> None:
        self.queue: list[Job] = []
        self.idle_nodes = ["n2", "n3", "n4"]
        self.cancelled: list[str] = []

    def idle(self) -> int:
        return len(self.idle_nodes)

    def jobs(self) -> list[Job]:
        return list(self.queue)

    def cancel(self, ids) -> None:
        self.cancelled += list(ids)
        self.queue = [j for j in self.queue if j.id not in ids]

    def start_pending(self) -> None:  # the scheduler places pending jobs on idle nodes
        for i, j in enumerate(self.queue):
            if j.state == "PENDING" and self.idle_nodes:
                self.queue[i] = Job(j.id, "RUNNING", (self.idle_nodes.pop(0),), j.submitted)


class FakeCoord:
    def __init__(self) -> None:
        self.events: list[dict] = []
        self.kind = "start"
        self.down = False

    def current_generation(self):
        if self.down:
            raise CoordinatorError("coordinator unreachable")
        return type("Rec", (), {"kind": self.kind})()

    def members(self):
        return {"w1": {"node": "n1", "state": "active", "alive": True}}

    def emit(self, type: str, **data) -> str:
        self.events.append({"type": type, **data})
        return "1-0"


def test_loop_grows_to_the_cap_then_stops_at_the_end() -> None:
    slurm, coord, lines = FakeSlurm(), FakeCoord(), []
    ids = iter(range(100, 200))

    def submit() -> str:
        job = Job(str(next(ids)), "PENDING", (), T0)
        slurm.queue.append(job)
        return job.id

    loop = Autogrow(coord, slurm, POLICY, submit, out=lines.append, clock=lambda: T0)
    for _ in range(4):
        assert loop.step()
        slurm.start_pending()
    assert loop.submitted == ["100", "101"]  # 1 + 2 = the cap of 3 nodes, n4 left idle
    assert sorted(j.nodes[0] for j in slurm.queue) == ["n2", "n3"]
    coord.kind = "end"
    slurm.queue.append(Job("150", "PENDING", (), T0))  # e.g. a requeued one
    assert not loop.step()
    assert slurm.cancelled == ["150"]
    actions = [(e["action"], tuple(e["jobs"])) for e in coord.events]
    assert actions == [("submit", ("100",)), ("submit", ("101",)), ("cancel", ("150",)),
                       ("stop", ())]
    assert coord.events[0]["max_nodes"] == 3 and coord.events[0]["idle"] == 3
    assert any("autogrow submit: 3 idle nodes (jobs 100)" in x for x in lines)


def test_loop_gives_up_after_a_coordinator_outage_and_cancels_its_jobs() -> None:
    slurm, coord = FakeSlurm(), FakeCoord()
    slurm.queue.append(Job("5", "PENDING", (), T0))
    coord.down = True
    now = [T0]

    def clock() -> float:
        now[0] += 30
        return now[0]

    loop = Autogrow(coord, slurm, POLICY, lambda: "x", interval=0.001, outage=60,
                    out=lambda s: None, clock=clock)
    with pytest.raises(CoordinatorError, match="autogrow gave up after 60 s"):
        loop.run()
    assert slurm.cancelled == ["5"]


# ---------------------------------------------------------------------------- the run file
def test_run_file_autogrow_table_starts_it_from_the_first_job(tmp_path: Path) -> None:
    from etcslurm.slurm import runfile
    from etcslurm.slurm.submission import submit

    path = tmp_path / "run.toml"
    path.write_text('run_id = "r1"\n[run]\nmodel = "gpt-tiny"\n[slurm]\nnodes = 1\n'
                    'partition = "spot"\nexclusive = true\n[autogrow]\nmax_nodes = 4\n'
                    'interval = 5\n')
    rf = runfile.load(path, {"steps": "10"})
    assert rf.autogrow == {"max_nodes": 4, "interval": 5, "partition": "spot"}
    script = submit(rf.worker_cmd, dry_run=True, **rf.submit_args()).script
    line = next(x for x in script.splitlines() if x.startswith("autogrow=("))
    assert line.endswith(f"-m etcslurm autogrow {path.resolve()} --set steps=10)")
    assert "trap 'stop_autogrow;" in script
    # without [autogrow] nothing runs
    path.write_text('run_id = "r1"\n[run]\nmodel = "gpt-tiny"\n')
    assert "autogrow=()" in submit(runfile.load(path).worker_cmd, dry_run=True,
                                   **runfile.load(path).submit_args()).script
    path.write_text('[run]\nmodel = "gpt-tiny"\n[autogrow]\nmax_node = 2\nmin_idle = 0\n')
    with pytest.raises(runfile.RunFileError) as err:
        runfile.load(path)
    assert err.value.problems == [
        "run.toml: [autogrow] max_node: unknown field; did you mean max_nodes?",
        "run.toml: [autogrow] min_idle: must be >= 1, got 0",
        "run.toml: [autogrow] max_nodes: missing (the most nodes the run may grow to)",
        "run.toml: [autogrow] partition: missing (here or in [slurm]): the partition whose "
        "idle nodes it grows into",
    ]
