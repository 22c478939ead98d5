"""Which GPU a task uses, and whether its job was given any (standard library only).

Slurm makes GPUs visible per task in three ways, and the device index follows from how
many the task sees:

* ``--gpus-per-task=1``: each task sees only its own GPU (``CUDA_VISIBLE_DEVICES`` of
  one) → device 0;
* ``--gpus-per-node=N`` / ``--gres=gpu[:type]:N``: every task of a node sees all N →
  device ``SLURM_LOCALID mod N`` (``LOCAL_RANK`` first: torchrun inside ``srun``);
* outside Slurm: ``rank mod N``.

A job that was given GPUs says so in ``SLURM_GPUS_ON_NODE``, ``SLURM_JOB_GPUS``,
``SLURM_STEP_GPUS`` or ``CUDA_VISIBLE_DEVICES``; a torch that cannot use them must not
fall back to the CPU silently (:func:`cpu_torch_problem`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

#: the variables that say GPUs were allocated, in the order they are reported
GPU_VARIABLES = ("SLURM_GPUS_ON_NODE", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES")


def allocated_gpus(environ: Mapping[str, str]) -> str | None:
    """``NAME=VALUE`` of the first variable that says this task has GPUs, else None.

    ``SLURM_GPUS_ON_NODE=0`` and an empty, ``-1`` or ``NoDevFiles`` device list mean none.
    """
    for name in GPU_VARIABLES:
        value = environ.get(name, "").strip()
        if not value or value in ("-1", "NoDevFiles", "none", "N/A"):
            continue
        if name == "SLURM_GPUS_ON_NODE" and not (value.isdigit() and int(value) > 0):
            continue
        return f"{name}={value}"
    return None


def local_device_index(environ: Mapping[str, str], visible: int, rank: int = 0) -> int:
    """The index among the ``visible`` GPUs (``torch.cuda.device_count()``) this task uses."""
    if visible < 1:
        raise ValueError("no visible GPU to choose from")
    if visible == 1:
        return 0
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        value = environ.get(name, "").strip()
        if re.fullmatch(r"\d+", value):
            return int(value) % visible
    return rank % visible


def cpu_torch_problem(environ: Mapping[str, str], cuda_available: bool,
                      torch_cuda: str | None, torch_version: str) -> str | None:
    """One line when GPUs are allocated but this torch cannot use them, else None.

    ``torch_cuda`` is ``torch.version.cuda`` (None: a CPU build).  ``ETCSLURM_DEVICE=cpu``
    runs on the CPU on purpose.
    """
    if cuda_available or environ.get("ETCSLURM_DEVICE", "").strip().lower() == "cpu":
        return None
    found = allocated_gpus(environ)
    if found is None:
        return None
    if torch_cuda is None:
        return (f"this job has GPUs ({found}) but torch {torch_version} is a CPU build: "
                "install a CUDA torch (sbin/setup-venv --cuda, or ETCSLURM_TORCH=cuda), "
                "or set ETCSLURM_DEVICE=cpu to train on the CPU on purpose")
    return (f"this job has GPUs ({found}) but torch {torch_version} (CUDA {torch_cuda}) "
            "sees none: check the driver on this node (nvidia-smi) and that the torch "
            "build's CUDA matches it, or set ETCSLURM_DEVICE=cpu to train on the CPU on purpose")
