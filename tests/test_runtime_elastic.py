"""The elastic runtime end to end on a real Redis: real worker processes, real signals,
real megatron-core training on gloo, compared with a run that never resized."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from etcslurm.runtime.launcher import LOSS_TOLERANCE, DemoOptions, run_demo
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
    # joiners need ~15 s to import torch + megatron-core on 2 busy cores and are sent home
    # if the run ends first: they are spawned at step 4 of 20, and steps last >= 1.5 s, so
    # they have >= 24 s (a CI run where they had 8 unpaced steps saw them miss the run)
    steps, gb = 20, 12
    opts = DemoOptions(workers=4, steps=steps, schedule="2:leave=1;4:join=2;14:leave=2",
                       redis=redis_url, run_id=run_id, run_dir=str(tmp_path), global_batch=gb,
                       keep_keys_s=5, min_step_seconds=1.5)
    result = run_demo(opts)
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
