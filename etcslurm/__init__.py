"""etcslurm: checkpoint-free elastic training of Megatron-style LLMs on Slurm.

The public API is small and documented in the README; everything else is internal.
Imports are lazy so that ``import etcslurm`` does not pull in torch or megatron-core.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "ParallelConfig": "etcslurm.core.layout",
    "GPTSpec": "etcslurm.core.models",
    "plan_migration": "etcslurm.core.planner",
    "ElasticSession": "etcslurm.runtime.session",
    "submit": "etcslurm.slurm.submission",
    "grow": "etcslurm.slurm.submission",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'etcslurm' has no attribute {name!r}")
