"""Operations on the REAL local Slurm cluster: autogrow, preemption and a drain in one run.

One run (the run file's ``[autogrow]``: its first job runs ``etcslurm autogrow`` beside
the workers) starts on one node and grows to 3 by itself; a ``high`` job preempts 2 of
its nodes (their workers hand their state over and leave, their jobs end COMPLETED);
autogrow takes the idle node, then the freed ones, back to 3 and never above; an
administrator drains a node of the run: its worker leaves at the next step boundary
(``node.released``), its job ends COMPLETED, the node reaches DRAINED with no job
killed.  Losses equal a run that never resized, every sample is trained once, and after
the run no job of it is left in squeue.  One run for all three: the cluster's reaction
times, not training, are what these checks wait for.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import job_state, sh
from tests.test_slurm_elastic import (
    GLOBAL_BATCH,
    MODEL,
    REFERENCE_STEPS,
    RUN_TIMEOUT,
    SEED,
    SLURM_TIMER,
    ReferenceLosses,
    Run,
    check_data_once,
    check_losses,
    partition,  # noqa: F401 (a fixture)
    wait_for,
)

pytestmark = [pytest.mark.slurm, pytest.mark.waits, pytest.mark.slow, pytest.mark.timeout(1500)]

# paced at >= 3 s; the run stands still while it resizes, yet the scenario below took
# from 14-16 of its steps (a quiet 2-core host) to 32 (the same host running the rest of
# the suite beside it: Slurm starts, preempts and requeues more slowly, the steps do not):
# 48 leave room for that without a long tail after the last check (a check before the
# drain names a run too short for it); the shared reference trains as many
STEPS = REFERENCE_STEPS
MAX_NODES = 3
HIGH_SLEEP = 20  # seconds the high job holds the two preempted nodes


@pytest.fixture(scope="module")
def reference(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> ReferenceLosses:
    return ReferenceLosses(redis_url, tmp_path_factory, STEPS)


def run_file(run_id: str, redis_url: str, part: str) -> str:
    return f"""run_id = "{run_id}"

[run]
model = "{MODEL}"
global_batch = {GLOBAL_BATCH}
steps = {STEPS}
seed = {SEED}

[worker]
min_step_seconds = 3
collective_timeout = 60
dead_after = 20

[slurm]
nodes = 1
partition = "{part}"
exclusive = true
time = "30"
redis_url = "{redis_url}"

[autogrow]
max_nodes = {MAX_NODES}
interval = 2
start_timeout = 90
"""


def node_state(node: str) -> str:
    return sh("sinfo", "-h", "-N", "-n", node, "-p", "debug", "-o", "%T")


class JobStates:
    """The last state squeue showed of every job of the run (squeue forgets a finished
    job after MinJobAge, 300 s on the local cluster: the run outlives that)."""

    def __init__(self, run_id: str) -> None:
        self.names = f"{run_id},{run_id}-autogrow"
        self.last: dict[str, str] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.stop.wait(1.0):
            try:
                out = sh("squeue", "-h", "-t", "all", "-n", self.names, "-o", "%i|%T")
            except Exception:  # slurmctld busy: next time
                continue
            for line in out.splitlines():
                jid, _, state = line.partition("|")
                self.last[jid] = state

    def close(self) -> dict[str, str]:
        self.stop.set()
        self.thread.join(10)
        return dict(self.last)


def test_autogrow_preemption_and_drain_in_one_run(
        partition: str, tmp_path: Path, redis_url: str,  # noqa: F811
        run_id: str, reference: ReferenceLosses) -> None:
    (tmp_path / "run.toml").write_text(run_file(run_id, redis_url, partition))
    run_dir = tmp_path / "runs" / run_id
    # the workers look at their node every second (default 30 s)
    env = dict(os.environ, ETCSLURM_NODE_WATCH_S="1",
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    out = subprocess.run(["etcslurm", "submit", "run.toml"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    first = re.search(r"as job (\d+)", out).group(1)
    seen = JobStates(run_id)
    jobs = [first]
    drained: str | None = None
    high: str | None = None
    passed = False
    t0 = time.time()
    run = Run(redis_url, run_id, 1, run_dir, store_spec=False, steps=STEPS)
    try:
        def worlds() -> list[int]:
            return [g["world"] for g in run.generations()]

        def autogrow_jobs() -> list[str]:
            return [j for e in run.of("autogrow") if e["data"]["action"] == "submit"
                    for j in e["data"]["jobs"]]

        # 1. one node, then 3 by itself
        run.wait(lambda: worlds() and worlds()[-1] == MAX_NODES, RUN_TIMEOUT / 3,
                 "autogrow to grow the run to 3 nodes")
        grown_at = run.step()
        members = run.coord.members()
        world = run.world()
        grown = [a["worker"] for a in world["assignment"]
                 if members[a["worker"]]["slurm_job"] != first]
        victims = {w: members[w] for w in grown}
        assert len(victims) == 2, victims

        # 2. a high-priority job preempts those 2 nodes
        nodes = sorted(v["node"] for v in victims.values())
        high = sh("sbatch", "--parsable", "-p", "high", "-N2", "--exclusive",
                  "-w", ",".join(nodes), "-o", str(tmp_path / "high-%j.out"),
                  "--wrap", f"sleep {HIGH_SLEEP}")
        run.wait(lambda: all(run.gone_at(w) for w in victims), SLURM_TIMER + 180,
                 "the 2 preempted workers to leave")
        preempted_at = run.step()
        for v in victims.values():  # they left by themselves: COMPLETED, not requeued
            wait_for(lambda v=v: job_state(v["slurm_job"]) == "COMPLETED", 60,
                     f"preempted job {v['slurm_job']} to end")
        signals = {e["worker"] for e in run.of("worker.signal")}
        assert set(victims) <= signals

        # 3. back to 3: the idle node at once, the freed ones once the high job ends
        n_gen = len(run.generations())
        run.wait(lambda: MAX_NODES in worlds()[n_gen:], RUN_TIMEOUT / 3,
                 "autogrow to grow the run back to 3 nodes")
        regrown_at = run.step()

        # 4. an administrator drains a grown node of the run
        assert run.step() < STEPS - 5, (
            f"at step {run.step()} of {STEPS} before the drain: too few steps left for it")
        world = run.world()
        members = run.coord.members()
        leaver = next(a["worker"] for a in world["assignment"]
                      if members[a["worker"]]["slurm_job"] != first)
        drained = members[leaver]["node"]
        drain_job = members[leaver]["slurm_job"]
        sh("scontrol", "update", f"NodeName={drained}", "State=DRAIN", "Reason=etcslurm-test")
        released = run.wait(lambda: next((e for e in run.of("node.released")
                                          if e["worker"] == leaver), None), 60,
                            "the drained node's worker to say it leaves")["data"]
        assert released["node"] == drained and "draining (etcslurm-test)" in released["reason"]
        shrink = run.wait(lambda: next((g for g in run.generations()
                                        if leaver in g.get("leaving", [])), None), 120,
                          "the generation without the drained node's worker")
        assert shrink["world"] == MAX_NODES - 1
        wait_for(lambda: job_state(drain_job) == "COMPLETED", 90, "the drained node's job to end")
        wait_for(lambda: node_state(drained) == "drained", 60, f"{drained} to be DRAINED")
        drained_at = run.step()

        run.wait(run.finished, RUN_TIMEOUT, "the run to finish")
        jobs += autogrow_jobs()
        # no leftovers: every job of the run ended (autogrow cancelled what was pending)
        wait_for(lambda: not sh("squeue", "-h", "-n", f"{run_id},{run_id}-autogrow", "-o", "%i"),
                 120, "no job of the run left in squeue")
        passed = True
    finally:
        seen.stop.set()
        if not passed:
            for f in sorted(run_dir.glob("*.out")) + sorted(run_dir.glob("autogrow-*.log")):
                print(f"---- {f.name}\n{f.read_text()[-3000:]}")
            subprocess.run(["scancel", "-n", f"{run_id},{run_id}-autogrow"], capture_output=True,
                           timeout=30, check=False)
        if high:
            subprocess.run(["scancel", high], capture_output=True, timeout=30, check=False)
        if drained:
            subprocess.run(["scontrol", "update", f"NodeName={drained}", "State=RESUME"],
                           capture_output=True, timeout=30, check=False)
    took = time.time() - t0
    last = seen.close()
    assert max(worlds()) == MAX_NODES, f"worlds: {worlds()}"  # never above its cap
    states = {j: job_state(j) or last.get(j, "?") for j in jobs}
    assert all(s in ("COMPLETED", "CANCELLED") for s in states.values()), states
    ran = [j for j in jobs if states[j] == "COMPLETED"]
    assert first in ran and drain_job in ran and len(ran) >= 5, states  # none killed
    cancelled = [j for j in jobs if states[j] == "CANCELLED"]
    cancels = {j for e in run.of("autogrow") if e["data"]["action"] == "cancel"
               for j in e["data"]["jobs"]}
    assert set(cancelled) <= cancels, "a job was cancelled that autogrow did not cancel"
    # autogrow stopped: on the end record, or on the first job's exit (its batch shell's trap)
    run.wait(lambda: any(e["data"]["action"] == "stop" for e in run.of("autogrow")), 60,
             "autogrow's stop event")
    diff = check_losses(run, reference)
    dp = check_data_once(run_dir, STEPS)
    assert {1, 2, 3} <= set(dp.values()), dp
    print(f"\nrun took {took:.0f} s; at 3 nodes by step {grown_at}, preempted ones gone by "
          f"{preempted_at}, back to 3 by {regrown_at}, {drained} DRAINED by {drained_at} of "
          f"{STEPS}; worlds {worlds()}; jobs {states}; max |loss - reference| = {diff:.3g}")
    run.close()
