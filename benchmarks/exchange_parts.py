"""The executor alone on a real plan: exchange vs its transport vs one pair's bandwidth.

Why: ``etcslurm bench migrate`` takes minutes (a model is built, trained, saved) and its
figures move with the load of this shared machine; comparing executor variants needs them
side by side in the same processes.  This starts ``old devices + joiners`` gloo processes
on a bare exchange group, gives them synthetic tensors of the analytic gpt state
(``megatron_state.rank_pieces``: the shapes the real model has; a piece a device holds
and needs is the same tensor, as in a kept model) and times, per repetition and in a
shuffled order: ``execute``, ``transport_only`` and, with ``--variant FILE``, another
executor module (e.g. a candidate change, or an older one: ``git show
COMMIT:etcslurm/transfer/executor.py > /tmp/old.py``).  Local copies are made once,
untimed (they are the same work in every variant).

    python benchmarks/exchange_parts.py [--from tp1pp1dp1 --to tp1pp1dp2 --join 1]
        [--repeat 6] [--variant FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import resource
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _worker(rank: int, n: int, port: int, args: argparse.Namespace, out: Any) -> None:
    from etcslurm.bench.driver import MigrateRequest
    from etcslurm.core.plan import message_cap
    from etcslurm.core.plan import plan as core_plan
    from etcslurm.groups import lifecycle as groups
    from etcslurm.megatron_state import rank_pieces
    from etcslurm.megatron_state.planning import gpt_inputs
    from etcslurm.transfer import executor as ex

    other = None
    if args.variant:
        spec_ = importlib.util.spec_from_file_location("variant_executor", args.variant)
        assert spec_ is not None and spec_.loader is not None
        other = importlib.util.module_from_spec(spec_)
        sys.modules["variant_executor"] = other
        spec_.loader.exec_module(other)
    torch.set_num_threads(1)
    spec, old, new = MigrateRequest(model=args.model, source=args.source, target=args.target,
                                    join=args.join).validate()
    plan = core_plan(gpt_inputs(spec, old, new, leaving=[], joiners=args.join,
                                optimizer="adam", staging_bytes=message_cap(args.staging_mb << 20),
                                params_dtype=spec.dtype))
    members = [str(r) for r in range(old.world_size)] + [f"join:{j}" for j in range(args.join)]
    me = members[rank]
    held = []
    if rank < old.world_size:
        for p in rank_pieces(spec, old, rank, "adam"):
            t = torch.empty(p.shape, dtype=ex.torch_dtype(p.dtype))
            t.view(-1).view(torch.uint8).fill_(7)
            held.append((p, t))
    mine = {p: t for p, t in held}
    needed = []
    if me in plan.assignment:
        for p in rank_pieces(spec, new, plan.assignment.index(me), "adam"):
            needed.append((p, mine.get(p, torch.zeros(p.shape, dtype=ex.torch_dtype(p.dtype)))))
    store = dist.TCPStore("127.0.0.1", port, n, rank == 0, timeout=timedelta(seconds=60))
    xg = groups.exchange_group(store, 1, rank, n, timeout=60)
    ranks = {d: i for i, d in enumerate(members)}
    arena = ex.staging_arena(plan.messages, me, None, held=held, needed=needed)
    held_ix, needed_ix = ex.ViewIndex(held, "held"), ex.ViewIndex(needed, "needed")
    for piece in plan.local.get(me, []) if me in plan.assignment else []:
        needed_ix.view(piece).copy_(held_ix.view(piece))

    def gmax(v: float) -> float:
        return float(groups.group_max(xg, torch.tensor([v], dtype=torch.float64), 60).item())

    res: dict[str, Any] = {}

    def timed(name: str, fn: Any) -> None:
        gmax(0.0)
        t0, c0 = time.perf_counter(), _cpu()
        fn()
        cpu = _cpu() - c0
        res.setdefault(name, []).append((gmax(time.perf_counter() - t0), gmax(cpu)))

    buf = torch.ones(128 << 20, dtype=torch.uint8)
    wait = timedelta(seconds=60)
    variants = ["execute", "transport"] + (["variant"] if other else [])
    for rep in range(args.repeat):
        best = float("inf")
        for _ in range(3):  # one pair's bandwidth, as the benchmark measures it
            gmax(0.0)
            t0 = time.perf_counter()
            if rank in (0, 1):
                (xg.send([buf], 1, 0) if rank == 0 else xg.recv([buf], 0, 0)).wait(wait)
            best = min(best, gmax(time.perf_counter() - t0))
        res.setdefault("pair", []).append(best)
        order = list(variants)
        random.Random(rep).shuffle(order)
        for v in order:
            module = other if v == "variant" else ex
            if v == "transport":
                timed(v, lambda: ex.transport_only(plan.messages, me, ranks, arena, held,
                                                   needed, group=xg, timeout=60))
            else:
                timed(v, lambda m=module: m.execute(plan.messages, [], me, ranks, held, needed,
                                                    group=xg, arena=arena, timeout=60))
    res["exact"] = all(bool((t.view(-1).view(torch.uint8) == 7).all()) for _, t in needed)
    res["max_recv"] = max(sum(m.nbytes for m in plan.messages if m.dst == d) for d in members)
    res["variants"] = variants
    out[rank] = res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-125m")
    ap.add_argument("--from", dest="source", default="tp1pp1dp1")
    ap.add_argument("--to", dest="target", default="tp1pp1dp2")
    ap.add_argument("--join", type=int, default=1)
    ap.add_argument("--staging-mb", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=6)
    ap.add_argument("--variant", default=None, help="another executor.py to time beside")
    args = ap.parse_args(argv)
    from etcslurm.core.layout import ParallelConfig

    n = ParallelConfig.parse(args.source).world_size + args.join
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(n, random.randint(20000, 40000), args, out), nprocs=n)
    first = out[0]
    bounds = [first["max_recv"] / ((128 << 20) / p) for p in first["pair"]]
    print(f"{args.source} -> {args.target} +{args.join}, {n} processes, {args.repeat} "
          f"repetitions; pair {statistics.median([(128 << 20) / p / 1e9 for p in first['pair']]):.2f}"
          f" GB/s, bound {statistics.median(bounds):.3f} s (medians); every result exact: "
          f"{all(out[r]['exact'] for r in range(n))}")
    for v in first["variants"]:
        wall = [w for w, _ in first[v]]
        cpu = [c for _, c in first[v]]
        ratio = [w / b for w, b in zip(wall, bounds, strict=True)]
        print(f"  {v:26s} {statistics.median(wall):.3f} s (min {min(wall):.3f}), CPU of the "
              f"busiest process {statistics.median(cpu):.3f} s, ÷ bound {statistics.median(ratio):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
