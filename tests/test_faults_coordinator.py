"""Fault injection on real elastic runs whose coordinator goes away for a while: its Redis
hung for 30 s, and restarted mid-run.  Nobody is taken for dead, no step waits for it,
and nothing the run published is lost.

The scenarios are ``etcslurm/testing/fault_scenarios.py``'s, asserted as in
``tests/test_faults.py``.  Unlike that module's runs, these are not paced by detection
timers (no peer dies), so sbin/test runs them with the main tests: they balance the two
pytests it runs side by side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from etcslurm.local.launcher import LOSS_TOLERANCE
from etcslurm.testing import fault_scenarios as fm
from tests.test_faults import STEPS, _assert_completed, _kinds, _measured


@pytest.mark.slow
@pytest.mark.redis
def test_training_goes_on_while_redis_is_unreachable_for_30_s(
        reference: Any, tmp_path: Path) -> None:
    """Redis hung for 30 s (longer than ``dead_after`` and ``collective_timeout``, which
    keep their 10 s defaults): no step waits for it, nobody is taken for dead, and the
    events of the steps trained meanwhile arrive once it answers."""
    row = _measured(fm.redis_unreachable(None, None, tmp_path, STEPS, None, outage=30.0),
                    reference)
    _assert_completed(row, 12)
    assert _kinds(row) == [("start", None, "tp1pp1dp3")]  # no resize, nobody lost
    assert row.detail["steps_during_outage"] >= 3, row.detail
    # one call met the hung server (rank 0's; reachability is then judged by the
    # heartbeat, so no later step waits for a socket timeout), not one per step or call;
    # rank 0 kept the events of the steps trained meanwhile and sent them once it answered
    (back,) = row.detail["coordinator_back"]
    assert back["failed_calls"] == 1, back
    assert back["kept_events"] >= row.detail["steps_during_outage"], (back, row.detail)
    # no step waited for the server to answer again
    assert row.recover_s is not None and row.recover_s < row.detail["outage_s"], row.recover_s
    assert all(code == 0 for code in row.result.exit_codes.values())


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.parametrize("outage", [0.0])
def test_redis_restart_mid_run(outage: float, redis_url: str,
                               reference: Any, tmp_path: Path) -> None:
    row = _measured(fm.redis_restart(None, None, tmp_path, STEPS, None, outage=outage),
                   reference)
    res = row.result
    assert row.error is None, row.error
    assert res is not None and sorted(res.losses) == list(range(1, STEPS + 1))
    assert row.max_loss_diff is not None and row.max_loss_diff <= LOSS_TOLERANCE
    assert [g["kind"] for _, g in sorted(row.records.items())] == ["start"]  # no resize needed
    assert all(code == 0 for code in res.exit_codes.values()), res.exit_codes
    assert row.recover_s is not None
