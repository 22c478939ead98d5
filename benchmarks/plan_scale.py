"""Planner scale benchmark: plan time and peak memory (ru_maxrss of the process, MiB) at 1k-16k devices.

Run: ``python benchmarks/plan_scale.py [--optimizer adam|distributed|both]``.
Target: gpt-70b tp8pp8dp128 → tp8pp8dp96 (8192 → 6144 devices) < 1 s, < 1 GiB, one core.
Leaving devices are whole DP replicas (dp index >= new dp), the common preemption case.
"""

from __future__ import annotations

import argparse
import resource
import time

from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import PRESETS
from etcslurm.core.planner import gpt_inputs, plan

CASES = [
    ("gpt-70b", ParallelConfig(8, 8, 16), ParallelConfig(8, 8, 12)),    # 1k
    ("gpt-70b", ParallelConfig(8, 8, 64), ParallelConfig(8, 8, 48)),    # 4k
    ("gpt-70b", ParallelConfig(8, 8, 128), ParallelConfig(8, 8, 96)),   # 8k (target)
    ("gpt-70b", ParallelConfig(8, 8, 256), ParallelConfig(8, 8, 192)),  # 16k
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--optimizer", default="both", choices=["adam", "distributed", "both"])
    args = ap.parse_args()
    opts = ["adam", "distributed"] if args.optimizer == "both" else [args.optimizer]
    print(f"{'optimizer':11} {'model':8} {'from':>12} {'to':>12} {'devices':>7} "
          f"{'inputs_s':>8} {'plan_s':>7} {'cpu_s':>6} {'rss_MiB':>8} {'moved_GiB':>9} {'messages':>8}")
    for opt in opts:
        for model, old, new in CASES:
            leave = [str(r) for r in range(old.world_size) if old.coord(r).dp >= new.dp]
            t0 = time.perf_counter()
            inputs = gpt_inputs(PRESETS[model], old, new, leave, 0, 8, opt)
            t1 = time.perf_counter()
            t2 = time.perf_counter()
            c2 = time.process_time()
            p = plan(inputs)
            t3 = time.perf_counter()
            c3 = time.process_time()
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            print(f"{opt:11} {model:8} {old!s:>12} {new!s:>12} {old.world_size:>7} "
                  f"{t1 - t0:8.2f} {t3 - t2:7.2f} {c3 - c2:6.2f} {peak / 2**20:8.0f} "
                  f"{p.stats['moved_bytes'] / 2**30:9.1f} {p.stats['messages']:>8}", flush=True)


if __name__ == "__main__":
    main()
