"""The elastic runtime end to end on a real Redis: real worker processes, real signals,
real megatron-core training on gloo, compared with a run that never resized."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from etcslurm.local.launcher import LOSS_TOLERANCE, DemoOptions, run_demo
from etcslurm.testing.fault_harness import faults
from tests.helpers import pids_alive

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(1200)]


def _data_positions(run_dir: Path, steps: int, global_batch: int) -> None:
    """Every sample of every step consumed exactly once (from the data-position logs)."""
    by_step: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    for log in run_dir.glob("data-*.jsonl"):
        for line in log.read_text().splitlines():
            e = json.loads(line)
            by_step[e["step"]].append((e["gen"], e["start"], e["stop"]))
    assert sorted(by_step) == list(range(steps))
    for step, entries in by_step.items():
        last_gen = max(g for g, _, _ in entries)
        ranges = sorted((a, b) for g, a, b in entries if g == last_gen)
        covered = [i for a, b in ranges for i in range(a, b)]
        assert covered == list(range(step * global_batch, (step + 1) * global_batch)), step




def test_leave_join_leave_matches_reference(redis_url: str, run_id: str, tmp_path: Path) -> None:
    # the run holds after step 4 until both joiners have registered (the testing worker's
    # hold): then the change that takes them in always comes before the second leave,
    # on a loaded host too, and no step needs pacing for them
    steps, gb = 12, 12
    opts = DemoOptions(workers=4, steps=steps, schedule="2:leave=1;3:join=2;8:leave=2",
                       redis=redis_url, run_id=run_id, run_dir=str(tmp_path), global_batch=gb,
                       keep_keys_s=5, **faults(hold={"step": 4, "file": str(tmp_path / "go"),
                                                      "timeout": 240.0}))

    def tick(run: Any) -> None:
        if len(run.by_worker) >= 6:
            (tmp_path / "go").touch()

    result = run_demo(opts, on_tick=tick)
    gens = result.generations
    assert (gens[0]["kind"], gens[0]["to"]) == ("start", "tp1pp1dp4")
    assert all(g["kind"] == "resize" for g in gens[1:]), gens
    # when the joiners finish importing decides how the changes group into generations;
    # what must hold: one left, two joined, two more left -> 3 ranks at the end
    assert sum(len(g["leaving"]) for g in gens) == 3
    assert sum(len(g["joining"]) for g in gens[1:]) == 2
    assert gens[-1]["to"] == "tp1pp1dp3" and len(gens) >= 3
    assert len(result.losses) == steps
    assert result.max_loss_diff is not None and result.max_loss_diff <= LOSS_TOLERANCE
    assert result.loss_match
    # leavers exit 0 after handing over; the finishers exit 0
    assert all(code == 0 for code in result.exit_codes.values()), result.exit_codes
    _data_positions(tmp_path, steps, gb)
    assert pids_alive(result.pids) == [], "no worker process may outlive the run"
    assert result.keys_left >= 0  # keys given a TTL: they expire, checked below
    import redis

    r = redis.Redis.from_url(redis_url)
    ttls = {k.decode(): r.pttl(k) for k in r.keys(f"etcslurm:{run_id}:*")}
    # data keys within keep_keys_s; the `ended` marker (refuses late writers) within 60 s
    lasting = {k: t for k, t in ttls.items()
               if not (t == -2 or 0 < t <= (60_000 if k.endswith(":ended") else 5000))}
    assert not lasting, f"run keys must be gone or expire: {lasting}"
    migrations = result.migrations
    assert len(migrations) == len(gens) - 1
    assert all(m["pause_seconds"] is not None for m in migrations)
    assert any(m["moved_bytes"] > 0 for m in migrations)  # the joiners received replicas


def test_tp_grows_by_itself_with_joiners_then_by_an_operator_request(
        redis_url: str, run_id: str, tmp_path: Path) -> None:
    """TP changes through the runtime, both ways a running job meets them.

    A global batch of 2 keeps DP at 2: two workers start in tp1pp1dp2, and when two more
    join the layout policy grows TP by itself (tp2pp1dp2); then ``etcslurm resize --to
    tp4pp1dp1`` grows it again at a later step boundary.  The losses equal a run that
    never resized, within what a TP change allows (reduction order).  The run holds at
    step 2 until the joiners have registered (no pacing for their start-up)."""
    import subprocess
    import sys

    from etcslurm.testing import fault_scenarios as fm

    steps = 14
    opts = DemoOptions(workers=2, steps=steps, schedule="1:join=2", redis=redis_url,
                       run_id=run_id, run_dir=str(tmp_path), global_batch=2,
                       gpus_per_node=4, keep_keys_s=5, min_step_seconds=0.5,
                       **fm.faults(hold={"step": 2, "file": str(tmp_path / "go"),
                                         "timeout": 240.0}))
    asked: list[subprocess.Popen] = []

    def tick(run: Any) -> None:
        if len(run.by_worker) >= 4:
            (tmp_path / "go").touch()
        if not asked and run.record is not None and run.record.to_layout == "tp2pp1dp2":
            asked.append(subprocess.Popen(
                [sys.executable, "-m", "etcslurm", "resize", "--run", run_id, "--redis",
                 redis_url, "--to", "tp4pp1dp1", "--json"], stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True))

    result = run_demo(opts, on_tick=tick)
    assert asked, "the joiners did not grow TP"
    out, err = asked[0].communicate(timeout=60)
    assert asked[0].returncode == 0, err
    assert json.loads(out)["request"]["to"] == "tp4pp1dp1"
    gens = result.generations
    assert [g["to"] for g in gens] == ["tp1pp1dp2", "tp2pp1dp2", "tp4pp1dp1"], gens
    assert steps - gens[2]["step"] >= 3, "at least three steps after the last change"
    assert len(result.losses) == steps
    assert result.max_loss_diff is not None and result.max_loss_diff <= LOSS_TOLERANCE
    # the joiners received their halves; TP 2 -> 4 finds every quarter in place
    assert result.migrations[0]["moved_bytes"] > 0, result.migrations
    assert all(code == 0 for code in result.exit_codes.values()), result.exit_codes
    assert pids_alive(result.pids) == []


def test_a_builder_of_our_own_resizes_twice_from_the_live_state(redis_url: str, run_id: str,
                                                                tmp_path: Path) -> None:
    """A builder written here (tests/custom_workers.py: a Llama-style model returned as
    plain megatron-core objects, distributed optimizer) and a run that names no model:
    its shapes are read from the model; it resizes twice, planned from the live state,
    and the losses equal a run that never resized."""
    opts = DemoOptions(workers=4, steps=10, schedule="2:leave=1;5:leave=1", model="",
                       optimizer="distributed", redis=redis_url, run_id=run_id,
                       run_dir=str(tmp_path), keep_keys_s=5, min_step_seconds=1.0,
                       worker_module="tests.custom_workers", worker_args=("--builder", "own"))
    result = run_demo(opts)
    assert [g["to"] for g in result.generations] == ["tp1pp1dp4", "tp1pp1dp3", "tp1pp1dp2"]
    assert result.loss_match, result.max_loss_diff
    assert all(m["moved_bytes"] > 0 for m in result.migrations), result.migrations
    assert all(code == 0 for code in result.exit_codes.values()), result.exit_codes


def test_a_model_etcslurm_cannot_describe_is_refused_at_start(redis_url: str, run_id: str,
                                                              tmp_path: Path) -> None:
    """A builder whose model etcslurm cannot describe stops the worker before its first
    step with one line naming the tensor (exit 2), not at its first resize."""
    import subprocess
    import sys

    from etcslurm.coord.client import connect
    from etcslurm.coord.coordinator import Coordinator
    from etcslurm.core.models import GPTSpec
    from etcslurm.runtime.config import RunSettings

    coord = Coordinator(connect(redis_url), run_id)
    coord.ensure_spec(RunSettings(model=GPTSpec.parse("gpt-tiny"), steps=3).to_json())
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.custom_workers", "--builder", "opaque", "--run", run_id,
             "--redis", redis_url, "--run-dir", str(tmp_path), "--join-timeout", "120"],
            capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        ours = [line for line in proc.stderr.splitlines() if line.startswith("etcslurm")]
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert len(ours) == 1, ours
        assert "cannot be made elastic" in ours[0] and "final_layernorm" in ours[0], ours[0]
        assert not list(tmp_path.glob("data-*.jsonl")) or all(
            not p.read_text() for p in tmp_path.glob("data-*.jsonl")), "no step may run"
    finally:
        coord.end_run()


def test_moe_run_changes_expert_parallelism_and_matches_reference(
        redis_url: str, run_id: str, tmp_path: Path) -> None:
    """moe-tiny on 4 workers starts with its 4 experts over EP 4; one worker leaves, and on 3
    devices no EP > 1 divides both DP (3) and the experts (4), so the run goes on in EP 1: every expert gathered on every rank, the
    distributed optimizer's expert buffer (ZeRO-1 over expert DP) becoming part of the
    dense one.  bf16, so fp32 main params travel too.  The losses equal a 4-worker run
    that never resized (megatron seeds experts per EP rank: the reference starts in the
    same first layout)."""
    steps, gb = 8, 12
    opts = DemoOptions(workers=4, model="moe-tiny", dtype="bf16", optimizer="distributed",
                       steps=steps, schedule="3:leave=1", redis=redis_url, run_id=run_id,
                       run_dir=str(tmp_path), global_batch=gb, keep_keys_s=5)
    result = run_demo(opts)
    kinds = [(g["kind"], g["from"], g["to"]) for g in result.generations]
    assert kinds == [("start", None, "tp1pp1dp4ep4"), ("resize", "tp1pp1dp4ep4", "tp1pp1dp3")]
    assert result.migrations[0]["moved_bytes"] > 0
    assert len(result.losses) == steps and len(result.reference_losses) == steps
    assert result.max_loss_diff is not None and result.max_loss_diff <= LOSS_TOLERANCE
    assert all(code == 0 for code in result.exit_codes.values()), result.exit_codes
    _data_positions(tmp_path, steps, gb)
    assert pids_alive(result.pids) == []
