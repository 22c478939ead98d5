"""``etcslurm resize`` as a user runs it: validated against the run's spec and members,
one line and exit 2 for a mistake, the request queued for the leader otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from etcslurm.coord.client import connect
from etcslurm.coord.coordinator import Coordinator
from etcslurm.coord.records import ChangeRequest, parse_event
from etcslurm.core.models import GPTSpec

pytestmark = pytest.mark.redis

SPEC = {"model": GPTSpec.parse("gpt-tiny").to_json(), "optimizer": "adam", "global_batch": 12,
        "micro_batch": 1, "seed": 1, "steps": 10, "lr": 1e-3, "initial_workers": 4,
        "gpus_per_node": 2}


def resize(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCSLURM_")}
    return subprocess.run([sys.executable, "-m", "etcslurm", "resize", *args],
                          capture_output=True, text=True, timeout=60, env=env,
                          stdin=subprocess.DEVNULL)


@pytest.fixture
def running(redis_url: str, run_id: str):
    """A run of gpt-tiny with four live workers w1..w4."""
    client = connect(redis_url)
    handles = []
    for _ in range(4):
        h = Coordinator(client, run_id, spec=SPEC, heartbeat_interval=1.0, dead_after=120.0)
        h.register({"node": "n1"}, heartbeat=False)
        handles.append(h)
    yield handles[0]
    handles[0].end_run()
    client.close()


@pytest.mark.parametrize(("args", "needle"), [
    (["--to", "tp2x"], "is not of the form tp<N>[cp<N>]pp<N>"),
    (["--to", "tp1pp3dp1"], "layers=4 is not divisible by pp=3"),
    (["--to", "tp1pp1dp8"], "global batch 12 does not split over dp=8"),
    (["--to", "tp1pp1dp6"], "needs 6 workers; the run has 4 live"),
    (["--to", "tp4pp1dp1"], "tp=4 does not fit a 2-GPU node"),
    (["--drain", "w9"], "--drain w9: no such worker"),
    ([], "nothing to do"),
])
def test_bad_requests_are_one_line_exit_2(running: Coordinator, redis_url: str,
                                          args: list[str], needle: str) -> None:
    proc = resize("--run", running.run_id, "--redis", redis_url, *args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("etcslurm: "), proc.stderr
    assert needle in lines[0] and "Traceback" not in proc.stderr
    assert running.pending_changes() == []  # nothing queued


def test_unknown_run_is_one_line(redis_url: str) -> None:
    proc = resize("--run", "no-such-run-x", "--redis", redis_url, "--to", "tp1pp1dp2")
    assert proc.returncode == 2 and "no run 'no-such-run-x'" in proc.stderr


def test_requests_are_queued_pending_then_taken(running: Coordinator, redis_url: str) -> None:
    proc = resize("--run", running.run_id, "--redis", redis_url, "--to", "TP1PP1DP2", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["run"] == running.run_id and out["request"]["to"] == "tp1pp1dp2"
    proc = resize("--run", running.run_id, "--redis", redis_url, "--drain", "w3", "--drain",
                  "w4", "--reason", "node n2 maintenance")
    assert proc.returncode == 0, proc.stderr
    assert f"queued for run {running.run_id}: drain w3, w4" in proc.stdout
    pending = running.pending_changes()
    assert [(r.to, r.drain, r.by) for r in pending] == [
        ("tp1pp1dp2", (), "operator"), (None, ("w3", "w4"), "operator")]
    assert isinstance(pending[1], ChangeRequest) and pending[1].reason == "node n2 maintenance"
    events = [parse_event(e) for e in running.read_events() if e["type"] == "change.requested"]
    assert [e.worker for e in events] == ["operator", "operator"]
    running.take_changes(len(pending))
    assert running.pending_changes() == []
