"""The REAL elastic runtime on the REAL local Slurm cluster (sbin/slurm-cluster).

Workers are the real elastic worker (``etcslurm.runtime.worker``, paced by its
``--min-step-seconds`` so a run outlives Slurm's reaction times) started by ``templates/elastic.sbatch``
/ ``grow.sbatch`` (or by Submitit); "preemption" is a job in the ``high`` partition
taking a node, so Slurm itself signals (``preempt_send_user_signal``: USR2) and, after
the partition's GraceTime, kills.  Each test checks the loss curve against a
one-worker run that never resized (``etcslurm demo`` machinery, same run spec) and that
every sample of every step was consumed exactly once (the workers' data-position logs).

The coordinator is the test Redis (``redis_url``: the template's "an existing
coordinator" path), so the test reads the run's event stream while it runs and after it
ended.  Timing tolerances follow slurmctld's 30 s timer (design.md).  Kept small for 2
shared cores: a 2-layer GPT, few steps, global batch 12.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from etcslurm.coord.client import connect
from etcslurm.coord.coordinator import Coordinator
from etcslurm.core.models import GPTSpec
from etcslurm.errors import EtcslurmError
from etcslurm.local.launcher import LOSS_TOLERANCE, DemoOptions, run_demo
from etcslurm.runtime.config import RunSettings
from etcslurm.slurm.submission import grow, submit
from tests.helpers import SHARED, Background, cluster_state, free_nodes, job_state, settle_jobs, sh
from tests.helpers import wait_for as _wait_for

# the runs train real models on 2 shared cores: allow more than the default 600 s
pytestmark = [pytest.mark.slurm, pytest.mark.waits, pytest.mark.slow, pytest.mark.timeout(1500)]

SLURM_TIMER = 30.0  # slurmctld checks signals, time limits and grace times every 30 s
# The runs use a preemptable partition with a production-like GraceTime (`elastic`, the
# README's): the lab's debug partition has 10 s, less than one training step takes on 2
# heavily shared cores (a signalled worker must first finish its step; 10-12 s there).
README = Path(__file__).resolve().parents[1] / "README.md"


def readme_slurm() -> tuple[str, list[str]]:
    """The README's Slurm section: its run file, and its commands (comments dropped)."""
    text = README.read_text()
    block = text.split("<!-- slurm-readme:start")[1].split("<!-- slurm-readme:end -->")[0]
    toml = re.search(r"```toml\n(.*?)```", block, re.S).group(1)
    bash = re.search(r"```bash\n(.*?)```", block, re.S).group(1)
    return toml, [ln for ln in bash.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


#: the README's run file names the local cluster's `elastic` partition (the fixture
#: creates it on a cluster started before sbin/slurm-cluster had it)
PARTITION = tomllib.loads(readme_slurm()[0])["slurm"]["partition"]
GRACE = 60.0
MODEL = "layers=2,hidden=64,heads=4,vocab=512,seq=32"  # smaller than gpt-tiny: 2 cores
STEPS = 24
GLOBAL_BATCH = 12
SEED = 4321
RUN_TIMEOUT = 900.0  # a whole run on 2 heavily shared cores
# The real worker, each step lasting >= 3 s (its --min-step-seconds): on idle CPUs
# this model trains a step in ~0.1 s and the run would end before Slurm or a joining
# job's imports could take part.  Collective timeout: workers of different Slurm jobs
# start seconds apart on a loaded machine.
STEP_SECONDS = 3
WORKER_ARGS = ["--min-step-seconds", str(STEP_SECONDS), "--collective-timeout", "60",
               "--dead-after", "20"]
WORKER_MODULE = "etcslurm.runtime.worker"


# ---------------------------------------------------------------------------- helpers
#: squeue/scontrol are polled every 0.5 s here (long waits on a 2-core host)
wait_for = functools.partial(_wait_for, every=0.5)







def preempt_node(node: str, out: Path) -> str:
    """A high-partition job on ``node``: Slurm preempts whatever low-priority job runs there."""
    return sh("sbatch", "--parsable", "-p", "high", "-N1", "--exclusive", "-w", node,
              "-o", str(out / "high-%j.out"), "--wrap", "sleep 1")


def run_settings(workers: int) -> RunSettings:
    return RunSettings(model=GPTSpec.parse(MODEL), global_batch=GLOBAL_BATCH, seed=SEED,
                       steps=STEPS, initial_workers=workers, gpus_per_node=1)


class Run:
    """The run as the coordinator's event stream shows it (read incrementally)."""

    def __init__(self, redis_url: str, run_id: str, initial_workers: int, run_dir: Path,
                 store_spec: bool = True, steps: int = STEPS) -> None:
        self.run_id, self.run_dir, self.steps = run_id, run_dir, steps
        self.coord = Coordinator(connect(redis_url), run_id)
        if store_spec:  # the run spec every worker reads (a run file's job stores its own)
            self.coord.ensure_spec(run_settings(initial_workers).to_json())
        self.last = "0"
        self.events: list[dict[str, Any]] = []
        self.losses: dict[int, list[float]] = {}

    def poll(self) -> None:
        for ev in self.coord.read_events(self.last, block_ms=200):
            self.last = ev["id"]
            self.events.append(ev)
            if ev["type"] == "step":
                self.losses.setdefault(int(ev["data"]["step"]), []).append(float(ev["data"]["loss"]))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    def generations(self) -> list[dict[str, Any]]:
        return [e["data"] for e in self.of("generation.start")]

    def step(self) -> int:
        return max(self.losses, default=0)

    def wait(self, pred: Callable[[], Any], timeout: float, what: str) -> Any:
        def check() -> Any:
            self.poll()
            return pred()
        try:
            return wait_for(check, timeout, f"{what} (run {self.run_id} at step {self.step()})",
                            every=0.1)
        except AssertionError as exc:  # say who was there and what Slurm did meanwhile
            try:
                members: Any = {w: {k: i.get(k) for k in ("state", "alive", "node", "slurm_job")}
                                for w, i in self.coord.members(deadline=5).items()}
            except EtcslurmError as unread:
                members = f"unreadable ({unread})"
            raise AssertionError(f"{exc}\nmembers: {members}\n{cluster_state()}") from None

    def world(self) -> dict[str, Any]:
        rec = self.coord.current_generation()
        assert rec is not None
        return rec.to_dict()

    def finished(self) -> bool:
        """Rank 0 reported the last step and every worker has left (its data log is
        complete: the others log their last step after rank 0 reported it)."""
        return self.step() >= self.steps and all(
            i["state"] == "gone" for i in self.coord.members().values())

    def gone_at(self, worker: str) -> float | None:
        for e in self.of("worker.state"):
            if e["worker"] == worker and e["data"].get("state") == "gone":
                return e["ts"]
        return None

    def close(self) -> None:
        self.coord.end_run(keep_s=0)


def check_losses(run: Run, losses: ReferenceLosses) -> float:
    """Every step once, in order, each loss within LOSS_TOLERANCE of the reference."""
    reference = losses.get()
    assert sorted(run.losses) == list(range(1, run.steps + 1)), f"steps seen: {sorted(run.losses)}"
    assert all(len(v) == 1 for v in run.losses.values()), "a step was emitted twice"
    diff = max(abs(run.losses[s][0] - reference[s]) for s in run.losses)
    table = [(s, round(run.losses[s][0], 7), round(reference[s], 7)) for s in sorted(run.losses)]
    assert diff <= LOSS_TOLERANCE, (
        f"loss differs from the no-resize reference by {diff:.3g}: (step, run, reference) {table}")
    return diff


def check_data_once(run_dir: Path, steps: int = STEPS) -> dict[int, int]:
    """Sample ranges per step from all workers: each step covers [s·B, (s+1)·B) exactly
    once.  Returns the DP degree each step ran with."""
    per_step: dict[int, list[tuple[int, int]]] = {}
    dp: dict[int, int] = {}
    for path in run_dir.glob("data-*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            per_step.setdefault(rec["step"], []).append((rec["start"], rec["stop"]))
            dp[rec["step"]] = rec["dp"]
    assert sorted(per_step) == list(range(steps)), f"steps logged: {sorted(per_step)}"
    for step, ranges in per_step.items():
        covered = sorted(i for a, b in ranges for i in range(a, b))
        assert covered == list(range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)), (
            f"step {step}: samples {covered}")
    return dp


def _log_tail(path: Path, chars: int = 3000) -> str:
    """The end of a job's output without the libraries' import warnings (they would fill
    the excerpt a failure shows)."""
    lines = [ln for ln in path.read_text(errors="replace").splitlines()
             if "Warning" not in ln and "warnings.warn" not in ln]
    return "\n".join(lines)[-chars:]


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def partition(slurm_cluster: str) -> Iterator[str]:
    """A low-priority partition (preempted by ``high`` with REQUEUE after GRACE seconds)
    on the lab's nodes, created for these tests and deleted afterwards."""
    nodes = sh("sinfo", "-h", "-p", "debug", "-o", "%N")
    fields = [f"PartitionName={PARTITION}", f"Nodes={nodes}", "PriorityTier=1",
              "PreemptMode=REQUEUE", f"GraceTime={GRACE:.0f}", "OverSubscribe=NO", "State=UP"]
    existed = PARTITION in sh("sinfo", "-h", "-o", "%R").split()
    sh("scontrol", "update" if existed else "create", *fields)
    yield PARTITION
    if not existed:
        subprocess.run(["scontrol", "delete", f"PartitionName={PARTITION}"], capture_output=True,
                       timeout=30, check=False)


@pytest.fixture
def jobs(partition: str) -> Iterator[list[str]]:
    """Job ids a test submitted; cancelled afterwards whatever happened.  The test starts
    once every node of the partition is idle (it submits one job per node)."""
    free_nodes(partition)
    ids: list[str] = []
    yield ids
    settle_jobs(ids)


#: the reference's steps: the longest run of these modules (test_slurm_ops); its first
#: steps are those of a shorter run's reference (the learning-rate schedule does not
#: depend on the run's length)
REFERENCE_STEPS = 48


def _train_reference(redis_url: str, out: Path) -> dict[int, float]:
    res = run_demo(DemoOptions(workers=1, schedule="", model=MODEL, steps=REFERENCE_STEPS,
                               global_batch=GLOBAL_BATCH, seed=SEED, gpus_per_node=1,
                               redis=redis_url, run_id=f"ref-{out.name}",
                               run_dir=str(out), reference=False, timeout=RUN_TIMEOUT,
                               keep_keys_s=0))
    assert sorted(res.losses) == list(range(1, REFERENCE_STEPS + 1))
    return res.losses


class ReferenceLosses:
    """Loss per step of one local worker that never resizes (same run spec): trained
    once, in a thread started by the first test that asks, for every module that checks
    against it; it trains while that test's Slurm jobs start and run."""

    def __init__(self, redis_url: str, tmp_path_factory: pytest.TempPathFactory,
                 steps: int) -> None:
        assert steps <= REFERENCE_STEPS, steps
        self.steps = steps
        if "slurm reference" not in SHARED:
            out = tmp_path_factory.mktemp("reference")
            SHARED["slurm reference"] = Background(lambda: _train_reference(redis_url, out),
                                                   "the Slurm tests' reference run")
        self.run: Background = SHARED["slurm reference"]

    def get(self) -> dict[int, float]:
        return {s: loss for s, loss in self.run.get(RUN_TIMEOUT).items() if s <= self.steps}


@pytest.fixture(scope="module")
def reference(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> ReferenceLosses:
    return ReferenceLosses(redis_url, tmp_path_factory, STEPS)


# ---------------------------------------------------------------------------- tests
def shell(line: str, cwd: Path) -> str:
    """Run one README line in bash, with this test's Python's ``etcslurm`` first on PATH."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    res = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=120, check=False)
    assert res.returncode == 0, f"{line!r} exit {res.returncode}: {res.stderr[-2000:]}"
    return res.stdout


def test_readme_slurm_section_runs_as_written(
        jobs: list[str], tmp_path: Path, reference: ReferenceLosses) -> None:
    """The README's run file and commands, as written: 4 one-node jobs start their own
    coordinator and store the run spec → a high job preempts one → its worker hands over
    and exits inside the grace time → 3 ranks → `etcslurm grow run.toml --nodes 1` → 4."""
    toml, commands = readme_slurm()
    assert len(commands) == 3, commands
    dry_run, submit_line, grow_line = commands
    (tmp_path / "run.toml").write_text(toml)
    run_id = tomllib.loads(toml)["run_id"]
    run_dir = tmp_path / "runs" / run_id
    script = shell(dry_run, tmp_path)
    assert "#SBATCH --array=0-3" in script and f"#SBATCH --partition={PARTITION}" in script
    job = re.search(r"as job (\d+)", shell(submit_line, tmp_path)).group(1)
    jobs.append(job)
    passed = False
    try:
        url = wait_for(lambda: (run_dir / "coordinator.url").is_file()
                       and (run_dir / "coordinator.url").read_text().strip(), RUN_TIMEOUT / 3,
                       "the run's coordinator URL (array task 0 starts it)")
        run = Run(url, run_id, 4, run_dir, store_spec=False)
        # what the job stored is the spec the reference trained (README = these constants)
        assert run.wait(run.coord.run_spec, 60, "the run spec") == run_settings(4).to_json()
        run.wait(lambda: run.step() >= 2, RUN_TIMEOUT / 2, "4 workers training")
        gen0 = run.world()
        assert gen0["kind"] == "start" and gen0["world"] == 4
        members = run.coord.members()
        # array task 3: its node hosts no coordinator site (tasks 0-2 do)
        victim = next(w for w, i in members.items() if int(i["slurm_array_task"]) == 3)
        info = members[victim]
        t0 = time.time()
        jobs.append(preempt_node(info["node"], tmp_path))

        signal = run.wait(lambda: next((e for e in run.of("worker.signal")
                                        if e["worker"] == victim), None),
                          SLURM_TIMER + 120, "the victim's leave signal")["data"]
        assert signal["signal"] == "USR2"  # the job's --signal, sent on preemption
        assert signal["received_at"] - t0 <= SLURM_TIMER + 5
        # min(lead 90, the partition's GraceTime as etcslurm.job.grace read it, end)
        assert signal["budget_s"] == pytest.approx(GRACE, abs=0.5)
        shrink = run.wait(lambda: next((g for g in run.generations()
                                        if victim in g.get("leaving", [])), None),
                          300, "the generation without the victim")
        assert shrink["kind"] == "resize" and shrink["world"] == 3
        assert victim not in [a["worker"] for a in shrink["assignment"]]

        # growth: a further job (it starts on the node the high job frees)
        before = run.step()
        jobs.append(re.search(r"submitted job (\S+)", shell(grow_line, tmp_path)).group(1))
        gone = run.wait(lambda: run.gone_at(victim), 120, "the victim to leave")
        assert gone - signal["received_at"] <= GRACE, "the victim left after the grace time"
        # it exited by itself: its job COMPLETED (not killed by Slurm, not requeued)
        wait_for(lambda: job_state(info["slurm_job"]) == "COMPLETED", 60, "the victim's job to end")
        grown = run.wait(lambda: next((g for g in run.generations()
                                       if g["kind"] == "resize" and g.get("joining")), None),
                         RUN_TIMEOUT / 2, "the joiner to be taken in")
        assert grown["world"] == 4 and len(grown["joining"]) == 1
        run.wait(run.finished, RUN_TIMEOUT, "the run to finish")
        passed = True
    finally:
        if not passed:
            for out in sorted(run_dir.glob("*.out")):
                print(f"---- {out.name}\n{_log_tail(out)}")
            _stop_sites(run_dir / f"coordinator-{job}", jobs)
    assert before < grown["step"] < STEPS, "the grown generation trained"
    diff = check_losses(run, reference)
    dp = check_data_once(run_dir)
    assert {dp[s] for s in range(STEPS)} >= {3, 4}, f"DP degrees per step: {dp}"
    assert len(run.of("migration.done")) == 2
    print(f"max |loss - reference| = {diff:.3g}; leave took {gone - signal['received_at']:.1f} s")
    run.coord.client.close()  # the run's coordinator went with its jobs: nothing to end


def test_submitit_run_grows_and_survives_preemption(
        jobs: list[str], tmp_path: Path, redis_url: str, run_id: str,
        reference: ReferenceLosses) -> None:
    """The same flows through Submitit from Python: start with one task, grow by two
    single-node jobs (each preemptable alone), preempt one of them."""
    run_dir = tmp_path / "run"
    run = Run(redis_url, run_id, 1, run_dir)
    argv = ["--run-dir", str(run_dir), *WORKER_ARGS]
    folder = tmp_path / "submitit"
    res = submit(f"{WORKER_MODULE}:main", argv, via="submitit", cluster="slurm",
                 run_id=run_id, nodes=1, redis_url=redis_url, partition=PARTITION,
                 time_limit=20, folder=folder, slurm_params={"exclusive": True})
    jobs.append(res.job_id)
    run.wait(lambda: run.step() >= 1, RUN_TIMEOUT / 2, "the first worker training")
    g = grow(run_id, 2, f"{WORKER_MODULE}:main", argv, redis_url=redis_url,
             via="submitit", cluster="slurm", split=True, partition=PARTITION, time_limit=20,
             folder=folder, slurm_params={"exclusive": True})
    jobs.extend(g.job_id.split(","))
    grown = run.wait(lambda: next((x for x in run.generations()
                                   if x["kind"] == "resize" and x.get("world") == 3), None),
                     RUN_TIMEOUT / 2, "the two joiners to be taken in")
    # the two joiners may be taken in at one boundary or at two
    joined = [w for x in run.generations() if x["kind"] == "resize" for w in x["joining"]]
    assert len(joined) == 2 and grown["joining"], f"joined: {joined}"
    # preempt one joined node (its own Submitit array task: Slurm preempts whole jobs)
    victim = next(a for a in grown["assignment"] if a["worker"] == grown["joining"][-1])
    info = run.coord.members()[victim["worker"]]
    jobs.append(preempt_node(info["node"], tmp_path))
    shrink = run.wait(lambda: next((x for x in run.generations()
                                    if victim["worker"] in x.get("leaving", [])), None),
                      SLURM_TIMER + 300, "the generation without the victim")
    assert shrink["world"] == 2
    signal = next(e["data"] for e in run.of("worker.signal") if e["worker"] == victim["worker"])
    gone = run.wait(lambda: run.gone_at(victim["worker"]), 120, "the victim to leave")
    assert gone - signal["received_at"] <= GRACE
    run.wait(run.finished, RUN_TIMEOUT, "the run to finish")
    check_losses(run, reference)
    dp = check_data_once(run_dir)
    assert {dp[s] for s in range(STEPS)} >= {1, 2, 3}, f"DP degrees per step: {dp}"
    first = res.job
    wait_for(first.done, 120, "the first Submitit job to return", every=1)
    assert first.result() == 0  # main() returned 0: finished normally
    run.close()


def test_whole_run_preempted_checkpoints_requeues_and_resumes(
        jobs: list[str], tmp_path: Path, redis_url: str, run_id: str,
        reference: ReferenceLosses) -> None:
    """Nothing survives → checkpoint → the job requeues itself → the restarted job
    resumes at the checkpoint's step: no step redone, none skipped, losses continue."""
    run_dir = tmp_path / "run"
    run = Run(redis_url, run_id, 2, run_dir)
    # paced until the preemption (the run must still train when the signal comes); the
    # requeued job trains the rest unpaced: nothing it does waits for a slow step
    unpaced_restart = ('export ETCSLURM_MIN_STEP_SECONDS='
                       f'$([ "${{SLURM_RESTART_COUNT:-0}}" = 0 ] && echo {STEP_SECONDS} || echo 0)')
    cmd = f"{sys.executable} -m {WORKER_MODULE} " + " ".join(WORKER_ARGS[2:])
    res = submit(cmd, run_id=run_id, nodes=2, redis_url=redis_url, partition=PARTITION,
                 time_limit="20", folder=tmp_path,
                 fields={"exclusive": 1, "run_dir": str(run_dir), "env_setup": unpaced_restart,
                         "output": str(tmp_path / "whole-%j.out")})
    jobs.append(res.job_id)
    run.wait(lambda: run.step() >= 2, RUN_TIMEOUT / 2, "2 workers training")
    node = run.coord.members()[run.world()["assignment"][0]["worker"]]["node"]
    jobs.append(preempt_node(node, tmp_path))
    ckpt = run.wait(lambda: next((g for g in run.generations() if g["kind"] == "checkpoint"),
                                 None), SLURM_TIMER + 300, "the checkpoint generation")
    end = run.wait(lambda: run.of("run.end"), 120, "the checkpoint to be written")[0]["data"]
    assert end["step"] == ckpt["step"] and Path(end["checkpoint"]).is_dir()
    # Megatron-LM's layout: the tracker names the step, iter_NNNNNNN holds it
    tracker = run_dir / "checkpoint" / "latest_checkpointed_iteration.txt"
    assert int(tracker.read_text()) == ckpt["step"]
    latest = {"path": str(run_dir / "checkpoint" / f"iter_{ckpt['step']:07d}")}
    assert end["checkpoint"] == latest["path"]
    run.wait(lambda: run.of("job.requeued"), 60, "the job to requeue itself")
    restart = run.wait(lambda: next((g for g in run.generations()
                                     if g["kind"] == "start" and g["generation"] > ckpt["generation"]),
                                    None), RUN_TIMEOUT / 2, "the requeued job to restart")
    assert restart["step"] == ckpt["step"]
    rec = run.world()  # no resize after the restart: still the start record
    assert rec["generation"] == restart["generation"] and rec["resume"] == latest["path"]
    run.wait(run.finished, RUN_TIMEOUT, "the resumed run to finish")
    check_losses(run, reference)  # every step exactly once: none redone, none skipped
    check_data_once(run_dir)
    assert sh("scontrol", "show", "job", res.job_id).count("Restarts=1") == 1
    run.close()


# ------------------------------------------- replicated coordinator: its primary's job goes
class Availability:
    """Writes through the run's Sentinel URL, one every ``every`` s, from a thread (the
    etcslurm client: it waits and retries while no primary answers), and notes, from a
    second thread, which address the Sentinels name as the primary.  The longest write
    is how long the run had no primary that accepted a write."""

    def __init__(self, url: str, run_id: str, every: float = 0.05) -> None:
        import threading

        self.client = connect(url, retry_deadline=60)
        self.key = f"etcslurm-test:availability:{run_id}"
        self.every = every
        self.writes: list[tuple[float, float]] = []  # (started, took) in time.time()
        self.errors: list[str] = []
        self.primaries: list[tuple[float, list[Any]]] = []  # (when, primary) on each change
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._write, daemon=True),
                        threading.Thread(target=self._watch, daemon=True)]
        for t in self.threads:
            t.start()

    def _write(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            t0 = time.time()
            try:
                self.client.call("availability probe",
                                 lambda r, n=n: r.set(self.key, n, ex=300))
            except Exception as exc:  # reported by the test
                self.errors.append(f"{time.time() - t0:.2f} s: {exc}")
            self.writes.append((t0, time.time() - t0))
            time.sleep(self.every)

    def _watch(self) -> None:
        from etcslurm.redis_host import failover

        while not self.stop.is_set():
            try:
                primary = failover.topology(self.client)["primary"]
                if not self.primaries or self.primaries[-1][1] != primary:
                    self.primaries.append((time.time(), primary))
            except Exception:  # a Sentinel being re-pointed: ask again
                pass
            time.sleep(0.2)

    def longest(self, since: float, until: float) -> float:
        return max((took for t0, took in self.writes if since <= t0 <= until), default=0.0)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)
        self.client.close()


def _site_processes(coord_dir: Path) -> list[int]:
    """PIDs (redis-server and Sentinel) the run's coordinator sites recorded."""
    pids = []
    for f in coord_dir.glob("site-*.json"):
        with_state = json.loads(f.read_text())
        pids += [int(with_state[k]) for k in ("pid", "sentinel_pid") if with_state.get(k)]
    return pids


def test_preempting_the_job_of_the_coordinators_primary_hands_it_over(
        jobs: list[str], tmp_path: Path, redis_url: str, run_id: str,
        reference: ReferenceLosses) -> None:
    """elastic.sbatch as 4 one-node array jobs that start their own replicated coordinator
    (3 sites: tasks 0-2, a Redis + a Sentinel each; task 0 the primary).  A high job
    preempts task 0: its worker's signal trap hands the primary to a replica, the worker
    hands its state over by P2P and leaves (4 -> 3), its job ends COMPLETED and takes its
    site with it.  Later task 3 is preempted (3 -> 2).  Losses equal the reference; no
    write through the Sentinels failed, and the longest one measures the time the run had
    no primary (the hand-over's pause, not Sentinel's ``down-after``)."""
    from etcslurm.redis_host import failover

    run_dir = tmp_path / "run"
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(run_settings(4).to_json()))
    down_after_ms = 5000  # the template default: a hard failover would stall writes >= 5 s
    cmd = f"{sys.executable} -m {WORKER_MODULE} --min-step-seconds 2 " + " ".join(WORKER_ARGS[2:])
    res = submit(cmd, run_id=run_id, nodes=4, split=True, partition=PARTITION,
                 time_limit="20", folder=tmp_path,
                 fields={"exclusive": 1, "run_dir": str(run_dir), "coordinator_sites": 3,
                         "coordinator_down_after_ms": down_after_ms,
                         "setup_cmd": f"{sys.executable} -m etcslurm.testing.probe "
                                      f"--store-spec {spec}",
                         "output": str(tmp_path / "primary-%A_%a.out")})
    jobs.append(res.job_id)
    t_submit = time.time()
    url_file = run_dir / f"coordinator-{res.job_id}.url"
    coord_dir = run_dir / f"coordinator-{res.job_id}"
    url = wait_for(lambda: url_file.exists() and url_file.read_text().strip(), 180,
                   f"the run's coordinator URL in {url_file} (array task 0 starts 3 sites)")
    assert url.startswith("redis+sentinel://")
    sites = {int(f.stem.split("-")[1]): json.loads(f.read_text())
             for f in coord_dir.glob("site-*.json")}
    assert sorted(sites) == [0, 1, 2], sites
    primary0 = list(sites[0]["address"])
    assert oct(os.stat(url_file).st_mode & 0o777) == "0o600"
    run = Run(url, run_id, 4, run_dir)
    avail = Availability(url, run_id)
    # a user's monitor (plain mode: one line per event) follows the run through the move
    # of the primary
    mon_out = tmp_path / "monitor.out"
    with mon_out.open("wb") as fh:
        monitor = subprocess.Popen([sys.executable, "-m", "etcslurm", "monitor", "--redis", url,
                                    "--run", run_id], stdout=fh, stderr=subprocess.STDOUT)
    passed = False
    try:
        assert failover.topology(run.coord.client)["primary"] == primary0
        run.wait(lambda: run.step() >= 2, RUN_TIMEOUT / 2, "4 workers training")
        started_s = time.time() - t_submit
        gen0 = run.world()
        assert gen0["kind"] == "start" and gen0["world"] == 4
        members = run.coord.members()
        # the worker on array task 0's node: the node of site 0 (the primary)
        task_of = {w: int(i["slurm_array_task"]) for w, i in members.items()}
        assert sorted(task_of.values()) == [0, 1, 2, 3], task_of
        victim = next(w for w, t in task_of.items() if t == 0)
        t_preempt = time.time()
        jobs.append(preempt_node(members[victim]["node"], tmp_path))
        signal = run.wait(lambda: next((e for e in run.of("worker.signal")
                                        if e["worker"] == victim), None),
                          SLURM_TIMER + 120, "task 0's worker to get its leave signal")["data"]
        shrink = run.wait(lambda: next((g for g in run.generations()
                                        if victim in g.get("leaving", [])), None),
                          300, "the generation without task 0's worker")
        assert shrink["kind"] == "resize" and shrink["world"] == 3
        gone = run.wait(lambda: run.gone_at(victim), 120, "task 0's worker to leave")
        assert gone - signal["received_at"] <= GRACE
        job0 = members[victim]["slurm_job"]
        wait_for(lambda: job_state(job0) == "COMPLETED", 90, f"task 0's job {job0} to end")
        t_job0_end = time.time()
        moved = [(t, p) for t, p in avail.primaries if p != primary0]
        assert moved, f"the primary never left site 0 {primary0}: {avail.primaries}"
        assert list(moved[0][1]) in [list(sites[k]["address"]) for k in (1, 2)]
        # handed over on the signal, not by Sentinel after site 0 went (down-after 5 s)
        assert moved[0][0] <= gone + 1.0, (moved, signal, gone)
        # the site of task 0 stopped with its job; the coordinator still decides the run
        wait_for(lambda: all(not _alive(p) for p in
                             (int(sites[0][k]) for k in ("pid", "sentinel_pid"))),
                 60, "task 0's Redis and Sentinel to stop with its job")

        # a later preemption, handled as usual by the run on the new primary
        run.wait(lambda: run.step() >= shrink["step"] + 2, RUN_TIMEOUT / 2,
                 "2 steps on 3 workers")
        second = next(w for w, t in task_of.items() if t == 3)
        jobs.append(preempt_node(members[second]["node"], tmp_path))
        shrink2 = run.wait(lambda: next((g for g in run.generations()
                                         if second in g.get("leaving", [])), None),
                           SLURM_TIMER + 300, "the generation without task 3's worker")
        assert shrink2["kind"] == "resize" and shrink2["world"] == 2
        # the run's coordinator ends with its last job: stop the monitor at the last step,
        # before the workers leave (SIGTERM leaves it like Ctrl-C, exit 0); once the sites
        # are gone it would say so (exit 3) before a later terminate reached it
        run.wait(lambda: run.step() >= STEPS, RUN_TIMEOUT, "the run's last step")
        monitor.terminate()
        run.wait(run.finished, RUN_TIMEOUT, "the run to finish")
        passed = True
    finally:
        avail.close()
        if not passed:  # the sites are the run's own: none may outlive a failed test
            monitor.kill()
            _stop_sites(coord_dir, jobs)
    try:
        code = monitor.wait(timeout=30)
    finally:
        if monitor.poll() is None:
            monitor.kill()
    p0, p1 = (f"{a[0]}:{a[1]}" for a in (primary0, moved[0][1]))
    shown = mon_out.read_text()
    assert code == 0, shown[-3000:]
    assert f"coordinator primary moved {p0} → {p1}" in shown, shown[-3000:]
    took = time.time() - t_submit
    diff = check_losses(run, reference)
    dp = check_data_once(run_dir)
    assert {dp[s] for s in range(STEPS)} == {4, 3, 2}, f"DP degrees per step: {dp}"
    assert len(run.of("migration.done")) == 2
    assert [g["kind"] for g in run.generations()][:3] == ["start", "resize", "resize"]
    assert avail.errors == [], f"writes failed through the Sentinels: {avail.errors}"
    window = avail.longest(t_preempt, t_job0_end)
    before = sorted(x for t0, x in avail.writes if t0 < t_preempt)
    typical = before[len(before) // 2] if before else 0.0
    print(f"\nrun took {took:.0f} s (4 workers training after {started_s:.0f} s); primary "
          f"{primary0} -> {moved[0][1]} {moved[0][0] - signal['received_at']:.2f} s after "
          f"the signal; longest write while task 0 left {window:.3f} s (median before "
          f"{typical:.3f} s, {len(avail.writes)} writes, 0 failed); max |loss - reference| "
          f"= {diff:.3g}")
    assert window < down_after_ms / 1000, (
        f"writes stalled {window:.2f} s: as long as a hard failover, not a hand-over")
    wait_for(lambda: all(job_state(j) in ("COMPLETED", "CANCELLED", "FAILED")
                         for j in (f"{res.job_id}_{k}" for k in range(4))),
             120, "the array jobs to end")
    left = [p for p in _site_processes(coord_dir) if _alive(p)]
    assert left == [], f"coordinator processes outlived their jobs: {left}"
    run.coord.client.close()  # the run's coordinator went with its jobs: nothing to end


def _stop_sites(coord_dir: Path, job_ids: list[str]) -> None:
    """Cancel the jobs, wait (bounded) for them to end, then stop by PID any coordinator
    process the template's watchdog has not stopped."""
    import signal as _signal

    settle_jobs(job_ids, timeout=60)
    time.sleep(2)  # the watchdog polls once a second
    for pid in _site_processes(coord_dir):
        if _alive(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, _signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False
