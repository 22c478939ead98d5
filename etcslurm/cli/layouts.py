"""``etcslurm layouts``: every layout of a device count, its per-rank memory, whether it
fits and why not, and the one the layout policy picks."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "layouts",
        help="list the layouts of N devices: per-rank memory, fits or why not, the choice",
        description="List every TPxPPxDP layout of N devices for a model with the busiest "
        "rank's memory (params, fp32 grads, optimizer state, activations), whether it fits "
        "the device memory and the other rules (TP inside a node, the global batch, the "
        "allowed layouts) and why not, and the layout the runtime's policy picks.",
    )
    p.add_argument("--model", required=True, help="a preset (llama3-70b, gpt-7b, ...) or "
                   "layers=..,hidden=..,heads=..,vocab=..,seq=..[,...]")
    p.add_argument("--devices", type=int, required=True, help="number of devices")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-memory", default=None, metavar="SIZE",
                   help="memory per device: 80GB (10^9), 80GiB (2^30), 80e9 (default: no limit)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="samples per step (default: no batch rule; every stage runs as "
                   "many microbatches as 1F1B allows)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--optimizer", default="adam", help="adam | distributed")
    p.add_argument("--recompute", default="selective", help="none | selective | full")
    p.add_argument("--margin", type=float, default=None,
                   help="share of device memory kept free (default 0.1)")
    p.add_argument("--no-sequence-parallel", action="store_true",
                   help="activations without sequence parallelism (TP splits fewer of them)")
    p.add_argument("--allow", action="append", default=[], metavar="LAYOUT",
                   help="an allowed layout (tp8pp2dp4) or fixed sizes (tp=8, tp=8,pp=2); "
                   "repeatable; default: all")
    p.add_argument("--cp", type=int, default=1, metavar="N",
                   help="context-parallel size the recipe fixes (default 1)")
    p.add_argument("--vpp", type=int, default=1, metavar="N",
                   help="model chunks per pipeline stage the recipe fixes, where pp > 1 "
                        "(default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from etcslurm.core.layout_choice import LayoutFilter, LayoutRules
    from etcslurm.core.memory import DEFAULT_MARGIN, TrainingSetup, parse_bytes
    from etcslurm.core.models import GPTSpec
    from etcslurm.errors import UsageError

    spec = GPTSpec.parse(args.model)
    if args.devices < 1:
        raise UsageError(f"--devices must be at least 1, got {args.devices}")
    if args.gpus_per_node < 1:
        raise UsageError(f"--gpus-per-node must be at least 1, got {args.gpus_per_node}")
    if args.micro_batch < 1:
        raise UsageError(f"--micro-batch must be at least 1, got {args.micro_batch}")
    if args.global_batch is not None and (args.global_batch < 1
                                          or args.global_batch % args.micro_batch):
        raise UsageError(f"--global-batch must be a positive multiple of --micro-batch "
                         f"{args.micro_batch}, got {args.global_batch}")
    memory = None if args.gpu_memory is None else parse_bytes(args.gpu_memory)
    margin = DEFAULT_MARGIN if args.margin is None else args.margin
    if not 0 <= margin < 1:
        raise UsageError(f"--margin must be in [0, 1), got {margin}")
    setup = TrainingSetup(optimizer=args.optimizer, micro_batch=args.micro_batch,
                          global_batch=args.global_batch, recompute=args.recompute,
                          sequence_parallel=not args.no_sequence_parallel)
    rules = LayoutRules(setup=setup, gpus_per_node=args.gpus_per_node,
                        device_memory_bytes=memory, memory_margin=margin,
                        allowed=tuple(LayoutFilter.parse(a) for a in args.allow),
                        cp=args.cp, vpp=args.vpp)
    report = listing(args.devices, spec, rules)
    if args.json:
        sys.stdout.write(json.dumps(report, sort_keys=True) + "\n")
    else:
        _print_human(report)
    return 0


def listing(n_devices: int, spec: Any, rules: Any) -> dict[str, Any]:
    """The command's JSON: every layout of ``n_devices`` judged, and the policy's pick."""
    from etcslurm.core.layout_choice import NoLayoutFits, choose, layout_options

    options = layout_options(n_devices, spec, rules)
    try:
        decision = choose(n_devices, spec, rules)
    except NoLayoutFits as exc:
        decision, why = None, str(exc)
    else:
        why = decision.reason
    memory = None if decision is None else decision.memory
    setup = rules.setup
    return {
        "model": str(spec), "devices": n_devices, "gpus_per_node": rules.gpus_per_node,
        "device_memory_bytes": rules.device_memory_bytes, "usable_bytes": rules.usable_bytes,
        "margin": rules.memory_margin, "optimizer": setup.optimizer,
        "recompute": setup.recompute, "sequence_parallel": setup.sequence_parallel,
        "global_batch": setup.global_batch, "micro_batch": setup.micro_batch,
        "chosen": None if decision is None else str(decision.config),
        "per_rank_bytes": None if memory is None else memory.total,
        "breakdown": None if memory is None else memory.to_json(),
        "used_devices": 0 if decision is None else decision.used_devices,
        "idle_devices": [] if decision is None else list(decision.idle_devices),
        "reason": why,
        "layouts": [o.to_json() for o in options],
    }


def _print_human(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from etcslurm.core.memory import format_bytes

    def size(n: int | None) -> str:
        return "—" if n is None else format_bytes(n)

    def gib(n: int | None) -> str:
        return "—" if n is None else f"{n / 2**30:.1f}"

    limit = ("no memory limit" if report["device_memory_bytes"] is None else
             f"{size(report['device_memory_bytes'])} per device, "
             f"{size(report['usable_bytes'])} usable")
    console = Console()
    t = Table(title=f"etcslurm layouts: {report['model']} on {report['devices']} devices "
                    f"({report['gpus_per_node']} per node, {report['optimizer']}, "
                    f"recompute {report['recompute']}; {limit}); sizes in GiB per rank")
    t.add_column("layout", no_wrap=True)
    for name in ("params", "grads", "optim", "activ", "total"):
        t.add_column(name, justify="right", no_wrap=True)
    t.add_column("fits", no_wrap=True)
    t.add_column("why not", overflow="fold")
    for row in report["layouts"]:
        b = row["breakdown"] or {}
        chosen = row["layout"] == report["chosen"]
        style = "bold green" if chosen else (None if row["fits"] else "dim")
        t.add_row(row["layout"],
                  *(gib(b.get(k)) for k in ("params", "grads", "optimizer", "activations",
                                            "total")),
                  "chosen" if chosen else "yes" if row["fits"] else "no", row["why"] or "",
                  style=style)
    console.print(t)
    if report["chosen"] is None:
        console.print(f"[bold red]no layout fits:[/] {report['reason']}")
    else:
        console.print(f"chosen: [bold]{report['chosen']}[/] "
                      f"({size(report['per_rank_bytes'])} per rank): {report['reason']}")
