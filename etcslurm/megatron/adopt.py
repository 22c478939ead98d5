"""A user's own megatron-core objects as etcslurm's ``Trainee``, and their shapes.

Why: a training script already builds its model chunks, its megatron optimizer and its
LR scheduler; it should not restate them for etcslurm.  The builder a session calls for
every layout returns those objects as they are (:data:`Built`); :func:`as_trainee` puts
them with what etcslurm tracks beside them (the layout, the data position), and
:func:`spec_of` reads the model's shapes from its own ``TransformerConfig`` and
``GPTModel`` attributes -- what the layout policy and the decider's analytic plan need
(the migration itself plans from the live state).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import GPTSpec
from etcslurm.errors import UsageError
from etcslurm.megatron.model import Trainee, TrainHyper

#: what a builder returns: the model chunks, the megatron optimizer, the LR scheduler
#: (or ``None``) -- or etcslurm's own :class:`Trainee`
Built = tuple[Sequence[torch.nn.Module], Any, Any]

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def _gpt(chunk: torch.nn.Module) -> Any:
    """The GPTModel inside a (DDP-wrapped) model chunk."""
    return getattr(chunk, "module", chunk)


def optimizer_kind(optimizer: Any) -> str:
    """``distributed`` for megatron's DistributedOptimizer (alone or chained), else
    ``adam``; another optimizer than Adam is refused (its state is not described)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    parts = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    for part in parts:
        inner = getattr(part, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam):
            raise UsageError(
                f"the builder's optimizer wraps {type(inner).__name__}: etcslurm migrates "
                "Adam's state (megatron's OptimizerConfig(optimizer='adam'))")
    return "distributed" if any(isinstance(p, DistributedOptimizer) for p in parts) else "adam"


def spec_of(model: Sequence[torch.nn.Module]) -> GPTSpec:
    """The shapes of a megatron-core GPT-family model, from its own config and
    attributes (one-line :class:`UsageError` for a model of another family)."""
    gpt = _gpt(model[0])
    cfg = getattr(gpt, "config", None)
    if cfg is None or not hasattr(gpt, "vocab_size"):
        raise UsageError(f"the builder's model is a {type(gpt).__name__}, not a megatron-core "
                         "GPTModel (inside DistributedDataParallel or bare)")
    activation = {F.silu: "silu", F.gelu: "gelu"}.get(cfg.activation_func)
    if activation is None:
        raise UsageError(f"the model's activation {cfg.activation_func!r} is not gelu or silu")
    position = "rope" if gpt.position_embedding_type == "rope" else "learned"
    return GPTSpec(
        layers=cfg.num_layers, hidden=cfg.hidden_size, heads=cfg.num_attention_heads,
        query_groups=cfg.num_query_groups or cfg.num_attention_heads,
        ffn=cfg.ffn_hidden_size, vocab=int(gpt.vocab_size), seq=int(gpt.max_sequence_length),
        tied_embeddings=bool(gpt.share_embeddings_and_output_weights),
        gated=bool(cfg.gated_linear_unit), activation=activation, norm=cfg.normalization,
        position=position, bias=bool(cfg.add_bias_linear),
        dtype=_DTYPES.get(cfg.params_dtype, "float32"),
        rope_base=int(getattr(gpt, "rotary_base", 10000) or 10000),
        experts=int(cfg.num_moe_experts or 0), topk=int(cfg.moe_router_topk or 2),
        expert_ffn=cfg.moe_ffn_hidden_size if cfg.num_moe_experts else None,
        name="from the model",
    )


def as_trainee(built: Built | Trainee, layout: ParallelConfig, *, seed: int,
               global_batch: int, micro_batch: int) -> Trainee:
    """``built`` (a builder's result) as a :class:`Trainee` for ``layout``."""
    if isinstance(built, Trainee):
        return built
    try:
        model, optimizer, scheduler = built
    except (TypeError, ValueError):
        raise UsageError("the builder must return (model chunks, optimizer, scheduler), got "
                         f"{type(built).__name__}") from None
    chunks = list(model) if isinstance(model, list | tuple) else [model]
    gpt = _gpt(chunks[0])
    dtype = getattr(getattr(gpt, "config", None), "params_dtype", torch.float32)
    return Trainee(chunks, optimizer, scheduler, spec_of(chunks), layout,
                   optimizer_kind(optimizer), seed, dtype,
                   TrainHyper(global_batch=global_batch, micro_batch=micro_batch))
