"""What a rank-local plan would cost: the plan of one pipeline stage's part against the
whole plan (issue 17: "does each rank need the whole plan, or only its own messages plus
the assignment?").

For a change that keeps TP and PP (e.g. tp8pp8dp128 → tp8pp8dp96), no state crosses a
pipeline stage except tied embeddings, so the planning problem falls apart into one part
per stage (TP ranks of a stage are tied together by the TP-replicated norms and biases,
whose distributed-optimizer shards sit on every TP rank).  This benchmark plans the whole
problem once, then each chosen stage's part alone -- its old devices, its new ranks with
the whole plan's assignment, and the devices assigned to them from elsewhere as holders
of nothing -- and prints, side by side, the part's CPU time and whether its messages
(rounds included) are the whole plan's messages to those ranks, byte for byte.

Run: ``python benchmarks/plan_components.py [--model gpt-70b] [--pattern dp|stage]
[--optimizer distributed|adam] [--stages 0,3,6,7]``.
"""

from __future__ import annotations

import argparse
import json
import time

from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import PRESETS
from etcslurm.core.planner import MigrationPlan, PlanInputs, gpt_inputs, plan

OLD, NEW = ParallelConfig(8, 8, 128), ParallelConfig(8, 8, 96)


def leavers(pattern: str) -> list[str]:
    """Whole DP replicas (``dp``) or the last two pipeline stages (``stage``)."""
    if pattern == "dp":
        return [str(r) for r in range(OLD.world_size) if OLD.coord(r).dp >= NEW.dp]
    return [str(r) for r in range(NEW.world_size, OLD.world_size)]


def stage_part(inputs: PlanInputs, whole: MigrationPlan, pp: int) -> tuple[PlanInputs, list[str]]:
    """The inputs of pipeline stage ``pp``'s part, renumbered, and its ranks' devices."""
    devices = [d for d in inputs.old_device_class if OLD.coord(int(d)).pp == pp]
    ranks = [r for r in range(NEW.world_size) if NEW.coord(r).pp == pp]
    given = [whole.assignment[r] for r in ranks]
    mine = set(devices)
    elsewhere = sorted({d for d in given if d not in mine}, key=int)
    old_cls = sorted({inputs.old_device_class[d] for d in devices})
    new_cls = sorted({inputs.new_rank_class[r] for r in ranks})
    old_blk = sorted({b for c in old_cls for b in inputs.old_class_blocks[c]})
    new_blk = sorted({b for c in new_cls for b in inputs.new_class_blocks[c]})
    ob, nb = ({b: i for i, b in enumerate(x)} for x in (old_blk, new_blk))
    oc, nc = ({c: i for i, c in enumerate(x)} for x in (old_cls, new_cls))
    part = PlanInputs(
        old_device_class={d: oc[inputs.old_device_class[d]] for d in devices},
        new_rank_class=[nc[inputs.new_rank_class[r]] for r in ranks],
        nodes={d: inputs.nodes[d] for d in [*devices, *elsewhere]},
        leaving=[d for d in inputs.leaving if d in mine],
        joiners=elsewhere,  # their old state is another stage's: they hold nothing here
        staging_bytes=inputs.staging_bytes, tp=inputs.tp,
        old_blocks=[inputs.old_blocks[b] for b in old_blk],
        old_class_blocks=[[ob[b] for b in inputs.old_class_blocks[c]] for c in old_cls],
        new_blocks=[inputs.new_blocks[b] for b in new_blk],
        new_class_blocks=[[nb[b] for b in inputs.new_class_blocks[c]] for c in new_cls],
    )
    return part, given


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt-70b", choices=sorted(PRESETS))
    ap.add_argument("--pattern", default="dp", choices=("dp", "stage"))
    ap.add_argument("--optimizer", default="distributed", choices=("distributed", "adam"))
    ap.add_argument("--stages", default="0,3,6,7", help="pipeline stages to plan alone")
    args = ap.parse_args()
    inputs = gpt_inputs(PRESETS[args.model], OLD, NEW, leavers(args.pattern), 0, 8,
                        args.optimizer)
    c0 = time.process_time()
    whole = plan(inputs)
    whole_s = time.process_time() - c0
    print(f"{args.model}, {OLD} → {NEW}, {args.pattern} leave, {args.optimizer} optimizer: "
          f"whole plan {whole_s:.2f} s CPU, {len(whole.messages)} messages")
    print(f"{'stage':>5} {'devices':>7} {'ranks':>5} {'cpu_s':>6} {'÷whole':>6} "
          f"{'messages':>8}  same messages and rounds as the whole plan's")
    for pp in (int(s) for s in args.stages.split(",")):
        part, given = stage_part(inputs, whole, pp)
        c0 = time.process_time()
        result = plan(part, assignment=given)
        part_s = time.process_time() - c0
        to = set(given)
        expect = sorted(json.dumps(m.to_json()) for m in whole.messages if m.dst in to)
        got = sorted(json.dumps(m.to_json()) for m in result.messages)
        same = "yes" if expect == got else f"no ({len(expect)} in the whole plan)"
        print(f"{pp:>5} {len(part.old_device_class) + len(part.joiners):>7} {len(given):>5} "
              f"{part_s:>6.2f} {part_s / whole_s:>6.2f} {len(result.messages):>8}  {same}")


if __name__ == "__main__":
    main()
