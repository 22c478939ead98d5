"""The monitor's view model and rendering: events written to a real Redis through the
coordinator's API, folded into a RunView, drawn at 80×24."""

from __future__ import annotations

import time

import msgspec
import pytest

from etcslurm.coord.client import connect
from etcslurm.coord.coordinator import Coordinator
from etcslurm.coord.records import EVENT_TYPES, Event, GenerationStart, event_data
from etcslurm.monitor.model import RunModel
from etcslurm.monitor.render import render_run
from etcslurm.monitor.source import RunSource, to_event
from etcslurm.monitor.text import compact_ids, fmt_bytes, rank_coord
from etcslurm.monitor.views import Refused
from tests.helpers import generation_record

pytestmark = pytest.mark.redis

BEFORE = "tp2pp2dp3"
AFTER = "tp2pp2dp2"


@pytest.fixture
def resized(redis_url: str, run_id: str):
    """A run of 12 workers on n1..n3 that lost n3 and is half-way through migrating."""
    client = connect(redis_url)
    handles = []
    for i in range(12):
        h = Coordinator(client, run_id, dead_after=60.0, heartbeat_interval=1.0)
        h.register({"node": f"n{i // 4 + 1}"}, heartbeat=False)
        handles.append(h)
    ids = [h.worker_id for h in handles]
    nodes = {h.worker_id: h.info["node"] for h in handles}
    lead = handles[0]
    lead.publish_generation(generation_record(0, BEFORE, ids, nodes))
    for r, h in enumerate(handles):
        h.set_state("active", rank=r, generation=0)
    for step, loss in enumerate([5.0, 4.8, 4.7, 4.5, 4.4, 4.2], start=1):
        lead.emit("step", gen=0, step=step, loss=loss, tokens_per_s=3100.0)
    for h in handles[8:]:
        h.emit("worker.signal", worker=h.worker_id, node="n3", signal="SIGUSR2", budget_s=88)
        h.leave(88.0, reason="USR2")
    stay = ids[:8]
    lead.publish_generation(generation_record(1, AFTER, stay, nodes, from_layout=BEFORE,
                                              leaving=tuple(ids[8:])))
    for r, h in enumerate(handles[:8]):
        done = r < 4  # ranks 0-3 are through, 4-7 half-way
        h.emit("migration.progress", gen=1, worker=h.worker_id, rank=r, sent=0, recv=0,
               total_send=200_000_000, total_recv=100_000_000)
        h.emit("migration.progress", gen=1, worker=h.worker_id, rank=r,
               sent=200_000_000 if done else 100_000_000,
               recv=100_000_000 if done else 50_000_000,
               total_send=200_000_000, total_recv=100_000_000)
    yield client, run_id, handles
    client.close()


def _fold(client, run_id) -> RunModel:
    model = RunModel(run_id)
    RunSource(client, run_id).catch_up(model)
    return model


def test_fold_mid_migration(resized) -> None:
    client, run_id, _ = resized
    view = _fold(client, run_id).view(time.time())
    assert (view.gen, view.layout, view.world, view.step) == (1, AFTER, 8, 6)
    assert view.phase == "migrating"  # generation.start without migration.done yet
    assert view.loss == 4.2 and view.loss_trend == "down"
    assert [n.name for n in view.nodes] == ["n1", "n2", "n3"]
    n1 = view.nodes[0].devices
    assert [(d.rank, d.tp, d.pp, d.dp, d.state) for d in n1] == [
        (0, 0, 0, 0, "active"), (1, 1, 0, 0, "active"), (2, 0, 0, 1, "active"),
        (3, 1, 0, 1, "active")]
    n3 = view.nodes[2].devices
    assert {d.state for d in n3} == {"leaving"} and all(d.rank is None for d in n3)
    assert all(80 < d.seconds_left <= 88 for d in n3)
    m = view.migration
    assert m is not None and not m.done and (m.from_layout, m.to_layout) == (BEFORE, AFTER)
    assert [r.fraction for r in m.ranks] == [1.0] * 4 + [0.5] * 4
    assert m.bytes_done == 4 * 200_000_000 + 4 * 100_000_000
    assert m.bytes_total == 8 * 200_000_000
    texts = [e.text for e in view.events]
    assert "n3 preempted: USR2, 88 s budget (×4)" not in texts  # count is separate
    assert any(e.text == "n3 preempted: USR2, 88 s budget" and e.count == 4 for e in view.events)
    assert f"gen 1: {BEFORE} → {AFTER} (8 ranks, 4 leaving)" in texts


def test_fold_done_and_gone(resized) -> None:
    client, run_id, handles = resized
    for r, h in enumerate(handles[4:8], start=4):
        h.emit("migration.progress", gen=1, worker=h.worker_id, rank=r, sent=200_000_000,
               recv=100_000_000, total_send=200_000_000, total_recv=100_000_000)
    handles[0].emit("migration.done", gen=1, seconds=0.8, moved_bytes=1_200_000_000,
                    local_bytes=3_400_000_000, checkpoint_bytes=0, pause_seconds=1.1)
    for h in handles[8:]:
        h.close()
    model = _fold(client, run_id)
    view = model.view(time.time())
    m = view.migration
    assert m.done and m.seconds == 0.8 and m.moved_bytes == 1_200_000_000
    assert all(r.fraction == 1.0 and r.eta_s == 0.0 for r in m.ranks)
    assert {d.state for d in view.nodes[2].devices} == {"gone"}
    texts = [e.text for e in view.events]
    assert f"gen 1: {BEFORE} → {AFTER}, 1.2 GB in 0.8 s" in texts
    assert "w9–w12 on n3: gone" in texts

    screen = render_run(view, width=80, height=24)
    lines = screen.splitlines()
    assert len(lines) <= 24 and max(len(x) for x in lines) <= 80
    assert f"gen 1  {AFTER} (world 8)" in lines[0]
    assert "r0(0,0,0)●" in screen and "r7(1,1,1)●" in screen
    assert "w9✗gone" in screen
    assert "moved 1.2 GB  local 3.4 GB  checkpoint 0 B  pause 1.1 s" in screen
    bars = [x for x in lines if x.startswith("r") and "█" in x]
    assert len(bars) == 8 and all("100%" in b for b in bars)
    assert "1.2 GB in 0.8 s" in screen.split("Events")[1]


def test_render_mid_migration_bars(resized) -> None:
    client, run_id, _ = resized
    screen = render_run(_fold(client, run_id).view(time.time()))
    lines = screen.splitlines()
    assert len(lines) <= 24 and max(len(x) for x in lines) <= 80
    bars = [x for x in lines if x.startswith("r") and ("█" in x or "░" in x)]
    assert len(bars) == 8
    assert sum("50%" in b for b in bars) == 4 and sum("100%" in b for b in bars) == 4
    half = next(b for b in bars if "50%" in b)
    assert "░" in half and "↑100 MB/200 MB ↓50.0 MB/100 MB" in half and "eta" in half
    assert "◐" in screen and ("88s" in screen or "87s" in screen)  # leaving countdown
    assert "running" in screen and f"{BEFORE} → {AFTER}" in screen


def test_keys_repair_missed_events(redis_url: str, run_id: str) -> None:
    """A monitor that missed generation.start still learns the layout from the gen key."""
    client = connect(redis_url)
    h = Coordinator(client, run_id, dead_after=60.0, heartbeat_interval=1.0)
    h.register({"node": "n7"}, heartbeat=False)
    h.publish_generation(generation_record(0, "tp1pp1dp1", [h.worker_id]))
    h.set_state("active", rank=0, generation=0)
    model = RunModel(run_id)
    src = RunSource(client, run_id)
    model.set_keys(**src.read_keys())  # keys only, no events
    view = model.view(time.time())
    assert (view.gen, view.layout) == (0, "tp1pp1dp1")
    (dev,) = view.nodes[0].devices
    assert (dev.node, dev.rank, dev.tp, dev.pp, dev.dp, dev.state) == ("n7", 0, 0, 0, 0, "active")
    client.close()


# ------------------------------------------------------------------ pure parts


def _ev(i: int, type_: str, ts: float, **data) -> Event:
    """An event emitted by ``data["worker"]`` (kept in the payload when its type has it)."""
    worker = data.get("worker", "w1")
    if "worker" not in {f.name for f in msgspec.structs.fields(EVENT_TYPES[type_])}:
        data.pop("worker", None)
    return Event(type_, ts, worker, event_data(type_, data), f"{i}-0")


def test_refused_and_sparse_events_are_shown_not_folded() -> None:
    m = RunModel("r")
    t = 1000.0
    # what the source makes of entries parse_event refuses: one log line each
    bad = [
        {"id": "1-0", "type": "frobnicate.now", "ts": t, "worker": "w1", "data": {"x": 1}},
        {"id": "2-0", "type": "generation.start", "ts": t, "worker": "w1", "data": {}},
        {"id": "3-0", "type": "step", "ts": t, "worker": "w1",
         "data": {"gen": 0, "step": 1, "loss": "nan?"}},
        {"id": "4-0", "type": "step", "ts": t, "worker": "w1",
         "data": {"gen": 0, "step": 1, "loss": 1.0, "gen_alias": 3}},
    ]
    refused = [to_event(e) for e in bad]
    assert all(isinstance(r, Refused) for r in refused)
    for r in refused:
        m.apply(r)
    # optional fields left out: drawn without them
    m.apply(_ev(5, "worker.signal", t, worker="w2", signal=12))
    m.apply(_ev(6, "migration.done", t, gen=4, seconds=1.0, moved_bytes=0, local_bytes=0))
    m.apply(_ev(7, "error", t, message="boom", worker="w3"))
    m.apply(_ev(8, "error", t, worker="w4", message="bang"))  # the emitter is the subject
    view = m.view(t + 1)
    texts = [e.text for e in view.events]
    assert texts[0] == "refused event: event 1-0: unknown event type 'frobnicate.now'"
    assert texts[1] == "refused event: event 2-0 (generation.start): missing field 'generation'"
    assert "field 'loss' must be number" in texts[2]
    assert "unknown field 'gen_alias'" in texts[3]
    assert "w2 preempted: USR2" in texts
    assert "error on w3: boom" in texts and "error on w4: bang" in texts
    assert view.migration is not None and view.migration.gen == 4
    render_run(view)  # draws without fields it does not have
    assert view.to_json()["migration"]["gen"] == 4
    assert m.last_id == "8-0"


def test_leaving_countdown_and_rate() -> None:
    m = RunModel("r")
    m.apply(_ev(1, "worker.registered", 100.0, worker="w1", node="n1"))
    m.apply(_ev(2, "worker.signal", 100.0, worker="w1", node="n1", signal="USR2", budget_s=30))
    assert m.view(110.0).nodes[0].devices[0].seconds_left == pytest.approx(20.0)
    assert m.view(200.0).nodes[0].devices[0].seconds_left == 0.0
    m.apply(_ev(3, "generation.start", 120.0, generation=2, kind="resize", step=0,
                world=1, assignment=[], **{"from": "tp2pp1dp1"}, to="tp1pp1dp1"))
    m.apply(_ev(4, "migration.progress", 122.0, gen=2, worker="w2", rank=0, sent=2_000_000_000,
                recv=0, total_send=4_000_000_000, total_recv=0))
    (r,) = m.view(122.0).migration.ranks
    assert r.gbps == pytest.approx(1.0) and r.eta_s == pytest.approx(2.0)
    assert r.fraction == 0.5
    (r,) = m.view(124.0).migration.ranks  # no news for 2 s: the rate falls, ETA grows
    assert r.gbps == pytest.approx(0.5) and r.eta_s == pytest.approx(4.0)
    m.apply(_ev(5, "migration.progress", 125.0, gen=2, worker="w2", rank=0, sent=4_000_000_000,
                recv=0, total_send=4_000_000_000, total_recv=0))
    (r,) = m.view(200.0).migration.ranks  # finished: rated up to its last report
    assert r.gbps == pytest.approx(0.8) and r.eta_s == 0.0


def test_state_lines_follow_the_event_not_a_newer_key() -> None:
    """The keys may show "gone" before the worker.state event arrives: still logged."""
    m = RunModel("r")
    m.apply(_ev(1, "worker.registered", 1.0, worker="w1", node="n1"))
    m.set_keys(workers={"w1": {"node": "n1", "state": "gone", "alive": False}})
    assert m.apply(_ev(2, "worker.state", 2.0, worker="w1", state="gone",
                       previous="active")) == "w1 on n1: gone"
    m.apply(_ev(3, "worker.registered", 1.0, worker="w2", node="n1"))
    m.apply(_ev(4, "worker.signal", 3.0, worker="w2", signal="USR2", budget_s=9))
    assert m.apply(_ev(5, "worker.state", 3.1, worker="w2", state="leaving",
                       previous="active", leave_deadline=12.0)) is None  # said already
    assert m.view(5.0).nodes[0].devices[1].seconds_left == pytest.approx(7.0)


def test_gen_key_read_before_the_generation_event() -> None:
    """publish_generation SETs the gen key, then emits: a key read may come in between."""
    m = RunModel("r")
    ws = [f"w{i}" for i in range(12)]
    m.apply(_ev(1, "generation.start", 1.0,
                **GenerationStart.of(generation_record(0, "tp2pp2dp3", ws)).to_json()))
    # the gen key of generation 1, read before its event (no "from" in this record)
    m.set_keys(gen=generation_record(1, "tp2pp2dp2", ws[:8], kind="resize"))
    m.apply(_ev(2, "generation.start", 2.0, **GenerationStart.of(
        generation_record(1, "tp2pp2dp2", ws[:8], kind="resize")).to_json()))
    mig = m.view(2.0).migration
    assert (mig.from_layout, mig.to_layout) == ("tp2pp2dp3", "tp2pp2dp2")
    assert m.log[-1].text == "gen 1: tp2pp2dp3 → tp2pp2dp2 (8 ranks)"


def test_helpers() -> None:
    assert fmt_bytes(1_200_000_000) == "1.2 GB" and fmt_bytes(512) == "512 B"
    assert rank_coord(5, "tp2pp2dp2") == (1, 1, 0)  # rank = tp + TP*(dp + DP*pp)
    assert compact_ids(["w9", "w10", "w11", "w12"]) == "w9–w12"
    assert compact_ids(["a", "b"]) == "a, b"


def test_coordinator_primary_moves_and_outages_are_logged_once() -> None:
    model = RunModel("r")
    assert model.set_coordinator(None, 1.0) is None and model.coordinator is None
    assert model.set_coordinator({"primary": "10.0.0.1:6379", "replicas": 2}, 1.0) is None
    assert model.coordinator == "primary 10.0.0.1:6379, 2 replicas"
    model.addresses["10.0.0.2"] = {"n2"}
    line = model.set_coordinator({"primary": "10.0.0.2:6379", "replicas": 1}, 2.0)
    assert line == "coordinator primary moved 10.0.0.1:6379 → 10.0.0.2:6379 (node n2)"
    assert model.coordinator == "primary 10.0.0.2:6379 (node n2), 1 replica"
    err = {"error": "no Sentinel of X answered: timeout"}
    assert model.set_coordinator(err, 3.0) == "coordinator: no Sentinel of X answered: timeout"
    assert model.set_coordinator(err, 4.0) is None  # an outage is one line, not one per poll
    view = model.view(5.0)
    assert view.coordinator.startswith("no primary")
    assert [e.type for e in view.events] == ["coordinator.primary", "coordinator.error"]
    assert "coordinator no primary" in render_run(view)
    assert view.to_json()["coordinator"] == view.coordinator


def test_released_nodes_autogrow_and_resize_causes() -> None:
    from etcslurm.coord.records import parse_event
    from etcslurm.monitor.model import fold
    from tests.helpers import generation_record

    def ev(i: int, type_: str, emitter: str = "operator", **data: object):
        return parse_event({"id": f"{i}-0", "type": type_, "ts": 100.0 + i, "worker": emitter,
                            "data": data})

    start = generation_record(0, "tp1pp1dp3", ["w1", "w2", "w3"])
    shrink = generation_record(1, "tp1pp1dp2", ["w1", "w2"], from_layout="tp1pp1dp3",
                               leaving=("w3",))
    grow = generation_record(2, "tp1pp1dp3", ["w1", "w2", "w4"], from_layout="tp1pp1dp2",
                             joining=("w4",))
    from etcslurm.coord.records import GenerationStart

    events = [
        ev(1, "generation.start", **GenerationStart.of(start).to_json()),
        ev(2, "node.released", "w3", worker="w3", node="n3", reason="draining (disk)",
           budget_s=90.0),
        ev(3, "generation.start", **GenerationStart.of(shrink).to_json()),
        ev(4, "autogrow", action="submit", reason="1 idle node", jobs=["41"], nodes=2,
           max_nodes=3, idle=1, pending=0),
        ev(5, "generation.start", **GenerationStart.of(grow).to_json()),
        ev(6, "step", "w1", gen=2, step=7, loss=1.0),
    ]
    view = fold("r", events, now=110.0)
    texts = [e.text for e in view.events]
    assert "n3 released: draining (disk), 90 s budget" in texts
    assert "autogrow submitted job 41: 1 idle node (2/3 nodes, 1 idle)" in texts
    assert view.resizes == {"release": 1, "grow": 1}
    assert view.last_step_ts == 106.0
