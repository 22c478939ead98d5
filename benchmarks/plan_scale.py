"""Planner scale benchmark: plan time and peak memory at 1k-16k devices.

Run: ``python benchmarks/plan_scale.py [--optimizer adam|distributed|both]
[--pattern dp|stage|scatter|all] [--model gpt-70b|llama3-70b|all] [--max-devices N]``.

Targets, on one core: 8192 → 6144 devices < 1 s and < 1 GiB, 16384 → 12288
< 2 s, for gpt-70b and llama3-70b, every leave pattern, both optimizers; 32768 → 24576
(gpt-70b, ``--max-devices 32768``): the whole plan < 2 s, one rank's part < 0.5 s.

- ``dp``: whole DP replicas leave (dp index >= new dp), the common preemption case;
- ``stage``: whole pipeline stages leave (the last ranks; ``etcslurm plan --leave
  6144-8191`` for tp8pp8dp128 → tp8pp8dp96): their state must come from the leavers;
- ``scatter``: every 4th DP replica leaves (holes spread over the whole job).

Each case runs in a fresh subprocess, so ``rss_MiB`` (ru_maxrss) is that case's own peak
(inputs + plan).  ``cpu_s`` is the planner's own CPU time (``time.process_time``: the
machine this runs on is shared, so wall time ``plan_s`` says more about the neighbours
than about the planner); the load average is printed before and after.

``decide`` is what the decider plans before it publishes a resize
(:func:`etcslurm.runtime.generation.decider_plan`: the assignment and the whole move's
totals, the sources of one device's part only).  ``rank_s`` is what one rank replays at a
resize: the runtime plans only its own part
(``plan(inputs, assignment, for_device=device)``: its messages, copies and missing pieces,
byte-identical to its share of the whole plan); the slowest of a few sampled devices
(:func:`sample_devices`).  The table ends with summaries of ``cpu_s`` and ``rank_s`` per
case (markdown tables, as in ``docs/planning.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import PRESETS
from etcslurm.core.plan import plan
from etcslurm.megatron_state.planning import gpt_inputs
from etcslurm.runtime.generation import decider_plan

P = ParallelConfig
#: (model, old, new) per pattern; stage cases drop the last two old pipeline stages
#: (pp is the outermost rank index), e.g. ranks 6144-8191 of tp8pp8dp128 at 8k
CASES: dict[str, list[tuple[str, ParallelConfig, ParallelConfig]]] = {
    "dp": [
        ("gpt-70b", P(8, 8, 16), P(8, 8, 12)),       # 1k
        ("gpt-70b", P(8, 8, 64), P(8, 8, 48)),       # 4k
        ("gpt-70b", P(8, 8, 128), P(8, 8, 96)),      # 8k (target < 1 s)
        ("gpt-70b", P(8, 8, 256), P(8, 8, 192)),     # 16k (target < 2 s)
        ("gpt-70b", P(8, 8, 512), P(8, 8, 384)),     # 32k (target < 2 s)
        ("llama3-70b", P(8, 8, 128), P(8, 8, 96)),   # 8k
        ("llama3-70b", P(8, 8, 256), P(8, 8, 192)),  # 16k
    ],
    "stage": [
        ("gpt-70b", P(8, 8, 16), P(8, 8, 12)),       # 1k, leave 768-1023
        ("gpt-70b", P(8, 8, 128), P(8, 8, 96)),      # 8k, leave 6144-8191
        ("gpt-70b", P(8, 16, 128), P(8, 16, 96)),    # 16k, leave 12288-16383
        ("gpt-70b", P(8, 8, 512), P(8, 8, 384)),     # 32k, leave 24576-32767
        ("llama3-70b", P(8, 8, 128), P(8, 8, 96)),   # 8k, leave 6144-8191
        ("llama3-70b", P(8, 16, 128), P(8, 16, 96)),  # 16k, leave 12288-16383
    ],
    "scatter": [
        ("gpt-70b", P(8, 8, 128), P(8, 8, 96)),      # 8k, every 4th DP replica
        ("gpt-70b", P(8, 8, 256), P(8, 8, 192)),     # 16k
        ("llama3-70b", P(8, 8, 128), P(8, 8, 96)),   # 8k
    ],
}


def leavers(pattern: str, old: ParallelConfig, new: ParallelConfig) -> list[str]:
    """The old ranks that leave under ``pattern`` (see the module docstring)."""
    n = old.world_size
    if pattern == "dp":
        return [str(r) for r in range(n) if old.coord(r).dp >= new.dp]
    if pattern == "stage":
        return [str(r) for r in range(new.world_size, n)]  # pp is the outermost index
    assert pattern == "scatter"
    return [str(r) for r in range(n) if old.coord(r).dp % 4 == 3]


def sample_devices(assignment: list[str], leave: list[str]) -> list[str]:
    """Devices whose own part of the plan is timed: those of the first, a middle and the
    last new rank (the first and last pipeline stage, tied by the embedding, and one in
    between) and the last leaver (whose stage may have to be sent on whole)."""
    n = len(assignment)
    return list(dict.fromkeys([assignment[0], assignment[n // 2], assignment[-1],
                               *leave[-1:]]))


def one(opt: str, pattern: str, idx: int) -> dict:
    """Build the inputs and plan one case (in this process); its measurements."""
    model, old, new = CASES[pattern][idx]
    leave = leavers(pattern, old, new)
    t0 = time.perf_counter()
    inputs = gpt_inputs(PRESETS[model], old, new, leave, 0, 8, opt)
    t1 = time.perf_counter()
    c2 = time.process_time()
    p = plan(inputs)
    t3 = time.perf_counter()
    c3 = time.process_time()
    # what the decider plans before it publishes (the assignment and the totals)
    c = time.process_time()
    decided = decider_plan(inputs)
    decide_cpu = time.process_time() - c
    assert decided.assignment == p.assignment
    # what one rank replays at a resize: only its own part, with the published assignment
    rank_cpu = {}
    for device in sample_devices(p.assignment, leave):
        c = time.process_time()
        plan(inputs, p.assignment, for_device=device)
        rank_cpu[device] = time.process_time() - c
    worst = max(rank_cpu, key=rank_cpu.__getitem__)
    s = p.stats
    return {
        "optimizer": opt, "pattern": pattern, "model": model, "from": str(old), "to": str(new),
        "devices": old.world_size, "leave": f"{leave[0]}-{leave[-1]}" if pattern == "stage"
        else f"{len(leave)} ranks", "inputs_s": t1 - t0, "plan_s": t3 - t1, "cpu_s": c3 - c2,
        "decide_cpu_s": decide_cpu, "rank_cpu_s": rank_cpu[worst], "rank_worst": worst,
        "rss_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "moved_GiB": s["moved_bytes"] / 2**30, "at_lower_bound":
        s["moved_bytes"] == s["lower_bound_moved_bytes"], "messages": s["messages"],
        "rounds": s["rounds"],
    }


def _load() -> str:
    a, b, c = os.getloadavg()
    return f"load average {a:.1f} {b:.1f} {c:.1f}"


def _size(devices: int) -> str:
    return f"{devices // 1024}k"


def _summary(rows: list[dict], field: str = "cpu_s") -> list[str]:
    """``field`` per (optimizer, pattern, model) and size, as markdown lines."""
    sizes = sorted({r["devices"] for r in rows})
    lines = ["| optimizer | leave | model | " + " | ".join(_size(s) for s in sizes) + " |",
             "|---" * (3 + len(sizes)) + "|"]
    groups: dict[tuple[str, str, str], dict[int, float]] = {}
    for r in rows:
        groups.setdefault((r["optimizer"], r["pattern"], r["model"]), {})[r["devices"]] = \
            r[field]
    for (opt, pattern, model), by_size in groups.items():
        cells = [f"{by_size[s]:.2f}" if s in by_size else "—" for s in sizes]
        lines.append(f"| {opt} | {pattern} | {model} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--optimizer", default="both", choices=["adam", "distributed", "both"])
    ap.add_argument("--pattern", default="all", choices=["dp", "stage", "scatter", "all"])
    ap.add_argument("--model", default="all", choices=["gpt-70b", "llama3-70b", "all"])
    ap.add_argument("--max-devices", type=int, default=16384)
    ap.add_argument("--write-results", action="store_true",
                    help="write docs/results/plan_scale.md")
    ap.add_argument("--one", nargs=3, metavar=("OPT", "PATTERN", "IDX"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1], int(args.one[2]))))
        return
    opts = ["adam", "distributed"] if args.optimizer == "both" else [args.optimizer]
    patterns = ["dp", "scatter", "stage"] if args.pattern == "all" else [args.pattern]
    print(_load() + " (cpu_s is process CPU time)")
    print(f"{'optimizer':11} {'leave':7} {'model':10} {'from':>12} {'to':>12} {'devices':>7} "
          f"{'inputs_s':>8} {'plan_s':>7} {'cpu_s':>6} {'decide':>6} {'rank_s':>6} {'rss_MiB':>8} "
          f"{'moved_GiB':>9} "
          f"{'=bound':>6} {'messages':>8} {'rounds':>6}")
    rows = []
    for opt in opts:
        for pattern in patterns:
            for idx, (model, old, _) in enumerate(CASES[pattern]):
                if old.world_size > args.max_devices or args.model not in ("all", model):
                    continue
                out = subprocess.run([sys.executable, __file__, "--one", opt, pattern, str(idx)],
                                     capture_output=True, text=True, check=True).stdout
                r = json.loads(out.strip().splitlines()[-1])
                rows.append(r)
                print(f"{opt:11} {pattern:7} {r['model']:10} {r['from']:>12} {r['to']:>12} "
                      f"{r['devices']:>7} {r['inputs_s']:8.2f} {r['plan_s']:7.2f} "
                      f"{r['cpu_s']:6.2f} {r['decide_cpu_s']:6.2f} {r['rank_cpu_s']:6.2f} {r['rss_MiB']:8.0f} "
                      f"{r['moved_GiB']:9.1f} "
                      f"{'yes' if r['at_lower_bound'] else 'NO':>6} {r['messages']:>8} "
                      f"{r['rounds']:>6}", flush=True)
    print(_load())
    print()
    print("whole plan, cpu_s:")
    print("\n".join(_summary(rows)))
    print()
    print("the decider's plan (runtime.generation.decider_plan), cpu_s:")
    print("\n".join(_summary(rows, "decide_cpu_s")))
    print()
    print("one rank's own part (plan(..., for_device=...)), the slowest sampled rank, cpu_s:")
    print("\n".join(_summary(rows, "rank_cpu_s")))
    if args.write_results:
        from etcslurm.bench.results import write_results

        at_bound = all(r["at_lower_bound"] for r in rows)
        table = "\n".join([
            "The whole plan, CPU seconds (one core):", "", *_summary(rows), "",
            "The decider's plan (the assignment and the totals), CPU seconds:", "",
            *_summary(rows, "decide_cpu_s"), "",
            "One rank's own part (the slowest sampled rank), CPU seconds:", "",
            *_summary(rows, "rank_cpu_s"), "",
            f"Moved bytes equal the lower bound in every row: {'yes' if at_bound else 'NO'}."])
        print(write_results("plan_scale", table, rows, title="Planning at scale"))


if __name__ == "__main__":
    main()
