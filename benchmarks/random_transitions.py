"""Many seeded random transitions, each checked like the suite's matrix.

    python benchmarks/random_transitions.py [--seed 7] [--count 24] [--max-devices 4]
                                            [--class dense|pipeline] [--steps-after 3]
                                            [--json out.json] [--write-results]

The cases are drawn by :func:`etcslurm.testing.transitions.random_cases` (``dense``: valid
layouts of gpt-tiny / llama-tiny, leavers and joiners at random, a random optimizer and
dtype) or :func:`~etcslurm.testing.transitions.random_pipeline_cases` (``pipeline``: random
depths and widths, tied or untied embeddings, uneven first/last stages and interleaved
chunks, from a pipelined layout), the functions ``tests/test_migrate_gpt.py`` draws its few
from, and run one after another
in one launch of the same processes (``etcslurm.bench.driver.run_many``).  For each: right
after the change every tensor and everything that shapes the next update equals the
checkpoint path's (``bit_exact``), and ``--steps-after`` steps later the losses and every
tensor, gradients included, are still equal (``loss_match``, ``after_steps_equal``).
Exit 1 when any case is not.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from rich.console import Console
from rich.table import Table

from etcslurm.bench.driver import MigrateRequest, run_many
from etcslurm.testing.transitions import random_cases, random_pipeline_cases

COLUMNS = ("case", "from → to", "leave", "join", "opt", "dtype", "path", "exact", "after",
           "loss=")


def _yes(value: object) -> str:
    return "yes" if value else "NO"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--count", type=int, default=24)
    ap.add_argument("--max-devices", type=int, default=4)
    ap.add_argument("--class", dest="kind", choices=("dense", "pipeline"), default="dense",
                    help="which class of transitions to draw (default: dense)")
    ap.add_argument("--steps-after", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write all reports to this file")
    ap.add_argument("--write-results", action="store_true",
                    help="write docs/results/random_transitions.md")
    args = ap.parse_args(argv)
    console = Console()
    draw = random_pipeline_cases if args.kind == "pipeline" else random_cases
    cases = draw(seed=args.seed, count=args.count, max_devices=args.max_devices)
    requests = [MigrateRequest(repeat=1, steps_before=1, steps_after=args.steps_after,
                               timeout=300, staging_mb=1, measure_bandwidth=False,
                               async_checkpoint=False, refit=False, **c.request_args())
                for c in cases]
    console.print(f"{len(cases)} random {args.kind} transitions (seed {args.seed}) in one "
                  "launch ...")
    t0 = time.perf_counter()
    reports = run_many(requests)
    wall = time.perf_counter() - t0
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(reports, fh, indent=1)
    rows = []
    for case, r in zip(cases, reports, strict=True):
        rows.append([case.name.split("-", 1)[0], f"{case.source} → {case.target}",
                     ",".join(map(str, case.leave)) or "–", str(case.join), case.optimizer,
                     case.dtype or "model's", str(r.get("plan_path")), _yes(r["bit_exact"]),
                     _yes(r["after_steps_equal"]), _yes(r["loss_match"])])
    table = Table(title=f"random {args.kind} transitions, seed {args.seed}, "
                        f"{args.steps_after} steps after")
    for col in COLUMNS:
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    good = sum(bool(r["bit_exact"] and r["loss_match"] and r["after_steps_equal"])
               for r in reports)
    summary = (f"{good} of {len(reports)} bit-exact and training equally {args.steps_after} "
               f"steps after; wall {wall:.0f} s")
    console.print(summary)
    if args.write_results:
        from etcslurm.bench.results import markdown_table, write_results

        name = "random_transitions" + ("_pipeline" if args.kind == "pipeline" else "")
        path = write_results(name, markdown_table(list(COLUMNS), rows), reports,
                             title=f"Random {args.kind} transitions (seed {args.seed})",
                             notes=summary)
        console.print(f"wrote {path}")
    return 0 if good == len(reports) else 1


if __name__ == "__main__":
    sys.exit(main())
