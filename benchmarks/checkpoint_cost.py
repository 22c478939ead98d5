"""What the periodic checkpoint (``RunSettings.checkpoint_every``) costs per training step.

Two CPU worker processes (gloo, tp1pp1dp2), one run: in each round both run the same
elastic loop (``ElasticSession`` on a private Redis, ``train_step`` between
``session.step()`` and ``step_done()``) twice with the same model, batch and seed --
once without periodic checkpoints, once with ``checkpoint_every`` (default 50): a
megatron-core ``dist_checkpointing`` save through its persistent asynchronous writer
process, started at the step boundary, written while training goes on, finalised at a
later boundary, the last ``checkpoint_keep`` (2) kept.  ``--rounds 2`` repeats both in
the other order (off, on, on, off) against a changing machine load.

The persistent writer is started before the first timed step, by a save of the initial
state to a scratch directory (its start-up, seconds, happens once per worker process and
is reported apart).  A loop of ``--steps`` (default 100) saves after steps 50 (and 100,
150, ... below the last: the runtime does not save at the run's last step), so each
save's whole cycle lies inside the timed steps.  Reported:

* *per-step cost at the interval*: (time of the timed steps with checkpoints − without) /
  (saves × interval × mean step without), i.e. one save's cost spread over the 50 steps
  between two saves; and the plain ratio of mean step times;
* *held per save*: the time the training loop itself spent in the checkpoint's calls at
  the boundary (start: the state staged for the writer; poll: the finalisation), and its
  share of the steps between two saves — what is left once the asynchronous write
  overlaps training.  On 2 shared cores the writer process also competes with training
  for CPU, which only the first figure captures;
* the losses both ways (checkpointing must not change training) and the load average.

Run: ``python benchmarks/checkpoint_cost.py [--model gpt-125m] [--seq 128] [--steps 100]
[--every 50] [--rounds 1] [--json]``.  gpt-125m's sequence is cut to 128 tokens by
default (its own 2048 is slow on CPU; a shorter step makes the checkpoint's share
larger, so the ratio is pessimistic); the state saved is the full model's either way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rank_processes import add_child_arguments, run_rank_processes

WORLD = 2


def _spec(args: argparse.Namespace) -> Any:
    from etcslurm.core.models import PRESETS

    spec = PRESETS[args.model]
    return dataclasses.replace(spec, seq=args.seq) if args.seq else spec


def loop(args: argparse.Namespace, rank: int, every: int, run_id: str,
         run_dir: Path) -> dict[str, Any]:
    """The elastic loop, ``every`` = 0 (no periodic checkpoint) or the interval; one step
    more than timed (the last ``step_done`` publishes the end record and, with
    checkpoints, waits for a save still pending: not a step's cost)."""
    from etcslurm.megatron.train import train_step
    from etcslurm.runtime.config import RunSettings, WorkerOptions
    from etcslurm.runtime.session import ElasticSession

    settings = RunSettings(model=_spec(args), optimizer="adam", global_batch=args.global_batch,
                           micro_batch=1, seed=1234, steps=args.steps,
                           initial_workers=WORLD, gpus_per_node=WORLD, checkpoint_every=every,
                           checkpoint_keep=2)
    run_dir.mkdir(parents=True, exist_ok=True)
    options = WorkerOptions(run_id=run_id, redis_url=args.redis, node=f"node{rank}",
                            run_dir=str(run_dir))
    times: list[float] = []
    losses: list[float] = []
    held: dict[str, float] = {"begin": 0.0, "poll": 0.0, "finish": 0.0}
    saves: list[int] = []
    depth = [0]  # start() calls finish(), which calls poll(): time the outermost call only
    i = 0

    def timed(fn: Any, name: str) -> Any:
        def run(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            depth[0] += 1
            try:
                return fn(*a, **kw)
            finally:
                depth[0] -= 1
                if i < args.steps and depth[0] == 0:
                    held[name] += time.perf_counter() - t0
                if name == "begin" and i < args.steps:
                    saves.append(i + 1)
        return run

    startup_s = 0.0
    with ElasticSession(settings, options) as session:
        periodic = session.ctx.periodic
        if every:
            assert periodic is not None, "checkpoint_every set but no periodic checkpoints"
            # start the persistent writer (a job that checkpoints has it running): one save
            # of the initial state to a scratch directory, awaited, outside the timed steps
            t0 = time.perf_counter()
            session.ctx.world.save_async(session.trainee, run_dir / "writer-warmup")
            session.ctx.world.checkpoint_poll(True)
            startup_s = time.perf_counter() - t0
            periodic.begin = timed(periodic.begin, "begin")
            periodic.poll = timed(periodic.poll, "poll")
            periodic.finish = timed(periodic.finish, "finish")
        while not session.finished:
            t0 = time.perf_counter()
            with session.step():
                loss = train_step(session.trainee)
                session.step_done(loss)
            if i < args.steps:
                times.append(time.perf_counter() - t0)
                losses.append(loss)
            i += 1
        generation = session.generation
    if generation != 0:
        raise RuntimeError(f"the world changed during the loop (generation {generation})")
    done = sorted(p.name for p in (run_dir / "checkpoint" / "periodic").glob("iter_*"))
    return {"step_s": times, "losses": losses, "held_s": held, "saves_at": saves,
            "kept": done, "writer_startup_s": startup_s}


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    rank = args.child
    out: dict[str, Any] = {"rank": rank, "rounds": []}
    for r in range(args.rounds):
        order = ("off", "on") if r % 2 == 0 else ("on", "off")
        res: dict[str, Any] = {}
        for mode in order:
            every = args.every if mode == "on" else 0
            run_dir = Path(args.run_dir) / f"r{r}-{mode}"
            res[mode] = loop(args, rank, every, f"{args.run}-{r}-{mode}", run_dir)
            if rank == 0:  # free the disk between loops (saves are GBs for gpt-125m)
                shutil.rmtree(run_dir / "checkpoint", ignore_errors=True)
                shutil.rmtree(run_dir / "writer-warmup", ignore_errors=True)
        out["rounds"].append(res)
    Path(args.run_dir, f"rank{rank}.json").write_text(json.dumps(out))


def summarize(ranks: list[dict[str, Any]], every: int) -> dict[str, Any]:
    """The world's step time is the slower rank's; held time the larger rank's."""
    out: dict[str, Any] = {}
    for mode in ("off", "on"):
        steps: list[float] = []
        for r in range(len(ranks[0]["rounds"])):
            per_rank = [rk["rounds"][r][mode]["step_s"] for rk in ranks]
            steps += [max(v) for v in zip(*per_rank, strict=True)]
        out[mode] = {"steps": len(steps), "mean_s": statistics.fmean(steps),
                     "median_s": statistics.median(steps), "min_s": min(steps),
                     "stdev_s": statistics.stdev(steps) if len(steps) > 1 else 0.0}
    rounds = ranks[0]["rounds"]
    saves = sum(len(r["on"]["saves_at"]) for r in rounds)
    held = {k: max(sum(r["on"]["held_s"][k] for r in rk["rounds"]) for rk in ranks)
            for k in ("begin", "poll", "finish")}
    total_held = sum(held.values())
    off, on = out["off"], out["on"]
    extra = on["mean_s"] * on["steps"] - off["mean_s"] * off["steps"]
    out.update(
        per_step_cost=extra / (max(1, saves) * every * off["mean_s"]),
        writer_startup_s=max(r["on"]["writer_startup_s"] for rk in ranks for r in rk["rounds"]),
        ratio_mean=on["mean_s"] / off["mean_s"],
        ratio_median=on["median_s"] / off["median_s"],
        saves=saves,
        saves_at=rounds[0]["on"]["saves_at"],
        kept=rounds[0]["on"]["kept"],
        held_per_save_s={k: v / max(1, saves) for k, v in held.items()},
        held_fraction=(total_held / max(1, saves)) / (every * off["mean_s"]),
        same_losses=all(r["off"]["losses"] == r["on"]["losses"] for r in rounds),
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-125m")
    ap.add_argument("--seq", type=int, default=None,
                    help="sequence length (default 128 for gpt-125m; 0: the model's own)")
    ap.add_argument("--global-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=100, help="timed steps per loop")
    ap.add_argument("--every", type=int, default=50, help="checkpoint interval (steps)")
    ap.add_argument("--rounds", type=int, default=1, help="off+on repetitions")
    ap.add_argument("--timeout", type=float, default=3000.0)
    ap.add_argument("--json", action="store_true")
    add_child_arguments(ap)
    args = ap.parse_args()
    if args.seq is None:
        args.seq = 128 if args.model == "gpt-125m" else 0
    if args.child is not None:
        child(args)
        return
    if args.every < 1 or args.steps < args.every:
        ap.error("--steps must cover at least one --every interval")

    from etcslurm.parent_death import die_with_parent
    from etcslurm.redis_host.server import BundledRedis

    load0 = os.getloadavg()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="etcslurm-ckpt-cost-") as tmp:
        server = BundledRedis(Path(tmp) / "coord").start()
        try:
            base = [sys.executable, os.path.abspath(__file__), "--model", args.model,
                    "--seq", str(args.seq), "--global-batch", str(args.global_batch),
                    "--steps", str(args.steps), "--every", str(args.every),
                    "--rounds", str(args.rounds), "--redis", server.url_with_password,
                    "--run", f"ckpt-cost-{secrets.token_hex(3)}", "--run-dir", tmp]
            # workers trap SIGTERM (a leave): they die with us
            ranks = run_rank_processes(base, WORLD, tmp, args.timeout,
                                       preexec_fn=die_with_parent)
        finally:
            server.stop()
    wall = time.perf_counter() - t0
    load1 = os.getloadavg()
    s = summarize(ranks, args.every)
    spec = _spec(args)
    if args.json:
        print(json.dumps({"model": args.model, "seq": spec.seq, "global_batch": args.global_batch,
                          "steps": args.steps, "every": args.every, "rounds": args.rounds,
                          "load_avg_before": load0, "load_avg_after": load1,
                          "cpus": os.cpu_count(), "wall_s": wall, **s}, indent=1))
        return
    print(f"periodic checkpoint cost: {spec.name} (seq {spec.seq}), {WORLD} CPU workers "
          f"(gloo, tp1pp1dp{WORLD}), global batch {args.global_batch}, adam, "
          f"{args.rounds} x {args.steps} timed steps each way, checkpoint every {args.every}")
    for mode, label in (("off", "without checkpoints"), ("on", f"checkpoint every {args.every}")):
        m = s[mode]
        print(f"  {label:24s} mean {m['mean_s'] * 1e3:8.1f} ms  median "
              f"{m['median_s'] * 1e3:8.1f} ms  min {m['min_s'] * 1e3:8.1f} ms  stdev "
              f"{m['stdev_s'] * 1e3:7.1f} ms  ({m['steps']} steps)")
    h = s["held_per_save_s"]
    print(f"  saves started after steps {s['saves_at']} (round 1), {s['saves']} in all; kept "
          f"{s['kept']}")
    print(f"  loop held per save: start {h['start']:.3f} s, poll/finalise {h['poll']:.3f} s, "
          f"finish {h['finish']:.3f} s = {s['held_fraction'] * 100:.2f} % of the steps "
          f"between two saves")
    print(f"  writer start-up (once per worker, before the timed steps): "
          f"{s['writer_startup_s']:.2f} s")
    print(f"  mean step with / without: {s['ratio_mean']:.4f}, median {s['ratio_median']:.4f}")
    print(f"per-step cost of a checkpoint every {args.every} steps: "
          f"{s['per_step_cost'] * 100:+.2f} % of a step (goal <= 2 %)")
    print(f"same losses both ways: {s['same_losses']}; load average {load0[0]:.1f} before, "
          f"{load1[0]:.1f} after (1 min), on {os.cpu_count()} cores; wall {wall:.0f} s")


if __name__ == "__main__":
    main()
