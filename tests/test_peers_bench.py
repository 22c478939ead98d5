"""A short run of ``benchmarks/peers.py`` (etcslurm vs torchft, 2 → 1 → 2 replicas): both
sides produce their numbers.  A benchmark, not a product test: skipped without the
optional ``peers`` extra (``pip install -e '.[peers]'``)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.waits, pytest.mark.timeout(600)]


def test_both_sides_measure_a_shrink_and_a_grow(redis_url: str, tmp_path: Path) -> None:
    if importlib.util.find_spec("torchft") is None:
        pytest.skip("torchft is not installed (the optional extra: pip install -e '.[peers]')")
    out = tmp_path / "peers.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--workers", "2",
           "--leave-at", "3", "--join-at", "6", "--after", "3", "--min-step", "0.2",
           "--tf-heartbeat-ms", "500", "--redis", redis_url, "--run-dir", str(tmp_path),
           "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    report = json.loads(out.read_text())
    assert "redis" not in report["settings"]  # the URL holds the password
    measures = report["measures"]
    assert set(measures) == {"etcslurm", "torchft hb 500 ms"}
    for framework, (m,) in measures.items():
        for value in (m["shrink"]["pause_s"], m["grow"]["pause_s"], m["joiner_start_s"],
                      m["joiner_arrival_s"]):
            assert math.isfinite(value), (framework, m)
        assert m["joiner_start_s"] > m["joiner_arrival_s"] > 0, (framework, m)
    # the same model on both sides: parameters, and the state a joiner receives (weights
    # and both Adam moments; torchft also sends the step counters and hyper-parameters)
    assert report["torchft_params"] == [report["params"]]
    sent = {fw: m["joiner_bytes"] for fw, (m,) in measures.items()}
    assert sent["etcslurm"] == 12 * report["params"]
    assert 0 <= sent["torchft hb 500 ms"] - sent["etcslurm"] < 4096
    # the lighthouse notices the leave only when its heartbeats stop
    assert measures["torchft hb 500 ms"][0]["shrink"]["pause_s"] > 0.3
