"""On the REAL local Slurm cluster (sbin/slurm-cluster): templates run, preemption signals
reach the workers with a budget, growth jobs start and join, Submitit runs and falls back
to checkpoint + requeue.  Timing tolerances follow slurmctld's 30 s timer (design.md).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from etcslurm.cli import main as cli_main
from etcslurm.slurm.submission import submit
from etcslurm.testing import probe
from tests.helpers import job_state, settle_jobs, sh, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.waits]
SLURM_TIMER = 30.0  # slurmctld checks signals/time limits/grace every 30 s








def reports(out: Path, n: int, timeout: float = 90) -> list[dict[str, Any]]:
    """The probes' start reports (``<worker>.json``), once ``n`` have been written."""
    files = wait_for(lambda: (lambda f: f if len(f) >= n else None)(
        sorted(p for p in out.glob("*.json") if not p.name.endswith(".signal.json"))),
        timeout, f"{n} worker reports in {out}")
    return [json.loads(p.read_text()) for p in files]


def probe_cmd(out: Path, duration: float, linger: float = 1.0) -> str:
    return f"{sys.executable} -m etcslurm.testing.probe --out {out} --duration {duration} --linger {linger}"


@pytest.fixture
def jobs(slurm_cluster: str) -> Iterator[list[str]]:
    """Job ids a test submitted; cancelled afterwards whatever happened."""
    ids: list[str] = []
    yield ids
    settle_jobs(ids)


def test_elastic_template_runs_workers_with_right_environment(jobs: list[str], tmp_path: Path) -> None:
    out = tmp_path / "probe"
    run_dir = tmp_path / "run"
    res = submit(probe_cmd(out, duration=2), run_id="t-elastic", nodes=2, tasks_per_node=2,
                 time_limit="5", folder=tmp_path,
                 fields={"output": str(tmp_path / "job-%j.out"), "run_dir": str(run_dir),
                         "setup_cmd": "echo $ETCSLURM_RUN $ETCSLURM_REDIS_URL > $ETCSLURM_RUN_DIR/setup.txt"})
    jobs.append(res.job_id)
    infos = reports(out, 4)
    assert sorted(i["proc_id"] for i in infos) == [0, 1, 2, 3]
    assert {i["job_id"] for i in infos} == {res.job_id}
    by_node: dict[str, list[int]] = {}
    for i in infos:
        by_node.setdefault(i["node_name"], []).append(i["local_id"])
        assert i["ntasks"] == 4 and len(i["nodes"]) == 2 and i["tasks_per_node"] == [2, 2]
        assert i["node_name"] == i["nodes"][i["node_id"]]
        assert i["run_id"] == "t-elastic" and i["role"] == "start" and i["run_dir"] == str(run_dir)
        assert i["coordinator_ping"] is True  # the coordinator started on the first node answers
        assert i["signals"] == ["USR2", "TERM"] and i["signal_lead"] == 90
        assert i["grace_time"] == 10  # the debug partition's GraceTime, exported by the template
        assert i["end_time"] == pytest.approx(i["started_at"] + 5 * 60, abs=SLURM_TIMER)
        assert i["restart_count"] == 0 and i["worker_id"] == f"{res.job_id}.{i['proc_id']}"
    assert sorted(by_node) == sorted(infos[0]["nodes"])
    assert all(sorted(v) == [0, 1] for v in by_node.values())
    wait_for(lambda: job_state(res.job_id) == "COMPLETED", 60, "the elastic job to complete")
    log = (tmp_path / f"job-{res.job_id}.out").read_text()
    assert "etcslurm: coordinator on" in log and "workers exited with 0" in log
    run, url = (run_dir / "setup.txt").read_text().split()  # setup_cmd ran with the contract
    assert run == "t-elastic" and url.startswith("redis://:") and url.endswith(infos[0]["redis_url"])


def test_preemption_signals_the_node_workers_with_a_budget(jobs: list[str], tmp_path: Path) -> None:
    out = tmp_path / "probe"
    res = submit(probe_cmd(out, duration=240), run_id="t-preempt", nodes=2, partition="debug",
                 time_limit="10", folder=tmp_path,
                 fields={"exclusive": 1, "output": str(tmp_path / "low-%j.out")})
    jobs.append(res.job_id)
    infos = reports(out, 2)
    victim = infos[-1]
    t0 = time.time()
    high = sh("sbatch", "--parsable", "-p", "high", "-N1", "--exclusive", "-w", victim["node_name"],
              "-o", str(tmp_path / "high-%j.out"), "--wrap", "sleep 1")
    jobs.append(high)
    sig_file = out / f"{victim['worker_id']}.signal.json"
    wait_for(sig_file.exists, SLURM_TIMER + 30, f"the preemption signal at {victim['worker_id']}")
    event = json.loads(sig_file.read_text())["events"][0]
    assert event["signal"] == "USR2"  # preempt_send_user_signal: the job's --signal, not only TERM
    assert event["received_at"] - t0 <= SLURM_TIMER
    # budget = min(lead 90 s, GraceTime 10 s, end − now ≈ 600 s) = the grace time
    assert event["budget"] == pytest.approx(10, abs=0.5)
    assert event["deadline"] == pytest.approx(event["received_at"] + event["budget"])
    # the worker left by itself inside the grace time → the job ends, the high job runs
    wait_for(lambda: job_state(high) == "COMPLETED", 60 + SLURM_TIMER, "the high job to run")
    assert job_state(res.job_id) in ("COMPLETED", "COMPLETING")


def test_grow_split_starts_one_joining_job_per_node(jobs: list[str], tmp_path: Path,
                                                     redis_url: str, run_id: str) -> None:
    out = tmp_path / "probe"
    rc = cli_main(["grow", "--run", run_id, "--nodes", "2", "--split", "--redis", redis_url,
                   "--worker-cmd", probe_cmd(out, duration=1), "--time", "5",
                   "--workdir", str(tmp_path), "--set", f"output={tmp_path}/grow-%A_%a.out"])
    assert rc == 0
    infos = reports(out, 2)
    jobs.append(str(infos[0]["array_job_id"]))
    assert sorted(i["array_task_id"] for i in infos) == [0, 1]
    assert len({i["job_id"] for i in infos}) == 2  # two independent jobs: preemptable alone
    for i in infos:
        assert i["role"] == "join" and i["run_id"] == run_id and i["coordinator_ping"] is True


def test_grow_het_job_mixed_shapes(jobs: list[str], tmp_path: Path, redis_url: str,
                                   run_id: str) -> None:
    out = tmp_path / "probe"
    assert cli_main(["grow", "--run", run_id, "--het", "1x2,1x1", "--redis", redis_url,
                     "--worker-cmd", probe_cmd(out, duration=1), "--time", "5",
                     "--workdir", str(tmp_path), "--set", f"output={tmp_path}/het-%j.out"]) == 0
    infos = reports(out, 3)
    jobs.append(str(infos[0]["het_job_id"]))
    assert sorted(i["het_component"] for i in infos) == [0, 0, 1]
    assert len({i["het_job_id"] for i in infos}) == 1
    assert all(i["role"] == "join" and i["coordinator_ping"] is True for i in infos)


def _done(job: Any) -> bool:
    return job.done()


def test_submitit_job_runs_elastic_task_and_returns(jobs: list[str], tmp_path: Path) -> None:
    res = submit(probe.submitit_report, via="submitit", cluster="slurm", run_id="t-submitit",
                 nodes=1, time_limit=5, partition="debug", folder=tmp_path / "submitit")
    jobs.append(res.job_id)
    wait_for(lambda: _done(res.job), 120, f"Submitit job {res.job_id}", every=1)
    info = res.job.result()
    assert info["job_id"] == res.job_id and info["run_id"] == "t-submitit"
    assert info["trap_signals"] == ["SIGUSR2", "SIGTERM"]
    assert info["grace_time"] == 10 and info["end_time"] is not None
    assert info["checkpoints"] == 0


@pytest.mark.slow
def test_submitit_preempted_job_checkpoints_and_requeues(jobs: list[str], tmp_path: Path) -> None:
    ready = tmp_path / "trap-installed"
    res = submit(probe.submitit_until_signal, 240.0, str(ready), via="submitit", cluster="slurm",
                 run_id="t-submitit-pre", nodes=1, time_limit=10, partition="debug",
                 folder=tmp_path / "submitit")
    jobs.append(res.job_id)
    node = wait_for(lambda: job_state(res.job_id) == "RUNNING" and sh(
        "squeue", "-h", "-j", res.job_id, "-o", "%N"), 60, "the Submitit job to run")
    wait_for(ready.exists, 120, "the Submitit task to install its signal trap")
    high = sh("sbatch", "--parsable", "-p", "high", "-N1", "--exclusive", "-w", node,
              "-o", str(tmp_path / "high-%j.out"), "--wrap", "sleep 1")
    jobs.append(high)
    wait_for(lambda: _done(res.job), 180, "the preempted Submitit job to requeue and finish", every=1)
    info = res.job.result()
    assert info["checkpoints"] == 1  # our checkpoint() ran once, the requeued task saw it
    assert info["restart_count"] >= 1 and info["job_id"] == res.job_id


def test_split_run_preempts_one_node_alone(jobs: list[str], tmp_path: Path) -> None:
    """elastic.sbatch as an array of single-node jobs: a high job takes one node, only that
    node's worker is signalled, the others (and the coordinator in task 0) keep running."""
    out = tmp_path / "probe"
    res = submit(probe_cmd(out, duration=240), run_id="t-split", nodes=3, split=True,
                 partition="debug", time_limit="10", folder=tmp_path,
                 fields={"exclusive": 1, "output": str(tmp_path / "split-%A_%a.out")})
    jobs.append(res.job_id)
    infos = reports(out, 3)
    assert sorted(i["array_task_id"] for i in infos) == [0, 1, 2]
    assert all(i["coordinator_ping"] is True for i in infos)  # task 0's coordinator, via run_dir
    victim = next(i for i in infos if i["array_task_id"] == 2)
    t0 = time.time()
    high = sh("sbatch", "--parsable", "-p", "high", "-N1", "--exclusive", "-w", victim["node_name"],
              "-o", str(tmp_path / "high-%j.out"), "--wrap", "sleep 1")
    jobs.append(high)
    sig_file = out / f"{victim['worker_id']}.signal.json"
    wait_for(sig_file.exists, SLURM_TIMER + 30, "the preemption signal at the victim")
    assert json.loads(sig_file.read_text())["events"][0]["received_at"] - t0 <= SLURM_TIMER
    wait_for(lambda: job_state(high) == "COMPLETED", 60 + SLURM_TIMER, "the high job to run")
    survivors = [i for i in infos if i is not victim]
    assert not any((out / f"{i['worker_id']}.signal.json").exists() for i in survivors)
    assert all(job_state(f"{res.job_id}_{i['array_task_id']}") == "RUNNING" for i in survivors)


def test_whole_run_preempted_requeues_and_restarts(jobs: list[str], tmp_path: Path) -> None:
    """Nothing survives → the worker requeues its job (as after writing a checkpoint) →
    Slurm restarts it with SLURM_RESTART_COUNT=1 (cred_expire=10 s + the scheduler tick)."""
    out = tmp_path / "probe"
    res = submit(probe_cmd(out, duration=240) + " --requeue-on-signal", run_id="t-requeue",
                 nodes=1, partition="debug", time_limit="10", folder=tmp_path,
                 fields={"exclusive": 1, "output": str(tmp_path / "rq-%j.out")})
    jobs.append(res.job_id)
    (first,) = reports(out, 1)
    assert first["restart_count"] == 0
    high = sh("sbatch", "--parsable", "-p", "high", "-N1", "--exclusive", "-w", first["node_name"],
              "-o", str(tmp_path / "high-%j.out"), "--wrap", "sleep 1")
    jobs.append(high)
    report = out / f"{first['worker_id']}.json"
    again = wait_for(lambda: (lambda d: d if d["restart_count"] >= 1 else None)(
        json.loads(report.read_text())), 90 + SLURM_TIMER, "the requeued job to restart")
    assert again["job_id"] == res.job_id and again["run_id"] == "t-requeue"
    assert again["coordinator_ping"] is True  # a fresh coordinator for the restarted run
