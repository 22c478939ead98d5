"""Checkpoint-based migration (megatron-core dist_checkpointing) between layouts.

4 real processes on gloo (``python -m etcslurm.testing.megatron_selftest migrate``): build
tp2pp2dp1, train 2 steps, save, rebuild the world in the same processes for each target
layout, load resharded into a freshly built model+optimizer, compare the global state
(gathered by key) bit for bit with the state before, train on and compare the losses with
a never-migrated run (1e-4: reduction order differs across a TP/PP/DP change).
"""

from __future__ import annotations

import pytest

from etcslurm.testing.megatron_selftest import launch

TIMEOUT_S = 420


def _check_migration(results: list[dict], targets: list[str]) -> None:
    r0 = results[0]
    ref = r0["reference_losses"]
    assert r0["losses_before"] == ref[: len(r0["losses_before"])]
    assert [t["to"] for t in r0["targets"]] == targets
    for rank in results:
        for i, target in enumerate(rank["targets"]):
            assert target["mismatched_keys"] == [], target["to"]
            assert target["keys"] >= 40
            assert target["iteration"] == 2
            after = target["losses_after"]
            assert after == r0["targets"][i]["losses_after"]  # identical on every rank
            assert after == pytest.approx(ref[2:], abs=1e-4), target["to"]
            assert after[1] < after[0] + 1e-3  # it is still training


@pytest.mark.slow
def test_checkpoint_migration_plain_adam(tmp_path) -> None:
    """tp2pp2dp1 → tp1pp2dp2 and tp2pp1dp2 through dist_checkpointing with megatron's
    persistent writer: global state bit-identical, losses continue the never-migrated run."""
    targets = ["tp1pp2dp2", "tp2pp1dp2"]
    results = launch(
        "migrate",
        4,
        ["--from", "tp2pp2dp1", "--to", *targets, "--optimizer", "adam", "--reference"],
        tmp_path,
        TIMEOUT_S,
    )
    _check_migration(results, targets)
    assert results[0]["saves"][0]["first"] is True


@pytest.mark.slow
def test_checkpoint_migration_distributed_optimizer(tmp_path) -> None:
    """Same with the distributed optimizer (fully_reshardable; step-alias workaround)."""
    targets = ["tp1pp2dp2", "tp2pp1dp2"]
    results = launch(
        "migrate",
        4,
        [
            "--from", "tp2pp2dp1", "--to", *targets, "--optimizer", "distributed",
            "--reference", "--sync-save",
        ],
        tmp_path,
        TIMEOUT_S,
    )  # fmt: skip
    _check_migration(results, targets)


_MANAGER_CHILD = """
import sys, time
from etcslurm.megatron.cpu_shim import install_if_needed
install_if_needed()
from etcslurm.baseline import writer
from megatron.core.dist_checkpointing.strategies import filesystem_async
writer.results_queue_dying_with_us()
filesystem_async._results_queue.put("ok")  # the queue works
print(writer._RESULTS_MANAGER._process.pid, flush=True)
time.sleep(600)
"""


def _child_dies_with_killed_parent(code: str, within_s: float) -> bool:
    """Run ``code`` (which prints the PID of a process it started), SIGKILL it, and say
    whether that process was gone within ``within_s``."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers import pids_alive

    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        assert pids_alive([child]) == [child]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        end = time.monotonic() + within_s
        while pids_alive([child]) and time.monotonic() < end:
            time.sleep(0.1)
        return pids_alive([child]) == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_writer_results_manager_dies_with_a_killed_trainer() -> None:
    """megatron's results-queue manager (a spawned server) must not outlive a trainer that
    is killed: it used to be left behind, ~270 MB each, after every killed run."""
    assert _child_dies_with_killed_parent(_MANAGER_CHILD, 10), \
        "the manager outlived its killed trainer"


_WRITER_CHILD = """
import sys, time
from etcslurm.megatron.cpu_shim import install_if_needed
install_if_needed()
from etcslurm.baseline.checkpoint import CheckpointMigrator
from megatron.core.dist_checkpointing.strategies import filesystem_async
import torch.distributed as dist
migrator = CheckpointMigrator(async_writer=True)
migrator.start_writer()  # before any process group exists, as a worker before it joins
caller = migrator._queue.persistent_caller
assert not dist.is_initialized() and filesystem_async._results_queue is not None
print(caller.process.pid, flush=True)
time.sleep(600)
"""


def test_the_periodic_writer_starts_before_the_worker_joins_and_dies_with_it() -> None:
    """A worker starts its checkpoint writer (megatron's persistent writer, a spawned
    interpreter) before it takes part in any world: a joiner's first save then does not
    hold its peers past the collective timeout while the writer imports torch; and the
    writer still dies with a killed worker."""
    assert _child_dies_with_killed_parent(_WRITER_CHILD, 20), \
        "the writer outlived its killed worker"
