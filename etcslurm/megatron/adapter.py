"""The megatron-core adapter: the one import the runtime, the transfer executor, the
baseline and ``etcslurm bench migrate`` need.

Lifecycle of a migration in the same processes (P2P path)::

    old = local_state(trainee)            # pieces + views of the OLD live storage
    scalars = extract_scalars(trainee)    # JSON, sent from one source
    init_parallel(new_cfg, rank, world, store, generation + 1)
    fresh = build_empty(spec, new_cfg, optimizer=...)     # same shapes, values overwritten
    new = local_state(fresh)              # views of the NEW storage to write into
    ... executor copies/sends old views → new views per the plan ...
    finish_restore(fresh, scalars)        # Adam step per param, scheduler, counters

The checkpoint baseline (``etcslurm.baseline.checkpoint``) produces the same ``fresh``
through ``dist_checkpointing`` save → load, for the side-by-side comparison and as the
fallback.
"""

from __future__ import annotations

from typing import Any

import torch

from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import GPTSpec
from etcslurm.megatron.adam_state import fix_step_alias, init_optimizer_state
from etcslurm.megatron.cpu_shim import install_if_needed
from etcslurm.megatron.model import (
    OPTIMIZERS,
    Trainee,
    TrainHyper,
    build_gpt,
    padded_vocab,
)
from etcslurm.megatron.parallel import (
    default_backend,
    init_model_parallel,
    init_parallel,
    init_world,
    megatron_groups,
    teardown,
)
from etcslurm.megatron.scalars import extract_scalars, restore_scalars
from etcslurm.megatron.sharded_meta import LocalState, gather_global, local_state
from etcslurm.megatron.train import num_microbatches, sample, train_step

__all__ = [
    "OPTIMIZERS",
    "LocalState",
    "TrainHyper",
    "Trainee",
    "build_empty",
    "build_gpt",
    "default_backend",
    "extract_scalars",
    "finish_restore",
    "fix_step_alias",
    "gather_global",
    "init_model_parallel",
    "init_optimizer_state",
    "init_parallel",
    "init_world",
    "install_if_needed",
    "local_state",
    "megatron_groups",
    "num_microbatches",
    "padded_vocab",
    "restore_scalars",
    "sample",
    "teardown",
    "train_step",
]


def build_empty(
    spec: GPTSpec,
    config: ParallelConfig,
    optimizer: str = "adam",
    seed: int = 1234,
    dtype: torch.dtype | str | None = None,
    hyper: TrainHyper | None = None,
) -> Trainee:
    """A model+optimizer for ``config`` whose every tensor will be overwritten by a
    migration (it is :func:`build_gpt`: megatron has no cheaper allocation path, and the
    random init costs little next to the transfer)."""
    return build_gpt(spec, config, optimizer=optimizer, seed=seed, dtype=dtype, hyper=hyper)


def finish_restore(trainee: Trainee, scalars: dict[str, Any], restore_rng: bool = False) -> None:
    """Make a trainee whose pieces were written through :func:`local_state` views
    consistent: scalars (Adam ``step`` per param, scheduler → lr/wd, counters), no stale
    gradients.  Model params and optimizer main params/shards share storage, so nothing
    has to be copied between them (checked by the bit-exact tests)."""
    restore_scalars(trainee, scalars, restore_rng=restore_rng)
    for chunk in trainee.model:
        chunk.zero_grad_buffer()
    trainee.optimizer.zero_grad()
