"""Training pause per resize: etcslurm's elastic resize vs restart-and-reload.

Both on the same job (local CPU workers, gloo, a bundled Redis):

* **elastic**: ``etcslurm demo`` with one worker leaving and one joining; the pause is
  from the preemption signal to the first step of the new generation (``pause_seconds``
  of ``migration.done``);
* **restart-and-reload** (what torchrun-style elasticity does): every worker is
  signalled, the job writes a megatron-core ``dist_checkpointing`` checkpoint and exits,
  a new set of processes starts, imports, rebuilds and loads the checkpoint resharded;
  the pause is from the signal to the first step of the restarted job.

Run: ``python benchmarks/resize_pause.py [--model gpt-tiny] [--workers 4]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from etcslurm.runtime.launcher import DemoOptions, run_demo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=14)
    args = ap.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        base = dict(model=args.model, workers=args.workers, steps=args.steps, reference=False,
                    global_batch=12)
        elastic = run_demo(DemoOptions(**base, schedule="4:leave=1;8:join=1",
                                       run_dir=str(Path(tmp) / "elastic")))
        pauses = [m["pause_seconds"] for m in elastic.migrations if m.get("pause_seconds")]

        run_dir = str(Path(tmp) / "restart")
        first = run_demo(DemoOptions(**base, schedule=f"4:leave={args.workers}",
                                     run_dir=run_dir, run_id=f"restart-a-{int(time.time())}"))
        signal_ts = next(g["signal_ts"] for g in first.generations if "signal_ts" in g)
        ckpt = [g for g in first.generations if g.get("kind") == "checkpoint"]
        t_restart = time.time()
        second = run_demo(DemoOptions(**base, schedule="", run_dir=run_dir,
                                      run_id=f"restart-b-{int(time.time())}"))
        first_step_ts = second.generations[0].get("first_step_ts")
        resumed_at = min(second.losses) if second.losses else None
        down = t_restart - signal_ts  # signal → checkpoint written → every process gone
        restart = first_step_ts - t_restart if first_step_ts else float("nan")

    table = Table(title=f"pause per resize, {args.model}, {args.workers} CPU workers")
    table.add_column("path")
    table.add_column("pause (s)", justify="right")
    table.add_column("notes")
    for i, p in enumerate(pauses):
        m = elastic.migrations[i]
        phases = ", ".join(f"{k} {v:.2f}" for k, v in (m.get("phases") or {}).items())
        table.add_row(f"elastic resize {m.get('from')} → {m.get('to')}", f"{p:.2f}",
                      f"moved {m.get('moved_bytes')} B; phases (s): {phases}")
    table.add_row("restart-and-reload (checkpoint + new processes)", f"{down + restart:.2f}",
                  f"save+exit {down:.2f} s, start+load {restart:.2f} s, "
                  f"resumed at step {resumed_at} (checkpoint generation: {bool(ckpt)})")
    if pauses:
        table.add_row("ratio restart ÷ elastic (median)", f"{(down + restart) / sorted(pauses)[len(pauses) // 2]:.1f}×", "")
    console.print(table)


if __name__ == "__main__":
    main()
