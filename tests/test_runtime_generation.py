"""The leader's decisions (pure): membership, layout, plan, idle and stop cases."""

from __future__ import annotations

import dataclasses

import pytest

from etcslurm.coord.records import Assignment, ChangeRequest, GenerationRecord, replace
from etcslurm.core.layout import ParallelConfig
from etcslurm.core.layout_choice import NoLayoutFits
from etcslurm.core.models import GPTSpec
from etcslurm.core.plan import plan
from etcslurm.errors import UsageError
from etcslurm.local.schedule import active_after, parse_schedule
from etcslurm.megatron_state import expand
from etcslurm.runtime.generation import (
    STANDBY,
    LayoutSettings,
    check_request,
    end_generation,
    first_generation,
    layout_problems,
    next_generation,
    plan_inputs,
    worth_changing,
)

SPEC = GPTSpec.parse("gpt-tiny")


def settings(global_batch: int = 12) -> LayoutSettings:
    return LayoutSettings(SPEC, "adam", global_batch, 1, gpus_per_node=2, staging_bytes=1 << 20)


def nodes(*workers: str) -> dict[str, str]:
    return {w: f"n{i // 2}" for i, w in enumerate(workers)}


def test_first_generation_takes_workers_in_order() -> None:
    rec = first_generation(settings(), ["w1", "w2", "w3", "w4"], nodes("w1", "w2", "w3", "w4"))
    assert rec.to_layout == "tp1pp1dp4"
    assert rec.workers_by_rank() == ["w1", "w2", "w3", "w4"]
    assert rec.idle == () and rec.rank_of("w3") == 2 and rec.rank_of("w9") is None
    assert GenerationRecord.from_json(rec.to_json()) == rec


def test_shrink_by_one_replica_moves_nothing_and_keeps_ranks_local() -> None:
    ws = ["w1", "w2", "w3", "w4"]
    gen1 = first_generation(settings(), ws, nodes(*ws))
    rec, migration = next_generation(settings(), gen1, leaving=["w4"], dead=[], ready=[],
                                     nodes=nodes(*ws), step=15, scalars={}, reason="t")
    assert rec.kind == "resize" and rec.to_layout == "tp1pp1dp3"
    assert rec.leaving == ("w4",) and "w4" in rec.union
    assert migration is not None and migration.stats["moved_bytes"] == 0
    assert sorted(rec.workers_by_rank()) == ["w1", "w2", "w3"]
    assert GenerationRecord.from_json(rec.to_json()) == rec


def test_joiners_receive_full_replicas_and_extra_device_idles() -> None:
    ws = ["w1", "w2", "w3"]
    gen = first_generation(settings(), ws, nodes(*ws))
    rec, migration = next_generation(settings(), gen, leaving=[], dead=[], ready=["w5", "w6"],
                                     nodes={**nodes(*ws), "w5": "j0", "w6": "j0"}, step=30,
                                     scalars={}, reason="t")
    # 5 devices: global batch 12 does not split over dp5 -> dp4, one idles
    assert rec.to_layout == "tp1pp1dp4" and len(rec.idle) == 1
    assert migration is not None
    one_replica = sum(p.nbytes for p in expand(SPEC, ParallelConfig.parse("tp1pp1dp4")).classes[0])
    assert migration.stats["moved_bytes"] == one_replica
    # every participant replays the same plan from the record
    again = plan(plan_inputs(settings(), rec))
    assert again.assignment == migration.assignment


def test_everyone_leaving_asks_for_a_checkpoint() -> None:
    ws = ["w1", "w2"]
    gen = first_generation(settings(), ws, nodes(*ws))
    rec, migration = next_generation(settings(), gen, leaving=ws, dead=[], ready=[],
                                     nodes=nodes(*ws), step=7, scalars={}, reason="t")
    assert rec.kind == "checkpoint" and migration is None


def test_dead_sole_holder_stops_the_run_with_a_reason() -> None:
    s = LayoutSettings(SPEC, "adam", 12, 1, gpus_per_node=2, staging_bytes=1 << 20)
    ws = ["w1", "w2"]
    gen = first_generation(s, ws, nodes(*ws))
    gen = replace(gen, to_layout="tp2pp1dp1", assignment=(
        Assignment(0, "w1", "n0", 0, 0, 0), Assignment(1, "w2", "n0", 1, 0, 0)))
    rec, _ = next_generation(s, gen, leaving=[], dead=["w2"], ready=["w3"],
                             nodes={**nodes(*ws), "w3": "j0"}, step=3, scalars={}, reason="t")
    assert rec.kind == "stop" and "w2" in rec.reason


def _request(to: str | None = None, *drain: str) -> ChangeRequest:
    return ChangeRequest(to=to, drain=tuple(drain), by="operator", ts=1.0)


def test_requested_layout_is_used_kept_and_released() -> None:
    ws = ["w1", "w2", "w3", "w4"]
    gen = first_generation(settings(), ws, nodes(*ws))
    req = _request("tp1pp1dp2")
    assert check_request(settings(), gen, req) is None
    assert worth_changing(settings(), gen, leaving=[], dead=[], ready=[], request=req)
    rec, migration = next_generation(settings(), gen, leaving=[], dead=[], ready=[],
                                     nodes=nodes(*ws), step=5, scalars={}, reason="operator",
                                     request=req)
    assert rec.kind == "resize" and rec.to_layout == "tp1pp1dp2" and rec.requested == "tp1pp1dp2"
    assert len(rec.idle) == 2 and migration is not None and migration.stats["moved_bytes"] == 0
    assert "requested by operator" in rec.layout_reason
    # the idle standbys are no reason to grow back while the operator's layout is in force
    assert not worth_changing(settings(), rec, leaving=[], dead=[], ready=list(rec.idle))
    # a leaver: the requested layout still fits (an idle one takes its place)
    leaver = rec.workers_by_rank()[0]
    nxt, _ = next_generation(settings(), rec, leaving=[leaver], dead=[], ready=list(rec.idle),
                             nodes=nodes(*ws), step=6, scalars={}, reason="leave")
    assert nxt.to_layout == "tp1pp1dp2" and nxt.requested == "tp1pp1dp2"
    # "auto" goes back to the automatic choice
    back, _ = next_generation(settings(), rec, leaving=[], dead=[], ready=list(rec.idle),
                              nodes=nodes(*ws), step=6, scalars={}, reason="op",
                              request=_request("auto"))
    assert back.to_layout == "tp1pp1dp4" and back.requested is None


def test_drain_treats_workers_as_leaving() -> None:
    ws = ["w1", "w2", "w3", "w4"]
    gen = first_generation(settings(), ws, nodes(*ws))
    req = _request(None, "w2")
    assert worth_changing(settings(), gen, leaving=[], dead=[], ready=[], request=req)
    rec, _ = next_generation(settings(), gen, leaving=[], dead=[], ready=[], nodes=nodes(*ws),
                             step=5, scalars={}, reason="operator", request=req)
    assert rec.leaving == ("w2",) and "w2" not in rec.workers_by_rank()
    assert rec.to_layout == "tp1pp1dp3"


@pytest.mark.parametrize(("to", "drain", "why"), [
    ("tp1pp1dp6", (), "needs 6 workers, only 4 are available"),
    ("tp3pp1dp1", (), "not divisible by tp=3"),
    ("tp1pp1dp3", ("w1",), None),
    (None, ("w9",), "cannot drain w9"),
])
def test_invalid_requests_are_ignored_with_a_reason(to: str | None, drain: tuple[str, ...],
                                                    why: str | None) -> None:
    ws = ["w1", "w2", "w3", "w4"]
    gen = first_generation(settings(), ws, nodes(*ws))
    req = _request(to, *drain)
    problem = check_request(settings(), gen, req)
    if why is None:
        assert problem is None
        return
    assert problem is not None and why in problem
    assert not worth_changing(settings(), gen, leaving=[], dead=[], ready=[], request=req)
    rec, _ = next_generation(settings(), gen, leaving=["w4"], dead=[], ready=[],
                             nodes=nodes(*ws), step=5, scalars={}, reason="leave", request=req)
    assert rec.to_layout == "tp1pp1dp3" and "change request by operator ignored" in rec.reason


def test_end_record_follows_the_current_one() -> None:
    ws = ["w1", "w2"]
    gen = first_generation(settings(), ws, nodes(*ws))
    end = end_generation(gen, step=20, reason="finished 20 steps")
    assert end.kind == "end" and end.generation == 1 and end.union == ()
    assert end.to_layout == gen.to_layout == end.from_layout
    assert GenerationRecord.from_json(end.to_json()) == end


def test_schedule_parsing_and_errors() -> None:
    events = parse_schedule("30:join=2; 15:leave=1;45:leave=2", steps=60)
    assert [(e.step, e.action, e.count) for e in events] == [(15, "leave", 1), (30, "join", 2),
                                                              (45, "leave", 2)]
    assert active_after(4, events) == [3, 5, 3]
    with pytest.raises(UsageError, match="bad schedule entry"):
        parse_schedule("15:explode=1")
    with pytest.raises(UsageError, match="only 10 steps"):
        parse_schedule("15:leave=1", steps=10)
    with pytest.raises(UsageError, match="removes more workers"):
        active_after(2, parse_schedule("5:leave=3"))


# ---------------------------------------------------------------------- memory and limits
LLAMA70 = GPTSpec.parse("llama3-70b")


def big(**kw: object) -> LayoutSettings:
    """llama3-70b, distributed optimizer, 8 GPUs a node, global batch 1024."""
    return LayoutSettings(LLAMA70, "distributed", 1024, 1, gpus_per_node=8,
                          staging_bytes=1 << 20, **kw)  # type: ignore[arg-type]


def test_the_first_layout_fits_device_memory() -> None:
    ws = [f"w{i}" for i in range(64)]
    unlimited = first_generation(big(), ws, nodes(*ws))
    assert unlimited.to_layout == "tp1pp1dp64"  # no limit: the most DP
    rec = first_generation(big(device_memory_bytes=80 * 10**9), ws, nodes(*ws))
    assert rec.to_layout == "tp8pp2dp4" and "usable" in rec.reason
    cfg = ParallelConfig.parse(rec.to_layout)
    assert big(device_memory_bytes=80 * 10**9).choose(64, None).memory.total <= 80 * 10**9
    assert layout_problems(big(device_memory_bytes=80 * 10**9), ParallelConfig(1, 1, 64))[0] \
        .startswith("state+activations")
    assert not layout_problems(big(device_memory_bytes=80 * 10**9), cfg)


def test_too_few_devices_for_the_memory_raise_no_layout_fits() -> None:
    ws = [f"w{i}" for i in range(8)]
    with pytest.raises(NoLayoutFits, match=r"8 devices: no layout of llama3-70b fits the "
                                           r"memory of a device .*smallest: tp8pp1dp1 needs"):
        first_generation(big(device_memory_bytes=80 * 10**9), ws, nodes(*ws))


def test_user_limits_pin_layouts_and_bound_the_world() -> None:
    ws = ["w1", "w2", "w3", "w4", "w5", "w6"]
    s = LayoutSettings(SPEC, "adam", 12, 1, gpus_per_node=2, staging_bytes=1 << 20,
                       max_world=4)
    rec = first_generation(s, ws, nodes(*ws))
    assert rec.world == 4 and rec.idle == ("w5", "w6") and "max_world=4" in rec.reason
    pinned = dataclasses.replace(s, layouts=("tp=2",))
    assert first_generation(pinned, ws, nodes(*ws)).to_layout == "tp2pp1dp2"
    listed = dataclasses.replace(s, layouts=("tp1pp2dp2", "tp1pp1dp3"))
    assert first_generation(listed, ws, nodes(*ws)).to_layout == "tp1pp2dp2"  # most devices
    first = dataclasses.replace(s, first_layout="tp1pp2dp1")
    rec = first_generation(first, ws, nodes(*ws))
    assert rec.to_layout == "tp1pp2dp1" and len(rec.idle) == 4
    # later generations choose again (within the limits, keeping TP and PP)
    nxt, _ = next_generation(first, rec, leaving=[], dead=[], ready=list(rec.idle),
                             nodes=nodes(*ws), step=3, scalars={}, reason="t")
    assert nxt.to_layout == "tp1pp2dp2" and len(nxt.idle) == 2
    with pytest.raises(NoLayoutFits, match="fewer than min_world=3"):
        first_generation(dataclasses.replace(s, min_world=3), ws[:2], nodes(*ws))
    with pytest.raises(NoLayoutFits, match="first layout tp1pp2dp2 needs 4"):
        first_generation(dataclasses.replace(s, first_layout="tp1pp2dp2"), ws[:3], nodes(*ws))


def test_a_shrink_no_layout_fits_checkpoints_for_standby() -> None:
    ws = ["w1", "w2", "w3", "w4"]
    s = LayoutSettings(SPEC, "adam", 12, 1, gpus_per_node=2, staging_bytes=1 << 20,
                       min_world=3)
    gen = first_generation(s, ws, nodes(*ws))
    rec, migration = next_generation(s, gen, leaving=["w3", "w4"], dead=[], ready=[],
                                     nodes=nodes(*ws), step=9, scalars={}, reason="leave")
    assert rec.kind == "checkpoint" and migration is None
    assert f"; {STANDBY}: 2 devices: fewer than min_world=3" in rec.reason
    assert set(rec.union) == set(ws)
    # a joiner that would not change the layout is no reason to change
    assert not worth_changing(dataclasses.replace(s, max_world=4), gen, leaving=[], dead=[], ready=["w9"])
