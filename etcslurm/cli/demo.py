"""``etcslurm demo``: the main job on the embedded default (no cluster, no GPU).

Starts the bundled Redis, spawns local CPU workers (gloo) that train a megatron-core GPT on
deterministic synthetic data, applies the resize schedule with real signals and real new
processes, shows the live monitor, and ends with a summary that compares the loss curve
with a run that never resized.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from typing import Any

from etcslurm.errors import EtcslurmError


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="run an elastic training job locally (bundled Redis, CPU workers)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workers", type=int, default=4, help="initial worker processes (default 4)")
    p.add_argument("--model", default="gpt-tiny",
                   help="model preset or spec layers=..,hidden=..,heads=..,vocab=..,seq=.. "
                        "(default gpt-tiny)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="params dtype (default: the model's own)")
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument("--schedule", default="15:leave=1;30:join=2;45:leave=2",
                   help="resizes as STEP:leave=N / STEP:join=N / STEP:kill=N, ';'-separated "
                        "(default %(default)s; '' for none)")
    p.add_argument("--optimizer", choices=("adam", "distributed"), default="adam")
    p.add_argument("--vpp", type=int, default=1, metavar="N",
                   help="model chunks per pipeline stage (an interleaved pipeline): the "
                        "policy prefers layouts with pp > 1 and gives each stage N chunks "
                        "(default 1)")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="a megatron-core checkpoint every N steps, written while training "
                        "goes on; state lost with a dead worker rolls back to the last one "
                        "(default 0: none, such a loss stops the run)")
    p.add_argument("--global-batch", type=int, default=12,
                   help="samples per step, kept constant across layouts (default 12)")
    p.add_argument("--gpus-per-node", type=int, default=2,
                   help="workers per simulated node (default 2)")
    p.add_argument("--redis", metavar="URL", help="use this coordinator instead of the bundled one")
    p.add_argument("--password-file", help="password for --redis")
    p.add_argument("--run", dest="run_id", help="run id (default demo-<time>-<pid>)")
    p.add_argument("--run-dir", help="logs, data positions, summary (default ./runs/<run id>)")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the reference run without resizes")
    p.add_argument("--no-monitor", action="store_true", help="do not show the live monitor")
    p.add_argument("--json", action="store_true", help="print the summary as JSON only")
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from etcslurm.local.launcher import DemoOptions, LocalRun, run_demo

    opts = DemoOptions(
        workers=args.workers, model=args.model, dtype=args.dtype, steps=args.steps, schedule=args.schedule,
        redis=args.redis, password_file=args.password_file, run_dir=args.run_dir,
        run_id=args.run_id,
        optimizer=args.optimizer, global_batch=args.global_batch,
        gpus_per_node=args.gpus_per_node, reference=not args.no_reference,
        timeout=args.timeout, checkpoint_every=args.checkpoint_every, vpp=args.vpp,
    )
    console = Console(stderr=True)
    monitor: list[subprocess.Popen[bytes]] = []
    show_monitor = not args.no_monitor and not args.json

    def on_tick(run: LocalRun) -> None:
        if show_monitor and not monitor:
            cmd = [sys.executable, "-m", "etcslurm", "monitor", "--run", run.run_id,
                   "--run-dir", str(run.run_dir)]
            if opts.redis:
                cmd += ["--redis", opts.redis]
                if opts.password_file:
                    cmd += ["--password-file", opts.password_file]
            monitor.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))

    def _terminate(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt  # run the cleanup below (workers, Redis, monitor)

    signal.signal(signal.SIGTERM, _terminate)
    quiet = args.json or show_monitor  # the monitor owns the terminal while it runs
    say = (lambda msg: None) if quiet else (lambda msg: console.print(f"[dim]{msg}[/]"))
    try:
        result = run_demo(opts, progress=say, on_tick=on_tick)
    finally:
        for proc in monitor:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        out = Console()
        print_summary(result, out if out.is_terminal else Console(width=110))
    if result.loss_match is False:
        raise EtcslurmError(
            f"loss curve differs from the reference by {result.max_loss_diff:.3g} "
            f"(tolerance {result.to_json()['loss_tolerance']})"
        )
    return 0


def print_summary(result: Any, console: Any) -> None:
    """A rich table per generation plus the loss comparison."""
    from rich import box
    from rich.table import Table

    table = Table(title=f"etcslurm demo {result.run_id}: {len(result.losses)} steps "
                        f"in {result.seconds:.1f} s", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("gen", justify="right")
    table.add_column("step", justify="right")
    table.add_column("layout", no_wrap=True, min_width=22)
    table.add_column("ranks", justify="right")
    table.add_column("-/+", justify="right")
    table.add_column("moved", justify="right")
    table.add_column("migr.", justify="right")
    table.add_column("pause", justify="right")
    migrations = {m.get("gen"): m for m in result.migrations}
    for g in result.generations:
        m = migrations.get(g.get("generation"), {})
        layout = g.get("to") if not g.get("from") else f"{g['from']}→{g['to']}"
        pause = m.get("pause_seconds")
        table.add_row(
            str(g.get("generation")), str(g.get("step")), str(layout), str(g.get("world")),
            f"-{len(g.get('leaving') or [])}/+{len(g.get('joining') or [])}"
            if g.get("from") else "",
            _bytes(m.get("moved_bytes")) if m else "-",
            f"{m['seconds']:.2f}s" if m.get("seconds") is not None else "-",
            f"{pause:.2f}s" if pause is not None else "-",
        )
    console.print(table)
    if result.losses:
        last = max(result.losses)
        console.print(f"loss: step 1 {result.losses.get(1, float('nan')):.4f} → step {last} "
                      f"{result.losses[last]:.4f}")
    if result.loss_match is not None:
        verdict = "[green]equal[/]" if result.loss_match else "[red]DIFFERENT[/]"
        console.print(
            f"loss curve vs reference run without resizes: {verdict} "
            f"(max |Δ| {result.max_loss_diff:.2e}, tolerance "
            f"{result.to_json()['loss_tolerance']:.0e})"
        )
    console.print(f"run directory: {result.run_dir}")


def _bytes(n: Any) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
