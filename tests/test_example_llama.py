"""``examples/pretrain_llama.py``: a user's own megatron-core Llama loop made elastic.

The elastic example runs as real worker processes under the local launcher (what
``etcslurm demo`` uses), one of them leaves mid-run (SIGUSR2, as Slurm's preemption
warning), and the losses must equal those of the plain, never-resized loop
(``examples/pretrain_llama_plain.py``) while every sample of megatron-core's
``GPTDataset`` is trained exactly once.  The README's diff of the two files is checked
against the files.
"""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from etcslurm.local.launcher import LOSS_TOLERANCE, DemoOptions, run_demo
from tests.helpers import pids_alive

ROOT = Path(__file__).resolve().parents[1]
PLAIN, ELASTIC = ROOT / "examples" / "pretrain_llama_plain.py", ROOT / "examples" / "pretrain_llama.py"
STEPS, GLOBAL_BATCH = 6, 12


def example_diff() -> list[str]:
    """The unified diff plain -> elastic (what the README shows), without file headers."""
    lines = difflib.unified_diff(PLAIN.read_text().splitlines(), ELASTIC.read_text().splitlines(),
                                 "examples/pretrain_llama_plain.py", "examples/pretrain_llama.py",
                                 lineterm="", n=0)
    return [line for line in lines if not line.startswith(("---", "+++", "@@"))]


def test_the_plain_loop_imports_nothing_of_etcslurm_and_the_elastic_diff_is_small() -> None:
    """The plain loop is a user's own megatron-core loop; the elastic one changes a
    handful of its lines (10 added, 7 removed: the session, its settings -- batch, steps,
    the first layout, the checkpoint to start from and how often to save -- and the
    loop), and the README shows exactly that diff."""
    assert "etcslurm" not in PLAIN.read_text()
    diff = example_diff()
    added = [line for line in diff if line.startswith("+")]
    removed = [line for line in diff if line.startswith("-")]
    assert len(added) <= 10 and len(removed) <= 10, "\n".join(diff)
    readme = (ROOT / "README.md").read_text()
    block = readme.split("Adopt it in your loop", 1)[1]
    block = block.split("```diff\n", 1)[1].split("```", 1)[0]
    shown = [line for line in block.splitlines()
             if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))]
    assert shown == diff, "README's diff is stale: regenerate it from the two files"


def _samples(run_dir: Path) -> dict[int, list[int]]:
    """step -> the dataset indices trained at that step, over every DP rank's log."""
    by_step: dict[int, list[int]] = defaultdict(list)
    for log in run_dir.glob("samples-*.jsonl"):
        for line in log.read_text().splitlines():
            entry = json.loads(line)
            by_step[entry["step"]].extend(entry["samples"])
    return by_step


def _run_plain(run_dir: Path, data_dir: Path) -> dict[int, float]:
    """The plain loop, one rank, never resized: step -> loss (run unchanged on the CPU
    through ``etcslurm.testing.cpu_run``, which installs the CPU shim first)."""
    run_dir.mkdir()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    out = subprocess.run(
        [sys.executable, "-m", "etcslurm.testing.cpu_run", str(PLAIN), "--steps", str(STEPS),
         "--global-batch", str(GLOBAL_BATCH),
         "--run-dir", str(run_dir), "--data-dir", str(data_dir)],
        capture_output=True, text=True, env=env, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {s["step"]: s["loss"] for s in steps}


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(1200)
def test_elastic_llama_example_matches_the_plain_loop(redis_url: str, run_id: str,
                                                       tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    data_dir = tmp_path / "data"  # one corpus (and index cache) for both runs
    t0 = time.monotonic()
    plain = _run_plain(tmp_path / "plain", data_dir)
    t_plain = time.monotonic() - t0
    assert sorted(plain) == list(range(1, STEPS + 1))
    assert plain[STEPS] < plain[1]  # it learns

    # two workers of the elastic example; the higher rank leaves at step 2 (SIGUSR2)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT),
                                                                   os.environ.get("PYTHONPATH")])))
    run_dir = tmp_path / "elastic"
    opts = DemoOptions(
        workers=2, steps=STEPS, schedule="2:leave=1", redis=redis_url, run_id=run_id,
        run_dir=str(run_dir), global_batch=GLOBAL_BATCH, model="", gpus_per_node=8,
        reference=False, keep_keys_s=5, min_step_seconds=1.0,
        worker_module="examples.pretrain_llama",
        worker_args=("--workers", "2", "--steps", str(STEPS), "--global-batch",
                     str(GLOBAL_BATCH), "--data-dir", str(data_dir)),
    )
    t1 = time.monotonic()
    result = run_demo(opts)
    t_elastic = time.monotonic() - t1
    print(f"plain run {t_plain:.1f} s, elastic run {t_elastic:.1f} s; "
          f"generations {[(g['kind'], g['to']) for g in result.generations]}")

    gens = result.generations
    assert gens[0]["kind"] == "start" and gens[0]["world"] == 2, gens
    assert [g["kind"] for g in gens[1:]] == ["resize"] and gens[-1]["world"] == 1, gens
    assert len(gens[1]["leaving"]) == 1
    assert all(code == 0 for code in result.exit_codes.values()), result.exit_codes
    assert pids_alive(result.pids) == [], "no worker process may outlive the run"

    # the loss curve of the run that resized is the plain loop's
    assert sorted(result.losses) == list(range(1, STEPS + 1))
    diffs = {s: abs(result.losses[s] - plain[s]) for s in plain}
    assert max(diffs.values()) <= LOSS_TOLERANCE, (diffs, result.losses, plain)
    print(f"resized at step {gens[1]['step']}; |elastic - plain| per step: {diffs}")

    # every sample of the GPTDataset trained exactly once, in the plain loop's steps
    elastic_samples, plain_samples = _samples(run_dir), _samples(tmp_path / "plain")
    assert sorted(elastic_samples) == list(range(STEPS))
    for step, samples in elastic_samples.items():
        assert sorted(samples) == list(range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)), step
        assert sorted(samples) == sorted(plain_samples[step])
    counts = Counter(i for samples in elastic_samples.values() for i in samples)
    assert set(counts.values()) == {1} and len(counts) == STEPS * GLOBAL_BATCH
    dps = {json.loads(line)["dp"] for log in run_dir.glob("samples-*.jsonl")
           for line in log.read_text().splitlines()}
    assert dps == {1, 2}  # the data order was rebuilt for the new DP size
