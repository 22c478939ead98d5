"""The parameters of one pipeline stage as megatron-core builds and checkpoints them.

Local GPT layer spec, ``GPTModel.sharded_state_dict()`` keys without a DDP ``module.``
prefix: TP-sharded as megatron's column/row-parallel layers shard them (QKV, fc1 and their
biases on axis 0; linear_proj and fc2 weights on axis 1; norms and row-parallel biases
replicated); transformer layers carry the prepended layer axis, one piece per layer (each
is a separate tensor on the rank).  Grouped-query attention: ``linear_qkv`` has
``(heads + 2*groups) * kv_channels`` rows, split by TP into whole groups.  SwiGLU:
megatron's ``ShardedTensorFactory`` checkpoints the local ``linear_fc1`` ``[2*ffn/tp, h]``
as two pieces of a ``[2*ffn, h]`` tensor (gate rows ``tp_rank*ffn/tp``, up rows
``ffn + tp_rank*ffn/tp``; :class:`ParamDef` ``parts``).  RMSNorm has no bias, RoPE no
position-embedding tensor, ``bias=False`` no linear biases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import MAKE_VOCAB_SIZE_DIVISIBLE_BY, GPTSpec
from etcslurm.core.stages import chunk_layers
from etcslurm.core.state import flat_range_boxes

#: etcslurm's megatron adapter builds every layout with the vocabulary pre-padded for TP 8
#: (a multiple of 1024), so the embedding has one shape in every layout of a run.
DEFAULT_VOCAB_PAD_TP = 8


def padded_vocab(spec: GPTSpec, tp: int, vocab_pad_tp: int | None = DEFAULT_VOCAB_PAD_TP) -> int:
    """Rows of the word embedding under TP ``tp``.

    megatron pads the vocabulary it is given to a multiple of ``128 * tp``; etcslurm's
    adapter first pre-pads it for ``vocab_pad_tp`` (``128 * 8``), so across layouts with
    TP <= 8 the shape never changes.  ``vocab_pad_tp=None``: plain megatron.
    """
    vocab = spec.vocab
    if vocab_pad_tp:
        vocab = pad(vocab, MAKE_VOCAB_SIZE_DIVISIBLE_BY * vocab_pad_tp)
    return pad(vocab, MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp)


def pad(n: int, divisor: int) -> int:
    """``n`` rounded up to a multiple of ``divisor``."""
    return -(-n // divisor) * divisor


@dataclass(frozen=True)
class ParamDef:
    """One parameter tensor of a pipeline stage, as this rank holds it.

    ``box``: where the local tensor sits in its global tensor (layer axis included).
    ``parts``: set when the local tensor is NOT one box of one global tensor -- megatron's
    ``ShardedTensorFactory`` for a gated (SwiGLU) ``linear_fc1`` checkpoints the local
    ``[2*ffn/tp, h]`` tensor as its two halves along axis 0, the gate half at rows
    ``tp_rank*ffn/tp`` and the up half at ``ffn + tp_rank*ffn/tp`` of a ``[2*ffn, h]``
    global tensor.  ``parts`` lists those boxes in local (flat-memory) order; ``box`` is
    then the first one.
    """

    key: str
    box: tuple[tuple[int, int], ...]  # in global coordinates (layer axis included)
    shared_embedding: bool = False
    parts: tuple[tuple[tuple[int, int], ...], ...] | None = None
    #: an expert's weight: sharded over expert parallelism, replicated over expert DP,
    #: and, with EP > 1, kept in DDP's separate expert buffer (its own ZeRO-1 shards)
    expert: bool = False

    @property
    def boxes(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """The global boxes of the local tensor, in local memory order."""
        return self.parts if self.parts is not None else (self.box,)

    @property
    def numel(self) -> int:
        return sum(math.prod(hi - lo for lo, hi in b) for b in self.boxes)

    def range_boxes(self, start: int, stop: int) -> list[tuple[tuple[int, int], ...]]:
        """Boxes of the flat element range ``[start, stop)`` of the local tensor."""
        out: list[tuple[tuple[int, int], ...]] = []
        offset = 0
        for b in self.boxes:
            n = math.prod(hi - lo for lo, hi in b)
            lo, hi = max(start, offset), min(stop, offset + n)
            if hi > lo:
                out.extend(flat_range_boxes(b, lo - offset, hi - offset))
            offset += n
        return out


def _split(extent: int, tp: int, tp_rank: int) -> tuple[int, int]:
    part = extent // tp
    return (tp_rank * part, (tp_rank + 1) * part)


def stage_params(spec: GPTSpec, cfg: ParallelConfig, tp_rank: int, pp_rank: int,
                 vocab_pad_tp: int | None = DEFAULT_VOCAB_PAD_TP,
                 ep_rank: int = 0, chunk: int | None = None,
                 etp_rank: int | None = None) -> list[ParamDef]:
    """Parameters of one (tp, pp) rank -- for a MoE model, of one (tp, pp, ep, etp) rank
    -- in ``model.named_parameters()`` order (cached); ``chunk``: only that model chunk of
    an interleaved pipeline (None: all of the rank's chunks, chunk 0 first); ``etp_rank``:
    the rank's slice of each expert (None: ``tp_rank``, as when ``etp = tp``)."""
    return list(cached_stage_params(spec, cfg, tp_rank, pp_rank, vocab_pad_tp, ep_rank, chunk,
                                    etp_rank))


def _gated(key: str, lay: tuple[int, int], rows: int, tp: int, tp_rank: int,
           *rest: tuple[int, int], expert: tuple[int, int] | None = None) -> ParamDef:
    """A gated ``linear_fc1`` tensor as megatron's SwiGLU factory splits it (``expert``:
    the expert axis of an expert's tensor, after the layer axis)."""
    lo, hi = _split(rows, tp, tp_rank)
    head = (lay, expert) if expert is not None else (lay,)
    gate, up = (*head, (lo, hi), *rest), (*head, (rows + lo, rows + hi), *rest)
    return ParamDef(key, gate, parts=(gate, up), expert=expert is not None)


#: checkpoint keys of a MoE layer (megatron-core 0.16.1, ``SequentialMLP``: every local
#: expert is checkpointed as one slice of a ``[layers, experts, ...]`` tensor)
ROUTER_KEY = "decoder.layers.mlp.router.weight"
EXPERT_FC1_KEY = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
EXPERT_FC2_KEY = "decoder.layers.mlp.experts.experts.linear_fc2.weight"


def _moe_params(spec: GPTSpec, cfg: ParallelConfig, etp_rank: int, ep_rank: int,
                lay: tuple[int, int]) -> list[ParamDef]:
    """One MoE layer's router (replicated) and this rank's experts: experts
    ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)``, each split over the experts' TP (``etp``)
    like a dense MLP over TP."""
    h, f, tp, tp_rank = spec.hidden, int(spec.expert_ffn or 0), cfg.expert_tp, etp_rank
    out = [ParamDef(ROUTER_KEY, (lay, (0, spec.experts), (0, h)))]
    per_rank = spec.experts // cfg.ep
    for g in range(ep_rank * per_rank, (ep_rank + 1) * per_rank):
        ex = (g, g + 1)
        if spec.gated:
            out.append(_gated(EXPERT_FC1_KEY, lay, f, tp, tp_rank, (0, h), expert=ex))
        else:
            out.append(ParamDef(EXPERT_FC1_KEY, (lay, ex, _split(f, tp, tp_rank), (0, h)),
                                expert=True))
        out.append(ParamDef(EXPERT_FC2_KEY, (lay, ex, (0, h), _split(f, tp, tp_rank)),
                            expert=True))
    return out


@lru_cache(maxsize=1024)
def cached_stage_params(spec: GPTSpec, cfg: ParallelConfig, tp_rank: int, pp_rank: int,
                        vocab_pad_tp: int | None = DEFAULT_VOCAB_PAD_TP,
                        ep_rank: int = 0, chunk: int | None = None,
                        etp_rank: int | None = None) -> tuple[ParamDef, ...]:
    """Parameters of one (tp, pp) rank in ``model.named_parameters()`` order (one tuple
    per rank, shared: :func:`stage_params` gives a list).  An interleaved pipeline's rank
    holds ``vpp`` model chunks, each a model of its own (its own DDP buffer): ``chunk``
    picks one, None gives all of them in chunk order.  The embedding sits in chunk 0 of
    the first stage, the final norm and output layer in the last chunk of the last.

    ``vocab_pad_tp``: see :func:`padded_vocab`.  Follows megatron-core 0.16.1's local
    layer spec: per layer ``input_layernorm`` (checkpointed as
    ``self_attention.linear_qkv.layer_norm_*``), ``linear_proj``, ``linear_qkv`` (rows
    ``(heads + 2*groups) * kv_channels``, TP-split by whole groups), ``pre_mlp_layernorm``
    (``mlp.linear_fc1.layer_norm_*``), ``linear_fc1`` (gated: two factory halves),
    ``linear_fc2``; biases and norm biases only when the spec has them.  A MoE layer has
    the router and this EP rank's experts in place of ``linear_fc1``/``linear_fc2``.
    """
    if chunk is None:
        return tuple(p for v in range(cfg.vpp) for p in cached_stage_params(
            spec, cfg, tp_rank, pp_rank, vocab_pad_tp, ep_rank, v, etp_rank))
    h, f, tp = spec.hidden, spec.ffn, cfg.tp
    vocab = padded_vocab(spec, tp, vocab_pad_tp)
    first, last = pp_rank == 0 and chunk == 0, pp_rank == cfg.pp - 1 and chunk == cfg.vpp - 1
    bias, norm_bias = spec.bias, spec.norm_has_bias
    q_rows, qkv_rows = spec.heads * spec.kv_channels, spec.qkv_rows

    def full(n: int) -> tuple[int, int]:
        return (0, n)

    out: list[ParamDef] = []
    if first:
        out.append(ParamDef("embedding.word_embeddings.weight",
                            (_split(vocab, tp, tp_rank), full(h)), shared_embedding=cfg.pp > 1
                            and spec.tied_embeddings))
        if spec.position == "learned":
            out.append(ParamDef("embedding.position_embeddings.weight",
                                (full(spec.seq), full(h))))
    attn, mlp = "decoder.layers.self_attention.", "decoder.layers.mlp."
    for layer in chunk_layers(spec, cfg.pp, cfg.vpp, pp_rank, chunk):
        lay = (layer, layer + 1)
        out.append(ParamDef(attn + "linear_qkv.layer_norm_weight", (lay, full(h))))
        if norm_bias:
            out.append(ParamDef(attn + "linear_qkv.layer_norm_bias", (lay, full(h))))
        out.append(ParamDef(attn + "linear_proj.weight",
                            (lay, full(h), _split(q_rows, tp, tp_rank))))
        if bias:
            out.append(ParamDef(attn + "linear_proj.bias", (lay, full(h))))
        out.append(ParamDef(attn + "linear_qkv.weight",
                            (lay, _split(qkv_rows, tp, tp_rank), full(h))))
        if bias:
            out.append(ParamDef(attn + "linear_qkv.bias", (lay, _split(qkv_rows, tp, tp_rank))))
        out.append(ParamDef(mlp + "linear_fc1.layer_norm_weight", (lay, full(h))))
        if norm_bias:
            out.append(ParamDef(mlp + "linear_fc1.layer_norm_bias", (lay, full(h))))
        if spec.moe:
            out.extend(_moe_params(spec, cfg, tp_rank if etp_rank is None else etp_rank,
                                   ep_rank, lay))
            continue
        if spec.gated:
            out.append(_gated(mlp + "linear_fc1.weight", lay, f, tp, tp_rank, full(h)))
            if bias:
                out.append(_gated(mlp + "linear_fc1.bias", lay, f, tp, tp_rank))
        else:
            out.append(ParamDef(mlp + "linear_fc1.weight", (lay, _split(f, tp, tp_rank), full(h))))
            if bias:
                out.append(ParamDef(mlp + "linear_fc1.bias", (lay, _split(f, tp, tp_rank))))
        out.append(ParamDef(mlp + "linear_fc2.weight", (lay, full(h), _split(f, tp, tp_rank))))
        if bias:
            out.append(ParamDef(mlp + "linear_fc2.bias", (lay, full(h))))
    if last:
        out.append(ParamDef("decoder.final_layernorm.weight", (full(h),)))
        if norm_bias:
            out.append(ParamDef("decoder.final_layernorm.bias", (full(h),)))
        if not spec.tied_embeddings:
            out.append(ParamDef("output_layer.weight", (_split(vocab, tp, tp_rank), full(h))))
        elif not first:
            # tied and PP > 1: the last stage keeps a copy of the word embeddings, which
            # megatron checkpoints under the first stage's key (replica_id (1, 0, dp)).
            out.append(ParamDef("embedding.word_embeddings.weight",
                                (_split(vocab, tp, tp_rank), full(h)), shared_embedding=True))
    return tuple(out)


def opt_kinds(optimizer: str, params_dtype: str) -> tuple[str, ...]:
    """The optimizer state kinds of every param (``optimizer.state.<kind>.<key>``)."""
    # with fp32 params megatron's optimizers update the model params themselves (the
    # distributed optimizer's main shard is a view of them): no separate fp32_param state
    if params_dtype != "float32":
        return ("fp32_param", "exp_avg", "exp_avg_sq")
    return ("exp_avg", "exp_avg_sq")
