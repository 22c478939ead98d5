"""Goodput under a preemption trace: etcslurm's elastic run against checkpoint-restart.

A seeded Poisson process of leaves and joins (compressed in time for this machine: an
event every ``1/rate`` steps on average, the worker count kept within ``--min-workers``
and ``--workers``) is replayed on a real local run (``etcslurm demo``'s launcher, CPU
workers, a bundled Redis).  Its goodput is the share of the training wall time that was
not spent paused in a resize (``migration.done``'s ``pause_seconds``, from the boundary
that decided it to the new rank 0 ready).

The same trace is then priced for checkpoint-restart (what a torchrun-style job does at
every change of its world): each event stops every process, writes a checkpoint, starts
new ones and loads it (``restart`` seconds, measured in this run on the same model, as
``benchmarks/resize_pause.py`` measures it), and loses the steps since the last periodic
checkpoint (every ``--checkpoint-every`` steps; its saves are counted free, which favours
checkpoint-restart).  Both goodputs and their ratio are printed.

    python benchmarks/goodput.py [--steps 60] [--rate 0.1] [--seed 3] [--write-results]
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from resize_pause import restart_run

from etcslurm.coord.client import connect
from etcslurm.coord.coordinator import Coordinator
from etcslurm.local.launcher import DemoOptions, run_demo
from etcslurm.redis_host.server import BundledRedis


def trace(seed: int, steps: int, rate: float, workers: int, least: int) -> list[tuple[int, str]]:
    """(step, "leave" | "join") events of a Poisson process of ``rate`` per step, the
    worker count kept within ``least`` and ``workers`` (a leave at ``least`` workers is
    a join instead, and the other way round); none in the first and last 3 steps."""
    rng = random.Random(seed)
    out, step, n = [], 3.0, workers
    while True:
        step += rng.expovariate(rate)
        if step >= steps - 3:
            return out
        kind = rng.choice(("leave", "join"))
        if kind == "leave" and n <= least:
            kind = "join"
        elif kind == "join" and n >= workers:
            kind = "leave"
        n += 1 if kind == "join" else -1
        if out and int(step) <= out[-1][0]:
            step = out[-1][0] + 1.0
        out.append((int(step), kind))


def elastic(args: argparse.Namespace, events: list[tuple[int, str]], url: str, pw: str,
            run_dir: Path) -> dict[str, Any]:
    """Run the trace; the training wall time, the pauses, the median step time."""
    run_id = f"goodput-{int(time.time())}"
    schedule = ";".join(f"{s}:{k}=1" for s, k in events)
    result = run_demo(DemoOptions(
        model=args.model, workers=args.workers, steps=args.steps, schedule=schedule,
        redis=url, password_file=pw, run_id=run_id, run_dir=str(run_dir), reference=True,
        global_batch=12, min_step_seconds=args.min_step, keep_keys_s=300))
    coord = Coordinator(connect(url, pw), run_id)
    steps = sorted((int(e["data"]["step"]), float(e["ts"]))
                   for e in coord.read_events("0", block_ms=0, count=100000)
                   if e["type"] == "step")
    first, last = steps[0][1], steps[-1][1]
    pauses = [float(m["pause_seconds"] or 0.0) for m in result.migrations]
    gaps = [b - a for (_, a), (_, b) in itertools.pairwise(steps)]
    return {"wall_s": last - first, "pauses_s": pauses, "step_s": statistics.median(gaps),
            "generations": [(g["kind"], g["to"], g["step"]) for g in result.generations],
            "max_loss_diff": result.max_loss_diff, "steps_done": len(result.losses)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--min-workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rate", type=float, default=0.1, help="events per step (Poisson)")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--min-step", type=float, default=1.0,
                    help="pace steps (s): joiners need ~15-25 s to start on this machine")
    ap.add_argument("--checkpoint-every", type=int, default=10,
                    help="the checkpoint-restart job's periodic checkpoint interval (steps)")
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    events = trace(args.seed, args.steps, args.rate, args.workers, args.min_workers)
    print(f"trace (seed {args.seed}, {args.rate} per step): {events}")
    with TemporaryDirectory() as tmp, BundledRedis(Path(tmp) / "redis") as server:
        url, pw = server.url, str(server.password_file)
        run = elastic(args, events, url, pw, Path(tmp) / "elastic")
        restart_args = argparse.Namespace(model=args.model, workers=args.workers)
        down, up, _ = restart_run(restart_args, url, pw, Path(tmp) / "restart")
    restart = down + up
    paused = sum(run["pauses_s"])
    useful = run["wall_s"] - paused
    goodput_elastic = useful / run["wall_s"]
    lost = sum((s % args.checkpoint_every) * run["step_s"] for s, _ in events)
    goodput_ckpt = useful / (useful + len(events) * restart + lost)
    rows = [["etcslurm (P2P resize at the next step boundary)", f"{paused:.2f} s", "0 s",
             f"{100 * goodput_elastic:.1f} %"],
            [f"checkpoint-restart (restart {restart:.1f} s, a checkpoint every "
             f"{args.checkpoint_every} steps)", f"{len(events) * restart:.1f} s",
             f"{lost:.1f} s", f"{100 * goodput_ckpt:.1f} %"]]
    from etcslurm.bench.results import markdown_table, write_results

    table = markdown_table(["", "paused / restarting", "steps redone", "goodput"], rows)
    summary = (f"{len(events)} events over {run['steps_done']} steps "
               f"({run['wall_s']:.0f} s of training, median step {run['step_s']:.2f} s); "
               f"goodput ratio {goodput_elastic / goodput_ckpt:.2f}×; losses equal the "
               f"never-resized run within {run['max_loss_diff']}")
    print(table)
    print(summary)
    if args.write_results:
        data = {"events": events, "elastic": run, "restart_s": restart, "restart_down_s": down,
                "restart_up_s": up, "lost_s": lost, "goodput_elastic": goodput_elastic,
                "goodput_checkpoint_restart": goodput_ckpt}
        print(write_results("goodput", table, data, notes=summary,
                            title="Goodput under a preemption trace"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
