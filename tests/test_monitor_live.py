"""The live loop: it redraws while it follows a run, and an event emitted while it runs
reaches a later redraw (it sleeps in XREAD between them).  How often it redraws, how soon
an event shows and what CPU it spends are measured by ``benchmarks/monitor_live.py``, not
asserted here: a loaded machine changes them, not their order."""

from __future__ import annotations

import io
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

EVENT_TEXT = "n1 preempted: USR2, 30 s budget"


def test_the_live_loop_redraws_and_shows_an_event_emitted_while_it_runs(
        redis_url: str, run_id: str, monkeypatch) -> None:
    client = connect(redis_url)
    op = Coordinator(client, run_id)
    op.publish_generation(generation_record(0, "tp1pp1dp2", ["a", "b"], {"a": "n1", "b": "n1"}))
    draws: list[tuple[float, list[str]]] = []
    real_build = live.build

    def counting_build(view, width, height):
        texts = [e.text for e in view.events]
        draws.append((time.monotonic(), texts))
        if sum(EVENT_TEXT in t for _, t in draws) >= 2:  # shown, and shown again: done
            live.STOP.set()
        return real_build(view, width, height)

    monkeypatch.setattr(live, "build", counting_build)
    emitted = threading.Event()

    def later() -> None:
        # once the loop has drawn, so the event arrives while it follows the run
        while not draws:
            time.sleep(0.01)
        op.emit("worker.signal", worker="b", node="n1", signal="USR2", budget_s=30)
        emitted.set()

    threading.Thread(target=later, daemon=True).start()
    console = Console(file=io.StringIO(), force_terminal=True, width=80, height=24)
    try:  # bounded: 60 s at most, however loaded the machine
        live.follow_live(RunSource(client, run_id), RunModel(run_id), console, max_seconds=60)
    finally:
        live.STOP.clear()
        client.close()

    assert emitted.is_set()
    before = [texts for _, texts in draws if EVENT_TEXT not in texts]
    after = [texts for _, texts in draws if EVENT_TEXT in texts]
    assert before and after, "drawn before the event, and again with it"
    first_with = next(i for i, (_, texts) in enumerate(draws) if EVENT_TEXT in texts)
    assert all(EVENT_TEXT in texts for _, texts in draws[first_with:]), "the event stays"
