"""etcslurm: checkpoint-free elastic training of Megatron-style LLMs on Slurm.

The public API is small and documented in the README; everything else is internal.
Imports are lazy so that ``import etcslurm`` does not pull in torch or megatron-core.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    # a training script: the session and what configures it
    "ElasticSession": "etcslurm.runtime.session",
    "run_worker": "etcslurm.runtime.session",
    "RunSettings": "etcslurm.runtime.config",
    "WorkerOptions": "etcslurm.runtime.config",
    "worker_arguments": "etcslurm.runtime.worker",
    "worker_options": "etcslurm.runtime.worker",
    "Hooks": "etcslurm.hooks",
    # models and layouts
    "GPTSpec": "etcslurm.core.models",
    "ParallelConfig": "etcslurm.core.layout",
    "plan_migration": "etcslurm.megatron_state.planning",
    # Slurm
    "submit": "etcslurm.slurm.submission",
    "grow": "etcslurm.slurm.submission",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'etcslurm' has no attribute {name!r}")
