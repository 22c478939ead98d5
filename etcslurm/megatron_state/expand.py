"""Every rank's holdings under a layout, analytically: megatron-core's model params and
optimizer state as pieces of global tensors, without building the model.

Why analytic: a plan for 10k GPUs needs no GPU, and the decider plans a resize before the
new layout's model exists.  ``tests/test_core_state_equivalence.py`` and
``tests/test_llama_state.py`` check every piece against the live megatron-core metadata.

* plain Adam (``optimizer='adam'``): ``optimizer.state.exp_avg.<key>`` and
  ``optimizer.state.exp_avg_sq.<key>`` (plus ``optimizer.state.fp32_param.<key>`` when the
  params are not fp32), replicated over DP;
* ``optimizer='distributed'``: megatron's DistributedOptimizer (ZeRO-1): each DP rank's
  shard of the DDP buffers (:mod:`etcslurm.megatron_state.buffers`).

Ranks with identical holdings share a *class* (plain Adam: one per (tp, pp), MoE: per
(tp, pp, ep); distributed: one per rank), which is what keeps the planner fast.  A rank of
an interleaved pipeline holds all its model chunks' pieces; a context-parallel rank the
same params as its CP peers and its own shard of the DP x CP-sharded buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

from etcslurm.core.layout import ExpertCoord, ParallelConfig
from etcslurm.core.models import GPTSpec
from etcslurm.core.state import Piece
from etcslurm.errors import UsageError
from etcslurm.megatron_state.buffers import shard_block
from etcslurm.megatron_state.params import DEFAULT_VOCAB_PAD_TP, opt_kinds, stage_params

OPTIMIZERS = ("adam", "distributed")


def check_optimizer(optimizer: str) -> None:
    if optimizer not in OPTIMIZERS:
        raise UsageError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")


def check_model(spec: GPTSpec, cfg: ParallelConfig, params_dtype: str | None = None) -> str:
    """Validate ``cfg`` for ``spec`` (TP must split heads, query groups and ffn); returns
    the params dtype to use (``params_dtype`` or the spec's)."""
    cfg.validate(spec)
    problems = spec.tp_problems(cfg.tp, cfg.expert_tp)
    if problems:
        raise UsageError(f"layout {cfg} is invalid for {spec}: {'; '.join(problems)}")
    dtype = params_dtype or spec.dtype
    if dtype not in ("float32", "bfloat16", "float16"):
        raise UsageError(f"unsupported params dtype {dtype!r}; use float32 or bfloat16")
    return dtype


@lru_cache(maxsize=256)
def _model_block(
    spec: GPTSpec, cfg: ParallelConfig, tp_rank: int, pp_rank: int, optimizer: str,
    params_dtype: str, vocab_pad_tp: int | None, ep_rank: int = 0,
    etp_rank: int | None = None,
) -> tuple[Piece, ...]:
    """What every DP replica of (tp, pp) -- MoE: every expert-DP replica of (tp, pp, ep,
    etp) -- holds: params (+ plain Adam's state)."""
    params = stage_params(spec, cfg, tp_rank, pp_rank, vocab_pad_tp, ep_rank,
                          etp_rank=etp_rank)
    out = [Piece(p.key, b, params_dtype) for p in params for b in p.boxes]
    if optimizer == "adam":
        kinds = opt_kinds(optimizer, params_dtype)
        for p in params:
            out.extend(Piece(f"optimizer.state.{k}.{p.key}", b, "float32")
                       for b in p.boxes for k in kinds)
    return tuple(out)


def _block_key(cfg: ParallelConfig, rank: int,
               expert: ExpertCoord) -> tuple[int, int, int, int | None]:
    """What a rank's model block depends on: (tp, pp, ep rank, etp rank), the etp rank None
    when the experts follow TP (it is then the tp rank); ``expert``: the rank's
    :meth:`ParallelConfig.expert_coord`."""
    c = cfg.coord(rank)
    return c.tp, c.pp, expert.ep, (expert.etp if cfg.etp else None)


def rank_pieces(
    spec: GPTSpec, cfg: ParallelConfig, rank: int, optimizer: str = "adam",
    params_dtype: str | None = None, overlap_grad_reduce: bool = False,
    vocab_pad_tp: int | None = DEFAULT_VOCAB_PAD_TP,
) -> list[Piece]:
    """Every piece global rank ``rank`` holds under ``cfg`` (``params_dtype`` None: the
    spec's ``dtype``)."""
    check_optimizer(optimizer)
    params_dtype = check_model(spec, cfg, params_dtype)
    expert = cfg.expert_coord(rank)
    tp, pp, ep, etp = _block_key(cfg, rank, expert)
    out = _model_block(spec, cfg, tp, pp, optimizer, params_dtype, vocab_pad_tp, ep, etp)
    if optimizer == "distributed":
        out += shard_block(spec, cfg, tp, pp, cfg.shard_rank(rank), params_dtype,
                           overlap_grad_reduce, vocab_pad_tp, expert)
    return list(out)


@dataclass(frozen=True)
class LayoutState:
    """Holdings of every rank of a layout, grouped into classes of identical holdings.

    A class is a union of *blocks* (plain Adam: one block per (tp, pp); distributed: the
    (tp, pp) params block shared by all DP ranks plus the rank's own ZeRO-1 shard block),
    so 8k ranks do not repeat the same pieces 8k times.
    """

    config: ParallelConfig
    blocks: tuple[tuple[Piece, ...], ...]
    class_blocks: tuple[tuple[int, ...], ...]
    rank_class: tuple[int, ...]

    @cached_property
    def classes(self) -> tuple[tuple[Piece, ...], ...]:
        return tuple(tuple(p for b in bl for p in self.blocks[b]) for bl in self.class_blocks)

    def pieces(self, rank: int) -> tuple[Piece, ...]:
        return tuple(p for b in self.class_blocks[self.rank_class[rank]] for p in self.blocks[b])


def expand(
    spec: GPTSpec, cfg: ParallelConfig, optimizer: str = "adam",
    params_dtype: str | None = None, overlap_grad_reduce: bool = False,
    vocab_pad_tp: int | None = DEFAULT_VOCAB_PAD_TP,
) -> LayoutState:
    """The holdings of every rank of ``cfg``, as classes of blocks (see module docstring).

    ``params_dtype`` None: the spec's ``dtype`` (``float32``/``bfloat16``).
    """
    check_optimizer(optimizer)
    params_dtype = check_model(spec, cfg, params_dtype)
    blocks: list[tuple[Piece, ...]] = []
    experts = [cfg.expert_coord(rank) for rank in range(cfg.world_size)]
    keys = [_block_key(cfg, rank, e) for rank, e in enumerate(experts)]
    model_block: dict[tuple[int, int, int, int | None], int] = {}
    # in (pp, tp, ep, etp) order: a MoE model's experts differ per EP (and ETP) rank
    for key in sorted(set(keys), key=lambda k: (k[1], k[0], k[2], k[3] or 0)):
        tp, pp, ep, etp = key
        model_block[key] = len(blocks)
        blocks.append(_model_block(spec, cfg, tp, pp, optimizer, params_dtype, vocab_pad_tp,
                                   ep, etp))
    class_blocks: list[tuple[int, ...]] = []
    rank_class: list[int] = []
    if optimizer == "adam":
        class_blocks = [(i,) for i in range(len(blocks))]
        rank_class = [model_block[key] for key in keys]
    else:
        for rank, key in enumerate(keys):
            tp, pp = key[0], key[1]
            blocks.append(shard_block(spec, cfg, tp, pp, cfg.shard_rank(rank), params_dtype,
                                      overlap_grad_reduce, vocab_pad_tp, experts[rank]))
            class_blocks.append((model_block[key], len(blocks) - 1))
            rank_class.append(rank)
    return LayoutState(cfg, tuple(blocks), tuple(class_blocks), tuple(rank_class))
