"""Megatron-LM's checkpoint conventions: where a checkpoint lies and what its common state
holds (``megatron/training/checkpointing.py``), so that a Megatron-LM or plain megatron-core
loop loads etcslurm's checkpoints and etcslurm loads theirs.

A save directory holds ``iter_NNNNNNN/`` (one ``dist_checkpointing`` checkpoint per saved
iteration, ``torch_dist`` format) and ``latest_checkpointed_iteration.txt`` (the newest
complete one, written after every rank's files).  The state dict of a checkpoint:

- ``model`` (one model chunk) or ``model0`` .. ``modelN`` (virtual pipeline stages):
  each chunk's ``sharded_state_dict()``;
- ``optimizer``: the megatron optimizer's ``sharded_state_dict()``; the distributed
  optimizer's format is recorded in the checkpoint's content metadata
  (``distrib_optim_sharding_type``);
- ``opt_param_scheduler``, ``iteration``, ``checkpoint_version`` (3.0),
  ``num_floating_point_operations_so_far``;
- ``rng_state``: a ``ShardedObject`` per (pp, tp) rank holding ``[{random_rng_state,
  np_rng_state, torch_rng_state, cuda_rng_state, rng_tracker_states}]`` (restored only
  into the same TP and PP, as Megatron-LM does);
- ``args``: an ``argparse.Namespace`` with the layout (``tensor_model_parallel_size``,
  ``pipeline_model_parallel_size``, ``data_parallel_size``, ...), the model's shapes and
  ``consumed_train_samples``, which is where Megatron-LM keeps the data position.

Nothing here imports torch at module level: the runtime reads the pointers without it.
"""

from __future__ import annotations

import os
import re
from argparse import Namespace
from pathlib import Path
from typing import Any

from etcslurm.core.layout import ParallelConfig
from etcslurm.errors import StateLostError, UsageError

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0
_ITER = re.compile(r"^iter_(\d{7,})$")


def iteration_dir(save_dir: str | os.PathLike[str], iteration: int) -> Path:
    """``save_dir/iter_NNNNNNN`` (Megatron-LM's ``get_checkpoint_name``)."""
    return Path(save_dir) / f"iter_{int(iteration):07d}"


def read_tracker(save_dir: str | os.PathLike[str]) -> int | None:
    """The iteration ``latest_checkpointed_iteration.txt`` names (None: no tracker);
    :class:`StateLostError` when it is unreadable or names no iteration."""
    tracker = Path(save_dir) / TRACKER
    if not tracker.exists():
        return None
    try:
        text = tracker.read_text().strip()
        return int(text)
    except (OSError, ValueError) as exc:
        raise StateLostError(f"cannot read checkpoint pointer {tracker}: {exc}") from None


def write_tracker(save_dir: str | os.PathLike[str], iteration: int) -> None:
    """Point ``latest_checkpointed_iteration.txt`` at ``iteration`` (atomically: a reader
    sees the old or the new one)."""
    tmp = Path(save_dir) / f"{TRACKER}.tmp"
    tmp.write_text(f"{int(iteration)}\n")
    tmp.replace(Path(save_dir) / TRACKER)


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is one ``dist_checkpointing`` checkpoint (its ``metadata.json``)."""
    return (Path(path) / "metadata.json").is_file()


def resolve(path: str | os.PathLike[str]) -> tuple[Path, int | None]:
    """The checkpoint ``path`` means, and its iteration when its name says it: a save
    directory (its tracker's ``iter_NNNNNNN``) or one checkpoint directory.  A one-line
    :class:`UsageError` when there is none."""
    path = Path(path)
    iteration = read_tracker(path)
    if iteration is not None:
        target = iteration_dir(path, iteration)
        if not is_checkpoint(target):
            raise StateLostError(f"{path / TRACKER} names iteration {iteration}, but "
                                 f"{target} is not a complete checkpoint")
        return target, iteration
    if is_checkpoint(path):
        m = _ITER.match(path.name)
        return path, int(m.group(1)) if m else None
    raise UsageError(f"no checkpoint in {path}: neither {TRACKER} nor a dist_checkpointing "
                     "checkpoint (metadata.json)")


def saved_iteration(path: str | os.PathLike[str]) -> int:
    """The ``iteration`` a checkpoint's common state records (0 when it has none)."""
    from megatron.core import dist_checkpointing

    return int(dist_checkpointing.load_common_state_dict(str(path)).get("iteration") or 0)


def saved_iterations(save_dir: str | os.PathLike[str]) -> list[Path]:
    """The ``iter_NNNNNNN`` directories of ``save_dir``, oldest first."""
    found = [p for p in Path(save_dir).glob("iter_*") if p.is_dir() and _ITER.match(p.name)]
    return sorted(found, key=lambda p: int(p.name[len("iter_"):]))


# ---------------------------------------------------------------------- common state
def args_namespace(trainee: Any) -> Namespace:
    """The ``args`` a Megatron-LM checkpoint carries, for what ``trainee`` is: the layout,
    the model's shapes (what Megatron-LM's ``check_checkpoint_args`` compares), the batch,
    the optimizer and the data position."""
    spec, cfg, hyper = trainee.spec, trainee.config, trainee.hyper
    return Namespace(
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        virtual_pipeline_model_parallel_size=(len(trainee.model)
                                              if len(trainee.model) > 1 else None),
        data_parallel_size=cfg.dp,
        expert_model_parallel_size=cfg.ep,
        expert_tensor_parallel_size=cfg.expert_tp,
        context_parallel_size=cfg.cp,
        world_size=cfg.world_size,
        num_layers=spec.layers,
        hidden_size=spec.hidden,
        num_attention_heads=spec.heads,
        num_query_groups=spec.query_groups,
        group_query_attention=spec.query_groups != spec.heads,
        ffn_hidden_size=spec.ffn,
        seq_length=spec.seq,
        max_position_embeddings=spec.seq,
        add_position_embedding=spec.position == "learned",
        untie_embeddings_and_output_weights=not spec.tied_embeddings,
        vocab_size=spec.vocab,
        num_experts=spec.experts or None,
        bf16=str(trainee.dtype).endswith("bfloat16"),
        fp16=str(trainee.dtype).endswith("float16") and "bfloat" not in str(trainee.dtype),
        use_distributed_optimizer=trainee.distributed,
        dist_ckpt_optim_fully_reshardable=trainee.distributed,
        ckpt_format="torch_dist",
        use_dist_ckpt=True,
        global_batch_size=hyper.global_batch,
        micro_batch_size=hyper.micro_batch,
        lr=hyper.lr,
        min_lr=hyper.min_lr,
        seed=trainee.seed,
        iteration=trainee.iteration,
        consumed_train_samples=trainee.consumed_samples,
        skipped_train_samples=0,
        consumed_valid_samples=0,
        data_parallel_random_init=False,
        no_save_rng=False,
        no_save_optim=False,
    )


def saved_layout(common: dict[str, Any]) -> ParallelConfig | None:
    """The layout a checkpoint was saved in, from its ``args`` (None: no args)."""
    args = common.get("args")
    if args is None:
        return None
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    # a dense model's args may name an expert TP that nothing uses
    etp = int(getattr(args, "expert_tensor_parallel_size", None) or tp) if ep > 1 else tp
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    dp = getattr(args, "data_parallel_size", None)
    if not dp:
        world = int(getattr(args, "world_size", tp * pp) or tp * pp)
        dp = max(1, world // (tp * pp * cp))
    return ParallelConfig(tp=tp, pp=pp, dp=int(dp), ep=ep, cp=cp, etp=etp)


def consumed_samples(common: dict[str, Any]) -> int:
    """The data position a checkpoint records (``args.consumed_train_samples``); 0 when it
    has none."""
    return int(getattr(common.get("args"), "consumed_train_samples", 0) or 0)


def rng_state() -> dict[str, Any]:
    """This process's random states, as Megatron-LM's ``get_rng_state`` collects them."""
    import random

    import numpy
    import torch
    from megatron.core import tensor_parallel

    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": numpy.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def rng_sharded_object(state: Any) -> Any:
    """``rng_state`` as Megatron-LM checkpoints it: one ``ShardedObject`` per (pp, tp)
    rank, replicated over DP (``state``: None when loading)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(
        "rng_state", [state] if state is not None else None,
        (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True),
    )


def set_rng_state(states: list[dict[str, Any]]) -> None:
    """Restore what :func:`rng_state` collected (the first entry: one per DP rank only with
    ``data_parallel_random_init``)."""
    import random

    import numpy
    import torch
    from megatron.core import tensor_parallel

    state = states[0]
    random.setstate(state["random_rng_state"])
    numpy.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def model_keys(chunks: int) -> list[str]:
    """The state-dict keys of the model chunks: ``model``, or ``model0`` .. ``modelN``."""
    return ["model"] if chunks == 1 else [f"model{i}" for i in range(chunks)]


def model_state(modules: list[Any], metadata: dict[str, Any] | None) -> dict[str, Any]:
    """Every chunk's ``sharded_state_dict`` under its key (:func:`model_keys`)."""
    return {key: module.sharded_state_dict(metadata=metadata)
            for key, module in zip(model_keys(len(modules)), modules, strict=True)}


def load_model_state(modules: list[Any], loaded: dict[str, Any]) -> None:
    """Load every chunk from its key of ``loaded`` (what ``dist_checkpointing.load``
    returned for :func:`model_state`'s request).  The tensors' own keys carry global layer
    numbers, so the chunks of one layout load from a checkpoint of any other."""
    for key, module in zip(model_keys(len(modules)), modules, strict=True):
        module.load_state_dict(loaded[key])
