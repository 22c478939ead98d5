"""Training pause per resize, phase by phase: etcslurm's elastic resize vs restart-and-reload.

All in one run, on the same job (local CPU workers, gloo, one bundled Redis):

* **elastic** (``etcslurm demo``): one worker is signalled (a DP shrink), later one worker
  joins (a DP grow), then an operator asks for another TP/PP layout (``etcslurm resize
  --to``).  The pause of each is ``pause_seconds`` of its ``migration.done`` event: from
  the boundary that decided the change (from the signal on the signalled worker) to the
  new rank 0 ready to train, with the phases it went through:

  ``decide`` (boundary vote, publish, read the record), ``read`` (the old state's views),
  ``world`` (the new default group), ``groups`` (megatron's groups), ``xgroup`` (the
  exchange group), ``build`` (the new model, or the kept one re-wrapped, and the
  description of its state), ``plan``, ``fill`` (holdings check, arena, fill check),
  ``exchange``, ``close`` (the exchange group released), ``commit`` (scalars + the new
  world's barrier) and ``other`` (the rest: bookkeeping around the migration).  With
  ``ETCSLURM_LOG=INFO`` and ``--run-dir`` every worker's log has its own phases.
* **restart-and-reload** (what torchrun-style elasticity does): every worker is
  signalled, the job writes a megatron-core ``dist_checkpointing`` checkpoint and exits,
  a new set of processes starts, imports, rebuilds and loads the checkpoint resharded;
  the pause is from the signal to the first step of the restarted job.

Goals: DP shrink pause <= 0.1 s and >= 30x shorter than restart-and-reload; any other
change <= its exchange + 0.15 s.

Run: ``python benchmarks/resize_pause.py [--model gpt-tiny] [--workers 4] [--to tp2pp1dp2]``.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from rich.console import Console
from rich.table import Table

from etcslurm.coord.client import connect
from etcslurm.coord.coordinator import Coordinator
from etcslurm.coord.records import ChangeRequest
from etcslurm.core.layout import ParallelConfig
from etcslurm.local.launcher import DemoOptions, DemoResult, run_demo
from etcslurm.redis_host.server import BundledRedis

#: table columns: (title, the phases of migration.done it sums)
COLUMNS = (
    ("decide", ("decide",)),
    ("read", ("read",)),
    ("form groups", ("world", "groups", "group")),
    ("build", ("build", "describe")),
    ("plan", ("plan",)),
    ("fill", ("prepare",)),
    ("exchange", ("exchange",)),
    ("close", ("close",)),
    ("commit", ("commit",)),
)
SHRINK_GOAL_S = 0.1  # a DP shrink's whole pause
OVER_EXCHANGE_GOAL_S = 0.15  # any other change: its pause beyond its exchange
RATIO_GOAL = 30.0


def kind_of(src: str, dst: str) -> str:
    a, b = ParallelConfig.parse(src), ParallelConfig.parse(dst)
    if (a.tp, a.pp) != (b.tp, b.pp):
        return "TP/PP change"
    return "DP shrink" if b.dp < a.dp else "DP grow" if b.dp > a.dp else "same layout"


def elastic_run(args: argparse.Namespace, url: str, pw: str, run_dir: Path) -> DemoResult:
    """The demo with a leave, a join and, once both are done, an operator request."""
    run_id = f"pause-{int(time.time())}"
    opts = DemoOptions(model=args.model, workers=args.workers, steps=args.steps,
                       schedule="3:leave=1;6:join=1", redis=url, password_file=pw,
                       run_id=run_id, run_dir=str(run_dir), reference=False,
                       global_batch=12, min_step_seconds=args.min_step, keep_keys_s=5)
    box: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: box.update(result=run_demo(opts)), daemon=True)
    runner.start()
    coord = Coordinator(connect(url, pw), run_id)
    last, done, asked = "0", 0, False
    while runner.is_alive():
        for ev in coord.read_events(last, block_ms=200):
            last = ev["id"]
            if ev["type"] == "migration.done":
                done += 1
            if ev["type"] == "step" and done >= 2 and not asked:
                coord.request_change(ChangeRequest(to=args.to, drain=(), by="operator",
                                                   ts=time.time(), reason="resize_pause"))
                asked = True
    runner.join()
    return box["result"]


def restart_run(args: argparse.Namespace, url: str, pw: str, run_dir: Path
                ) -> tuple[float, float, Any]:
    """(signal → every process gone, start → first step, step resumed at)."""
    base = dict(model=args.model, workers=args.workers, steps=14, reference=False,
                global_batch=12, redis=url, password_file=pw, keep_keys_s=5)
    first = run_demo(DemoOptions(**base, schedule=f"4:leave={args.workers}",
                                 run_dir=str(run_dir), run_id=f"restart-a-{int(time.time())}"))
    signal_ts = next(g["signal_ts"] for g in first.generations if "signal_ts" in g)
    t_restart = time.time()
    second = run_demo(DemoOptions(**base, schedule="", run_dir=str(run_dir),
                                  run_id=f"restart-b-{int(time.time())}"))
    first_step_ts = second.generations[0].get("first_step_ts")
    resumed = min(second.losses) if second.losses else None
    down = t_restart - signal_ts
    up = first_step_ts - t_restart if first_step_ts else float("nan")
    return down, up, resumed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--to", default="tp2pp1dp2", help="the TP/PP layout the operator asks for")
    ap.add_argument("--min-step", type=float, default=0.4,
                    help="pace steps (s) so the joiner's imports finish before the run does")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    ap.add_argument("--write-results", action="store_true",
                    help="write docs/results/resize_pause.md")
    ap.add_argument("--run-dir", metavar="DIR",
                    help="keep the runs' logs here (each worker's phases with ETCSLURM_LOG=INFO)")
    ap.add_argument("--no-restart", action="store_true",
                    help="skip the restart-and-reload baseline (quicker, no ratio)")
    args = ap.parse_args()
    console = Console(width=200)
    with TemporaryDirectory() as tmp, BundledRedis(Path(tmp) / "redis") as server:
        url, pw = server.url, str(server.password_file)
        runs = Path(args.run_dir) if args.run_dir else Path(tmp)
        elastic = elastic_run(args, url, pw, runs / "elastic")
        down, up, resumed = (float("nan"), float("nan"), None) if args.no_restart else (
            restart_run(args, url, pw, runs / "restart"))
    restart = down + up

    table = Table(title=f"pause per resize, {args.model}, {args.workers} CPU workers "
                        f"(seconds; new rank 0)")
    for title in ("change", "pause", *(c for c, _ in COLUMNS), "other", "kept", "moved B"):
        table.add_column(title, justify="left" if title == "change" else "right")
    rows = []
    for m in elastic.migrations:
        phases, pause = m.get("phases") or {}, m.get("pause_seconds")
        if pause is None:
            continue
        cols = [sum(float(phases.get(p, 0.0)) for p in ps) for _, ps in COLUMNS]
        other = pause - sum(cols)
        kind = kind_of(m["from"], m["to"])
        rows.append(dict(kind=kind, src=m["from"], dst=m["to"], pause=pause, phases=phases,
                         moved=m.get("moved_bytes"), other=other))
        table.add_row(f"{kind} {m['from']} → {m['to']}", f"{pause:.3f}",
                      *(f"{c:.3f}" for c in cols), f"{other:.3f}",
                      "yes" if phases.get("kept") else "no", str(m.get("moved_bytes")))
    if not args.no_restart:
        table.add_row("restart-and-reload (checkpoint + new processes)", f"{restart:.2f}",
                      *([""] * len(COLUMNS)), "", "", "")
    console.print(table)
    if not args.no_restart:
        console.print(f"restart-and-reload: save+exit {down:.2f} s, start+load {up:.2f} s, "
                      f"resumed at step {resumed}")
    shrink = [r for r in rows if r["kind"] == "DP shrink"]
    for r in shrink:
        if args.no_restart:
            console.print(f"DP shrink {r['src']} → {r['dst']}: pause {r['pause']:.3f} s")
            continue
        ratio = restart / r["pause"]
        met = r["pause"] <= SHRINK_GOAL_S
        console.print(f"DP shrink {r['src']} → {r['dst']}: pause {r['pause']:.3f} s "
                      f"(goal ≤ {SHRINK_GOAL_S} s: {'met' if met else 'NOT met'}), "
                      f"restart ÷ pause = {ratio:.1f}× (goal ≥ {RATIO_GOAL:.0f}×: "
                      f"{'met' if ratio >= RATIO_GOAL else 'NOT met'})")
    for r in rows:
        if r["kind"] == "DP shrink":
            continue
        exchange = float(r["phases"].get("exchange", 0.0))
        over = r["pause"] - exchange
        met = over <= OVER_EXCHANGE_GOAL_S
        console.print(f"{r['kind']} {r['src']} → {r['dst']}: pause − exchange = {over:.3f} s "
                      f"(goal ≤ {OVER_EXCHANGE_GOAL_S} s: {'met' if met else 'NOT met'})")
    data = dict(rows=rows, restart=restart, down=down, up=up)
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))
    if args.write_results:
        from etcslurm.bench.results import markdown_table, write_results

        lines = []
        for r in rows:
            exchange = float(r["phases"].get("exchange", 0.0))
            ratio = f"{restart / r['pause']:.0f}×" if not args.no_restart else "–"
            lines.append([f"{r['kind']} {r['src']} → {r['dst']}", f"{r['pause']:.3f} s",
                          f"{exchange:.3f} s", f"{r['pause'] - exchange:.3f} s", ratio])
        if not args.no_restart:
            lines.append(["restart-and-reload (checkpoint, new processes, load)",
                          f"{restart:.2f} s", "", "", ""])
        print(write_results("resize_pause", markdown_table(
            ["change", "pause", "exchange", "pause − exchange", "restart ÷ pause"], lines),
            data, title=f"Training pause per resize ({args.model}, {args.workers} CPU workers)"))


if __name__ == "__main__":
    main()
