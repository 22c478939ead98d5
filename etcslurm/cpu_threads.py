"""How many CPU threads a worker's torch runs its own ops on.

Why: torch starts one OpenMP thread per core it can see, in every process.  Several
workers on one host then each take every core, and OpenMP's idle threads spin between
the many small ops of a step, taking the cores the other workers need: on a 2-core
host, two local runs of 4-6 workers side by side took 113 s and 222 CPU-seconds with
torch's default, 23-27 s and 52 CPU-seconds with one thread each.  Launchers of several processes per host
give each one thread for that reason (torchrun sets ``OMP_NUM_THREADS=1``), and Slurm
sites export ``OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK``.  etcslurm does the same, and a
user's ``OMP_NUM_THREADS`` always wins.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, MutableMapping


def visible_cpus() -> int:
    """The CPUs this process may run on (its affinity, which Slurm and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def share(workers: int, cpus: int | None = None) -> int:
    """Threads per worker when ``workers`` share ``cpus`` (default: this process's)."""
    return max(1, (visible_cpus() if cpus is None else cpus) // max(1, workers))


def slurm_threads(env: Mapping[str, str]) -> int | None:
    """A Slurm task's share of the CPUs Slurm gave it: ``--cpus-per-task``, else the
    job's CPUs on this node over its tasks on this node; None outside Slurm."""
    per_task = env.get("SLURM_CPUS_PER_TASK", "")
    if per_task.isdigit() and int(per_task) > 0:
        return int(per_task)
    on_node = env.get("SLURM_CPUS_ON_NODE", "")
    # SLURM_TASKS_PER_NODE reads like "2(x3),1": the first node's count is the usual one
    tasks = re.match(r"\d+", env.get("SLURM_NTASKS_PER_NODE")
                     or env.get("SLURM_TASKS_PER_NODE", ""))
    if on_node.isdigit() and tasks and int(tasks.group()) > 0:
        return share(int(tasks.group()), int(on_node))
    return None


def apply(env: MutableMapping[str, str] | None = None) -> int | None:
    """Set this process's threads: ``OMP_NUM_THREADS`` when set (also for a torch that a
    template process imported before the variable was this worker's), else the Slurm
    task's share; returns the count set, None where torch keeps its own default."""
    env = os.environ if env is None else env
    given = env.get("OMP_NUM_THREADS", "")
    threads = int(given) if given.isdigit() and int(given) > 0 else slurm_threads(env)
    if threads is None:
        return None
    env["OMP_NUM_THREADS"] = str(threads)  # read by OpenMP where torch is not loaded yet
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    return threads
