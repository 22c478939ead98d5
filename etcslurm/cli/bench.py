"""``etcslurm bench migrate``: P2P migration vs the checkpoint baseline on local processes."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from etcslurm.errors import UsageError


def register(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (migrate: P2P vs checkpoint)")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH", parser_class=type(bench))
    p = sub.add_parser(
        "migrate",
        help="migrate live megatron-core state P2P and by checkpoint; compare",
        description=(
            "Start the local processes (gloo), train a few steps in the old layout, then "
            "migrate the identical state peer to peer and through a dist_checkpointing "
            "checkpoint into the new layout, check both bit for bit and report."
        ),
    )
    p.add_argument("--model", default="gpt-125m", help="preset or layers=..,hidden=..,... spec")
    p.add_argument("--from", dest="source", default="tp2pp2dp2", help="old layout, e.g. tp2pp2dp2")
    p.add_argument("--to", dest="target", default="tp1pp2dp3", help="new layout, e.g. tp1pp2dp3")
    p.add_argument("--leave", default="", help="old ranks that leave, e.g. 6-7 or 3,5")
    p.add_argument("--join", type=int, default=0, metavar="N", help="devices that join")
    p.add_argument("--optimizer", choices=("adam", "distributed"), default="adam")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="params dtype (default: the model's own; bf16 keeps fp32 main params "
                        "and moments in the optimizer)")
    p.add_argument("--repeat", type=int, default=3, help="timed repetitions of each path")
    p.add_argument("--ckpt-dir", default=None, help="checkpoint folder (default: local temp)")
    p.add_argument("--steps-before", type=int, default=2)
    p.add_argument("--steps-after", type=int, default=2)
    p.add_argument("--seq", type=int, default=None, help="override the model's sequence length")
    p.add_argument("--global-batch", type=int, default=None)
    p.add_argument("--staging-mb", type=int, default=256, help="staging cap per device (MiB)")
    p.add_argument("--reference", action="store_true",
                   help="also train a never-migrated model in the new layout and compare")
    p.add_argument("--no-verify-global", action="store_true",
                   help="skip the independent check against the pre-migration state dump")
    p.add_argument("--no-refit", action="store_true",
                   help="skip megatron-core's refit (weights-only resharding), timed and "
                        "checked against P2P where it applies (same world size, nobody "
                        "leaves or joins)")
    p.add_argument("--live-plan", action="store_true",
                   help="plan from live descriptions of the state, as the runtime does for "
                        "a model etcslurm did not build (default: etcslurm's own GPT is "
                        "planned from its analytic state, as the runtime does)")
    p.add_argument("--weights-only", action="store_true",
                   help="move the model's weights alone (no optimizer state) and time it "
                        "against megatron-core's refit on the same transition and bytes "
                        "(one world: same world size, nobody leaving or joining)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per bounded wait")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_migrate)
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])


def _request(args: argparse.Namespace) -> Any:
    from etcslurm.bench.driver import MigrateRequest
    from etcslurm.core.layout import parse_ranges

    req = MigrateRequest(
        model=args.model, source=args.source, target=args.target,
        leave=parse_ranges(args.leave) if args.leave else [], join=args.join,
        optimizer=args.optimizer, repeat=args.repeat, ckpt_dir=args.ckpt_dir,
        steps_before=args.steps_before, steps_after=args.steps_after, seq=args.seq,
        global_batch=args.global_batch, staging_mb=args.staging_mb,
        reference=args.reference, verify_global=not args.no_verify_global,
        timeout=args.timeout, dtype=args.dtype, refit=not args.no_refit,
        live_plan=args.live_plan, weights_only=args.weights_only,
    )
    req.validate()
    return req


def _migrate(args: argparse.Namespace) -> int:
    req = _request(args)
    if req.ckpt_dir is not None:
        from pathlib import Path

        if not Path(req.ckpt_dir).is_dir():
            raise UsageError(f"--ckpt-dir {req.ckpt_dir}: not a directory")
    from etcslurm.bench.driver import run

    if args.json:
        report = run(req)
        print(json.dumps(report, indent=2))
    else:
        report = _run_with_progress(req, run)
        (_print_weights if req.weights_only else _print_table)(report)
    ok = (report["bit_exact"] and report.get("loss_match", True)
          and report.get("refit_equals_p2p") is not False)
    return 0 if ok else 1


def _run_with_progress(req: Any, run: Any) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task(f"{req.source} → {req.target}: starting processes")

        def poll(store: Any) -> None:
            phases = []
            n = 64
            keys = [f"progress/{i}" for i in range(n)] + [f"progress/join:{j}" for j in range(n)]
            present = [k for k in keys[: 2 * n] if _has(store, k)]
            for key in present:
                info = json.loads(store.get(key))
                phases.append(f"{info['device']}:{info['phase']}")
            if phases:
                progress.update(task, description=f"{req.source} → {req.target}: " + " ".join(phases[:8]))

        return run(req, poll=poll)


def _has(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:
        return False


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _print_weights(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{r['model']}: {r['from']} → {r['to']}, weights only "
                    f"(median of {r['repeat']})")
    t.add_column("path")
    t.add_column("seconds", justify="right")
    t.add_column("details")
    t.add_row("P2P", f"{r['p2p_seconds']:.3f}",
              f"plan {r['p2p_plan_seconds']:.3f} + exchange {r['p2p_exchange_seconds']:.3f}; "
              f"{_fmt_bytes(r['moved_bytes'])} moved of {_fmt_bytes(r['weight_bytes'])}")
    if r.get("refit_seconds") is not None:
        t.add_row("refit", f"{r['refit_seconds']:.3f}",
                  f"megatron-core swap_model_weights; P2P ÷ refit {r['p2p_vs_refit']:.2f}; "
                  f"weights equal P2P's: {'yes' if r['refit_equals_p2p'] else '[red]NO[/]'}")
    else:
        t.add_row("refit", "-", f"not run: {r.get('refit_skipped')}")
    Console().print(t)


def _print_table(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{r['model']}: {r['from']} → {r['to']} ({r['optimizer']}, "
                    f"{r['processes']} processes, median of {r['repeat']})")
    t.add_column("path")
    t.add_column("seconds", justify="right")
    t.add_column("details")
    t.add_row("P2P", f"{r['p2p_seconds']:.3f}",
              f"plan {r['p2p_plan_seconds']:.3f} + exchange {r['p2p_exchange_seconds']:.3f} + "
              f"restore {r['p2p_restore_seconds']:.3f}; {_fmt_bytes(r['moved_bytes'])} moved, "
              f"{r['p2p_gbps']:.2f} GB/s, peak staging {_fmt_bytes(r['peak_staging_bytes'])}")
    t.add_row("checkpoint", f"{r['checkpoint_seconds']:.3f}",
              f"save {r['checkpoint_save_seconds']:.3f} + load {r['checkpoint_load_seconds']:.3f}"
              f"; first save (writer start-up) {r['checkpoint_startup_seconds']:.3f}")
    t.add_row("speedup", f"{r['speedup']:.1f}×", f"state {_fmt_bytes(r['state_bytes'])}")
    if r.get("refit_seconds") is not None:
        warm = r.get("refit_warm_seconds")
        same = "yes" if r.get("refit_equals_p2p") else "[red]NO[/]"
        t.add_row("refit (weights only)", f"{r['refit_seconds']:.3f}",
                  "megatron-core swap_model_weights (gloo): plan + copy"
                  + (f"; cached plan {warm:.3f}" if warm is not None else "")
                  + f"; weights equal P2P's: {same}")
    elif r.get("refit_skipped"):
        t.add_row("refit (weights only)", "-", f"not run: {r['refit_skipped']}")
    if r.get("transport_seconds"):
        t.add_row("transport only", f"{r['transport_seconds']:.3f}",
                  f"the plan's buffers, nothing else; exchange ÷ this "
                  f"{r['exchange_vs_transport']:.2f}")
    if r.get("bound_seconds"):
        t.add_row("bound", f"{r['bound_seconds']:.3f}",
                  f"max received {_fmt_bytes(r['max_recv_bytes'])} ÷ one idle pair's "
                  f"{r['pair_gbps']:.2f} GB/s; exchange ÷ this {r['exchange_vs_bound']:.2f}")
    t.add_row("plan path", str(r["plan_path"]),
              "the runtime's path for this change" + (", on the new world" if r["on_world"]
                                                      else ", on an exchange group"))
    t.add_row("bit exact", "yes" if r["bit_exact"] else "[red]NO[/]",
              "P2P = checkpoint = pre-migration state, and everything else that shapes the "
              f"next update; after {r['steps_after']} steps every tensor still equal")
    t.add_row("loss match", "yes" if r["loss_match"] else "[red]NO[/]",
              f"{r['steps_after']} steps after: {r['losses_p2p']}")
    Console().print(t)
    sys.stdout.flush()
