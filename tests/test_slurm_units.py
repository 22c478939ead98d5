"""Slurm seams without a cluster: templates, environment parsing, signal trap (fast)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from etcslurm.cli import main as cli_main
from etcslurm.errors import UsageError
from etcslurm.job.environment import SlurmEnvironment, expand_hostlist
from etcslurm.job.signals import SignalTrap, compute_budget, parse_signal
from etcslurm.slurm.templates import load_template, render, render_het

BASE = {"run_id": "r1", "worker_cmd": "python -m etcslurm.testing.probe --out /tmp/x"}


# ---- templates -------------------------------------------------------------------------------
def test_elastic_renders_fields_and_drops_unset_options() -> None:
    script = render("elastic", {**BASE, "nodes": 4, "tasks_per_node": 2, "signal_lead": 60,
                                "partition": "debug", "exclusive": 1})
    lines = script.splitlines()
    assert "#SBATCH --nodes=4" in lines and "#SBATCH --ntasks-per-node=2" in lines
    assert "#SBATCH --signal=USR2@60" in lines and "#SBATCH --requeue" in lines
    assert "#SBATCH --partition=debug" in lines and "#SBATCH --exclusive" in lines
    assert not any("gpus-per-node" in ln for ln in lines)  # empty field → line dropped
    assert "export ETCSLURM_RUN='r1' ETCSLURM_RUN_ID='r1'" in lines
    assert "{{" not in script and "##@" not in script
    assert any(ln.startswith("srun ") and BASE["worker_cmd"] in ln for ln in lines)
    plain = render("elastic", BASE)
    assert "#SBATCH --exclusive" not in plain and "#SBATCH --partition" not in plain


def test_grow_with_redis_and_array() -> None:
    script = render("grow", {**BASE, "redis_url": "redis://:pw@h:6379/0", "array": "0-3"})
    assert "#SBATCH --array=0-3" in script
    assert "export ETCSLURM_REDIS_URL='redis://:pw@h:6379/0'" in script
    assert "export ETCSLURM_ROLE=join" in script


def test_het_job_has_one_block_per_component() -> None:
    script = render_het("grow", [{"nodes": 1, "tasks_per_node": 4}, {"nodes": 2}],
                        {**BASE, "redis_url": "redis://h:1/0"})
    blocks = script.split("#SBATCH hetjob")
    assert len(blocks) == 2
    assert "--ntasks-per-node=4" in blocks[0] and "--nodes=2" in blocks[1].split("set -uo")[0]
    assert "--het-group=0-1" in script


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({**BASE, "nodez": 3}, "unknown field(s) nodez for template 'elastic'; valid: run_id, worker_cmd, nodes=2"),
        ({"run_id": "r1"}, "missing field(s) worker_cmd"),
        ({**BASE, "nodes": "two"}, "expected a non-negative integer"),
        ({**BASE, "signal": "USR1"}, "NCCL"),
        ({**BASE, "partition": "a b"}, "only letters"),
        ({**BASE, "redis_url": "redis://x'; rm -rf /"}, "no spaces, quotes"),
    ],
)
def test_bad_fields_are_one_line_errors(values: dict, message: str) -> None:
    with pytest.raises(UsageError) as err:
        render("elastic", values)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_unknown_template_lists_available() -> None:
    with pytest.raises(UsageError, match="available: elastic, grow"):
        load_template("nope")


def test_cli_submit_dry_run_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["submit", "--template", "elastic", "--set", "run_id=abc",
                     "--set", "worker_cmd=hostname", "--set", "nodes=3", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash") and "#SBATCH --nodes=3" in out and "srun" in out
    assert cli_main(["submit", "--set", "bogus=1", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("etcslurm: unknown field(s) bogus") and "valid: run_id" in err
    assert len(err.splitlines()) == 1
    assert cli_main(["submit", "--dry-run"]) == 2
    assert "missing field(s) worker_cmd" in capsys.readouterr().err


def test_cli_grow_dry_run_split_and_het(capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["grow", "--run", "r1", "--redis", "redis://:p@h:1/0", "--worker-cmd", "hostname", "--dry-run"]
    assert cli_main([*args, "--nodes", "3", "--split"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --array=0-2" in out and "#SBATCH --nodes=1" in out
    assert cli_main([*args, "--het", "1x4,2x2"]) == 0
    assert capsys.readouterr().out.count("#SBATCH hetjob") == 1
    monkeypatch.delenv("ETCSLURM_REDIS_URL", raising=False)
    assert cli_main(["grow", "--run", "r1", "--nodes", "1", "--dry-run"]) == 2
    assert "coordinator is unknown" in capsys.readouterr().err
    assert cli_main([*args, "--het", "2"]) == 2


# ---- environment -----------------------------------------------------------------------------
def test_hostlist_expansion() -> None:
    assert expand_hostlist("n[1-3,5],gpu-[08-10]a,x") == [
        "n1", "n2", "n3", "n5", "gpu-08a", "gpu-09a", "gpu-10a", "x"]
    with pytest.raises(UsageError):
        expand_hostlist("n[1-")


def test_environment_from_step_variables() -> None:
    env = SlurmEnvironment.from_env({
        "SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NODELIST": "n[1-4]",
        "SLURM_STEP_TASKS_PER_NODE": "2(x4)", "SLURMD_NODENAME": "n3", "SLURM_RESTART_COUNT": "2",
        "SLURM_JOB_END_TIME": "1800000000", "SLURM_CPUS_PER_TASK": "4",
        "ETCSLURM_RUN_ID": "r9", "ETCSLURM_SIGNALS": "USR2,TERM", "ETCSLURM_SIGNAL_LEAD": "90",
        "ETCSLURM_GRACE_TIME": "30", "ETCSLURM_ROLE": "join",
    })
    assert env.is_slurm and env.in_step
    assert (env.proc_id, env.local_id, env.node_id, env.ntasks) == (5, 1, 2, 8)
    assert env.nodes == ("n1", "n2", "n3", "n4") and env.node_name == "n3"
    assert env.tasks_per_node == (2, 2, 2, 2) and env.local_world_size == 2
    assert env.restart_count == 2 and env.end_time == 1_800_000_000 and env.cpus_per_task == 4
    assert env.worker_id == "42.5" and env.device() == "cpu" and env.device(2) == "cuda:1"
    assert env.seconds_left(now=1_799_999_900) == 100
    assert env.torch_env(master_port=29500)["MASTER_ADDR"] == "n1"
    assert (env.run_id, env.role, env.signals, env.grace_time) == ("r9", "join", ("USR2", "TERM"), 30)


def test_environment_array_and_het_ids() -> None:
    arr = SlurmEnvironment.from_env({"SLURM_JOB_ID": "17", "SLURM_ARRAY_JOB_ID": "15",
                                     "SLURM_ARRAY_TASK_ID": "2"})
    assert arr.worker_id == "15_2.0"
    het = SlurmEnvironment.from_env({
        "SLURM_JOB_ID": "14", "SLURM_HET_SIZE": "2", "SLURM_JOB_ID_HET_GROUP_0": "14",
        "SLURM_NTASKS_HET_GROUP_0": "2", "SLURM_NTASKS_HET_GROUP_1": "1", "SLURM_PROCID": "2",
        "SLURM_NTASKS": "3"})
    assert (het.het_component, het.het_job_id, het.worker_id) == (1, "14", "14+1.2")
    local = SlurmEnvironment.from_env({})
    assert not local.is_slurm and local.world_size == 1 and local.worker_id.startswith("local.")


# ---- signals ---------------------------------------------------------------------------------
def test_usr1_and_unknown_signals_are_refused() -> None:
    with pytest.raises(UsageError, match="NCCL"):
        SignalTrap(["USR2", "SIGUSR1"])
    with pytest.raises(UsageError, match="unknown signal"):
        parse_signal("NOPE")
    assert parse_signal("sigterm") is signal.SIGTERM and parse_signal(12) is signal.SIGUSR2


def test_budget_is_the_tightest_known_limit() -> None:
    assert compute_budget("USR2", 1000.0, {"USR2": 90}, None, None) == 90
    assert compute_budget("USR2", 1000.0, 90, 10, None) == 10
    assert compute_budget("USR2", 1000.0, 90, 0, 1030.0) == 30
    assert compute_budget("TERM", 1000.0, {"USR2": 90}, None, 990.0) == 0
    assert compute_budget("TERM", 1000.0, None, None, None) is None


def test_trap_records_signal_calls_back_and_restores() -> None:
    before = signal.getsignal(signal.SIGUSR2)
    seen = []
    with SignalTrap(["USR2", "TERM"], lead_time={"USR2": 90}, end_time=time.time() + 45,
                    callback=seen.append) as trap:
        assert not trap.received
        os.kill(os.getpid(), signal.SIGUSR2)
        event = trap.wait(5)
        assert event is not None and event.signal == "USR2"
        assert 40 <= event.budget <= 45 and event.deadline == pytest.approx(event.received_at + event.budget)
        for _ in range(100):
            if seen:
                break
            time.sleep(0.01)
        assert seen == [event] and trap.received
    assert signal.getsignal(signal.SIGUSR2) == before


def test_fallback_hands_the_signal_to_the_previous_handler() -> None:
    calls = []
    old = signal.signal(signal.SIGUSR2, lambda s, f: calls.append(s))
    try:
        with SignalTrap(["USR2"]) as trap:
            os.kill(os.getpid(), signal.SIGUSR2)
            assert trap.wait(5) is not None
            assert calls == []  # ours first: the previous handler is not run by the signal
            assert trap.fallback() is True
            assert calls == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, old)


def test_submitit_local_executor_runs_the_elastic_task(tmp_path: object) -> None:
    from etcslurm.slurm.submission import submit
    from etcslurm.testing import probe

    res = submit(probe.submitit_report, via="submitit", cluster="local", run_id="t-local",
                 nodes=1, time_limit=5, redis_url="redis://:pw@127.0.0.1:1/0",
                 folder=str(tmp_path))
    info = res.job.result()
    assert info["run_id"] == "t-local" and info["role"] == "start"
    assert info["redis_url"] == "127.0.0.1:1/0"  # credentials never reported
    assert info["trap_signals"] == ["SIGUSR2", "SIGTERM"] and info["checkpoints"] == 0
    assert info["job_id"] is None and info["worker_id"].startswith("local.")


def test_cli_submit_via_submitit_local(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["submit", "--via", "submitit", "--cluster", "local",
                   "--worker", "etcslurm.testing.probe:submitit_report", "--set", "run_id=t-cli",
                   "--set", "time=5", "--workdir", str(tmp_path)])
    assert rc == 0 and "submitted run t-cli as Submitit job" in capsys.readouterr().out
    from pathlib import Path

    end = time.monotonic() + 60  # the local job ends by itself: wait for its result file
    while not list(Path(str(tmp_path)).rglob("*_result.pkl")) and time.monotonic() < end:
        time.sleep(0.2)
    assert list(Path(str(tmp_path)).rglob("*_result.pkl")), "the local Submitit job gave no result"
    assert cli_main(["submit", "--via", "submitit", "--worker", "x:y", "--set", "array=0-1"]) == 2
    assert "unknown field(s) array for --via submitit" in capsys.readouterr().err


def test_scontrol_requeue_is_started_deaf_to_the_sigterm_its_requeue_sends() -> None:
    # the requeue ends the job's step (SIGTERM to every process in it, scontrol included):
    # scontrol must live to read the answer, and this process keeps its own handler
    import subprocess

    from etcslurm.job.environment import _children_ignore_sigterm

    before = signal.getsignal(signal.SIGTERM)
    with _children_ignore_sigterm():
        child = subprocess.Popen(["sleep", "30"])
    plain = subprocess.Popen(["sleep", "30"])
    try:
        assert signal.getsignal(signal.SIGTERM) == before
        child.send_signal(signal.SIGTERM)
        plain.send_signal(signal.SIGTERM)
        assert plain.wait(timeout=10) == -signal.SIGTERM  # the control: SIGTERM kills sleep
        time.sleep(0.3)
        assert child.poll() is None
    finally:
        child.kill()
        plain.kill()
        child.wait(timeout=10)
        plain.wait(timeout=10)
