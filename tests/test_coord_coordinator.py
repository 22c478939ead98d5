"""Coordinator behaviour on a real Redis (``redis_url`` from sbin/test)."""

from __future__ import annotations

import threading
import time

import pytest

from etcslurm.coord.client import connect
from etcslurm.coord.coordinator import Coordinator, SpecMismatch
from etcslurm.coord.records import ChangeRequest, GenerationRecord, parse_event
from etcslurm.coord.schema import Keys
from etcslurm.core.layout import ParallelConfig
from etcslurm.errors import CoordinatorError, RecordError, UsageError, WaitTimeout
from etcslurm.redis_host.acl import grant_run_user, revoke_run_user, run_user_url
from tests.helpers import generation_record, redis_commands

pytestmark = pytest.mark.redis

FAST = {"heartbeat_interval": 0.2, "dead_after": 1.5}  # margin for 2 busy cores


def gen_record(n: int, layout: str = "tp1pp1dp1", reason: str = "test") -> GenerationRecord:
    return generation_record(n, layout, ["w1"] * ParallelConfig.parse(layout).world_size,
                             from_layout=None if n == 0 else layout, reason=reason)


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
    req = a.pending_changes()[0]
    assert req.drain == (wa,) and req.by == wa and req.to is None
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
        # a bounded wait: the heartbeat key's TTL lapses after dead_after
        assert time.monotonic() - t0 < a.dead_after + 10.0, "death not detected in time"
        time.sleep(0.05)
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
        # a bounded wait: the heartbeat key's TTL lapses after dead_after
        assert time.monotonic() - t0 < cs[0].dead_after + 10.0, "death not detected in time"
        time.sleep(0.05)
    assert cs[0].is_leader()


def test_generation_cas_one_winner(make, client):
    cs = [make() for _ in range(6)]
    for c in cs:
        c.register(heartbeat=False)
    assert cs[0].publish_generation(gen_record(0))
    start = threading.Barrier(len(cs))
    results: list[bool] = [False] * len(cs)

    def publish(i: int) -> None:
        start.wait()
        results[i] = cs[i].publish_generation(gen_record(1, reason=f"by {i}"))

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(len(cs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(results) == 1
    rec = cs[0].current_generation()
    assert rec.generation == 1 and rec.reason == f"by {results.index(True)}"
    assert rec.published_by in {c.worker_id for c in cs} and rec.published_at
    assert not cs[1].publish_generation(gen_record(3))  # skipping a number loses
    assert cs[1].wait_generation(after=0, timeout=1).generation == 1
    with pytest.raises(UsageError, match="needs a GenerationRecord"):
        cs[1].publish_generation({"generation": 2})  # type: ignore[arg-type]
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


def test_hold_says_who_stands_by_after_which_failure_and_ends_with_the_run(make, client):
    a, b = make(), make()
    wa, wb = a.register(heartbeat=False), b.register(heartbeat=False)
    assert a.holding() == {}
    a.hold(3)
    b.hold(2)
    b.hold(4)  # the latest failure it came back from
    assert a.holding() == {wa: 3, wb: 4}
    a.end_run()
    b.hold(5)  # after the end nothing is re-created
    assert client.redis.exists(a.keys.holding) == 0


def test_waiters_block_on_news_and_read_the_record_once(own_redis_client, run_id):
    """A waiting worker costs O(1) (the head, a blocked XREAD), wakes at the publish or
    the commit, and reads the (O(N)) record once, not at every poll.  On a Redis of its
    own: the count is the server's."""
    client = own_redis_client
    a, b = Coordinator(client, run_id, **FAST), Coordinator(client, run_id, **FAST)
    try:
        _block_on_news(a, b, client)
    finally:
        a.stop_heartbeat()
        b.stop_heartbeat()


def _block_on_news(a: Coordinator, b: Coordinator, client) -> None:
    a.register(heartbeat=False)
    b.register(heartbeat=False)
    assert b.head().generation == -1 and b.head().committed == -1
    assert b.watch(-1, timeout=0.1).generation == -1  # nothing yet: back after the timeout
    got: list = []
    reads: list[int] = []
    real_read = b.generations.current

    def counted() -> GenerationRecord | None:
        reads.append(1)
        return real_read()

    b.generations.current = counted  # type: ignore[method-assign]
    waiter = threading.Thread(target=lambda: got.append(b.wait_generation(after=-1, timeout=20)))
    waiter.start()
    time.sleep(0.5)  # blocked: a handful of commands, no record read
    before = redis_commands(client)
    time.sleep(0.5)
    assert redis_commands(client) - before <= 4 and not reads
    assert a.publish_generation(gen_record(0))
    waiter.join(timeout=10)
    # woken by the publish: one record read, and none while it was blocked (above)
    assert got and got[0].generation == 0 and len(reads) == 1
    assert client.redis.get(a.keys.gen_no) == b"0"
    # a leaver's wait: woken by the commit
    done: list = []
    leaver = threading.Thread(target=lambda: done.append(b.watch(0, timeout=20, committed=-1)))
    leaver.start()
    time.sleep(0.3)
    a.commit_generation(0)
    leaver.join(timeout=10)
    assert done and done[0].committed == 0 and done[0].generation == 0
    # a record written behind the scripts' back (no gen_no: an older etcslurm) is read
    client.redis.delete(a.keys.gen_no)
    assert b.head().generation == 0
    client.redis.set(a.keys.gen, client.redis.get(a.keys.gen).replace(
        b'"generation":0', b'"generation":1'))
    assert b.wait_generation(after=0, timeout=5).generation == 1
    with pytest.raises(WaitTimeout, match=r"no generation after 1 published within 0\.3 s "
                                          r"\(current: 1, committed: 0, leader: "):
        b.wait_generation(after=1, timeout=0.3)
    assert a.keys.gen_no not in a.run_keys() and a.keys.news in a.run_keys()


def test_two_runs_do_not_see_each_other(make, client):
    a = make("runa-" + make().run_id)
    b = make("runb-" + a.run_id)
    wa = a.register()
    b.register()
    a.publish_generation(gen_record(0, "tp1pp1dp1"))
    a.emit("step", gen=0, step=1, loss=1.0)
    assert list(b.members()) == ["w1"] and wa in a.members()  # each its own counter
    assert b.current_generation() is None
    assert all(e["worker"] != wa or e["type"] != "step" for e in b.read_events())
    assert b.publish_generation(gen_record(0, "tp1pp2dp1"))
    assert a.current_generation().to_layout == "tp1pp1dp1"
    assert all(k.startswith(Keys(a.run_id).prefix) for k in a.run_keys())
    b.end_run()
    assert a.current_generation().to_layout == "tp1pp1dp1"
    a.end_run()


def test_run_ids_cannot_escape_their_namespace(client):
    for bad in ("a:*", "*", "a b", "", "x" * 65, "../x"):
        with pytest.raises(UsageError, match="invalid run id"):
            Coordinator(client, bad)


def test_acl_user_cannot_touch_other_runs(redis_url, client, run_id):
    other = Coordinator(client, run_id + "-other")
    other.publish_generation(gen_record(0))
    user, password = grant_run_user(client, run_id)
    try:
        rc = connect(run_user_url(redis_url, user, password), retry_deadline=2)
        mine = Coordinator(rc, run_id, **FAST)
        wid = mine.register(heartbeat=False)
        assert mine.publish_generation(gen_record(0)) and wid == "w1"
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
        a.publish_generation(gen_record(0))
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
    client.redis.delete(k.gen)
    # well-formed JSON that is no generation record: refused, naming the field
    client.redis.set(k.gen, b'{"generation": 0, "kind": "start"}')
    with pytest.raises(RecordError, match=rf"{k.gen}: generation record: missing field"):
        a.current_generation()
    client.redis.set(k.gen, b'{"generation": 0, "version": 7}')
    with pytest.raises(RecordError, match="version 7 is not supported"):
        a.current_generation()
    client.redis.rpush(k.changes, b'{"to": "tp0", "drain": [], "by": "x", "ts": 1}')
    with pytest.raises(RecordError, match=rf"{k.changes}\[0\]: change request: field 'to'"):
        a.pending_changes()
    with pytest.raises(UsageError, match="exceeds the 1000-byte limit"):
        a.emit("error", message="z" * 2000)
    assert wid in a.members()


def test_events_and_end_run(make, client):
    a = make()
    a.register(heartbeat=False)
    first = a.read_events()
    eid = a.emit("migration.progress", gen=1, worker="w1", rank=0, sent=10, recv=0,
                 total_send=100, total_recv=0)
    new = a.read_events(first[-1]["id"])
    assert [e["id"] for e in new] == [eid]
    assert new[0]["data"] == {"gen": 1, "worker": "w1", "rank": 0, "sent": 10, "recv": 0,
                              "total_send": 100, "total_recv": 0}
    ev = parse_event(new[0])
    assert ev.data.sent == 10 and ev.worker == a.worker_id and ev.id == eid
    t0 = time.monotonic()
    assert a.read_events(eid, block_ms=200) == []
    assert time.monotonic() - t0 >= 0.15
    keys = a.run_keys()
    assert {a.keys.events, a.keys.workers} <= set(keys)
    n = a.end_run(keep_s=30)
    assert n == len(keys) + 0 and all(0 < client.redis.ttl(k) <= 30 for k in a.run_keys())
    a.end_run()
    assert a.run_keys() == []


def test_end_run_is_final_for_live_workers(make, client):
    a, b = make(), make()
    a.register()
    wb = b.register()
    assert a.end_run() > 0
    t0 = time.monotonic()
    while not b.ended:  # b's heartbeat learns it and stops
        assert time.monotonic() - t0 < 30, "the heartbeat did not learn that the run ended"
        time.sleep(0.05)
    time.sleep(3 * b.heartbeat_interval)
    assert a.run_keys() == []  # nothing re-created by b's heartbeat
    assert client.redis.exists(a.keys.hb(wb)) == 0
    assert 0 < client.redis.pttl(a.keys.ended) <= 60_000
    b.set_state("gone")  # an exiting worker's last writes do not re-create keys
    assert b.emit("step", gen=0, step=9, loss=1.0) == ""
    assert a.run_keys() == []
    with pytest.raises(CoordinatorError, match=rf"run {a.run_id} has ended"):
        make().register()


def test_emit_refuses_unknown_types_and_malformed_fields(make):
    a = make()
    a.register(heartbeat=False)
    before = len(a.read_events())
    with pytest.raises(RecordError, match=r"unknown event type 'migration\.bogus'"):
        a.emit("migration.bogus", gen=1)
    with pytest.raises(RecordError, match="step event: field 'loss' must be number"):
        a.emit("step", gen=0, step=1, loss="low")
    with pytest.raises(RecordError, match="step event: missing field 'gen'"):
        a.emit("step", step=1, loss=1.0)
    with pytest.raises(RecordError, match=r"migration\.done event: unknown field 'speed'"):
        a.emit("migration.done", gen=1, seconds=1.0, moved_bytes=1, local_bytes=0, speed=3)
    assert len(a.read_events()) == before  # nothing was written


def test_change_requests_queue_pending_take(make):
    a = make()
    a.register(heartbeat=False)
    assert a.pending_changes() == []
    first = ChangeRequest(to="tp1pp1dp2", drain=(), by="operator", ts=1.0, reason="shrink")
    second = ChangeRequest(to=None, drain=("w1",), by="operator", ts=2.0)
    a.request_change(first)
    a.request_change(second)
    assert a.pending_changes() == [first, second]
    a.take_changes(1)
    assert a.pending_changes() == [second]
    a.take_changes(5)
    assert a.pending_changes() == []
    events = [parse_event(e) for e in a.read_events() if e["type"] == "change.requested"]
    assert [(e.data.to, e.data.drain) for e in events] == [("tp1pp1dp2", ()), (None, ("w1",))]
    with pytest.raises(RecordError, match="needs 'to' or a non-empty 'drain'"):
        ChangeRequest(to=None, drain=(), by="operator", ts=1.0)
