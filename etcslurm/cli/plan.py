"""``etcslurm plan``: show what a resize would move, before it happens."""

from __future__ import annotations

import argparse
import json
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="plan a layout change: assignment, bytes moved, messages, rounds",
        description="Plan the state migration of a GPT model from one TPxPPxDP layout to "
        "another when devices leave or join. Device ids are the old global ranks; joiners "
        "are join:0..N-1.",
    )
    p.add_argument("--model", required=True, help="gpt-tiny|gpt-125m|gpt-1.3b|gpt-7b|gpt-70b "
                   "or layers=..,hidden=..,heads=..,vocab=..,seq=..[,ffn=..]")
    p.add_argument("--from", dest="old", required=True, help="old layout, e.g. tp2pp2dp4")
    p.add_argument("--to", dest="new", required=True, help="new layout, e.g. tp2pp2dp3")
    p.add_argument("--leave", default="", help="old ranks that leave, e.g. 4-7,9")
    p.add_argument("--join", type=int, default=0, help="number of joining devices")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--optimizer", default="adam", help="adam | distributed")
    p.add_argument("--staging-mb", type=float, default=512.0,
                   help="staging cap per device and round, MiB")
    p.add_argument("--part-of", metavar="DEVICE", default=None,
                   help="also plan only DEVICE's own part of the move, as each rank does "
                   "at a resize (its messages, copies and missing pieces, with the whole "
                   "plan's assignment), and report its time and size")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def run(args: argparse.Namespace) -> int:
    from etcslurm.core.layout import ParallelConfig, parse_ranges
    from etcslurm.core.layout_choice import LayoutRules
    from etcslurm.core.memory import TrainingSetup
    from etcslurm.core.models import GPTSpec
    from etcslurm.core.plan import plan
    from etcslurm.errors import UsageError
    from etcslurm.megatron_state.planning import gpt_inputs

    spec = GPTSpec.parse(args.model)
    old = ParallelConfig.parse(args.old)
    new = ParallelConfig.parse(args.new)
    # an invalid layout's error lists the ones `etcslurm layouts` shows as fitting
    rules = LayoutRules(setup=TrainingSetup(optimizer=args.optimizer),
                        gpus_per_node=max(1, args.gpus_per_node))
    old.validate(spec, rules=rules)
    new.validate(spec, rules=rules)
    if args.join < 0:
        raise UsageError(f"--join must be >= 0, got {args.join}")
    if args.gpus_per_node < 1:
        raise UsageError(f"--gpus-per-node must be >= 1, got {args.gpus_per_node}")
    if args.staging_mb <= 0:
        raise UsageError(f"--staging-mb must be positive, got {args.staging_mb}")
    leaving = parse_ranges(args.leave)
    bad = [r for r in leaving if r >= old.world_size]
    if bad:
        raise UsageError(
            f"--leave: device {bad[0]} is out of range 0-{old.world_size - 1} for {old}"
        )
    remaining = old.world_size - len(leaving) + args.join
    if remaining != new.world_size:
        raise UsageError(
            f"device counts do not add up: {old.world_size} old - {len(leaving)} leaving + "
            f"{args.join} joining = {remaining}, but {new} needs {new.world_size}"
        )
    inputs = gpt_inputs(spec, old, new, [str(r) for r in leaving], args.join,
                        args.gpus_per_node, args.optimizer, int(args.staging_mb * 2**20))
    if args.part_of is not None and args.part_of not in (*inputs.old_device_class,
                                                         *inputs.joiners):
        raise UsageError(f"--part-of: {args.part_of!r} is not a device of this plan (old "
                         f"ranks 0-{old.world_size - 1}, joiners join:0..)")
    result = plan(inputs)
    part = None
    if args.part_of is not None:
        mine = plan(inputs, result.assignment, for_device=args.part_of)
        part = {"device": args.part_of, "plan_seconds": mine.stats["plan_seconds"],
                "messages": mine.stats["messages"],
                "own_messages": sum(args.part_of in (m.src, m.dst) for m in mine.messages)}
    if args.json:
        out = dict(result.stats)
        if part is not None:
            out["part_of"] = part
        out.update(model=str(spec), old=str(old), new=str(new), optimizer=args.optimizer,
                   assignment={str(r): d for r, d in enumerate(result.assignment)},
                   idle=result.idle)
        sys.stdout.write(json.dumps(out, sort_keys=True) + "\n")
        return 0
    _print_human(result, spec, old, new, args)
    if part is not None:
        print(f"{part['device']}'s own part: planned in {part['plan_seconds']:.3f} s, "
              f"{part['messages']} messages ({part['own_messages']} to or from it)")
    return 0


def _print_human(result, spec, old, new, args) -> None:
    from rich.console import Console
    from rich.table import Table

    s = result.stats
    console = Console()
    t = Table(title=f"etcslurm plan: {spec} {old} → {new} ({args.optimizer})")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    for key in ("state_bytes", "needed_bytes", "local_bytes", "moved_bytes",
                "lower_bound_moved_bytes", "naive_moved_bytes", "inter_node_bytes",
                "missing_bytes", "max_send_bytes", "max_recv_bytes", "peak_staging_bytes"):
        t.add_row(key, _human(s[key]))
    t.add_row("messages", str(s["messages"]))
    t.add_row("rounds", str(s["rounds"]))
    t.add_row("plan_seconds", f"{s['plan_seconds']:.3f}")
    console.print(t)
    a = Table(title="assignment (new rank → device)")
    a.add_column("new rank", justify="right")
    a.add_column("tp,pp,dp" + (",ep" if new.ep > 1 else ""))
    a.add_column("device")
    shown = result.assignment if len(result.assignment) <= 64 else result.assignment[:64]
    for r, d in enumerate(shown):
        c = new.coord(r)
        ep = f",{new.expert_coord(r).ep}" if new.ep > 1 else ""
        a.add_row(str(r), f"{c.tp},{c.pp},{c.dp}{ep}", d)
    console.print(a)
    if len(result.assignment) > 64:
        console.print(f"... {len(result.assignment) - 64} more ranks (use --json for all)")
    if result.idle:
        console.print(f"idle devices: {', '.join(result.idle)}")
