"""RedisStore: torch.distributed Store semantics, and gloo process groups rendezvousing on it.

Run as a script it is one rank of the gloo check:
``python tests/test_coord_store.py URL RUN RANK WORLD``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

pytestmark = pytest.mark.redis


def _worker(url: str, run: str, rank: int, world: int) -> None:
    import time

    import torch
    import torch.distributed as dist

    from etcslurm.coord.client import connect
    from etcslurm.coord.store import RedisStore

    client = connect(url)
    out = []
    for gen in (0, 1):  # two generations, same processes, fresh store namespace each
        t0 = time.monotonic()
        store = RedisStore(client, run, gen, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        x = torch.tensor([float(rank + 1 + 10 * gen)])
        dist.all_reduce(x)
        send = torch.full((1000,), float(rank + 100 * gen))
        recv = torch.empty(1000)
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % world),
               dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        out.append({"gen": gen, "sum": x.item(), "recv": recv[0].item(),
                    "all_equal": bool((recv == recv[0]).all()),
                    "init_s": time.monotonic() - t0})
        dist.destroy_process_group()
    print(json.dumps(out), flush=True)


@pytest.fixture
def client(redis_url):
    from etcslurm.coord.client import connect

    c = connect(redis_url)
    yield c
    c.close()


def test_store_semantics_match_torch_hashstore(client, run_id):
    import torch.distributed as dist

    from etcslurm.coord.store import RedisStore

    ours = RedisStore(client, run_id, 0, timeout=timedelta(seconds=1))
    ref = dist.HashStore()
    ref.set_timeout(timedelta(seconds=1))
    for s in (ours, ref):
        s.set("a", "1")
        s.set("b", b"\x00\xffraw")
    for s in (ours, ref):
        assert s.get("b") == b"\x00\xffraw"
        assert s.add("n", 3) == 3 and s.add("n", 4) == 7 and s.get("n") == b"7"
        assert s.compare_set("a", "1", "2") == b"2"
        assert s.compare_set("a", "1", "3") == b"2"  # mismatch: current value back
        assert s.compare_set("new", "", "x") == b"x"  # missing + empty expected: created
        assert s.compare_set("none", "e", "x") == b"e"  # missing: expected back, not set
        assert s.check(["a", "n"]) and not s.check(["a", "zzz"])
        assert s.num_keys() == 4  # a, b, n, new
        assert s.delete_key("a") and not s.delete_key("a")
    with pytest.raises(dist.DistStoreError, match=r"store keys \['zzz'\]"):
        ours.wait(["b", "zzz"], timedelta(seconds=0.2))
    with pytest.raises(dist.DistStoreError, match=r"waiting for store key 'never'"):
        ours.get("never")  # store timeout (1 s)
    # a get waits for a key set later and fetches it in the same command that finds it
    import threading

    later = threading.Timer(0.2, lambda: ours.set("late", b"id"))
    later.start()
    assert ours.get("late") == b"id"
    later.join()
    ours.wait([])  # nothing to wait for
    # generations do not share keys
    other = RedisStore(client, run_id, 1)
    assert not other.check(["b"]) and other.num_keys() == 0
    from etcslurm.coord.coordinator import Coordinator

    co = Coordinator(client, run_id)
    assert co.keys.store(0) in co.run_keys()
    co.end_run()
    assert not ours.check(["b"])


def test_waiters_block_until_a_write_instead_of_polling(own_redis_client, run_id):
    """A rank waiting 1.5 s for another's key (``get`` and ``wait``) wakes as soon as it is
    written and costs Redis a few commands, not one per 20 ms (which, for 1023 ranks
    waiting on rank 0's NCCL id, was 68 000 commands at 1024 workers).  On a Redis of its
    own: the count is the server's."""
    client = own_redis_client
    import threading
    import time

    from etcslurm.coord.store import RedisStore
    from tests.helpers import redis_commands

    store = RedisStore(client, run_id, "blocking", timeout=timedelta(seconds=10))
    got: dict[str, float] = {}

    def waiter(kind: str) -> None:
        if kind == "get":
            assert store.get("uid") == b"nccl-id"
        else:
            store.wait(["uid", "addr"])
        got[kind] = time.monotonic()

    threads = [threading.Thread(target=waiter, args=(k,)) for k in ("get", "wait")]
    before = redis_commands(client)
    for t in threads:
        t.start()
    time.sleep(1.5)
    t_set = time.monotonic()
    store.set("uid", "nccl-id")
    store.add("addr", 1)
    for t in threads:
        t.join(10)
    used = redis_commands(client) - before
    assert set(got) == {"get", "wait"}
    # woken by the write (not found by a poll: the command count below), after it
    assert all(t >= t_set for t in got.values()), (got, t_set)
    # counted with the commands inside scripts and transactions: 2 waiters, a check (a
    # script: 3) and a block per second each, a check after the wake-up; 2 writes of 6;
    # the 2 INFOs -- 46 measured; polling every 20 ms would be over 400
    assert used < 80, used
    store.clear()
    assert not client.redis.exists(store.hash, store.news)


def test_gloo_process_groups_on_redis_store(redis_url, run_id):
    world = 3
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, __file__, redis_url, run_id, str(r), str(world)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for r in range(world)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, err[-2000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, res in enumerate(results):
        for gen, r in enumerate(res):
            assert r["gen"] == gen
            assert r["sum"] == sum(k + 1 + 10 * gen for k in range(world))
            assert r["recv"] == float((rank - 1) % world + 100 * gen) and r["all_equal"]
    from etcslurm.coord.client import connect
    from etcslurm.coord.coordinator import Coordinator

    co = Coordinator(connect(redis_url), run_id)
    assert {co.keys.store(0), co.keys.store(1)} <= set(co.run_keys())
    co.end_run()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
