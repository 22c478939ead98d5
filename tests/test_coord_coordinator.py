"""Coordinator behaviour on a real Redis (``redis_url`` from sbin/test)."""

from __future__ import annotations

import threading
import time

import pytest

from etcslurm.coord.acl import grant_run_user, revoke_run_user, run_user_url
from etcslurm.coord.client import connect
from etcslurm.coord.coordinator import BarrierTimeout, Coordinator, SpecMismatch
from etcslurm.coord.schema import Keys
from etcslurm.errors import CoordinatorError, UsageError, WaitTimeout

pytestmark = pytest.mark.redis

FAST = {"heartbeat_interval": 0.2, "dead_after": 1.5}  # margin for 2 busy cores


@pytest.fixture
def client(redis_url):
    c = connect(redis_url, retry_deadline=5)
    yield c
    c.close()


@pytest.fixture
def make(client, run_id):
    made: list[Coordinator] = []

    def _make(run: str | None = None, **kw) -> Coordinator:
        co = Coordinator(client, run or run_id, **{**FAST, **kw})
        made.append(co)
        return co

    yield _make
    for co in made:
        co.stop_heartbeat()
    Coordinator(client, run_id).end_run()


def test_register_members_and_states(make):
    a, b = make(), make()
    wa = a.register({"device": "cpu:0", "address": "127.0.0.1:1"})
    wb = b.register()
    assert (wa, wb) == ("w1", "w2")
    m = a.members()
    assert list(m) == [wa, wb]
    assert m[wa]["state"] == "joining" and m[wa]["device"] == "cpu:0" and m[wa]["alive"]
    a.set_state("active", rank=0, generation=0)
    with pytest.raises(UsageError, match="cannot go from active to joining"):
        a.set_state("joining")
    a.leave(within=5.0, reason="SIGUSR2")
    info = a.members()[wa]
    assert info["state"] == "leaving" and info["leave_deadline"] > time.time()
    assert a.pending_change()[0]["worker"] == wa
    types = [e["type"] for e in a.read_events()]
    assert types.count("worker.registered") == 2 and "worker.state" in types
    assert "change.requested" in types


def test_heartbeat_expiry_detected_within_dead_after(make):
    a, b = make(), make()
    a.register()
    wb = b.register()
    assert a.dead_workers() == []
    b.stop_heartbeat()  # b "dies": no more beats
    t0 = time.monotonic()
    while wb not in a.dead_workers():
        assert time.monotonic() - t0 < a.dead_after + 1.0, "death not detected in time"
        time.sleep(0.05)
    elapsed = time.monotonic() - t0
    assert elapsed <= a.dead_after + 0.5
    assert wb not in a.live_members()


def test_leader_reelected_when_leader_leaves_or_dies(make):
    cs = [make() for _ in range(3)]
    ids = [c.register() for c in cs]
    assert cs[2].leader() == ids[0]  # no ranks yet: lowest worker id
    for c, rank in zip(cs, (2, 0, 1), strict=True):
        c.set_state("active", rank=rank)
    assert cs[0].leader() == ids[1] and cs[1].is_leader()
    cs[1].leave(within=10)  # the leader leaves -> rank 1 leads
    assert cs[0].leader() == ids[2]
    cs[2].stop_heartbeat()  # the new leader dies -> rank 2 leads once it is detected
    t0 = time.monotonic()
    while cs[0].leader() != ids[0]:
        assert time.monotonic() - t0 < cs[0].dead_after + 1.5
        time.sleep(0.05)
    assert cs[0].is_leader()


def test_generation_cas_one_winner(make, client):
    cs = [make() for _ in range(6)]
    for c in cs:
        c.register(heartbeat=False)
    assert cs[0].publish_generation({"generation": 0, "layout": "tp1pp1dp6"})
    start = threading.Barrier(len(cs))
    results: list[bool] = [False] * len(cs)

    def publish(i: int) -> None:
        start.wait()
        results[i] = cs[i].publish_generation({"generation": 1, "by": i})

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(len(cs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(results) == 1
    rec = cs[0].current_generation()
    assert rec["generation"] == 1 and rec["by"] == results.index(True)
    assert not cs[1].publish_generation({"generation": 3})  # skipping a number loses
    assert cs[1].wait_generation(after=0, timeout=1)["generation"] == 1
    with pytest.raises(WaitTimeout, match=r"no generation after 1 published within 0\.2 s"):
        cs[1].wait_generation(after=1, timeout=0.2)


def test_commit_only_moves_forward_and_stops_after_end_run(make):
    a, b = make(), make()
    a.register(heartbeat=False)
    assert b.committed_generation() == -1
    a.commit_generation(2)
    a.commit_generation(1)  # a late commit of an older generation changes nothing
    assert b.committed_generation() == 2
    a.end_run()
    a.commit_generation(5)  # after the end nothing is re-created
    assert b.committed_generation() == -1


def test_barrier_timeout_names_missing_workers(make):
    cs = [make() for _ in range(4)]
    ids = [c.register() for c in cs]
    done: list[float] = []
    t = threading.Thread(target=lambda: done.append(cs[1].barrier("b1", ids[:2], 5)))
    t.start()
    cs[0].barrier("b1", ids[:2], 5)
    t.join()
    assert done  # both arrived
    with pytest.raises(BarrierTimeout) as exc:
        cs[0].barrier("b2", ids, timeout=0.5)
    assert exc.value.missing == ids[1:] and exc.value.dead == []
    assert f"missing {ids[1]}, {ids[2]}, {ids[3]}" in str(exc.value)
    assert "(1/4 arrived)" in str(exc.value)


def test_barrier_reports_dead_participant_early(make):
    cs = [make() for _ in range(3)]
    ids = [c.register() for c in cs]
    cs[2].stop_heartbeat()
    time.sleep(cs[0].dead_after + 0.2)
    t0 = time.monotonic()
    with pytest.raises(BarrierTimeout) as exc:
        cs[0].barrier("b", ids, timeout=30)
    assert time.monotonic() - t0 < 5.0  # not the full 30 s
    assert exc.value.dead == [ids[2]]
    assert f"{ids[2]} died" in str(exc.value)


def test_two_runs_do_not_see_each_other(make, client):
    a = make("runa-" + make().run_id)
    b = make("runb-" + a.run_id)
    wa = a.register()
    b.register()
    a.publish_generation({"generation": 0, "layout": "A"})
    a.emit("step", step=1)
    assert list(b.members()) == ["w1"] and wa in a.members()  # each its own counter
    assert b.current_generation() is None
    assert all(e["worker"] != wa or e["type"] != "step" for e in b.read_events())
    assert b.publish_generation({"generation": 0, "layout": "B"})
    assert a.current_generation()["layout"] == "A"
    assert all(k.startswith(Keys(a.run_id).prefix) for k in a.run_keys())
    b.end_run()
    assert a.current_generation()["layout"] == "A"
    a.end_run()


def test_run_ids_cannot_escape_their_namespace(client):
    for bad in ("a:*", "*", "a b", "", "x" * 65, "../x"):
        with pytest.raises(UsageError, match="invalid run id"):
            Coordinator(client, bad)


def test_acl_user_cannot_touch_other_runs(redis_url, client, run_id):
    other = Coordinator(client, run_id + "-other")
    other.publish_generation({"generation": 0})
    user, password = grant_run_user(client, run_id)
    try:
        rc = connect(run_user_url(redis_url, user, password), retry_deadline=2)
        mine = Coordinator(rc, run_id, **FAST)
        wid = mine.register(heartbeat=False)
        assert mine.publish_generation({"generation": 0}) and wid == "w1"
        okey = Keys(run_id + "-other").gen
        with pytest.raises(CoordinatorError, match="denied access"):
            rc.call("read", lambda r: r.get(okey))
        with pytest.raises(CoordinatorError, match="denied access"):
            rc.call("write", lambda r: r.set(okey, b"{}"))
        with pytest.raises(CoordinatorError, match="denied access"):
            rc.call("scan", lambda r: list(r.scan_iter()))
        with pytest.raises(CoordinatorError, match="denied access"):
            Coordinator(rc, run_id + "-other").register()
        assert mine.end_run() > 0 and mine.run_keys() == []
        rc.close()
    finally:
        revoke_run_user(client, run_id)
        other.end_run()


def test_spec_mismatch_refused(make):
    spec = {"model": "gpt-tiny", "seed": 1, "global_batch": 8}
    make(spec=spec).register()
    make(spec=dict(spec)).register()  # equal spec joins
    with pytest.raises(SpecMismatch, match=r"global_batch: run has 8, this worker 16"):
        make(spec={**spec, "global_batch": 16}).register()


def test_oversized_and_malformed_entries_rejected(make, client):
    a = make(max_value_bytes=1000)
    wid = a.register(heartbeat=False)
    k = a.keys
    client.redis.set(k.gen, b"x" * 5000)
    with pytest.raises(CoordinatorError, match=rf"{k.gen} is 5000 bytes, over the 1000-byte"):
        a.current_generation()
    client.redis.set(k.gen, b"\x80\x04pickle")
    with pytest.raises(CoordinatorError, match=rf"{k.gen} is not valid JSON"):
        a.current_generation()
    client.redis.set(k.gen, b"[1, 2]")
    with pytest.raises(CoordinatorError, match=rf"{k.gen} is a JSON list, expected an object"):
        a.current_generation()
    with pytest.raises(CoordinatorError, match="malformed"):
        a.publish_generation({"generation": 0})
    client.redis.hset(k.workers, "w9", b"y" * 2000)
    with pytest.raises(CoordinatorError, match=rf"{k.workers}\[w9\] is 2000 bytes"):
        a.members()
    client.redis.hset(k.workers, "w9", b'{"run_id": "other", "state": "active"}')
    with pytest.raises(CoordinatorError, match=r"belongs to run 'other'"):
        a.members()
    client.redis.hdel(k.workers, "w9")
    client.redis.delete(k.gen)
    client.redis.hset(k.gen, "a", "b")  # wrong type
    with pytest.raises(CoordinatorError, match="holds a hash"):
        a.current_generation()
    with pytest.raises(UsageError, match="exceeds the 1000-byte limit"):
        a.emit("step", blob="z" * 2000)
    with pytest.raises(UsageError, match="not plain JSON"):
        a.set_status({"x": object()})
    assert wid in a.members()


def test_events_status_and_end_run(make, client):
    a = make()
    a.register(heartbeat=False)
    first = a.read_events()
    eid = a.emit("migration.progress", rank=0, done=10, total=100)
    new = a.read_events(first[-1]["id"])
    assert [e["id"] for e in new] == [eid]
    assert new[0]["data"] == {"rank": 0, "done": 10, "total": 100}
    t0 = time.monotonic()
    assert a.read_events(eid, block_ms=200) == []
    assert time.monotonic() - t0 >= 0.15
    a.set_status({"step": 3})
    assert a.status()["step"] == 3
    a.barrier("x", [a.worker_id], 1)
    keys = a.run_keys()
    assert {a.keys.gen, a.keys.status, a.keys.barrier("x")} - set(keys) == {a.keys.gen}
    n = a.end_run(keep_s=30)
    assert n == len(keys) + 0 and all(0 < client.redis.ttl(k) <= 30 for k in a.run_keys())
    a.end_run()
    assert a.run_keys() == []


def test_large_barrier_passes_and_neighbours_report_a_death(make, client):
    n = 24  # > 16: each waiter watches only its three successors
    cs = [make(heartbeat_interval=0.2, dead_after=60) for _ in range(n)]
    doomed = cs[5]
    ids = [c.register(heartbeat=False) for c in cs]  # one beat each, TTL 60 s
    errors: list[BaseException] = []
    waited: list[float] = []

    def run(c: Coordinator, name: str) -> None:
        try:
            waited.append(c.barrier(name, ids, timeout=20))
        except BarrierTimeout as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c, "all")) for c in cs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(waited) == n
    assert cs[0].read_events()  # stream untouched by barriers
    client.redis.delete(doomed.keys.hb(ids[5]))  # what its TTL expiring does
    t0 = time.monotonic()
    threads = [threading.Thread(target=run, args=(c, "second")) for c in cs if c is not doomed]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - t0 < 5.0  # reported within ~one check interval, not 20 s
    assert len(errors) == n - 1
    assert all(e.dead == [ids[5]] and e.missing == [ids[5]] for e in errors)
    assert f"{ids[5]} died or left" in str(errors[0])


def test_end_run_is_final_for_live_workers(make, client):
    a, b = make(), make()
    a.register()
    wb = b.register()
    assert a.end_run() > 0
    t0 = time.monotonic()
    while not b.ended:  # b's heartbeat learns it and stops
        assert time.monotonic() - t0 < 5
        time.sleep(0.05)
    time.sleep(3 * b.heartbeat_interval)
    assert a.run_keys() == []  # nothing re-created by b's heartbeat
    assert client.redis.exists(a.keys.hb(wb)) == 0
    assert 0 < client.redis.pttl(a.keys.ended) <= 60_000
    b.set_state("gone")  # an exiting worker's last writes do not re-create keys
    assert b.emit("step", step=9) == ""
    assert a.run_keys() == []
    with pytest.raises(CoordinatorError, match=rf"run {a.run_id} has ended"):
        make().register()
