"""A worker's torch threads: the user's ``OMP_NUM_THREADS``, else its Slurm share, else
torch's own default; a local run's workers share the host's cores."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from etcslurm import cpu_threads


def test_slurm_share_of_a_task() -> None:
    rng = random.Random(5)
    for _ in range(200):
        cpus, tasks = rng.randint(1, 256), rng.randint(1, 16)
        env = {"SLURM_CPUS_ON_NODE": str(cpus), "SLURM_NTASKS_PER_NODE": str(tasks)}
        assert cpu_threads.slurm_threads(env) == max(1, cpus // tasks), env
        per_task = rng.randint(1, 32)
        assert cpu_threads.slurm_threads({**env, "SLURM_CPUS_PER_TASK": str(per_task)}) \
            == per_task  # --cpus-per-task says it outright
    # without --ntasks-per-node Slurm writes the tasks of every node, "4(x2),3"
    assert cpu_threads.slurm_threads({"SLURM_CPUS_ON_NODE": "16",
                                      "SLURM_TASKS_PER_NODE": "4(x2),3"}) == 4
    assert cpu_threads.slurm_threads({}) is None  # not a Slurm task: torch's default
    assert cpu_threads.slurm_threads({"SLURM_CPUS_ON_NODE": "8"}) is None


def test_workers_on_a_host_share_its_cores() -> None:
    rng = random.Random(9)
    for _ in range(200):
        cpus, workers = rng.randint(1, 256), rng.randint(0, 64)
        got = cpu_threads.share(workers, cpus)
        assert got >= 1 and got * max(1, workers) <= max(cpus, max(1, workers)), (cpus, workers)
        assert got == max(1, cpus // max(1, workers))
    assert cpu_threads.share(1) == cpu_threads.visible_cpus()


@pytest.mark.parametrize(("env", "before", "expected"), [
    ({"SLURM_CPUS_PER_TASK": "1"}, False, 1),   # OpenMP reads the variable at torch's import
    ({"SLURM_CPUS_PER_TASK": "1"}, True, 1),    # torch already imported: set_num_threads
    ({"SLURM_CPUS_PER_TASK": "1", "OMP_NUM_THREADS": "2"}, False, 2),  # the user's wins
])
def test_a_process_runs_torch_on_the_threads_it_was_given(env: dict[str, str], before: bool,
                                                          expected: int) -> None:
    code = ("import torch\n" if before else "") + (
        "from etcslurm import cpu_threads\n"
        "print(cpu_threads.apply())\n"
        "import torch\n"
        "print(torch.get_num_threads())\n")
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("SLURM_") and k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, text=True,
                         capture_output=True, timeout=120, check=True).stdout.split()
    assert out == [str(expected), str(expected)]
