"""One resize's coordinator work with N simulated workers, through the runtime's own code.

Real Redis (a private ``redis-server`` on 127.0.0.1, port picked at random, stopped at the
end; or ``--redis URL``), one :class:`~etcslurm.coord.coordinator.Coordinator` handle and
one thread per simulated worker (heartbeat threads off), all in this process.  A world of
N workers (``tp1pp1dpN``, gpt-tiny) loses its last k workers (``--leave``, default N/8)
and shrinks to ``tp1pp1dp(N-k)``.  Phases, each started on all workers at once and timed
until the slowest worker is done:

* ``announce``: the k leavers announce, as ``Boundary.announce_leaving`` does
  (``worker.signal`` event, ``Coordinator.leave``: state ``leaving`` + a drain request).
* ``boundary poll``: rank 0's poll, as ``runtime.steps._leader_sees_change`` does
  (``Boundary.world_view`` + ``pending_request`` + ``worth_changing``).
* ``decide``: ``transitions.decide`` on every worker at once, as the runtime runs it after
  the boundary's all-reduce agreed on the decider (the lowest rank that stays): the decider
  runs ``transitions.publish_next`` (world view, ``next_generation`` with the planner, the
  CAS) while every other worker waits in ``Coordinator.wait_generation`` (blocked on the
  run's ``news`` stream, O(1) each); then every worker reads the record once.  Marks: the
  decider's ``publish_next`` (and its world view and plan), and when the last worker
  had the record, and what one worker's parse of the record costs (each host parses it
  once; the threads here share one parse, see ``generations._parse_record``).  The row ``(a waiting worker's re-check)`` is what one waiter costs
  each time it looks again without news (one ``head`` call, every 2 s): shown apart,
  not in the total.
* ``form new world``: the new world's N-k ranks on :class:`~etcslurm.coord.store.RedisStore`
  the way an NCCL group meets (``migration.rebuild`` event; rank 0 sets the unique id key
  under the generation's prefix, every other rank ``get``s it, which waits for it).
* ``form exchange group``: the same for the N members of the exchange (the union).
* ``enter + commit``: the new world's ranks ``set_state(active)``, rank 0
  ``commit_generation`` and emits ``migration.done``; the leavers run
  ``transitions.handed_over`` (they poll ``committed_generation``) until released.

Registration (``Coordinator.register`` of all N) and generation 0 are set up first and
reported apart (not part of a resize).  Per phase: wall time, Redis server CPU, commands,
bytes Redis sent, and the client CPU of the workers (sum, and the slowest worker's).
The client threads share this process's GIL, so a phase whose per-worker client CPU is
large is slower here than on N hosts; the Redis columns are what every deployment
shares, and the row ``est., a host per worker`` adds, per phase, the Redis CPU and the
slowest worker's own CPU (what the resize would take with every worker on its own host,
network round trips aside).  ``--save FILE`` keeps the JSON, ``--render FILE`` prints it
again.  Run: ``python benchmarks/resize_coordinator.py [--workers 64,128,256,512,1024]
[--json]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from rich.console import Console
from rich.table import Table

from etcslurm.coord.client import connect
from etcslurm.coord.coordinator import ACTIVE, Coordinator
from etcslurm.coord.records import GenerationRecord
from etcslurm.coord.store import RedisStore
from etcslurm.core.models import PRESETS
from etcslurm.redis_host.server import BundledRedis
from etcslurm.runtime import transitions
from etcslurm.runtime.boundary import Boundary
from etcslurm.runtime.config import RunSettings, WorkerOptions
from etcslurm.runtime.generation import first_generation, worth_changing
from etcslurm.runtime.machine import Phase, State, settle

PHASES = ("announce", "boundary poll", "decide (publish; every worker gets the record)",
          "form new world", "form exchange group", "enter + commit")
#: a diagnostic row, not part of the resize total: every waiting worker looks once more
POLL = "(a waiting worker's re-check, each 2 s)"
#: bytes of an NCCL unique id (what rank 0 puts in the store)
UNIQUE_ID_BYTES = 128


@dataclass
class PhaseStats:
    wall_s: float = 0.0
    redis_cpu_s: float = 0.0
    redis_calls: int = 0
    redis_out_bytes: int = 0
    client_cpu_sum_s: float = 0.0
    client_cpu_max_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


def _redis_snapshot(r: Any) -> tuple[float, int, int]:
    """(server CPU seconds, commands processed, bytes sent to clients)."""
    cpu = r.info("cpu")
    stats = r.info("stats")
    return (float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
            int(stats["total_commands_processed"]), int(stats["total_net_output_bytes"]))


class Simulation:
    """N worker threads that run one phase at a time, all released together."""

    def __init__(self, n: int, url: str, leave: int, model: str) -> None:
        self.n = n
        self.k = leave
        self.client = connect(url, max_connections=max(256, 2 * n + 64))
        self.admin = self.client.redis
        self.run_id = f"rc{n}-{secrets.token_hex(3)}"
        self.settings = RunSettings(
            model=PRESETS[model], optimizer="adam",
            global_batch=math.lcm(n, n - leave), micro_batch=1, initial_workers=n,
            gpus_per_node=8,
        )
        self.options = WorkerOptions(run_id=self.run_id, redis_url=url, node="sim",
                                     heartbeat_interval=60.0, dead_after=600.0,
                                     collective_timeout=60.0, decide_timeout=300.0)
        spec = self.settings.to_json()
        self.coords = [Coordinator(self.client, self.run_id, spec=spec, heartbeat_interval=60,
                                   dead_after=600) for _ in range(n)]
        self.ctxs: list[Any] = []
        self.barrier = threading.Barrier(n + 1)
        self.errors: list[str] = []
        self.record0: Any = None
        self.record1: Any = None
        self.stores: list[RedisStore] = []
        #: per worker: (start, end, thread CPU) of the current phase
        self.times: list[tuple[float, float, float]] = [(0.0, 0.0, 0.0)] * n
        self.marks: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ machinery
    def _worker(self, i: int, jobs: list[Callable[[int], None]]) -> None:
        for job in jobs:
            try:
                self.barrier.wait()
            except threading.BrokenBarrierError:
                return
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                job(i)
            except Exception:
                with self._lock:
                    self.errors.append(f"worker {i}: {traceback.format_exc()}")
                self.barrier.abort()
                return
            self.times[i] = (t0, time.perf_counter(), time.thread_time() - c0)
            try:
                self.barrier.wait()
            except threading.BrokenBarrierError:
                return

    def _mark(self, name: str, value: float) -> None:
        with self._lock:
            self.marks.setdefault(name, []).append(value)

    def run(self) -> dict[str, PhaseStats]:
        jobs: list[tuple[str, Callable[[int], None]]] = [
            ("register", self.register), ("generation 0", self.enter_first),
            ("announce", self.announce), ("boundary poll", self.boundary_poll),
            (POLL, self.poll_round), (PHASES[2], self.decide),
            ("form new world", self.form_world),
            ("form exchange group", self.form_exchange), ("enter + commit", self.commit),
        ]
        threads = [threading.Thread(target=self._worker, args=(i, [j for _, j in jobs]),
                                    daemon=True, name=f"sim-w{i}") for i in range(self.n)]
        for t in threads:
            t.start()
        out: dict[str, PhaseStats] = {}
        for name, _ in jobs:
            self.marks = {}
            before = _redis_snapshot(self.admin)
            try:
                self.barrier.wait()  # start
                self.barrier.wait()  # every worker done
            except threading.BrokenBarrierError:
                break
            after = _redis_snapshot(self.admin)
            starts = [t[0] for t in self.times]
            ends = [t[1] for t in self.times]
            cpus = [t[2] for t in self.times]
            st = PhaseStats(
                wall_s=max(ends) - min(starts), redis_cpu_s=after[0] - before[0],
                redis_calls=after[1] - before[1] - 2,  # the two INFO of the snapshot
                redis_out_bytes=after[2] - before[2],
                client_cpu_sum_s=sum(cpus), client_cpu_max_s=max(cpus),
            )
            t_min = min(starts)
            for mark, values in self.marks.items():
                st.extra[mark] = max(values) - t_min if mark.endswith("@") else max(values)
            out[name] = st
        for t in threads:
            t.join(timeout=30)
        if self.errors:
            raise RuntimeError(f"{len(self.errors)} simulated workers failed; first:\n"
                               f"{self.errors[0]}")
        return out

    def close(self) -> None:
        try:
            self.coords[0].end_run()
        finally:
            self.client.close()

    # ------------------------------------------------------------------ the phases
    def register(self, i: int) -> None:
        self.coords[i].register({"device": f"gpu:{i % 8}", "node": f"node{i // 8:04d}"},
                                heartbeat=False)

    def enter_first(self, i: int) -> None:
        coord = self.coords[i]
        if i == 0:  # registered first: the leader publishes generation 0 (untimed setup)
            workers = [c.worker_id for c in self.coords]
            nodes = {c.worker_id: c.info["node"] for c in self.coords}
            assert coord.publish_generation(first_generation(
                transitions.layout_settings(SimpleNamespace(settings=self.settings)),
                workers, nodes))
        record = coord.wait_generation(after=-1, timeout=300)
        with self._lock:
            self.record0 = record
        coord.set_state(ACTIVE, rank=record.rank_of(coord.worker_id), generation=0)
        boundary = Boundary(coord, self.options)
        ctx = SimpleNamespace(
            settings=self.settings, options=self.options, coord=coord, boundary=boundary,
            worker_id=coord.worker_id, record=record, step=10, trainee=None,
            holdings=lambda: ({}, {}), forget_holdings=lambda: None,
        )
        store = RedisStore(self.client, self.run_id, "pg")
        with self._lock:
            self.ctxs.append((i, ctx))
            self.stores.append((i, store))

    def announce(self, i: int) -> None:
        if i == 0:  # the lookups the later phases need, built once the setup is done
            self._ctx_by = dict(self.ctxs)
            self._store_by = dict(self.stores)
        if i < self.n - self.k:
            return
        coord = self.coords[i]
        coord.emit("worker.signal", worker=coord.worker_id, node="sim", signal="USR2",
                   budget_s=60.0, received_at=time.time(), retry_s=0)
        coord.leave(within=60.0, reason="SIGUSR2")

    def boundary_poll(self, i: int) -> None:
        if i != 0:
            return
        ctx = self._ctx_by[0]
        settings = transitions.layout_settings(ctx)
        t0 = time.perf_counter()
        view = ctx.boundary.world_view(ctx.record, deadline=0)
        self._mark("world_view (members)", time.perf_counter() - t0)
        request = ctx.boundary.pending_request(settings, ctx.record, view)
        changed = worth_changing(settings, ctx.record, leaving=view.leaving, dead=[],
                                 ready=view.ready, request=request)
        if not changed or len(view.leaving) != self.k:
            raise AssertionError(f"the leader saw no change ({len(view.leaving)} leaving)")

    def poll_round(self, i: int) -> None:
        """What a waiting worker costs each time it looks again without news (every
        ``NEWS_BLOCK_S``): one O(1) head read, whatever N."""
        head = self._ctx_by[i].coord.watch(0, timeout=0)
        assert head.generation == 0, head

    def decide(self, i: int) -> None:
        """``transitions.decide`` as the runtime runs it on every rank after the vote."""
        ctx = self._ctx_by[i]
        record = ctx.record
        leaving = {c.worker_id for c in self.coords[self.n - self.k:]}
        # the boundary's all-reduce: the lowest rank that is not leaving decides
        decider = min(r for r, w in enumerate(record.workers_by_rank()) if w not in leaving)
        real_publish = transitions.publish_next
        is_decider = record.workers_by_rank()[decider] == ctx.worker_id
        if is_decider:
            real_next, real_view = transitions.next_generation, ctx.boundary.world_view

            def timed(fn: Callable[..., Any], mark: str) -> Callable[..., Any]:
                def run(*a: Any, **kw: Any) -> Any:
                    t0 = time.perf_counter()
                    try:
                        return fn(*a, **kw)
                    finally:
                        self._mark(mark, time.perf_counter() - t0)
                return run

            # only the decider calls these: patching the module for this phase is safe
            transitions.next_generation = timed(real_next, "of which next_generation (plan)")
            ctx.boundary.world_view = timed(real_view, "of which world_view (members)")
            transitions.publish_next = timed(real_publish, "publish_next (decider)")
        try:
            state = transitions.decide(ctx, State(Phase.DECIDE, decider=decider))
        finally:
            if is_decider:
                transitions.next_generation = real_next
                transitions.publish_next = real_publish
                del ctx.boundary.world_view
        self._mark("last worker has the record @", time.perf_counter())
        assert state.phase is Phase.FOLLOW and state.record.generation == 1, state
        if i == 0:
            self.record1 = state.record
            # what each host pays to parse the record (O(N)); the simulated workers share
            # one parse (the coordinator hands the same bytes' record out again), so it
            # is measured here, once, on a fresh copy
            doc = json.loads(json.dumps(state.record.to_json()))
            c0 = time.thread_time()
            GenerationRecord.from_json(doc)
            self._mark("one worker's parse of the record (CPU, not shared)",
                       time.thread_time() - c0)
        ctx.new_record = state.record

    def _group(self, i: int, members: list[str], prefix: str) -> None:
        ctx = self._ctx_by[i]
        if ctx.worker_id not in members:
            return
        rank = members.index(ctx.worker_id)
        store = self._store_by[i]
        key = f"{prefix}/0"  # what ProcessGroupNCCL's first communicator puts there
        if rank == 0:
            store.set(key, os.urandom(UNIQUE_ID_BYTES))
        else:
            assert len(store.get(key)) == UNIQUE_ID_BYTES

    def form_world(self, i: int) -> None:
        ctx = self._ctx_by[i]
        rec = ctx.new_record
        rank = rec.rank_of(ctx.worker_id)
        if rank is None:
            return
        ctx.coord.emit("migration.rebuild", gen=rec.generation, worker=ctx.worker_id,
                       rank=rank)
        self._group(i, rec.workers_by_rank(), f"gen{rec.generation}t")

    def form_exchange(self, i: int) -> None:
        rec = self._ctx_by[i].new_record
        self._group(i, list(rec.union), f"exchange{rec.generation}")

    def commit(self, i: int) -> None:
        ctx = self._ctx_by[i]
        rec = ctx.new_record
        rank = rec.rank_of(ctx.worker_id)
        if rank is None:  # a leaver: wait for the commit as the runtime does
            state = settle(ctx, transitions.handed_over, State(Phase.HANDED_OVER, record=rec))
            assert state.phase is Phase.LEFT, state
            self._mark("last leaver released @", time.perf_counter())
            return
        ctx.coord.set_state(ACTIVE, rank=rank, generation=rec.generation)
        if rank == 0:
            ctx.coord.commit_generation(rec.generation)
            self._mark("committed @", time.perf_counter())
            ctx.coord.emit("migration.done", gen=rec.generation, seconds=0.0, moved_bytes=0,
                           local_bytes=0, checkpoint_bytes=0, pause_seconds=0.0,
                           transfer_seconds=0.0, rebuild_seconds=0.0, phases={},
                           **{"from": rec.from_layout, "to": rec.to_layout})


def measure(n: int, url: str, leave: int | None, model: str) -> dict[str, Any]:
    k = leave if leave is not None else max(1, n // 8)
    sim = Simulation(n, url, k, model)
    try:
        phases = sim.run()
        rec = sim.record1
        assert rec is not None and rec.kind == "resize", rec
        assert rec.to_layout == f"tp1pp1dp{n - k}", rec.to_layout
        record_bytes = len(json.dumps(rec.to_json()))
    finally:
        sim.close()
    total = {name: sum(getattr(phases[p], name) for p in PHASES)
             for name in ("wall_s", "redis_cpu_s", "redis_calls", "redis_out_bytes",
                          "client_cpu_sum_s", "client_cpu_max_s")}
    return {
        "workers": n, "leaving": k, "from": f"tp1pp1dp{n}", "to": rec.to_layout,
        "record_bytes": record_bytes,
        "phases": {name: vars(st) for name, st in phases.items()},
        "resize_total": total,
    }


def _fmt_s(x: float) -> str:
    return f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s"


def _ratios(values: list[float], ns: list[int]) -> str:
    """The growth per doubling of N, between consecutive sizes (geometric per doubling)."""
    out = []
    for (a, na), (b, nb) in zip(zip(values, ns, strict=True), zip(values[1:], ns[1:],
                                                                   strict=True), strict=False):
        doublings = math.log2(nb / na)
        out.append(f"{(b / a) ** (1 / doublings):.1f}" if a > 0 and doublings > 0 else "-")
    return " ".join(out)


def _overall(values: list[float], ns: list[int]) -> str:
    """The mean growth per doubling from the smallest N to the largest: 2.0 is linear,
    4.0 quadratic."""
    if len(values) < 2 or values[0] <= 0 or values[-1] <= 0 or ns[-1] <= ns[0]:
        return "-"
    return f"{(values[-1] / values[0]) ** (1 / math.log2(ns[-1] / ns[0])):.2f}"


def render(results: list[dict[str, Any]], load: tuple[float, float, float]) -> None:
    console = Console(width=160)
    ns = [r["workers"] for r in results]
    title = (f"one resize tp1pp1dpN -> tp1pp1dp(N-k), k = N/8 leaving; coordinator work "
             f"(wall, N threads in one process; load avg {load[0]:.1f} on {os.cpu_count()} "
             f"cores)")
    table = Table(title=title)
    table.add_column("phase")
    for n in ns:
        table.add_column(f"N={n}", justify="right")
    table.add_column("x per doubling", justify="right")
    table.add_column(f"{ns[0]}→{ns[-1]}, x per doubling", justify="right")
    rows = [*PHASES, "resize total", POLL]
    for name in rows:
        vals = [(r["resize_total"]["wall_s"] if name == "resize total"
                 else r["phases"][name]["wall_s"]) for r in results]
        table.add_row(name, *(_fmt_s(v) for v in vals), _ratios(vals, ns), _overall(vals, ns))
        if name in PHASES:
            extra_names = list(results[-1]["phases"][name]["extra"])
            for extra in extra_names:
                ev = [r["phases"][name]["extra"].get(extra, 0.0) for r in results]
                table.add_row(f"  {extra}", *(_fmt_s(v) for v in ev), _ratios(ev, ns),
                              _overall(ev, ns))
    est = [sum(r["phases"][p]["redis_cpu_s"] + r["phases"][p]["client_cpu_max_s"]
               for p in PHASES) for r in results]
    table.add_row("est., a host per worker: Σ (Redis CPU + slowest worker CPU)",
                  *(_fmt_s(v) for v in est), _ratios(est, ns), _overall(est, ns))
    reg = [r["phases"]["register"]["wall_s"] for r in results]
    table.add_row("(setup) register all", *(_fmt_s(v) for v in reg), _ratios(reg, ns),
                  _overall(reg, ns))
    console.print(table)

    t2 = Table(title="the same phases at the Redis server (shared by every deployment) "
                     "and in the workers' own code")
    t2.add_column("phase")
    t2.add_column("what")
    for n in ns:
        t2.add_column(f"N={n}", justify="right")
    t2.add_column("x per doubling", justify="right")
    t2.add_column(f"{ns[0]}→{ns[-1]}", justify="right")
    for name in rows:
        get = ((lambda r, key: r["resize_total"][key]) if name == "resize total"
               else (lambda r, key, name=name: r["phases"][name][key]))
        for key, label, fmt in (
            ("redis_cpu_s", "Redis CPU", _fmt_s),
            ("redis_calls", "Redis commands", lambda v: f"{v:,.0f}"),
            ("redis_out_bytes", "bytes from Redis", lambda v: f"{v / 2**20:.1f} MiB"),
            ("client_cpu_sum_s", "worker CPU, sum", _fmt_s),
            ("client_cpu_max_s", "worker CPU, slowest", _fmt_s),
        ):
            vals = [float(get(r, key)) for r in results]
            t2.add_row(name if key == "redis_cpu_s" else "", label, *(fmt(v) for v in vals),
                       _ratios(vals, ns), _overall(vals, ns))
        t2.add_section()
    sizes = [r["record_bytes"] for r in results]
    t2.add_row("record", "JSON size", *(f"{v / 1024:.1f} KiB" for v in sizes),
               _ratios([float(s) for s in sizes], ns), _overall([float(s) for s in sizes], ns))
    console.print(t2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="64,128,256,512,1024",
                    help="comma-separated world sizes N")
    ap.add_argument("--leave", type=int, help="workers leaving (default N/8)")
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--redis", help="an existing Redis URL with password (default: a private "
                                    "redis-server started here)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ap.add_argument("--save", help="also write the JSON to this file")
    ap.add_argument("--render", help="print the tables of a JSON file --save wrote; no run")
    args = ap.parse_args()
    if args.render:
        with open(args.render) as fh:
            saved = json.load(fh)
        render(saved["results"], tuple(saved["load_avg_before"]))
        print(f"load average before {saved['load_avg_before'][0]:.1f}, after "
              f"{saved['load_avg_after'][0]:.1f} ({saved['cpus']} cores); the simulation's "
              "own threads count in the load average")
        return
    ns = [int(x) for x in args.workers.split(",") if x]
    results = []
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="etcslurm-rc-") as tmp:
        server = None
        url = args.redis
        if url is None:
            server = BundledRedis(tmp).start()  # 127.0.0.1, a free port, a fresh password
            url = server.url_with_password
        try:
            for n in ns:
                if not args.json:
                    print(f"N={n} ...", file=sys.stderr, flush=True)
                results.append(measure(n, url, args.leave, args.model))
        finally:
            if server is not None:
                server.stop()
    load_after = os.getloadavg()
    doc = {"load_avg_before": load, "load_avg_after": load_after, "cpus": os.cpu_count(),
           "results": results}
    if args.save:
        with open(args.save, "w") as fh:
            json.dump(doc, fh, indent=1)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        render(results, load)
        print(f"load average before {load[0]:.1f}, after {load_after[0]:.1f} "
              f"({os.cpu_count()} cores); the simulation's own threads count in the load "
              "average")


if __name__ == "__main__":
    main()
