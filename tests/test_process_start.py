"""Workers forked from the preloaded template behave as ``python -m`` would have made
them: arguments, environment, working directory, output files, exit codes and signals
(real processes, both start modes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from etcslurm.process_start import start_worker

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(params=["fork", "exec"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("ETCSLURM_WORKER_START", request.param)
    monkeypatch.chdir(ROOT)
    return str(request.param)


def test_a_worker_runs_as_main_with_its_own_env_output_and_exit_code(mode: str,
                                                                     tmp_path: Path) -> None:
    log = tmp_path / "log"
    env = dict(os.environ, PROBE=f"value-{mode}", OMP_NUM_THREADS="1")
    proc = start_worker("tests.probe_worker", ["exit", "7"], env=env, stdout=log, stderr=log)
    assert proc.wait(timeout=120) == 7
    assert proc.returncode == 7 and proc.poll() == 7
    first, second = log.read_text().splitlines()[-2:]
    seen = json.loads(first)
    assert seen["argv"] == ["exit", "7"] and seen["name"] == "__main__"
    assert seen["probe"] == f"value-{mode}" and seen["threads"] == 1
    assert seen["cwd"] == str(ROOT) and seen["pid"] == proc.pid
    assert second == "to stderr"


def test_a_signalled_worker_reports_the_signal_and_wait_is_bounded(mode: str,
                                                                   tmp_path: Path) -> None:
    out, err = tmp_path / "out", tmp_path / "err"
    proc = start_worker("tests.probe_worker", ["wait", "0"], env=dict(os.environ),
                        stdout=out, stderr=err)
    deadline = time.monotonic() + 120
    while "to stderr" not in err.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    assert proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert err.read_text() == "to stderr\n" and "to stderr" not in out.read_text()


def test_an_uncaught_exception_exits_1_with_its_traceback(mode: str, tmp_path: Path) -> None:
    log = tmp_path / "log"
    proc = start_worker("tests.probe_worker", ["exit", "not-a-number"], env=dict(os.environ),
                        stdout=log, stderr=log)
    assert proc.wait(timeout=120) == 1
    assert "ValueError" in log.read_text()
