"""The live loop: redraws at least twice a second, picks up new events at once, and
spends little CPU doing it (it sleeps in XREAD)."""

from __future__ import annotations

import io
import itertools
import threading
import time

import pytest
from rich.console import Console

from etcslurm.coord.client import connect
from etcslurm.coord.coordinator import Coordinator
from etcslurm.monitor import live
from etcslurm.monitor.model import RunModel
from etcslurm.monitor.source import RunSource
from tests.helpers import generation_record

pytestmark = pytest.mark.redis


def test_live_loop_refresh_rate_latency_and_cpu(redis_url: str, run_id: str, monkeypatch) -> None:
    client = connect(redis_url)
    op = Coordinator(client, run_id)
    op.publish_generation(generation_record(0, "tp1pp1dp2", ["a", "b"], {"a": "n1", "b": "n1"}))
    draws: list[tuple[float, list[str]]] = []
    real_build = live.build

    def counting_build(view, width, height):
        draws.append((time.monotonic(), [e.text for e in view.events]))
        return real_build(view, width, height)

    monkeypatch.setattr(live, "build", counting_build)
    emitted: list[float] = []

    def later() -> None:
        time.sleep(1.0)
        emitted.append(time.monotonic())
        op.emit("worker.signal", worker="b", node="n1", signal="USR2", budget_s=30)

    threading.Thread(target=later, daemon=True).start()
    console = Console(file=io.StringIO(), force_terminal=True, width=80, height=24)
    cpu0, t0 = time.process_time(), time.monotonic()
    live.follow_live(RunSource(client, run_id), RunModel(run_id), console, max_seconds=3.0)
    cpu, wall = time.process_time() - cpu0, time.monotonic() - t0
    client.close()

    assert len(draws) >= 2 * wall - 1, f"{len(draws)} redraws in {wall:.1f} s"
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(draws)]
    # 0.4-0.5 s when idle; slack for a loaded CI box
    assert max(gaps) < 1.0, f"a redraw gap of {max(gaps):.2f} s"
    seen = next(t for t, texts in draws if "n1 preempted: USR2, 30 s budget" in texts)
    assert seen - emitted[0] < 0.5, "a new event took too long to reach the screen"
    assert cpu < 0.5 * wall, f"{cpu:.2f} s CPU in {wall:.1f} s"
    print([round(g, 2) for g in gaps])
    print(f"redraws {len(draws)} in {wall:.1f} s, max gap {max(gaps):.2f} s, "
          f"event→screen {seen - emitted[0]:.3f} s, CPU {cpu:.2f} s")
