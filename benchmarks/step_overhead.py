"""What an ``ElasticSession`` costs per training step when nothing changes.

Two CPU worker processes (gloo), the same model, batch and seed, one run: first the plain
loop -- ``init_process_group`` on a ``TCPStore``, megatron-core's ``parallel_state``,
``etcslurm.megatron.model.build_gpt``, ``etcslurm.megatron.train.train_step`` -- then the
elastic loop: ``ElasticSession`` on a private Redis (``redis-server`` on 127.0.0.1, a free
port, stopped at the end) with ``session.step()`` / ``step_done()`` around the same
``train_step`` (the boundary all-reduce, rank 0's coordinator poll every 0.25 s, the
``step`` event, the data log, the heartbeat thread).  ``--rounds 2`` repeats both in the other
order (plain, elastic, elastic, plain) against a changing machine load and the advantage
of going second.

Prints the mean and median step time both ways, their ratio, and the session's own time
per step measured directly (``step()`` entry/exit and ``step_done``), which a busy
machine disturbs far less than the difference of two means (per step, the smaller of the
two ranks': the rank that reaches the boundary last does not wait for its peer there),
and what the parts of ``step_done`` take on each rank.  The default (gpt-125m with
its sequence cut to 128 tokens, global batch 2, 6 timed steps each way) takes two to three
minutes on two cores; ``--seq 0`` keeps the model's own 2048 (slow on CPU).
Run: ``python benchmarks/step_overhead.py [--model gpt-tiny] [--steps 20] [--json]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rank_processes import add_child_arguments, run_rank_processes

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spec(args: argparse.Namespace) -> Any:
    from etcslurm.core.models import PRESETS

    spec = PRESETS[args.model]
    return dataclasses.replace(spec, seq=args.seq) if args.seq else spec


def _settings(args: argparse.Namespace, steps: int) -> Any:
    from etcslurm.runtime.config import RunSettings

    return RunSettings(model=_spec(args), optimizer="adam", global_batch=args.global_batch,
                       micro_batch=1, seed=1234, steps=steps, initial_workers=WORLD,
                       gpus_per_node=WORLD)


# ---------------------------------------------------------------------- the two loops
def plain_loop(args: argparse.Namespace, rank: int, port: int) -> dict[str, Any]:
    """The loop without etcslurm's session: a torch.distributed world formed the usual
    way, megatron's groups, the model, ``train_step``."""
    import torch.distributed as dist

    from etcslurm.core.layout import ParallelConfig
    from etcslurm.megatron.cpu_shim import install_if_needed
    from etcslurm.megatron.model import TrainHyper, build_gpt
    from etcslurm.megatron.parallel import init_model_parallel, teardown
    from etcslurm.megatron.train import train_step

    install_if_needed()
    settings = _settings(args, args.warmup + args.steps)
    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    layout = ParallelConfig.parse(f"tp1pp1dp{WORLD}")
    init_model_parallel(layout)
    hyper = TrainHyper(lr=settings.lr, global_batch=settings.global_batch,
                       micro_batch=settings.micro_batch)
    trainee = build_gpt(settings.model, layout, optimizer=settings.optimizer,
                        seed=settings.seed, hyper=hyper)
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        loss = train_step(trainee)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            losses.append(loss)
    teardown()
    del store
    return {"step_s": times, "session_s": [0.0] * len(times), "losses": losses}


def elastic_loop(args: argparse.Namespace, rank: int, redis_url: str, run_dir: str,
                 run_id: str) -> dict[str, Any]:
    """The same loop inside an ``ElasticSession`` (the loop of the README)."""
    from etcslurm.megatron.train import train_step
    from etcslurm.runtime import steps
    from etcslurm.runtime.config import WorkerOptions
    from etcslurm.runtime.session import ElasticSession

    # one step more than timed: the last step_done publishes the run's end record
    settings = _settings(args, args.warmup + args.steps + 1)
    options = WorkerOptions(run_id=run_id, redis_url=redis_url, node=f"node{rank}",
                            run_dir=run_dir)
    times, session_s, losses = [], [], []
    parts: dict[str, float] = {}

    def timed(fn: Any, name: str) -> Any:
        def run(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                if args.warmup <= i < args.warmup + args.steps:
                    parts[name] = parts.get(name, 0.0) + time.perf_counter() - t0
        return run

    i = 0
    with ElasticSession(settings, options) as session:
        # the parts of step_done, timed where they run (instance attributes shadow methods)
        ctx = session.ctx
        ctx.world.vote = timed(ctx.world.vote, "boundary all-reduce (incl. waiting for the peer)")
        ctx.boundary.emit_soft = timed(ctx.boundary.emit_soft, "step event (rank 0)")
        # the boundary's own helpers (module functions, looked up at each call)
        steps._leader_sees_change = timed(steps._leader_sees_change,
                                          "coordinator poll (rank 0, every 0.25 s)")
        steps._log_data = timed(steps._log_data, "data log line")
        rank_seen = session.rank
        while not session.finished:
            t0 = time.perf_counter()
            with session.step():
                t1 = time.perf_counter()
                loss = train_step(session.trainee)
                t2 = time.perf_counter()
                session.step_done(loss)
                t3 = time.perf_counter()
            t4 = time.perf_counter()
            if args.warmup <= i < args.warmup + args.steps:
                times.append(t4 - t0)
                session_s.append((t1 - t0) + (t4 - t2))
                losses.append(loss)
            i += 1
            del t3
        generation = session.generation
    if generation != 0:  # the start only: nothing changed, as the benchmark requires
        raise RuntimeError(f"the world changed during the elastic loop (generation {generation})")
    return {"step_s": times, "session_s": session_s, "losses": losses, "rank": rank_seen,
            "parts_s": {k: v / max(1, len(times)) for k, v in parts.items()}}


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    rank = args.child
    out: dict[str, Any] = {"rank": rank, "rounds": []}
    for r in range(args.rounds):
        if args.elastic_first != bool(r % 2):  # rounds alternate the order: A B, B A, ...
            elastic = elastic_loop(args, rank, args.redis, args.run_dir, f"{args.run}-{r}")
            plain = plain_loop(args, rank, args.ports[r])
        else:
            plain = plain_loop(args, rank, args.ports[r])
            elastic = elastic_loop(args, rank, args.redis, args.run_dir, f"{args.run}-{r}")
        out["rounds"].append({"plain": plain, "elastic": elastic})
    Path(args.run_dir, f"rank{rank}.json").write_text(json.dumps(out))


# ---------------------------------------------------------------------- the parent
def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per loop: the world's step time (the slower rank of each step) over all rounds."""
    out: dict[str, Any] = {}
    for loop in ("plain", "elastic"):
        steps, session = [], []
        for r in range(len(ranks[0]["rounds"])):
            per_rank = [rk["rounds"][r][loop] for rk in ranks]
            steps += [max(v) for v in zip(*(p["step_s"] for p in per_rank), strict=True)]
            # the rank that reaches the boundary last waits least in its all-reduce: its
            # session time is the session's cost, not the other rank's wait for it
            session += [min(v) for v in zip(*(p["session_s"] for p in per_rank), strict=True)]
        out[loop] = {
            "steps": len(steps), "mean_s": statistics.fmean(steps),
            "median_s": statistics.median(steps), "min_s": min(steps),
            "stdev_s": statistics.stdev(steps) if len(steps) > 1 else 0.0,
            "session_mean_s": statistics.fmean(session),
        }
    p, e = out["plain"], out["elastic"]
    out["ratio_mean"] = e["mean_s"] / p["mean_s"]
    out["ratio_median"] = e["median_s"] / p["median_s"]
    out["ratio_min"] = e["min_s"] / p["min_s"]
    out["session_fraction"] = e["session_mean_s"] / p["mean_s"]
    by_rank = sorted(ranks, key=lambda rk: rk["rounds"][0]["elastic"]["rank"])
    out["parts_per_rank"] = [  # by the session's rank (rank 0 polls and emits events)
        {k: statistics.fmean(r["elastic"]["parts_s"].get(k, 0.0) for r in rk["rounds"])
         for k in rk["rounds"][0]["elastic"]["parts_s"]} for rk in by_rank]
    rounds = ranks[0]["rounds"]
    out["same_losses"] = all(r["plain"]["losses"] == r["elastic"]["losses"] for r in rounds)
    return out


def render(summary: dict[str, Any], args: argparse.Namespace, load: tuple[float, float],
           wall: float) -> None:
    from rich.console import Console
    from rich.table import Table

    spec = _spec(args)
    table = Table(title=f"per-step cost of ElasticSession, {spec.name} (seq {spec.seq}), "
                        f"{WORLD} CPU workers (gloo), global batch {args.global_batch}, "
                        f"{args.rounds} x {args.steps} timed steps each way")
    for col in ("loop", "mean", "median", "min", "stdev", "session / step (min of ranks)"):
        table.add_column(col, justify="left" if col == "loop" else "right")
    for loop, label in (("plain", "plain (init_process_group + train_step)"),
                        ("elastic", "elastic (ElasticSession + step/step_done)")):
        s = summary[loop]
        table.add_row(label, *(f"{s[k] * 1e3:.1f} ms" for k in
                               ("mean_s", "median_s", "min_s", "stdev_s", "session_mean_s")))
    console = Console(width=150)
    console.print(table)
    parts = Table(title="inside the elastic step boundary, mean per step")
    parts.add_column("part")
    for r in range(WORLD):
        parts.add_column(f"rank {r}", justify="right")
    names = list(dict.fromkeys(k for pr in summary["parts_per_rank"] for k in pr))
    for name in names:
        parts.add_row(name, *(f"{pr.get(name, 0.0) * 1e3:.2f} ms"
                              for pr in summary["parts_per_rank"]))
    console.print(parts)
    print(f"elastic / plain: mean {summary['ratio_mean']:.4f}, median "
          f"{summary['ratio_median']:.4f}, min {summary['ratio_min']:.4f}; the session's own "
          f"time is {summary['session_fraction'] * 100:.2f} % of a plain step (goal <= 1 %)")
    print(f"same losses both ways: {summary['same_losses']}; load average "
          f"{load[0]:.1f} before, {load[1]:.1f} after, on {os.cpu_count()} cores; "
          f"wall {wall:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-125m")
    ap.add_argument("--seq", type=int, default=None,
                    help="sequence length (default 128 for gpt-125m, else the model's; "
                         "0: the model's own)")
    ap.add_argument("--global-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per loop and round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--rounds", type=int, default=1, help="plain+elastic repetitions")
    ap.add_argument("--elastic-first", action="store_true",
                    help="run the elastic loop before the plain one in each round")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", action="store_true")
    # the worker side (internal)
    add_child_arguments(ap)
    ap.add_argument("--ports", type=lambda s: [int(x) for x in s.split(",")],
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.seq is None:
        args.seq = 128 if args.model == "gpt-125m" else 0
    if args.child is not None:
        child(args)
        return

    from etcslurm.redis_host.server import BundledRedis

    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="etcslurm-overhead-") as tmp:
        server = BundledRedis(tmp).start()
        try:
            ports = ",".join(str(_free_port()) for _ in range(args.rounds))
            base = [sys.executable, os.path.abspath(__file__), "--model", args.model,
                    "--seq", str(args.seq), "--global-batch", str(args.global_batch),
                    "--steps", str(args.steps), "--warmup", str(args.warmup),
                    "--rounds", str(args.rounds), "--ports", ports,
                    *(["--elastic-first"] if args.elastic_first else []),
                    "--redis", server.url_with_password, "--run",
                    f"overhead-{secrets.token_hex(3)}", "--run-dir", tmp]
            ranks = run_rank_processes(base, WORLD, tmp, args.timeout)
        finally:
            server.stop()
    wall = time.perf_counter() - t0
    load = (load0, os.getloadavg()[0])
    summary = summarize(ranks)
    if args.json:
        print(json.dumps({"model": args.model, "seq": _spec(args).seq,
                          "global_batch": args.global_batch, "steps": args.steps,
                          "rounds": args.rounds, "load_avg": load, "cpus": os.cpu_count(),
                          "wall_s": wall, **summary}, indent=1))
    else:
        render(summary, args, load, wall)


if __name__ == "__main__":
    main()
