"""A week of preemptions in an hour: one local run through many seeded random faults.

    python benchmarks/soak.py [--events 60] [--seed 7] [--workers 4] [--steps N]
                              [--json] [--write-results]

Faults (each once the previous one settled): leave by signal, join, SIGKILL of any
worker (the leader included), an operator's resize and drain, a Redis restart, a
preemption while a change's state is moving (:mod:`etcslurm.testing.soak`).  Prints the
report: ``events``, ``survived``, ``steps``, ``samples_once``, ``max_abs_dloss``,
``bytes_lost``, ``rss_mb_per_generation`` / ``fds_per_generation`` /
``threads_per_generation`` (per-worker least-squares slopes after warm-up: median and
max), ``leftovers``.  Exit 1 when the run did not survive, a step trained twice
unexplained, the losses left the reference's tolerance, a byte was lost, or something
was left behind.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

from rich.console import Console

from etcslurm.testing.soak import SoakOptions, soak

SHOWN = ("events", "kinds", "survived", "stalled", "steps", "steps_trained", "generations",
         "samples_once", "max_abs_dloss", "bytes_lost", "bytes_recovered_from_checkpoint",
         "rss_mb_per_generation", "fds_per_generation", "threads_per_generation",
         "leftovers", "median_settle_s", "wall_s")


def passed(report: dict) -> bool:
    return bool(report["survived"] and report["samples_once"] and report["loss_match"]
                and report["bytes_lost"] == 0 and not report["leftovers"]["processes"]
                and not report["leftovers"]["shm_segments"]
                and report["events"] == report["events_asked"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=60)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=None, help="default: 10 per event, >= 400")
    ap.add_argument("--min-step-seconds", type=float, default=0.25)
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--json", action="store_true", help="print the whole report as JSON")
    ap.add_argument("--write-results", action="store_true", help="write docs/results/soak.md")
    args = ap.parse_args(argv)
    console = Console(stderr=True)
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="etcslurm-soak-")
    opts = SoakOptions(events=args.events, seed=args.seed, workers=args.workers,
                       steps=args.steps, min_step_seconds=args.min_step_seconds,
                       run_dir=run_dir)
    report = soak(opts, progress=lambda m: console.print(f"[dim]{m}[/dim]"))
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for key in SHOWN:
            console.print(f"{key:32} {report[key]}")
    ok = passed(report)
    console.print("soak " + ("passed" if ok else "FAILED") + f" (run dir {run_dir})")
    if args.write_results:
        from etcslurm.bench.results import markdown_table, write_results

        rows = [[k, json.dumps(report[k])] for k in SHOWN]
        path = write_results("soak", markdown_table(["field", "value"], rows), report,
                             title=f"Soak: {report['events']} faults, seed {args.seed}")
        console.print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
