"""The run file, the site's fields, GPU hosts and grace times, without a cluster (fast)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from etcslurm.cli import main as cli_main
from etcslurm.errors import UsageError
from etcslurm.groups.devices import allocated_gpus, cpu_torch_problem, local_device_index
from etcslurm.job import grace
from etcslurm.job.environment import SlurmEnvironment
from etcslurm.slurm import in_job, runfile
from etcslurm.slurm.templates import templates_dir

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "run.toml"
SMALL = """
run_id = "r1"
[run]
model = "gpt-tiny"
steps = 5
[slurm]
nodes = 2
"""


def write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems(path: Path, sets: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(runfile.RunFileError) as err:
        runfile.load(path, sets)
    return err.value.problems


# ---- the run file -------------------------------------------------------------------------
def test_example_dry_run_has_the_sites_fields(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["submit", str(EXAMPLE), "--dry-run"]) == 0
    script = capsys.readouterr().out
    lines = script.splitlines()
    for line in ("#SBATCH --account=my-project", "#SBATCH --qos=normal",
                 "#SBATCH --gres=gpu:h100:8", "#SBATCH --constraint=h100&ib",
                 "#SBATCH --comment=elastic-llama3-8b", "#SBATCH --mail-type=END",
                 "#SBATCH --mem=0", "#SBATCH --exclusive", "#SBATCH --array=0-3",
                 "#SBATCH --ntasks-per-node=8", "#SBATCH --job-name=llama3-8b-elastic"):
        assert line in lines, line
    assert "module load cuda/12.4" in lines  # env_setup, in the tasks' wrapper
    spec = json.loads(lines[lines.index("run_spec=$(cat <<'ETCSLURM_RUN_SPEC'") + 1])
    # GPUs per node from gres: 8 tasks per node, the layouts' node size, 4 x 8 workers
    assert spec["gpus_per_node"] == 8 and spec["initial_workers"] == 32
    assert spec["model"]["name"] == "llama3-8b" and spec["optimizer"] == "distributed"
    assert "{{" not in script


def test_a_typo_is_one_line_naming_the_nearest_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, EXAMPLE.read_text().replace("account =", "acount ="))
    assert cli_main(["submit", str(path), "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ("etcslurm: run.toml: [slurm] acount: unknown field; "
                            "did you mean account?\n")


def test_every_problem_is_reported_on_its_own_line(tmp_path: Path) -> None:
    text = (EXAMPLE.read_text().replace("steps =", "stepz =").replace("nodes = 4", 'nodes = "4x"')
            .replace("collective_timeout = 120", 'collective_timeout = "long"'))
    path = write(tmp_path, text + "\n[x]\ny = 1\n")
    found = problems(path)
    assert any("[run] stepz: unknown field; did you mean steps?" in p for p in found)
    assert any("[slurm] nodes: expected a non-negative integer" in p for p in found)
    assert any("[worker] collective_timeout: expected a number" in p for p in found)
    assert any("run.toml: x: unknown field" in p for p in found)
    assert all("\n" not in p for p in found) and len(found) == 4


def test_bad_toml_and_missing_file_are_one_line(tmp_path: Path) -> None:
    assert problems(write(tmp_path, "[run\n"))[0].startswith("run.toml: not valid TOML:")
    assert problems(tmp_path / "nope.toml") == [f"{tmp_path / 'nope.toml'}: no such run file"]
    assert problems(write(tmp_path, "[slurm]\nnodes = 1\n")) == [
        "run.toml: [run] model: missing (a preset such as gpt-tiny, or a spec "
        "layers=..,hidden=..,heads=..,vocab=..,seq=..)"]


def test_sets_override_dotted_or_unique_bare_keys(tmp_path: Path) -> None:
    path = write(tmp_path, SMALL)
    rf = runfile.load(path, {"slurm.nodes": "3", "steps": "7", "partition": "gpu",
                             "time": "10:00", "worker.dead_after": "20", "run_id": "other"})
    assert rf.nodes == 3 and rf.spec["steps"] == 7 and rf.slurm["partition"] == "gpu"
    assert rf.slurm["time"] == "10:00"  # not TOML's time of day
    assert "--dead-after 20" in rf.worker_cmd and rf.run_id == "other"
    assert problems(path, {"nodez": "3"}) == ["--set nodez: unknown field; did you mean slurm.nodes?"]
    assert problems(path, {"sqrm.x": "1"})[0].startswith("--set sqrm.x: unknown table")


def test_gpus_per_node_has_one_source(tmp_path: Path) -> None:
    def load(slurm: str) -> runfile.RunFile:
        return runfile.load(write(tmp_path, SMALL.replace("nodes = 2", f"nodes = 2\n{slurm}")))

    for slurm in ('gres = "gpu:a100:4"', "gpus_per_node = 4",
                  "gpus_per_task = 1\ntasks_per_node = 4"):
        rf = load(slurm)
        assert (rf.tasks_per_node, rf.spec["gpus_per_node"], rf.spec["initial_workers"]) == (4, 4, 8)
    cpu = load("tasks_per_node = 3")  # no GPUs: a device is a task
    assert (cpu.tasks_per_node, cpu.spec["gpus_per_node"]) == (3, 3)
    path = write(tmp_path, SMALL.replace("nodes = 2", 'nodes = 2\ngres = "gpu:8"\ngpus_per_node = 4'))
    assert problems(path) == ["run.toml: [slurm] GPUs per node disagree: gpus_per_node says 4, "
                              "gres says 8"]
    path = write(tmp_path, SMALL.replace("nodes = 2", "nodes = 2\ngpus_per_node = 4\ntasks_per_node = 2"))
    assert problems(path) == ["run.toml: [slurm] tasks_per_node: one task per GPU, so 4, got 2"]
    path = write(tmp_path, SMALL.replace("steps = 5", "steps = 5\ngpus_per_node = 8"))
    assert "set it in [slurm]" in problems(path)[0]
    path = write(tmp_path, SMALL.replace("nodes = 2", 'nodes = 2\nmem = "1G"\nmem_per_gpu = "2G"'))
    assert problems(path) == ["run.toml: [slurm] mem and mem_per_gpu: Slurm takes one of them"]


def test_run_table_takes_every_run_spec_field(tmp_path: Path) -> None:
    """[run] maps onto RunSettings' run spec generically: any field it has works."""
    defaults = runfile._spec_defaults()
    body = "\n".join(f"{k} = {json.dumps(v)}" for k, v in defaults.items()
                     if k not in ("model", "gpus_per_node") and v is not None)
    rf = runfile.load(write(tmp_path, f'[run]\nmodel = "gpt-tiny"\n{body}\n'))
    for key, value in defaults.items():
        if key not in ("model", "gpus_per_node", "initial_workers"):
            assert rf.spec[key] == value, key
    path = write(tmp_path, '[run]\nmodel = "gpt-tiny"\nsteps = "many"\nmicro_batch = 5\n')
    assert problems(path) == ["run.toml: [run] steps: expected an integer, got 'many'"]


def test_builder_entry_point_is_passed_to_the_worker(tmp_path: Path) -> None:
    rf = runfile.load(write(tmp_path, SMALL.replace("steps = 5", 'steps = 5\nbuilder = "mypkg.model:build"')))
    assert rf.worker_cmd.endswith("--builder mypkg.model:build")
    assert "builder" not in rf.spec
    path = write(tmp_path, SMALL.replace("steps = 5", 'steps = 5\nbuilder = "mypkg.model"'))
    assert problems(path) == ["run.toml: [run] builder: expected module:function, got 'mypkg.model'"]


def test_worker_command_env_setup_and_extra_sbatch(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    text = SMALL + '[worker]\ncommand = "python train.py --my-flag"\nmin_step_seconds = 1\n'
    text = text.replace("nodes = 2", 'nodes = 2\nenv_setup = "conda activate llm\\nexport X=1"\n'
                                     'extra_sbatch = ["#SBATCH --comment=x", "--begin=now"]\n'
                                     'srun_args = "--container-image=img.sqsh"')
    path = write(tmp_path, text)
    assert cli_main(["submit", str(path), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "#SBATCH --comment=x" in lines and "#SBATCH --begin=now" in lines
    i = lines.index("cat > \"$task_env\" <<'ETCSLURM_ENV_SETUP'")
    assert lines[i + 1: i + 4] == ["conda activate llm", "export X=1", "ETCSLURM_ENV_SETUP"]
    srun = next(ln for ln in lines if ln.startswith("srun "))
    assert "--container-image=img.sqsh" in srun and '"${task_wrap[@]}"' in srun
    assert srun.endswith("python train.py --my-flag --min-step-seconds 1 &")
    path = write(tmp_path, SMALL.replace("nodes = 2", 'nodes = 2\nextra_sbatch = ["comment=x"]'))
    assert problems(path) == ["run.toml: [slurm] extra_sbatch: sbatch options start with -, got 'comment=x'"]


def test_grow_from_the_run_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, EXAMPLE.read_text().replace('run_id = "llama3-8b-elastic"', 'run_id = "g1"'))
    assert cli_main(["grow", str(path), "--nodes", "2"]) == 3
    assert "runs/g1/coordinator.url does not exist" in capsys.readouterr().err
    run_dir = tmp_path / "runs" / "g1"
    run_dir.mkdir(parents=True)
    (run_dir / "coordinator.url").write_text("redis://:pw@n1:6379/0")
    assert cli_main(["grow", str(path), "--nodes", "2", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "export ETCSLURM_REDIS_URL='redis://:pw@n1:6379/0'" in lines
    for line in ("#SBATCH --account=my-project", "#SBATCH --gres=gpu:h100:8",
                 "#SBATCH --array=0-1", "#SBATCH --comment=elastic-llama3-8b"):
        assert line in lines, line
    assert f"run_dir='{run_dir}'" in lines
    assert cli_main(["grow", str(path), "--partition", "x", "--dry-run"]) == 2
    assert "use --set instead" in capsys.readouterr().err


def test_store_spec_is_what_the_job_runs(redis_url: str, run_id: str) -> None:
    from etcslurm.coord.client import connect
    from etcslurm.coord.coordinator import Coordinator

    rf = runfile.load(EXAMPLE)
    spec = rf.submit_args()["fields"]["run_spec"]
    env = dict(os.environ, ETCSLURM_REDIS_URL=redis_url, ETCSLURM_RUN=run_id)
    cmd = [sys.executable, "-m", "etcslurm.slurm.in_job", "store-spec"]
    assert subprocess.run(cmd, input=spec, env=env, text=True, timeout=60).returncode == 0
    coord = Coordinator(connect(redis_url), run_id)
    try:
        assert coord.run_spec() == json.loads(spec)
        other = json.dumps({**json.loads(spec), "steps": 1})  # a requeued job must agree
        res = subprocess.run(cmd, input=other, env=env, text=True, capture_output=True, timeout=60)
        assert res.returncode == 3 and "spec differs (steps" in res.stderr
    finally:
        coord.end_run(keep_s=0)
        coord.client.close()


# ---- packaging ----------------------------------------------------------------------------
def test_templates_are_package_data_and_the_top_level_link_agrees() -> None:
    package = Path(str(templates_dir()))
    assert package == ROOT / "etcslurm" / "slurm" / "templates"
    assert (ROOT / "templates").resolve() == package.resolve()
    assert sorted(p.name for p in (ROOT / "templates").iterdir()) == ["elastic.sbatch", "grow.sbatch"]


# ---- GPU hosts ----------------------------------------------------------------------------
def test_device_follows_how_slurm_shows_gpus() -> None:
    # --gpus-per-task=1: Slurm narrows CUDA_VISIBLE_DEVICES to the task's own GPU
    per_task = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_LOCALID": "3",
                "SLURM_PROCID": "11", "SLURM_GPUS_PER_TASK": "1", "CUDA_VISIBLE_DEVICES": "3",
                "SLURM_STEP_GPUS": "3"}
    assert local_device_index(per_task, 1) == 0
    assert SlurmEnvironment.from_env(per_task).device(1) == "cuda:0"
    # --gpus-per-node=8 / --gres=gpu:8: every task of the node sees all eight
    per_node = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_LOCALID": "5",
                "SLURM_PROCID": "13", "SLURM_GPUS_ON_NODE": "8",
                "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7"}
    assert local_device_index(per_node, 8) == 5
    assert SlurmEnvironment.from_env(per_node).device(8) == "cuda:5"
    # --gpus-per-task=1 with --gpu-bind=none: all visible, so the local id picks
    assert local_device_index({**per_node, "SLURM_GPUS_PER_TASK": "1"}, 8) == 5
    assert local_device_index({**per_node, "LOCAL_RANK": "2"}, 8) == 2  # torchrun in srun
    assert local_device_index({}, 4, rank=6) == 2  # no launcher: rank mod GPUs
    assert SlurmEnvironment.from_env({}).device(0) == "cpu"


def test_allocated_gpus_are_read_from_slurms_variables() -> None:
    assert allocated_gpus({"SLURM_GPUS_ON_NODE": "1"}) == "SLURM_GPUS_ON_NODE=1"
    assert allocated_gpus({"SLURM_JOB_GPUS": "0,1"}) == "SLURM_JOB_GPUS=0,1"
    assert allocated_gpus({"SLURM_STEP_GPUS": "2"}) == "SLURM_STEP_GPUS=2"
    assert allocated_gpus({"CUDA_VISIBLE_DEVICES": "0"}) == "CUDA_VISIBLE_DEVICES=0"
    for none in ({}, {"SLURM_GPUS_ON_NODE": "0"}, {"CUDA_VISIBLE_DEVICES": ""},
                 {"CUDA_VISIBLE_DEVICES": "-1"}, {"CUDA_VISIBLE_DEVICES": "NoDevFiles"}):
        assert allocated_gpus(none) is None, none
    gpu = {"SLURM_GPUS_ON_NODE": "4"}
    assert "CPU build" in cpu_torch_problem(gpu, False, None, "2.13.0+cpu")
    assert "sees none" in cpu_torch_problem(gpu, False, "12.4", "2.6.0")
    assert cpu_torch_problem(gpu, True, "12.4", "2.6.0") is None
    assert cpu_torch_problem({**gpu, "ETCSLURM_DEVICE": "cpu"}, False, None, "x") is None
    assert cpu_torch_problem({}, False, None, "x") is None


@pytest.mark.parametrize("variable", ["SLURM_GPUS_ON_NODE=1", "CUDA_VISIBLE_DEVICES=0"])
def test_worker_with_gpus_on_a_cpu_torch_refuses_before_connecting(variable: str) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch can use a GPU")
    name, value = variable.split("=")
    env = dict(os.environ, **{name: value})
    # a coordinator that does not exist: the refusal must come before any connection
    cmd = [sys.executable, "-m", "etcslurm.runtime.worker", "--run", "r1",
           "--redis", "redis://127.0.0.1:9/0"]
    t0 = time.monotonic()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1 and res.stdout == ""
    assert res.stderr.startswith(f"etcslurm worker: this job has GPUs ({variable}) but torch ")
    assert "sbin/setup-venv --cuda" in res.stderr
    assert time.monotonic() - t0 < 60


def test_cpu_shim_stays_off_when_gpus_are_allocated(monkeypatch: pytest.MonkeyPatch) -> None:
    from etcslurm.megatron import cpu_shim

    if cpu_shim.torch.cuda.is_available():
        pytest.skip("this torch can use a GPU")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "2")
    with pytest.raises(UsageError, match="CPU build"):
        cpu_shim.needed()
    monkeypatch.setenv("ETCSLURM_DEVICE", "cpu")
    assert cpu_shim.needed()


@pytest.mark.parametrize(("args", "env", "expect"), [
    (["--cuda"], {}, "torch: cuda build (asked for): pip install torch>=2.6"),
    ([], {"ETCSLURM_TORCH": "cuda", "ETCSLURM_TORCH_INDEX": "https://x/cu124"},
     "torch: cuda build (asked for): pip install torch>=2.6 --index-url https://x/cu124"),
    (["--cpu"], {"ETCSLURM_TORCH": "cuda"}, "torch: cpu build (asked for): pip install torch==2.13.0"),
])
def test_setup_venv_torch_choice(args: list[str], env: dict[str, str], expect: str) -> None:
    res = subprocess.run([str(ROOT / "sbin" / "setup-venv"), *args, "--dry-run"],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == expect, res.stderr


# ---- grace time ---------------------------------------------------------------------------
SCONTROL_PARTITION = """PartitionName=elastic
   AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL
   AllocNodes=ALL Default=NO QoS=N/A
   DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=60 Hidden=NO
   MaxNodes=UNLIMITED MaxTime=UNLIMITED MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED
   Nodes=n[1-4]
   PriorityJobFactor=1 PriorityTier=1 RootOnly=NO ReqResv=NO OverSubscribe=NO
   OverTimeLimit=NONE PreemptMode=REQUEUE
"""
SCONTROL_CONFIG = """AccountingStorageType   = accounting_storage/slurmdbd
PreemptMode             = REQUEUE
PreemptType             = preempt/qos
PreemptExemptTime       = 00:00:00
"""


def test_grace_time_from_partition_or_qos() -> None:
    assert grace.partition_grace(SCONTROL_PARTITION) == 60
    assert grace.preempt_type(SCONTROL_CONFIG) == "preempt/qos"
    assert grace.preempt_type("PreemptType             = preempt/partition_prio\n") == \
        "preempt/partition_prio"
    assert grace.qos_grace("00:05:00\n") == 300  # sacctmgr -nP show qos Q format=GraceTime
    assert grace.qos_grace("normal|1-00:00:30\n") == 86430
    assert grace.qos_grace("") is None
    assert grace.parse_duration("120") == 120 and grace.parse_duration("02:30") == 150
    assert grace.applicable_grace("preempt/qos", 60, 300) == (300, "qos")
    assert grace.applicable_grace("preempt/qos", 60, None) == (60, "partition")  # no slurmdbd
    assert grace.applicable_grace("preempt/partition_prio", 60, 300) == (60, "partition")
    assert grace.applicable_grace("", None, None) == (0, "unknown")


def test_gpu_check_fails_in_one_line_without_a_gpu() -> None:
    script = ROOT / "benchmarks" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], timeout=30).returncode == 0
    import shutil

    if shutil.which("nvidia-smi"):
        pytest.skip("a GPU machine: run benchmarks/gpu_check.sh itself")
    res = subprocess.run([str(script)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert res.stderr == "gpu_check: FAIL: no nvidia-smi: not a GPU machine (or no driver)\n"


def test_linger_keeps_the_coordinator_until_the_other_jobs_workers_left(
        redis_url: str, run_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job hosting the coordinator waits, once the run ended, for every live member to
    leave (bounded), and not at all while the run goes on."""
    import threading

    from etcslurm.coord.client import connect
    from etcslurm.coord.coordinator import Coordinator
    from etcslurm.runtime.generation import end_generation
    from tests.helpers import generation_record

    monkeypatch.setenv("ETCSLURM_REDIS_URL", redis_url)
    monkeypatch.setenv("ETCSLURM_RUN", run_id)
    workers = [Coordinator(connect(redis_url), run_id) for _ in range(2)]
    ids = [w.register({"node": f"n{i}"}) for i, w in enumerate(workers)]
    gen0 = generation_record(0, "tp1pp1dp2", ids)
    workers[0].publish_generation(gen0)
    try:
        assert in_job.linger(30) == []  # the run goes on: at once
        workers[0].publish_generation(end_generation(gen0, 5, reason="finished 5 steps"))
        workers[0].close()
        assert in_job.linger(0.5) == [ids[1]]  # bounded: names who is still there
        left: list[bool] = []

        def leave_later() -> None:
            time.sleep(1.0)
            left.append(True)
            workers[1].close()
        threading.Thread(target=leave_later, daemon=True).start()
        assert in_job.linger(30) == [] and left == [True]
        assert in_job.main(["linger", "soon"]) == 2
    finally:
        workers[0].end_run(keep_s=0)
        for w in workers:
            w.client.close()
