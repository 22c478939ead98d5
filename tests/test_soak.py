"""A short chaos soak (``benchmarks/soak.py`` runs the long one): seeded random faults
in a row on one local run, each after the previous one settled, judged from what the
run published and from ``/proc``.

Seed 21 draws a leave by signal, a SIGKILL, a coordinator restart, a join and an
operator's drain: every kind of change a run meets, on the real runtime, a real
persistent Redis and real megatron-core workers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from etcslurm.testing.soak import SoakOptions, soak

pytestmark = [pytest.mark.slow, pytest.mark.waits, pytest.mark.timeout(900)]

EVENTS = 5


def test_soak_of_faults_in_a_row_loses_nothing_and_leaks_nothing(tmp_path: Path) -> None:
    # the faults as they strike, shown with a failure's report
    report = soak(SoakOptions(events=EVENTS, seed=21, steps=40, run_dir=str(tmp_path / "run"),
                              settle_timeout=180.0, timeout=600.0),
                  progress=lambda line: print(line, flush=True))
    kinds = [f["kind"] for f in report["faults"]]
    assert report["error"] is None and report["stalled"] is None, (report["error_detail"],
                                                                   report)
    assert report["survived"] and report["steps_trained"] == report["steps"]
    assert report["events"] == EVENTS, kinds
    assert {"leave", "kill", "redis_restart", "join", "drain"} <= set(kinds), kinds
    assert all(f["settled_s"] is not None for f in report["faults"][:-1]), report["faults"]
    # every step trained once (a rollback's re-trained steps accounted for)
    assert report["samples_once"], report["samples_detail"]
    assert report["loss_match"], report["max_abs_dloss"]
    assert report["bytes_lost"] == 0
    assert report["generations"] >= EVENTS  # each fault but the coordinator restart changes
    assert report["leftovers"] == {"processes": [], "shm_segments": []}
