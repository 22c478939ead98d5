"""Metrics where clusters look: ``etcslurm metrics`` scraped over HTTP during a real demo
(parsed with prometheus-client's own parser) across a resize, and the TensorBoard event
file its rank 0 wrote, read back."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from etcslurm.coord.client import connect
from etcslurm.local.launcher import DemoOptions, run_demo
from etcslurm.monitor.metrics import RunCollector, serve
from etcslurm.monitor.source import RunSource

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(600)]


def scrape(url: str) -> dict[str, list]:
    """name → [(labels, value)] of every sample of one scrape."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(samples: dict[str, list], name: str, **labels: str) -> float | None:
    for got, v in samples.get(name, []):
        if all(got.get(k) == x for k, x in labels.items()):
            return v
    return None


def test_metrics_endpoint_and_tensorboard_across_a_resize(
        redis_url: str, run_id: str, tmp_path: Path) -> None:
    client = connect(redis_url)
    server, port = serve(RunCollector(RunSource(client, run_id)), 0, "127.0.0.1")
    url = f"http://127.0.0.1:{port}/metrics"
    scrapes: list[dict[str, list]] = []
    errors: list[str] = []
    stop = threading.Event()

    def scraper() -> None:
        while not stop.is_set():
            try:
                scrapes.append(scrape(url))
            except Exception as exc:  # reported below
                errors.append(repr(exc))
            stop.wait(0.3)

    thread = threading.Thread(target=scraper, daemon=True)
    thread.start()
    tb = tmp_path / "tb"
    steps = 8
    try:
        res = run_demo(DemoOptions(workers=2, steps=steps, schedule="3:leave=1",
                                   redis=redis_url, run_id=run_id, run_dir=str(tmp_path / "run"),
                                   reference=False, keep_keys_s=30, min_step_seconds=0.8,
                                   tensorboard_dir=str(tb)))
        time.sleep(0.5)  # one scrape after the end
    finally:
        stop.set()
        thread.join(10)
    try:
        last = scrape(url)
    finally:
        server.shutdown()
        client.close()
    assert errors == [], errors[:3]
    worlds = [value(s, "etcslurm_world_size", run=run_id) for s in scrapes]
    seen = [w for w in worlds if w is not None]
    assert 2.0 in seen and 1.0 in seen and seen.index(2.0) < len(seen) - seen[::-1].index(1.0)
    assert value(last, "etcslurm_coordinator_up", run=run_id) == 1
    assert value(last, "etcslurm_step", run=run_id) == steps
    assert value(last, "etcslurm_generation", run=run_id) == 1
    assert value(last, "etcslurm_resizes_total", run=run_id, cause="preemption") == 1
    assert value(last, "etcslurm_resizes_total", run=run_id, cause="grow") == 0
    assert value(last, "etcslurm_layout_info", run=run_id, layout="tp1pp1dp1", dp="1") == 1
    assert value(last, "etcslurm_last_moved_bytes", run=run_id) is not None
    ratio = value(last, "etcslurm_last_moved_over_lower_bound", run=run_id)
    assert ratio is not None and 1.0 <= ratio < 1.01  # bytes moved = the lower bound
    assert value(last, "etcslurm_last_pause_seconds", run=run_id) > 0
    assert 0 <= value(last, "etcslurm_seconds_since_last_step", run=run_id) < 60
    assert value(last, "etcslurm_tokens_per_second", run=run_id) > 0
    assert value(last, "etcslurm_coordinator_failovers_total", run=run_id) == 0
    assert value(last, "etcslurm_workers", run=run_id, state="gone") == 2

    # the TensorBoard event files rank 0 wrote (one process here: the survivor was rank 0)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    loss = {e.step: e.value for e in acc.Scalars("etcslurm/loss")}
    assert sorted(loss) == list(range(1, steps + 1))
    assert all(abs(loss[s] - res.losses[s]) < 1e-5 for s in loss)
    world = [e.value for e in acc.Scalars("etcslurm/world_size")]
    assert world[0] == 2 and world[-1] == 1
    assert "etcslurm/resize/preemption" in tags and "etcslurm/pause_seconds" in tags
    assert "etcslurm/tokens_per_s" in tags and "etcslurm/moved_over_lower_bound" in tags


def test_metrics_cli_errors() -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "etcslurm", "metrics", *args],
                              capture_output=True, text=True, timeout=60, check=False)

    bad = cli("--port", "70000")
    assert bad.returncode == 2 and bad.stderr.strip() == "etcslurm: --port must be 0..65535, got 70000"
    down = cli("--port", "0", "--redis", "redis://127.0.0.1:1/0")
    assert down.returncode == 3 and down.stderr.startswith("etcslurm: coordinator at")
    assert len(down.stderr.strip().splitlines()) == 1
