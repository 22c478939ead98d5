"""The leader's decisions (pure): membership, layout, plan, idle and stop cases."""

from __future__ import annotations

import pytest

from etcslurm.core.gpt_state import expand
from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import GPTSpec
from etcslurm.core.planner import plan
from etcslurm.errors import UsageError
from etcslurm.runtime.generation import RunSettings, first_generation, next_generation, plan_inputs
from etcslurm.runtime.schedule import active_after, parse_schedule

SPEC = GPTSpec.parse("gpt-tiny")


def settings(global_batch: int = 12) -> RunSettings:
    return RunSettings(SPEC, "adam", global_batch, 1, gpus_per_node=2, staging_bytes=1 << 20)


def nodes(*workers: str) -> dict[str, str]:
    return {w: f"n{i // 2}" for i, w in enumerate(workers)}


def test_first_generation_takes_workers_in_order() -> None:
    rec = first_generation(settings(), ["w1", "w2", "w3", "w4"], nodes("w1", "w2", "w3", "w4"))
    assert rec["to"] == "tp1pp1dp4"
    assert [a["worker"] for a in rec["assignment"]] == ["w1", "w2", "w3", "w4"]
    assert rec["idle"] == []


def test_shrink_by_one_replica_moves_nothing_and_keeps_ranks_local() -> None:
    ws = ["w1", "w2", "w3", "w4"]
    gen1 = first_generation(settings(), ws, nodes(*ws))
    rec, migration = next_generation(settings(), gen1, leaving=["w4"], dead=[], ready=[],
                                     nodes=nodes(*ws), step=15, scalars={}, reason="t")
    assert rec["kind"] == "resize" and rec["to"] == "tp1pp1dp3"
    assert rec["leaving"] == ["w4"] and "w4" not in rec["union"][:0]
    assert migration is not None and migration.stats["moved_bytes"] == 0
    assert sorted(a["worker"] for a in rec["assignment"]) == ["w1", "w2", "w3"]


def test_joiners_receive_full_replicas_and_extra_device_idles() -> None:
    ws = ["w1", "w2", "w3"]
    gen = first_generation(settings(), ws, nodes(*ws))
    rec, migration = next_generation(settings(), gen, leaving=[], dead=[], ready=["w5", "w6"],
                                     nodes={**nodes(*ws), "w5": "j0", "w6": "j0"}, step=30,
                                     scalars={}, reason="t")
    # 5 devices: global batch 12 does not split over dp5 -> dp4, one idles
    assert rec["to"] == "tp1pp1dp4" and len(rec["idle"]) == 1
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
    assert rec["kind"] == "checkpoint" and migration is None


def test_dead_sole_holder_stops_the_run_with_a_reason() -> None:
    s = RunSettings(SPEC, "adam", 12, 1, gpus_per_node=2, staging_bytes=1 << 20)
    ws = ["w1", "w2"]
    gen = first_generation(s, ws, nodes(*ws))
    gen = {**gen, "to": "tp2pp1dp1", "assignment": [
        {"rank": 0, "worker": "w1", "node": "n0", "tp": 0, "pp": 0, "dp": 0},
        {"rank": 1, "worker": "w2", "node": "n0", "tp": 1, "pp": 0, "dp": 0}]}
    rec, _ = next_generation(s, gen, leaving=[], dead=["w2"], ready=["w3"],
                             nodes={**nodes(*ws), "w3": "j0"}, step=3, scalars={}, reason="t")
    assert rec["kind"] == "stop" and "w2" in rec["reason"]


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
