"""Typed records (coord/records/): round trips, refusals that name the problem, and the
docs listing exactly the fields the code has."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from etcslurm.coord.records import (
    EVENT_TYPES,
    Assignment,
    ChangeRequest,
    GenerationRecord,
    event_data,
    field_summary,
    pack_ids,
    parse_event,
    replace,
    unpack_ids,
)
from etcslurm.errors import CoordinatorError, RecordError
from etcslurm.runtime.generation import merge_requests

DOCS = Path(__file__).resolve().parent.parent / "docs"

SAMPLES = {
    "worker.registered": {"host": "h", "node": "n1", "pid": 7, "device": "cpu:0",
                          "address": None, "slurm_job": "12", "slurm_step": None},
    "worker.state": {"state": "leaving", "previous": "active", "rank": 3,
                     "leave_deadline": 17.5},
    "worker.gone": {"worker": "w3", "reason": "dead"},
    "worker.signal": {"worker": "w3", "signal": "USR2", "node": "n1", "budget_s": 88,
                      "received_at": 1.5},
    "change.requested": {"to": "tp1pp1dp2", "drain": ["w2"], "by": "operator", "ts": 3.0,
                         "reason": "x"},
    "generation.start": {"generation": 1, "kind": "resize", "step": 4, "from": "tp1pp1dp2",
                         "to": "tp1pp1dp1", "world": 1,
                         "assignment": [{"rank": 0, "worker": "w1", "node": "n1", "tp": 0,
                                         "pp": 0, "dp": 0}],
                         "leaving": ["w2"], "joining": [], "reason": "leave"},
    "migration.rebuild": {"gen": 1, "worker": "w1", "rank": None},
    "migration.progress": {"gen": 1, "worker": "w1", "rank": 0, "sent": 1, "recv": 2,
                           "total_send": 3, "total_recv": 4},
    "migration.done": {"gen": 1, "seconds": 0.5, "moved_bytes": 10, "local_bytes": 20,
                       "checkpoint_bytes": 0, "pause_seconds": 0.7, "transfer_seconds": 0.2,
                       "rebuild_seconds": 0.3, "from": "tp1pp1dp2", "to": "tp1pp1dp1",
                       "phases": {"decide": 0.1, "exchange": 0.2}},
    "step": {"gen": 1, "step": 5, "loss": 4.25, "tokens_per_s": 1000.0},
    "run.end": {"reason": "finished", "step": 9, "keep_s": 0.0, "checkpoint": None},
    "run.rollback": {"step": 4, "lost_steps": 2, "checkpoint": "/ckpt/iter_0000004",
                     "reason": "2 pieces lost"},
    "run.standby": {"reason": "64 devices: no layout fits", "devices": 64},
    "error": {"message": "boom", "worker": "w2"},
    "job.requeued": {"worker": "w1", "job": "123"},
    "coordinator.back": {"worker": "w1", "unreachable_s": 31.2, "failed_calls": 1,
                         "kept_events": 9},
    "node.released": {"worker": "w3", "reason": "draining (maintenance)",
                      "node": "n1", "budget_s": 90.0},
    "autogrow": {"action": "submit", "reason": "2 idle nodes in debug", "jobs": ["41"],
                 "nodes": 2, "max_nodes": 3, "idle": 2, "pending": 1},
    "checkpoint.requested": {"by": "operator", "ts": 3.0, "reason": "before the upgrade"},
    "checkpoint.saving": {"step": 12, "path": "/ckpt/periodic/iter_0000012",
                          "by": "operator"},
}


def record() -> GenerationRecord:
    return GenerationRecord(
        generation=2, kind="resize", step=40, from_layout="tp1pp1dp2", to_layout="tp1pp1dp1",
        world=1, assignment=(Assignment(0, "w1", "n1", 0, 0, 0),), old_world=("w1", "w2"),
        union=("w1", "w2"), leaving=("w2",), joining=(), dead=(), idle=(),
        nodes={"w1": "n1", "w2": "n2"}, planner_ids={"w1": "0", "w2": "1"},
        scalars={"iteration": 40, "lr": [0.1, 0.2]}, reason="w2 leaving",
        layout_reason="tp1pp1dp1 on 1 of 1 devices", plan_stats={"moved_bytes": 0})


def test_generation_record_round_trips_through_json() -> None:
    rec = record()
    doc = json.loads(json.dumps(rec.to_json()))
    assert doc["from"] == "tp1pp1dp2" and doc["to"] == "tp1pp1dp1" and doc["version"] == 2
    assert GenerationRecord.from_json(doc) == rec
    assert rec.rank_of("w1") == 0 and rec.rank_of("w2") is None
    assert rec.workers_by_rank() == ["w1"]
    # a changed record is checked again, and knows its own ranks
    moved = replace(rec, assignment=(Assignment(0, "w2", "n2", 0, 0, 0),))
    assert moved.rank_of("w2") == 0 and moved.rank_of("w1") is None and rec.rank_of("w1") == 0
    with pytest.raises(RecordError, match="field 'kind' must be one of"):
        replace(rec, kind="grow")
    # the full form (every row spelled out) is what tools read; it is not a stored form,
    # and no other version of the stored form is read either
    full = rec.to_dict()
    assert full["assignment"][0] == {"rank": 0, "worker": "w1", "node": "n1", "tp": 0,
                                     "pp": 0, "dp": 0}
    assert full["nodes"] == {"w1": "n1", "w2": "n2"} and full["leaving"] == ["w2"]
    with pytest.raises(RecordError, match="field 'nodes'"):
        GenerationRecord.from_json(full)
    with pytest.raises(RecordError, match="version 1 is not supported"):
        GenerationRecord.from_json({**doc, "version": 1})


def _big(n: int) -> GenerationRecord:
    """A resize of an n-worker DP world losing its last n/8 (what the benchmark does)."""
    workers = [f"w{i + 1}" for i in range(n)]
    k = n // 8
    stay = workers[: n - k]
    return GenerationRecord(
        generation=5, kind="resize", step=9, from_layout=f"tp1pp1dp{n}",
        to_layout=f"tp1pp1dp{n - k}", world=n - k,
        assignment=tuple(Assignment(r, w, f"node{(int(w[1:]) - 1) // 8:04d}", 0, 0, r)
                         for r, w in enumerate(stay)),
        old_world=tuple(workers), union=tuple(workers), leaving=tuple(workers[n - k:]),
        joining=(), dead=(), idle=(),
        nodes={w: f"node{i // 8:04d}" for i, w in enumerate(workers)},
        planner_ids={w: str(i) for i, w in enumerate(workers)}, scalars={"iteration": 9},
        reason="leave")


def test_the_stored_record_is_compact_and_lossless() -> None:
    sizes = {}
    for n in (64, 1024):
        rec = _big(n)
        doc = rec.to_json()
        sizes[n] = len(json.dumps(doc))
        assert GenerationRecord.from_json(json.loads(json.dumps(doc))) == rec
        assert doc["assignment"] == [[1, n - n // 8]] and doc["old_world"] == [[1, n]]
        assert "planner_ids" not in doc  # the rule: old rank, join:k
    # workers registered in order: the record grows with the nodes, not with N x fields
    assert sizes[1024] < 8 * 1024, sizes
    # anything off the rule is written out, never guessed
    rec = _big(64)
    odd = replace(rec, planner_ids={**rec.planner_ids, "w3": "join:0"},
                  assignment=(replace(rec.assignment[0], node="elsewhere"),
                              *rec.assignment[1:]),
                  union=("x-1", *rec.union[1:]), nodes={**rec.nodes, "x-1": "n9"})
    doc = odd.to_json()
    assert doc["planner_ids"]["w3"] == "join:0" and isinstance(doc["assignment"][0], dict)
    assert GenerationRecord.from_json(json.loads(json.dumps(doc))) == odd
    assert pack_ids(["w1", "w2", "w3", "w7", "x", "w8", "w9", "w01"]) == [
        [1, 3], "w7", "x", [8, 9], "w01"]
    assert unpack_ids([[2, 4], "a"], "x") == ["w2", "w3", "w4", "a"]
    for bad in ([[3, 2]], [[1]], [[1, "2"]], [[0, 2]]):
        with pytest.raises(RecordError, match=r"field 'idle'\[0\] must be a worker id or a range"):
            GenerationRecord.from_json({**rec.to_json(), "idle": bad})
    with pytest.raises(RecordError, match="field 'assignment' names 56 ranks, layout tp1pp1dp8 has 8"):
        GenerationRecord.from_json({**rec.to_json(), "to": "tp1pp1dp8", "world": 8})


@pytest.mark.parametrize(("change", "needle"), [
    ({"kind": "grow"}, "field 'kind' must be one of start, resize, checkpoint, stop, end"),
    ({"layout": "tp1pp1dp1"}, "unknown field 'layout'"),
    ({"world": "1"}, "field 'world' must be integer, got '1'"),
    ({"to": "tp2x"}, "field 'to': layout 'tp2x' is not of the form"),
    ({"assignment": [{"rank": 0, "worker": "w1"}]}, "missing field 'node'"),
    ({"leaving": "w2"}, "field 'leaving' must be a list of string"),
    ({"version": 7}, "version 7 is not supported"),
    ({"nodes": {"n1": "w1"}}, "field 'nodes'['n1'] must be a list of worker ids"),
    ({"generation": True}, "field 'generation' must be integer, got True"),
    ({"published_at": float("nan")}, "field 'published_at' must be number or null, got nan"),
    ({"planner_ids": {"w1": 3}}, "field 'planner_ids'['w1'] must be string, got 3"),
    ({"assignment": [{"rank": 0, "worker": "w1", "node": "n1", "tp": 0, "pp": 0, "dp": "0"}]},
     "field 'assignment'[0]['dp'] must be integer, got '0'"),
    ({"layout": "x", "shape": "y"}, "unknown field 'layout' (and 1 more)"),
])
def test_malformed_generation_records_are_refused_naming_the_field(change: dict,
                                                                    needle: str) -> None:
    doc = {**record().to_json(), **change}
    with pytest.raises(RecordError, match="generation record") as exc:
        GenerationRecord.from_json(doc)
    assert needle in str(exc.value) and "\n" not in str(exc.value)
    assert isinstance(exc.value, CoordinatorError)  # exit code 3, one line
    missing = record().to_json()
    del missing["union"]
    with pytest.raises(RecordError, match="missing field 'union'"):
        GenerationRecord.from_json(missing)


def test_every_event_type_round_trips() -> None:
    assert set(SAMPLES) == set(EVENT_TYPES)
    for type_, data in SAMPLES.items():
        ev = parse_event({"id": "5-0", "type": type_, "ts": 2.0, "worker": "w1", "data": data})
        assert ev.type == type_ and ev.id == "5-0" and ev.ts == 2.0
        assert json.loads(json.dumps(ev.data.to_json())) == {
            k: (float(v) if k == "budget_s" else v) for k, v in data.items()}
        assert event_data(type_, ev.data.to_json()) == ev.data


@pytest.mark.parametrize(("raw", "needle"), [
    ({"type": "worker.exploded", "ts": 1, "worker": "w1", "data": {}},
     "unknown event type 'worker.exploded'"),
    ({"type": "step", "ts": 1, "worker": "w1", "data": {"gen": 0, "step": 1}},
     "(step): missing field 'loss'"),
    ({"type": "step", "ts": "soon", "worker": "w1", "data": SAMPLES["step"]},
     "field 'ts' must be number"),
    ({"type": "worker.state", "ts": 1, "worker": "w1", "data": {"state": "sleeping"}},
     "field 'state' must be one of joining, active, leaving, gone"),
    ({"type": "migration.progress", "ts": 1, "worker": "w1",
      "data": {**SAMPLES["migration.progress"], "sent": 1.5}}, "field 'sent' must be integer"),
    ({"type": "step", "ts": 1, "worker": "w1", "data": [1, 2]}, "expected a JSON object"),
    ({"type": 5, "ts": 1, "worker": "w1", "data": {}}, "field 'type' must be a string"),
    ({"type": "step", "ts": 1, "worker": "w1", "data": {**SAMPLES["step"], "loss": float("inf")}},
     "(step): field 'loss' must be number, got inf"),
])
def test_unknown_and_malformed_events_are_refused(raw: dict, needle: str) -> None:
    with pytest.raises(RecordError) as exc:
        parse_event(raw)
    assert needle in str(exc.value)


def test_change_requests_check_and_merge() -> None:
    req = ChangeRequest(to="tp1pp1dp2", drain=("w3",), by="operator", ts=1.0)
    assert ChangeRequest.from_json(req.to_json()) == req
    with pytest.raises(RecordError, match="change request: needs 'to' or a non-empty 'drain'"):
        ChangeRequest.from_json({"to": None, "drain": [], "by": "x", "ts": 1})
    with pytest.raises(RecordError, match="field 'to': layout 'dp2'"):
        ChangeRequest.from_json({"to": "dp2", "drain": [], "by": "x", "ts": 1})
    assert ChangeRequest.from_json({"to": "auto", "drain": [], "by": "x", "ts": 1}).to == "auto"
    leave = ChangeRequest(to=None, drain=("w5",), by="w5", ts=2.0, reason="w5 leaving")
    later = ChangeRequest(to="tp1pp1dp1", drain=("w3", "w6"), by="operator", ts=3.0)
    merged = merge_requests([req, leave, later])
    assert merged is not None
    assert (merged.to, merged.drain, merged.by, merged.ts) == (
        "tp1pp1dp1", ("w3", "w5", "w6"), "operator, w5", 3.0)
    assert merge_requests([]) is None and merge_requests([leave]) == leave


def test_docs_list_the_fields_the_code_has() -> None:
    monitor = (DOCS / "monitor.md").read_text()
    coordinator = (DOCS / "coordinator.md").read_text()
    for type_, cls in EVENT_TYPES.items():
        row = f"| `{type_}` | {field_summary(cls)} |"
        assert row in monitor, f"docs/monitor.md lacks (or differs from) {row}"
    for cls in (GenerationRecord, Assignment, ChangeRequest):
        assert field_summary(cls) in coordinator, f"docs/coordinator.md: {cls.__name__}"
