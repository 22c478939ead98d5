"""Unit tests of the session's state machine: each transition alone, on fakes.

A fake coordinator and a fake world (tests/fakes.py) stand in for Redis and
torch.distributed, so each transition's decision is checked in milliseconds; the layout
policy and the planner are the real (pure) ones.  The real parts are exercised by the
multi-process tests (test_runtime_elastic.py, test_faults.py, test_slurm_elastic.py).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest

from etcslurm.coord.records import ChangeRequest, CheckpointRequest, GenerationRecord, replace
from etcslurm.errors import StateLostError, UsageError, WaitTimeout
from etcslurm.runtime import recovery, steps, transitions
from etcslurm.runtime.generation import end_generation
from etcslurm.runtime.machine import Phase, State, drive, settle
from etcslurm.runtime.session import TRANSITIONS
from tests.fakes import FakeCoordinator, FakeTrainee, context, member


def _running(workers: list[str], **coord_kw: object) -> tuple[FakeCoordinator, GenerationRecord]:
    """A coordinator whose run is in generation 0 with ``workers`` (all active)."""
    coord = FakeCoordinator({w: member(node=f"n{i // 2}") for i, w in enumerate(workers)},
                            **coord_kw)
    ctx = context(workers[0], coord, initial=len(workers))
    record = transitions.first_generation(transitions.layout_settings(ctx), workers,
                                          {w: f"n{i // 2}" for i, w in enumerate(workers)})
    assert coord.publish_generation(record)
    return coord, record


def _member_of(coord: FakeCoordinator, record: GenerationRecord, me: str, **kw: object):
    """The context of world member ``me`` training in ``record``."""
    ctx = context(me, coord, initial=len(record.union), **kw)
    ctx.record, ctx.rank = record, record.rank_of(me)
    ctx.trainee = FakeTrainee(record.to_layout, ctx.rank or 0, iteration=7)
    return ctx


def test_first_worker_publishes_generation_zero_and_enters() -> None:
    coord = FakeCoordinator({"w1": member("joining"), "w2": member("joining")})
    ctx = context("w1", coord, initial=2)
    final = drive(ctx, State(Phase.START), TRANSITIONS)
    assert final.phase is Phase.ACTIVE
    gen0 = coord.records[0]
    assert (gen0.generation, gen0.kind, gen0.union) == (0, "start", ("w1", "w2"))
    assert ctx.rank == 0 and ctx.record == gen0
    assert ctx.world.formed == [(0, gen0.to_layout, 0)]
    assert coord.states[-1] == ("active", {"rank": 0, "generation": 0})


def test_joiner_waits_then_enters_a_running_world() -> None:
    coord, gen0 = _running(["w1", "w2"])
    ctx = context("w2", coord, initial=2)
    assert transitions.start(ctx, State(Phase.START)) == State(Phase.WAIT, after=-1)
    final = drive(ctx, State(Phase.START), TRANSITIONS)
    assert final.phase is Phase.ACTIVE and ctx.rank == 1 and ctx.record == gen0


def test_too_few_initial_workers_time_out_with_a_named_wait() -> None:
    coord = FakeCoordinator({"w1": member("joining")})
    ctx = context("w1", coord, initial=3, join_timeout=0.2)
    with pytest.raises(Exception, match=r"only 1 of 3 initial workers registered within 0.2 s"):
        settle(ctx, transitions.first, State(Phase.FIRST))


def test_a_leaver_hands_over_and_the_survivor_commits() -> None:
    coord, gen0 = _running(["w1", "w2", "w3", "w4"])
    coord.workers["w4"]["state"] = "leaving"
    survivor = _member_of(coord, gen0, "w1")
    final = drive(survivor, State(Phase.DECIDE), TRANSITIONS)
    gen1 = coord.records[-1]
    assert final.phase is Phase.ACTIVE
    assert (gen1.generation, gen1.kind, gen1.leaving) == (1, "resize", ("w4",))
    assert survivor.record == gen1 and coord.committed == 1
    assert survivor.trainee.iteration == 7  # the scalars travelled with the plan's record
    job = survivor.world.migrations[0]
    assert job.me == "0" and job.members == [gen1.planner_ids[w] for w in gen1.union]
    assert not job.on_world  # the leaver takes part but is not in the new world
    assert "migration.done" in coord.event_types()
    leaver = _member_of(coord, gen0, "w4")
    final = drive(leaver, State(Phase.DECIDE), TRANSITIONS)
    assert final == State(Phase.LEFT, reason="left")
    assert leaver.world.migrations[0].new_rank is None and leaver.trainee is None


def test_a_peer_lost_mid_migration_falls_back_for_members_and_joiners() -> None:
    coord, gen0 = _running(["w1", "w2"])
    coord.workers["w3"] = member("joining")
    old = _member_of(coord, gen0, "w1")
    transitions.publish_next(old, reason="test")
    gen1 = coord.records[-1]
    assert "w3" in gen1.joining
    old.world.fail_migration = "exchange"
    nxt = transitions.resize(old, State(Phase.RESIZE, record=gen1))
    assert nxt.phase is Phase.RECOVER and nxt.failed == gen1
    assert old.record == gen0 and old.rank == 0 and old.world.aborted == 1  # untouched
    joiner = context("w3", coord, initial=2)
    joiner.world.fail_migration = "group"
    assert transitions.resize(joiner, State(Phase.RESIZE, record=gen1)) == State(
        Phase.WAIT, after=gen1.generation)
    assert any("failed in group" in f.get("message", "") for _, f in coord.events)


def test_a_change_among_the_new_worlds_members_exchanges_on_the_world() -> None:
    """Nobody leaves (a joiner comes in): the participants are the new world, listed in
    new-rank order, so the migration may run the exchange on the world itself; the
    joiner, with no old state, is told so too.  Each participant plans analytically when
    the model is etcslurm's own (no descriptions to exchange)."""
    coord, gen0 = _running(["w1", "w2", "w3"])
    coord.workers["w4"] = member("joining", node="n1")
    old = _member_of(coord, gen0, "w1")
    transitions.publish_next(old, reason="test")
    gen1 = coord.records[-1]
    assert set(gen1.union) == set(gen1.workers_by_rank())
    for ctx in (old, context("w4", coord, initial=3)):
        transitions.resize(ctx, State(Phase.RESIZE, record=gen1))
        job = ctx.world.migrations[-1]
        assert job.on_world
        assert job.members == [gen1.planner_ids[w] for w in gen1.workers_by_rank()]
        assert job.members.index(job.me) == job.new_rank


def test_the_analytic_plan_is_the_decider_s_own_part() -> None:
    """For etcslurm's own model every participant replays the decider's analytic plan
    for its own part, with the published assignment; the whole move's totals are the
    decider's; vocabulary rows no old layout had are to be zero-filled, not lost."""
    from types import SimpleNamespace

    from etcslurm.core.plan import plan
    from etcslurm.runtime.generation import plan_inputs
    from etcslurm.runtime.plans import plan_analytically

    coord, gen0 = _running(["w1", "w2", "w3", "w4"])
    coord.changes.append(ChangeRequest(to="tp2pp1dp2", drain=(), by="operator", ts=0.0))
    ctx = _member_of(coord, gen0, "w2")
    ctx.world.analytic = True  # etcslurm's own model
    transitions.publish_next(ctx, reason="test")
    gen1 = coord.records[-1]
    assert gen1.to_layout == "tp2pp1dp2"
    me = gen1.planner_ids["w2"]
    migration = SimpleNamespace(job=SimpleNamespace(me=me, generation=1), fill=[])
    got = plan_analytically(transitions.layout_settings(ctx), gen1, migration)
    inputs = plan_inputs(transitions.layout_settings(ctx), gen1)
    whole = plan(inputs, assignment=[gen1.planner_ids[w] for w in gen1.workers_by_rank()])
    assert got.missing == {} and got.stats["lost_pieces"] == 0
    assert got.stats["moved_bytes"] == gen1.plan_stats["moved_bytes"] == whole.stats["moved_bytes"]
    assert [m for m in whole.messages if me in (m.src, m.dst)] == got.messages
    assert whole.local.get(me, []) == got.local.get(me, [])
    assert migration.fill == []  # gpt-tiny's padded vocabulary is the same under TP 1 and 2


def test_recover_publishes_a_generation_without_the_dead_and_follows_it() -> None:
    coord, gen0 = _running(["w1", "w2", "w3", "w4"])
    coord.workers["w3"]["alive"] = False
    ctx = _member_of(coord, gen0, "w1")
    nxt = settle(ctx, recovery.recover, State(Phase.RECOVER, error=RuntimeError("peer closed")))
    assert nxt.phase is Phase.FOLLOW
    assert nxt.record.dead == ("w3",) and "w3" not in nxt.record.union
    assert coord.gone == ["w3"] and "error" in coord.event_types()


def test_a_collective_that_fails_with_every_peer_alive_forms_the_world_again_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A timeout, nobody dead: the first member publishes the same world again once every
    member is back on its old state (a pending drain carried out with it); the same
    failure at the same step again is no timeout: the bounded wait, then its error."""
    coord, gen0 = _running(["w1", "w2", "w3"])
    coord.changes.append(ChangeRequest(to=None, drain=("w3",), by="operator", ts=0.0))
    ctx = _member_of(coord, gen0, "w1", dead_after=10.0, collective_timeout=10.0)
    clock = _Clock()
    monkeypatch.setattr(recovery, "time", clock)
    clock.at.append((4.0, lambda: coord.held.update(w2=0, w3=0)))  # the others come back
    failed = State(Phase.RECOVER, error=RuntimeError("Timed out waiting 10000ms for recv"))
    nxt = settle(ctx, recovery.recover, failed)
    assert nxt.phase is Phase.FOLLOW and 4.0 <= clock.now < 5
    gen1 = nxt.record
    assert gen1.generation == 1 and gen1.dead == () and coord.gone == []
    assert gen1.union == ("w1", "w2", "w3") and gen1.leaving == ("w3",)  # the drain
    assert "every peer alive" in gen1.reason
    # at the same step, in the world formed again, the same failure: no second re-form
    ctx.record, ctx.rank = gen1, gen1.rank_of("w1")
    coord.held.update(w1=1, w2=1, w3=1)  # all back again: only the step says no
    published = len(coord.records)
    with pytest.raises(WaitTimeout, match="no peer was found dead"):
        settle(ctx, recovery.recover, failed)
    assert len(coord.records) == published


class _Clock:
    """``time`` for :mod:`etcslurm.runtime.recovery`: sleeping advances a virtual clock,
    and ``at`` runs an action once the clock has passed a time (another worker acting)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.at: list[tuple[float, Any]] = []

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        for when, action in [a for a in self.at if a[0] <= self.now]:
            self.at.remove((when, action))
            action()


def _survivor_of_a_failed_change(monkeypatch: pytest.MonkeyPatch, me: str):
    """``me`` of four saw generation 1 fail; w4 is dead.  w1 is the first survivor, who
    publishes; gloo can keep a survivor inside the failed rendezvous for 5x the group's
    timeout (50 s at 10 s, seen in CI)."""
    coord, gen0 = _running(["w1", "w2", "w3", "w4"])
    failed = replace(gen0, generation=1, kind="resize")
    coord.publish_generation(failed)
    coord.workers["w4"]["alive"] = False
    ctx = _member_of(coord, gen0, me, dead_after=10.0, collective_timeout=10.0)
    ctx.world.notice = 50.0
    clock = _Clock()
    monkeypatch.setattr(recovery, "time", clock)
    state = State(Phase.RECOVER, error=RuntimeError("rendezvous failed"), failed=failed)
    return coord, gen0, ctx, clock, state


def _follower_of_a_slow_decider(monkeypatch: pytest.MonkeyPatch):
    """w3, while w1 (the publisher) is still inside the failed rendezvous."""
    return _survivor_of_a_failed_change(monkeypatch, "w3")


def test_recover_waits_for_a_decider_still_inside_a_failed_rendezvous(
        monkeypatch: pytest.MonkeyPatch) -> None:
    coord, gen0, ctx, clock, state = _follower_of_a_slow_decider(monkeypatch)
    decided = replace(gen0, generation=2, kind="resize", union=("w1", "w2", "w3"),
                      dead=("w4",))
    clock.at.append((50.5, lambda: coord.publish_generation(decided)))
    nxt = settle(ctx, recovery.recover, state)
    assert nxt == State(Phase.FOLLOW, record=decided)
    assert clock.now >= 50.5 and coord.gone == []  # it waited; only the decider decides


def test_recover_gives_up_on_a_decider_that_never_publishes_and_names_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    coord, _, ctx, clock, state = _follower_of_a_slow_decider(monkeypatch)
    published = len(coord.records)
    with pytest.raises(WaitTimeout, match=r"within 130 s \(w4 found dead, w1 was to publish it\)"):
        settle(ctx, recovery.recover, state)
    # dead_after x 2 + collective timeout + twice the notice (the decider's own, then
    # its wait for the others to come back)
    assert 130 <= clock.now < 131
    assert len(coord.records) == published and coord.gone == []  # a follower never decides
    assert coord.held == {"w3": 1}  # it said it stands by on its old state


def _decider_with_a_member_still_in_the_rendezvous(monkeypatch: pytest.MonkeyPatch):
    """w1 (the publisher) saw generation 1 fail; w4 is dead; w2 is alive but still inside
    the failed rendezvous (it has not said it holds its old state)."""
    coord, _, ctx, clock, state = _survivor_of_a_failed_change(monkeypatch, "w1")
    coord.held["w3"] = 1
    return coord, ctx, clock, state


def test_the_publisher_waits_for_members_still_inside_the_failed_rendezvous(
        monkeypatch: pytest.MonkeyPatch) -> None:
    coord, ctx, clock, state = _decider_with_a_member_still_in_the_rendezvous(monkeypatch)
    clock.at.append((40.0, lambda: coord.held.update(w2=1)))  # w2's rendezvous fails
    nxt = settle(ctx, recovery.recover, state)
    assert nxt.phase is Phase.FOLLOW and nxt.record.generation == 2
    assert 40.0 <= clock.now < 41 and coord.gone == ["w4"]
    assert nxt.record.union == ("w1", "w2", "w3") and nxt.record.dead == ("w4",)


def test_the_publisher_waits_for_stragglers_no_longer_than_a_rendezvous_can_take(
        monkeypatch: pytest.MonkeyPatch) -> None:
    coord, ctx, clock, state = _decider_with_a_member_still_in_the_rendezvous(monkeypatch)
    nxt = settle(ctx, recovery.recover, state)  # w2 never says it is back
    assert nxt.phase is Phase.FOLLOW and "w2" in nxt.record.union
    assert 60.0 <= clock.now < 61  # the collective timeout + the notice
    assert coord.gone == ["w4"]  # a straggler is planned in, not taken for dead


def test_follow_dispatches_and_refuses() -> None:
    coord, gen0 = _running(["w1", "w2"])
    ctx = _member_of(coord, gen0, "w1")
    stop = replace(gen0, generation=1, kind="stop", reason="2 pieces lost")
    with pytest.raises(StateLostError, match="stopped: 2 pieces lost"):
        transitions.follow(ctx, State(Phase.FOLLOW, record=stop))
    without_me = replace(gen0, generation=1, kind="resize", union=("w2",))
    assert transitions.follow(ctx, State(Phase.FOLLOW, record=without_me)).reason == "evicted"
    ckpt = replace(gen0, generation=1, kind="checkpoint")
    assert transitions.follow(ctx, State(Phase.FOLLOW, record=ckpt)).phase is Phase.CHECKPOINT


def test_waiting_worker_goes_home_on_signal_or_end() -> None:
    coord, gen0 = _running(["w1", "w2"])
    ctx = context("w9", coord)
    ctx.boundary.on_signal(object())
    assert settle(ctx, transitions.wait, State(Phase.WAIT, after=0)).phase is Phase.LEFT
    coord.publish_generation(end_generation(gen0, 5, reason="finished 5 steps"))
    ctx = context("w9", coord)
    left = settle(ctx, transitions.wait, State(Phase.WAIT, after=0))
    assert left.phase is Phase.LEFT and "finished 5 steps" in left.reason


def test_handed_over_follows_a_replanned_change_that_still_needs_it() -> None:
    coord, gen0 = _running(["w1", "w2"])
    ctx = _member_of(coord, gen0, "w2")
    failed = replace(gen0, generation=1, kind="resize", leaving=("w2",))
    again = replace(gen0, generation=2, kind="resize", leaving=("w2",))
    coord.publish_generation(failed)
    coord.publish_generation(again)
    assert settle(ctx, transitions.handed_over, State(Phase.HANDED_OVER, record=failed)) == State(
        Phase.FOLLOW, record=again)
    assert ctx.trainee is not None  # still holds the state the new plan sends


def test_operator_drain_and_layout_requests_are_carried_out() -> None:
    coord, gen0 = _running(["w1", "w2", "w3", "w4"])
    coord.changes.append(ChangeRequest(to=None, drain=("w3",), by="operator", ts=0.0))
    ctx = _member_of(coord, gen0, "w1")
    transitions.publish_next(ctx, reason="resize at step boundary")
    assert coord.records[-1].leaving == ("w3",) and coord.changes == []
    coord2, gen0b = _running(["w1", "w2", "w3", "w4"])
    coord2.changes.append(ChangeRequest(to="tp1pp1dp2", drain=(), by="operator", ts=0.0))
    ctx2 = _member_of(coord2, gen0b, "w1")
    transitions.publish_next(ctx2, reason="resize at step boundary")
    assert coord2.records[-1].to_layout == "tp1pp1dp2"


def test_whole_run_preempted_writes_a_checkpoint_and_a_restart_resumes(tmp_path: Path) -> None:
    coord, gen0 = _running(["w1", "w2"])
    for w in ("w1", "w2"):
        coord.workers[w]["state"] = "leaving"
    ctx = _member_of(coord, gen0, "w1", tmp=str(tmp_path))
    final = drive(ctx, State(Phase.DECIDE), TRANSITIONS)
    assert final == State(Phase.LEFT, reason="checkpointed")
    assert coord.records[-1].kind == "checkpoint"
    assert ctx.world.saved == [str(tmp_path / "checkpoint")]  # the save directory
    # Megatron-LM's tracker names the step's iter_NNNNNNN (the fake save moved it)
    assert (tmp_path / "checkpoint" / "latest_checkpointed_iteration.txt").read_text() == "7\n"
    pointer = {"path": str(tmp_path / "checkpoint" / "iter_0000007"), "step": 7}
    assert pointer["step"] == coord.records[-1].step
    (tmp_path / "checkpoint" / "iter_0000007").mkdir()
    (tmp_path / "checkpoint" / "iter_0000007" / "metadata.json").write_text("{}")
    # the requeued job's workers register afresh and resume from the pointer
    for w in ("w1", "w2"):
        coord.workers[w]["state"] = "gone"
    coord.workers.update({"w5": member("joining"), "w6": member("joining")})
    fresh = context("w5", coord, initial=2, tmp=str(tmp_path))
    assert drive(fresh, State(Phase.START), TRANSITIONS).phase is Phase.ACTIVE
    start = coord.records[-1]
    assert start.kind == "start" and start.resume == pointer["path"]
    assert fresh.world.loaded == [pointer["path"]]


def _saved(where: Path, iteration: int) -> Path:
    """A save directory in Megatron-LM's layout (the files the loader looks at)."""
    target = where / f"iter_{iteration:07d}"
    target.mkdir(parents=True)
    (target / "metadata.json").write_text("{}")
    (where / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
    return target


def test_a_run_started_with_load_resumes_that_checkpoint_unless_it_has_its_own(
        tmp_path: Path) -> None:
    """``RunSettings(load=DIR)``: generation 0 resumes DIR's latest iteration (any layout:
    the loader reshards); a requeued run resumes its own whole-run checkpoint instead."""
    theirs = _saved(tmp_path / "plain", 5)
    for own in (False, True):
        if own:
            mine = _saved(tmp_path / "run" / "checkpoint", 9)
        coord = FakeCoordinator({"w1": member("joining"), "w2": member("joining")})
        ctx = context("w1", coord, initial=2, tmp=str(tmp_path / "run"))
        ctx.settings = ctx.world.settings = dataclasses.replace(ctx.settings, load=str(tmp_path / "plain"))
        assert drive(ctx, State(Phase.START), TRANSITIONS).phase is Phase.ACTIVE
        start = coord.records[0]
        want = mine if own else theirs
        assert (start.resume, start.step) == (str(want), 9 if own else 5)
        assert ctx.world.loaded == [str(want)]


def test_load_names_a_directory_without_a_checkpoint_in_one_line(tmp_path: Path) -> None:
    coord = FakeCoordinator({"w1": member("joining"), "w2": member("joining")})
    ctx = context("w1", coord, initial=2, tmp=str(tmp_path))
    ctx.settings = dataclasses.replace(ctx.settings, load=str(tmp_path / "nothing"))
    with pytest.raises(UsageError, match=r"no checkpoint in .*nothing: neither "
                                         r"latest_checkpointed_iteration.txt"):
        drive(ctx, State(Phase.START), TRANSITIONS)


def test_a_checkpoint_request_is_a_save_at_the_next_boundary(tmp_path: Path) -> None:
    """``etcslurm checkpoint``: rank 0 sees the request, the boundary's one all-reduce
    carries it, every rank begins the periodic save of this step, rank 0 takes it; while
    the world changes it waits for a later boundary."""
    coord, gen0 = _running(["w1", "w2"])
    coord.checkpoint = CheckpointRequest(by="operator", ts=1.0)
    ctx = _member_of(coord, gen0, "w1", tmp=str(tmp_path))
    assert steps.vote(ctx, State(Phase.VOTE)) == State(Phase.ACTIVE)
    periodic = tmp_path / "checkpoint" / "periodic"
    assert ctx.world.save_votes == [True] and ctx.world.started_saves == [str(periodic)]
    assert coord.checkpoint is None and ctx.periodic.last_step == 7
    assert ("checkpoint.saving", {"step": 7, "path": str(periodic / "iter_0000007"),
                                  "by": "operator"}) in coord.events
    # another rank saves on the vote alone; a leaving worker: the request waits
    other = _member_of(coord, gen0, "w2", tmp=str(tmp_path))
    other.world.vote = lambda *a, **k: (False, 0, True)  # type: ignore[method-assign]
    assert steps.vote(other, State(Phase.VOTE)) == State(Phase.ACTIVE)
    assert other.world.started_saves == [str(periodic)]
    coord.checkpoint = CheckpointRequest(by="operator", ts=2.0)
    coord.workers["w2"]["state"] = "leaving"
    again = _member_of(coord, gen0, "w1", tmp=str(tmp_path))
    assert steps.vote(again, State(Phase.VOTE)).phase is Phase.DECIDE
    assert again.world.save_votes == [False] and coord.checkpoint is not None


def test_no_transition_calls_another_or_loops() -> None:
    """The protocol's only loop is machine.drive: a transition returns the next state,
    and a wait looks once per call (no loop of its own)."""
    names = {fn.__name__ for fn in TRANSITIONS.values()}
    for fn in TRANSITIONS.values():
        tree = ast.parse(inspect.getsource(fn).lstrip())
        loops = [n for n in ast.walk(tree) if isinstance(n, ast.While)]
        assert not loops, f"{fn.__name__} loops (line {loops[0].lineno if loops else 0})"
        # calls of a transition by name, or through its module (``steps.vote(...)``);
        # a method of the same name elsewhere (``ctx.world.vote``) is not one
        called = {n.func.id if isinstance(n.func, ast.Name) else n.func.attr
                  for n in ast.walk(tree) if isinstance(n, ast.Call)
                  and (isinstance(n.func, ast.Name)
                       or (isinstance(n.func, ast.Attribute)
                           and isinstance(n.func.value, ast.Name)
                           and n.func.value.id in {"transitions", "steps", "recovery"}))}
        assert not (called & names) - {fn.__name__}, (fn.__name__, called & names)
        assert fn.__name__ not in called, f"{fn.__name__} recurses"


def test_the_decider_agreed_in_the_vote_publishes_without_asking_redis() -> None:
    """The boundary's all-reduce names the lowest rank that stays; only that rank
    publishes (rank 0 is leaving here), and nobody reads the member list for it."""
    coord, gen0 = _running(["w1", "w2", "w3", "w4"])
    coord.workers["w1"]["state"] = "leaving"
    reads = []
    ctx = _member_of(coord, gen0, "w2")
    original = coord.members

    def counting(deadline: float | None = None) -> dict:
        reads.append(deadline)
        return original(deadline)

    coord.members = counting  # type: ignore[method-assign]
    nxt = transitions.decide(ctx, State(Phase.DECIDE, decider=1))
    assert nxt.phase is Phase.FOLLOW and nxt.record.leaving == ("w1",)
    assert len(reads) == 1  # the world view of publish_next only, not the decider
    other = _member_of(coord, gen0, "w3")
    assert transitions.decide(other, State(Phase.DECIDE, decider=1)).record == nxt.record
    assert len(coord.records) == 2  # w3 did not publish a second record


def test_no_layout_fits_the_first_workers_waits_as_standby_then_starts() -> None:
    coord = FakeCoordinator({"w1": member("joining"), "w2": member("joining")})
    ctx = context("w1", coord, initial=2, join_timeout=5.0)
    ctx.settings = dataclasses.replace(ctx.settings, min_world=3)

    def third_arrives(c: FakeCoordinator) -> None:
        if "run.standby" in c.event_types():
            c.workers.setdefault("w3", member("joining"))

    coord.on_wait = third_arrives
    state = settle(ctx, transitions.first, State(Phase.FIRST))
    standby = [f for t, f in coord.events if t == "run.standby"]
    assert standby == [{"devices": 2, "reason": "2 devices: fewer than min_world=3"}]
    gen0 = coord.records[0]
    assert gen0.kind == "start" and gen0.world == 3 and state.phase is Phase.FOLLOW


def test_standby_that_lasts_times_out_naming_the_reason() -> None:
    coord = FakeCoordinator({"w1": member("joining")})
    ctx = context("w1", coord, initial=1, join_timeout=0.2)
    ctx.settings = dataclasses.replace(ctx.settings, min_world=2)
    with pytest.raises(WaitTimeout, match=r"standby for 0.2 s: 1 devices: fewer than min_world"):
        settle(ctx, transitions.first, State(Phase.FIRST))


def test_a_shrink_below_what_fits_checkpoints_and_says_standby() -> None:
    coord, gen0 = _running(["w1", "w2", "w3"])
    coord.workers["w3"]["state"] = "leaving"
    ctx = _member_of(coord, gen0, "w1")
    ctx.settings = dataclasses.replace(ctx.settings, min_world=3)
    transitions.publish_next(ctx, reason="resize at step boundary")
    assert coord.records[-1].kind == "checkpoint"
    assert ("run.standby", {"reason": "2 devices: fewer than min_world=3"}) in coord.events
