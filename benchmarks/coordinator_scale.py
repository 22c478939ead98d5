"""1024 simulated workers registering with the coordinator, beating and being listed.

Real Redis (a bundled server started here, or --redis URL), real Coordinator handles,
one thread per worker sharing one connection pool (as workers on one host would share
nothing but the server).  Prints registration, heartbeat, membership-read and
leader-election times.  Run: ``python benchmarks/coordinator_scale.py [--workers 1024]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from rich.console import Console
from rich.table import Table

from etcslurm.coord.client import connect
from etcslurm.coord.coordinator import Coordinator
from etcslurm.redis_host.server import BundledRedis


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workers", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=128, help="client threads (the pool size)")
    ap.add_argument("--redis", help="an existing Redis URL (with password); default: bundled")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = None
        url = args.redis
        if url is None:
            server = BundledRedis(tmp).start()
            url = server.url_with_password
        client = connect(url)
        run = f"scale-{int(time.time())}"
        spec = {"model": "gpt-70b", "global_batch": 1024}
        handles = [Coordinator(client, run, spec=spec, dead_after=60, heartbeat_interval=5)
                   for _ in range(args.workers)]
        pool = ThreadPoolExecutor(args.threads)
        reg_times: list[float] = []
        lock = threading.Lock()

        def register(h: Coordinator) -> None:
            t0 = time.perf_counter()
            h.register({"device": "gpu:0"}, heartbeat=False)
            with lock:
                reg_times.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        list(pool.map(register, handles))
        t_register = time.perf_counter() - t0

        t0 = time.perf_counter()
        list(pool.map(lambda h: h.beat(deadline=5), handles))
        t_beat = time.perf_counter() - t0

        t0 = time.perf_counter()
        members = handles[0].members()
        t_members = time.perf_counter() - t0
        assert len(members) == args.workers

        t0 = time.perf_counter()
        leader = handles[0].leader()
        t_leader = time.perf_counter() - t0
        handles[0].end_run()
        client.close()
        if server is not None:
            server.stop()

    table = Table(title=f"coordinator with {args.workers} simulated workers (real Redis)")
    table.add_column("operation")
    table.add_column("seconds", justify="right")
    table.add_row(f"register all ({args.threads} client threads)", f"{t_register:.2f}")
    table.add_row("  one registration, median / p99",
                  f"{statistics.median(reg_times) * 1e3:.1f} / "
                  f"{sorted(reg_times)[int(len(reg_times) * 0.99)] * 1e3:.1f} ms")
    table.add_row("one heartbeat from every worker", f"{t_beat:.2f}")
    table.add_row("read membership (all workers + liveness)", f"{t_members:.3f}")
    table.add_row(f"leader election (leader {leader})", f"{t_leader:.3f}")
    Console().print(table)


if __name__ == "__main__":
    main()
