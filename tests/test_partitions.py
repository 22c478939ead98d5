"""Network partitions on real elastic runs: workers on test hosts of their own (network
namespaces joined by a bridge, :mod:`etcslurm.testing.netns`), their links cut, healed
and slowed while they train.

One run of 4 workers meets, one after another:

- a worker cut off from the coordinator but not from its peers: its heartbeats stop, the
  others take it for dead and go on without it; healed, it finds itself out and exits;
- a worker cut off from its peers but not from the coordinator: the next collective
  fails on every side; it goes on beating, yet the survivors' rebuild does not wait for
  it forever: it is dropped, the run goes on, and once healed it finds itself out;
- a joiner behind a slow, lossy link (a token bucket whose small queue drops packets):
  its state arrives over it, checksummed, and training goes on bit for bit.

The losses equal a run that never resized; nothing of the test network is left after.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from etcslurm.local.launcher import LOSS_TOLERANCE, DemoOptions, run_demo
from etcslurm.redis_host.server import BundledRedis
from etcslurm.testing import netns
from etcslurm.testing.fault_harness import COLLECTIVE_TIMEOUT, DEAD_AFTER, run_events
from tests.helpers import pids_alive

pytestmark = [pytest.mark.slow, pytest.mark.waits, pytest.mark.timeout(900)]

NODES = ["n0", "n1", "n2", "n3", "j0"]


@pytest.fixture
def network() -> Any:
    why = netns.available()
    if why is not None:
        pytest.fail(f"the partition tests need network namespaces: {why}")
    with netns.TestNetwork(NODES) as net:
        yield net
    assert net.leftovers() == [], "the test network must be removed"


class Partitions:
    """The on_tick hook: one partition at a time, each healed once the run went on."""

    def __init__(self, net: netns.TestNetwork) -> None:
        self.net = net
        self.phase = "start"
        self.log: list[tuple[str, int, float]] = []
        self.cut_workers: dict[str, str] = {}

    def _note(self, what: str, run: Any) -> None:
        self.log.append((what, run.step, time.time()))

    def _worker_on(self, run: Any, node: str) -> str | None:
        return next((wp.worker_id for wp in run.procs if wp.node == node), None)

    def _without(self, run: Any, worker: str) -> bool:
        return run.record is not None and worker not in run.record.workers_by_rank() \
            and run.step > (run.record.step or 0)

    def __call__(self, run: Any) -> None:
        if self.phase == "start" and run.step >= 2 and run.record is not None:
            self.cut_workers["coordinator"] = self._worker_on(run, "n3")
            self.net.cut("n3", coordinator=True)
            self.phase = "cut-coordinator"
            self._note("cut n3 from the coordinator", run)
        elif self.phase == "cut-coordinator" and self._without(run,
                                                               self.cut_workers["coordinator"]):
            self.net.heal()
            self.phase = "healed-coordinator"
            self._note("healed n3", run)
        elif self.phase == "healed-coordinator" and run.step >= self.log[-1][1] + 2:
            self.cut_workers["peers"] = self._worker_on(run, "n2")
            self.net.cut("n2", peers=True)
            self.phase = "cut-peers"
            self._note("cut n2 from its peers", run)
        elif self.phase == "cut-peers" and self._without(run, self.cut_workers["peers"]):
            self.net.heal()
            self.phase = "healed-peers"
            self._note("healed n2", run)
        elif self.phase == "healed-peers" and run.step >= self.log[-1][1] + 2:
            self.net.shape("j0", rate="8mbit", queue="12kb")
            run.spawn_joiners(1)
            self.phase = "slow-joiner"
            self._note("a joiner behind a slow, lossy link", run)
        elif self.phase == "slow-joiner" and run.record is not None \
                and self._worker_on(run, "j0") in run.record.workers_by_rank() \
                and run.step > (run.record.step or 0):
            self.phase = "done"
            self._note("the joiner trains", run)


def test_partitions_of_a_worker_from_the_coordinator_from_its_peers_and_a_slow_link(
        network: netns.TestNetwork, tmp_path: Path) -> None:
    server = BundledRedis(tmp_path / "redis", host=network.host_ip).start()
    hook = Partitions(network)
    try:
        opts = DemoOptions(
            workers=4, steps=30, schedule="", redis=server.url,
            password_file=str(server.password_file), run_id="partitions",
            run_dir=str(tmp_path / "run"), global_batch=12, gpus_per_node=1,
            dead_after=DEAD_AFTER, collective_timeout=COLLECTIVE_TIMEOUT,
            min_step_seconds=0.5, keep_keys_s=60, timeout=600,
            worker_module="etcslurm.testing.worker",
            worker_args=("--netns", network.prefix, "--faults", "{}"))
        result = run_demo(opts, on_tick=hook)
        events = run_events(server.url, str(server.password_file), "partitions")
        drops = network.drops("j0")
    finally:
        server.stop()
    for what, step, ts in hook.log:
        print(f"step {step:3d} {ts:.1f}: {what}")
    print("generations:", [(g["generation"], g["kind"], g["to"], g["dead"], g["leaving"],
                            g["joining"]) for g in result.generations])
    print("exit codes:", result.exit_codes, "drops:", drops)
    assert hook.phase == "done", hook.log
    assert len(result.losses) == 30
    assert result.max_loss_diff is not None and result.max_loss_diff <= LOSS_TOLERANCE
    cut_c, cut_p = hook.cut_workers["coordinator"], hook.cut_workers["peers"]
    dead = [w for g in result.generations for w in g["dead"]]
    assert cut_c in dead and cut_p in dead, result.generations
    assert pids_alive(result.pids) == []
    errors = [e for e in events if e["type"] == "error"]
    print("errors:", [(e["worker"], e["data"].get("message", "")[:160]) for e in errors])
    assert drops > 0, "the slow link dropped nothing: not lossy"
