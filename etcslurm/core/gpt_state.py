"""Analytic expansion of a :class:`GPTSpec` into the pieces every rank holds.

This mirrors megatron-core 0.16.1 (local GPT layer spec, ``GPTModel.sharded_state_dict()``
keys without a DDP ``module.`` prefix) so that a plan for 10k GPUs needs no GPU:

* model parameters: TP-sharded as megatron's column/row-parallel layers shard them (QKV,
  fc1 and their biases on axis 0; linear_proj and fc2 weights on axis 1; norms and
  row-parallel biases replicated); transformer layers carry the prepended layer axis, one
  piece per layer (each is a separate tensor on the rank).  Grouped-query attention:
  ``linear_qkv`` has ``(heads + 2*groups) * kv_channels`` rows, split by TP into whole
  groups.  SwiGLU: megatron's ``ShardedTensorFactory`` checkpoints the local
  ``linear_fc1`` ``[2*ffn/tp, h]`` as two pieces of a ``[2*ffn, h]`` tensor (gate rows
  ``tp_rank*ffn/tp``, up rows ``ffn + tp_rank*ffn/tp``; :class:`ParamDef` ``parts``).
  RMSNorm has no bias, RoPE no position-embedding tensor, ``bias=False`` no linear biases;
* plain Adam (``optimizer='adam'``): ``optimizer.state.exp_avg.<key>`` and
  ``optimizer.state.exp_avg_sq.<key>`` (plus ``optimizer.state.fp32_param.<key>`` when the
  params are not fp32), replicated over DP;
* ``optimizer='distributed'``: megatron's DistributedOptimizer (ZeRO-1).  Its shards are
  the DP-rank slices of the DDP param-and-grad buffer: params in *reverse* order, each
  start padded to 64 elements, buckets padded to ``lcm(dp, 128)``, the shared embedding in
  its own bucket when PP > 1; each param's owned ``flattened_range`` becomes
  ``exp_avg``/``exp_avg_sq`` (and ``fp32_param`` for non-fp32 params) pieces via :func:`flat_range_pieces` (keys as
  the ``fully_sharded_model_space`` format names them).

Ranks with identical holdings share a *class* (plain Adam: one per (tp, pp), MoE: per (tp, pp, ep); distributed:
one per (tp, pp, dp)), which is what keeps the planner fast.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import cached_property, lru_cache

from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import MAKE_VOCAB_SIZE_DIVISIBLE_BY, GPTSpec
from etcslurm.core.state import Piece, flat_range_boxes
from etcslurm.errors import UsageError

OPTIMIZERS = ("adam", "distributed")

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
        vocab = _pad(vocab, MAKE_VOCAB_SIZE_DIVISIBLE_BY * vocab_pad_tp)
    return _pad(vocab, MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp)


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
                 ep_rank: int = 0) -> list[ParamDef]:
    """Parameters of one (tp, pp) rank -- for a MoE model, of one (tp, pp, ep) rank -- in
    ``model.named_parameters()`` order (cached)."""
    return list(_stage_params(spec, cfg, tp_rank, pp_rank, vocab_pad_tp, ep_rank))


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


def _moe_params(spec: GPTSpec, cfg: ParallelConfig, tp_rank: int, ep_rank: int,
                lay: tuple[int, int]) -> list[ParamDef]:
    """One MoE layer's router (replicated) and this rank's experts: experts
    ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)``, each TP-split like a dense MLP."""
    h, f, tp = spec.hidden, int(spec.expert_ffn or 0), cfg.tp
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
def _stage_params(spec: GPTSpec, cfg: ParallelConfig, tp_rank: int, pp_rank: int,
                  vocab_pad_tp: int | None = DEFAULT_VOCAB_PAD_TP,
                  ep_rank: int = 0) -> tuple[ParamDef, ...]:
    """Parameters of one (tp, pp) rank in ``model.named_parameters()`` order.

    ``vocab_pad_tp``: see :func:`padded_vocab`.  Follows megatron-core 0.16.1's local
    layer spec: per layer ``input_layernorm`` (checkpointed as
    ``self_attention.linear_qkv.layer_norm_*``), ``linear_proj``, ``linear_qkv`` (rows
    ``(heads + 2*groups) * kv_channels``, TP-split by whole groups), ``pre_mlp_layernorm``
    (``mlp.linear_fc1.layer_norm_*``), ``linear_fc1`` (gated: two factory halves),
    ``linear_fc2``; biases and norm biases only when the spec has them.  A MoE layer has
    the router and this EP rank's experts in place of ``linear_fc1``/``linear_fc2``.
    """
    h, f, tp = spec.hidden, spec.ffn, cfg.tp
    vocab = padded_vocab(spec, tp, vocab_pad_tp)
    first, last = pp_rank == 0, pp_rank == cfg.pp - 1
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
    per_stage = spec.layers // cfg.pp
    attn, mlp = "decoder.layers.self_attention.", "decoder.layers.mlp."
    for layer in range(pp_rank * per_stage, (pp_rank + 1) * per_stage):
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
            out.extend(_moe_params(spec, cfg, tp_rank, ep_rank, lay))
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


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def buffer_layout(
    params: list[ParamDef], dp: int, bucket_size: int | None
) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
    """megatron's ``_ParamAndGradBuffer`` layout with the distributed optimizer.

    Returns ``(buckets, index)``: bucket ``(start, end)`` ranges and, for each param in
    ``params`` order, ``(start, end, bucket_id)`` in the buffer.
    """
    divisor = math.lcm(dp, 128)
    index: dict[int, tuple[int, int, int]] = {}
    buckets: list[tuple[int, int]] = []
    start = bucket_start = 0
    n_in_bucket = 0
    end = 0

    def close(param_end: int) -> int:
        nonlocal bucket_start, n_in_bucket
        bucket_end = _pad(param_end, divisor)
        buckets.append((bucket_start, bucket_end))
        bucket_start = bucket_end
        n_in_bucket = 0
        return bucket_end

    for i in range(len(params) - 1, -1, -1):
        p = params[i]
        start = _pad(start, 64)
        if p.shared_embedding and n_in_bucket:
            start = close(start)
        end = start + p.numel
        index[i] = (start, end, len(buckets))
        n_in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or p.shared_embedding:
            start = close(end)
        else:
            start = end
    if n_in_bucket:
        close(end)
    return buckets, [index[i] for i in range(len(params))]


def ddp_bucket_size(dp: int, pp_rank: int, overlap_grad_reduce: bool) -> int | None:
    """megatron DDP's bucket size: none without overlap or on stages after the first."""
    if not overlap_grad_reduce or pp_rank > 0:
        return None
    return max(40_000_000, 1_000_000 * dp)


def _opt_kinds(optimizer: str, params_dtype: str) -> tuple[str, ...]:
    # with fp32 params megatron's optimizers update the model params themselves (the
    # distributed optimizer's main shard is a view of them): no separate fp32_param state
    if params_dtype != "float32":
        return ("fp32_param", "exp_avg", "exp_avg_sq")
    return ("exp_avg", "exp_avg_sq")


def check_optimizer(optimizer: str) -> None:
    if optimizer not in OPTIMIZERS:
        raise UsageError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")


def check_model(spec: GPTSpec, cfg: ParallelConfig, params_dtype: str | None = None) -> str:
    """Validate ``cfg`` for ``spec`` (TP must split heads, query groups and ffn); returns
    the params dtype to use (``params_dtype`` or the spec's)."""
    cfg.validate(spec)
    problems = spec.tp_problems(cfg.tp)
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
) -> tuple[Piece, ...]:
    """What every DP replica of (tp, pp) -- MoE: every expert-DP replica of (tp, pp, ep)
    -- holds: params (+ plain Adam's state)."""
    params = stage_params(spec, cfg, tp_rank, pp_rank, vocab_pad_tp, ep_rank)
    out = [Piece(p.key, b, params_dtype) for p in params for b in p.boxes]
    if optimizer == "adam":
        kinds = _opt_kinds(optimizer, params_dtype)
        for p in params:
            out.extend(Piece(f"optimizer.state.{k}.{p.key}", b, "float32")
                       for b in p.boxes for k in kinds)
    return tuple(out)


def _shard_block(
    spec: GPTSpec, cfg: ParallelConfig, tp_rank: int, pp_rank: int, dp_rank: int,
    params_dtype: str, overlap_grad_reduce: bool, vocab_pad_tp: int | None,
) -> tuple[Piece, ...]:
    """The distributed optimizer's ZeRO-1 shard of one (tp, pp, dp) rank: of the dense
    buffer (sharded over DP) and, for a MoE model, of the expert buffer (sharded over
    expert DP)."""
    out = _buffer_shard(spec, cfg, tp_rank, pp_rank, dp_rank, params_dtype,
                        overlap_grad_reduce, vocab_pad_tp, expert=False)
    if spec.moe and cfg.ep > 1:
        ep_rank, edp_rank = divmod(dp_rank, cfg.ep)[::-1]
        out += _buffer_shard(spec, cfg, tp_rank, pp_rank, edp_rank, params_dtype,
                             overlap_grad_reduce, vocab_pad_tp, expert=True, ep_rank=ep_rank)
    return out


def _in_expert_buffer(param: ParamDef, cfg: ParallelConfig) -> bool:
    """Whether megatron's DDP keeps ``param`` in its expert buffer (ZeRO-1-sharded over
    expert DP).  Only with EP > 1: megatron marks expert weights ``allreduce=False`` only
    when ``expert_model_parallel_size > 1``; with EP 1 they sit in the dense buffer."""
    return param.expert and cfg.ep > 1


def _buffer_shard(
    spec: GPTSpec, cfg: ParallelConfig, tp_rank: int, pp_rank: int, dp_rank: int,
    params_dtype: str, overlap_grad_reduce: bool, vocab_pad_tp: int | None, *,
    expert: bool, ep_rank: int = 0,
) -> tuple[Piece, ...]:
    """One DP rank's ZeRO-1 shard of one DDP buffer (``dp_rank``: in the buffer's group)."""
    params = [p for p in _stage_params(spec, cfg, tp_rank, pp_rank, vocab_pad_tp, ep_rank)
              if _in_expert_buffer(p, cfg) == expert]
    kinds = _opt_kinds("distributed", params_dtype)
    buckets, _, order, starts, ends = _buffer_layout_cached(
        spec, cfg, pp_rank, overlap_grad_reduce, vocab_pad_tp, expert)
    group = cfg.edp if expert else cfg.dp
    out: list[Piece] = []
    for b_start, b_end in buckets:
        shard = (b_end - b_start) // group
        lo, hi = b_start + dp_rank * shard, b_start + (dp_rank + 1) * shard
        # params in buffer order whose range meets [lo, hi)
        k = bisect.bisect_right(ends, lo)
        while k < len(order) and starts[k] < hi:
            s, e = max(lo, starts[k]), min(hi, ends[k])
            if e > s:
                p = params[order[k]]
                boxes = p.range_boxes(s - starts[k], e - starts[k])
                for kind in kinds:
                    name = f"optimizer.state.{kind}.{p.key}"
                    out.extend(Piece(name, b, "float32") for b in boxes)
            k += 1
    return tuple(out)


@lru_cache(maxsize=256)
def _buffer_layout_cached(spec, cfg, pp_rank, overlap_grad_reduce, vocab_pad_tp, expert=False):
    # sizes do not depend on the TP or EP rank, so rank 0 stands for all; a MoE model's
    # DDP keeps its expert params in a buffer of their own, sharded over expert DP
    params = [p for p in stage_params(spec, cfg, 0, pp_rank, vocab_pad_tp)
              if _in_expert_buffer(p, cfg) == expert]
    group = cfg.edp if expert else cfg.dp
    buckets, index = buffer_layout(
        params, group, ddp_bucket_size(cfg.dp, pp_rank, overlap_grad_reduce))
    # DistributedOptimizer order: buckets in order, params by buffer position
    order = sorted(range(len(params)), key=lambda i: index[i][0])
    starts = [index[i][0] for i in order]
    ends = [index[i][1] for i in order]
    return buckets, index, order, starts, ends


def _class_pieces(
    spec: GPTSpec, cfg: ParallelConfig, tp_rank: int, pp_rank: int, dp_rank: int | None,
    optimizer: str, params_dtype: str, overlap_grad_reduce: bool, vocab_pad_tp: int | None = DEFAULT_VOCAB_PAD_TP,
) -> tuple[Piece, ...]:
    ep_rank = (dp_rank or 0) % cfg.ep
    out = _model_block(spec, cfg, tp_rank, pp_rank, optimizer, params_dtype, vocab_pad_tp,
                       ep_rank)
    if optimizer == "adam":
        return out
    assert dp_rank is not None
    return out + _shard_block(spec, cfg, tp_rank, pp_rank, dp_rank, params_dtype,
                              overlap_grad_reduce, vocab_pad_tp)


def rank_pieces(
    spec: GPTSpec, cfg: ParallelConfig, rank: int, optimizer: str = "adam",
    params_dtype: str | None = None, overlap_grad_reduce: bool = False,
    vocab_pad_tp: int | None = DEFAULT_VOCAB_PAD_TP,
) -> list[Piece]:
    """Every piece global rank ``rank`` holds under ``cfg`` (``params_dtype`` None: the
    spec's ``dtype``)."""
    check_optimizer(optimizer)
    params_dtype = check_model(spec, cfg, params_dtype)
    c = cfg.coord(rank)
    if optimizer == "adam" and cfg.ep > 1:  # the model block depends on the EP rank
        block = _model_block(spec, cfg, c.tp, c.pp, optimizer, params_dtype, vocab_pad_tp,
                             cfg.expert_coord(rank).ep)
        return list(block)
    return list(_class_pieces(spec, cfg, c.tp, c.pp, c.dp if optimizer == "distributed" else None,
                              optimizer, params_dtype, overlap_grad_reduce, vocab_pad_tp))


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
    model_block: dict[tuple[int, int, int], int] = {}
    for pp in range(cfg.pp):
        for tp in range(cfg.tp):
            for ep in range(cfg.ep):  # a MoE model's experts differ per EP rank
                model_block[(tp, pp, ep)] = len(blocks)
                blocks.append(_model_block(spec, cfg, tp, pp, optimizer, params_dtype,
                                           vocab_pad_tp, ep))
    class_blocks: list[tuple[int, ...]] = []
    rank_class: list[int] = []

    def block_of(rank: int) -> int:
        c = cfg.coord(rank)
        return model_block[(c.tp, c.pp, c.dp % cfg.ep)]

    if optimizer == "adam":
        class_blocks = [(i,) for i in range(len(blocks))]
        rank_class = [block_of(rank) for rank in range(cfg.world_size)]
    else:
        for rank in range(cfg.world_size):
            c = cfg.coord(rank)
            blocks.append(_shard_block(spec, cfg, c.tp, c.pp, c.dp, params_dtype,
                                       overlap_grad_reduce, vocab_pad_tp))
            class_blocks.append((block_of(rank), len(blocks) - 1))
            rank_class.append(rank)
    return LayoutState(cfg, tuple(blocks), tuple(class_blocks), tuple(rank_class))


# --------------------------------------------------------------------------- vocabulary padding
#: tensors whose axis 0 is the (padded) vocabulary
VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")
#: how rows no old rank holds are filled: megatron-core's own resharded load
#: (``dist_checkpointing`` with ``allow_shape_mismatch=True`` on the embedding and output
#: layer) zeroes the tensor and reads only the rows the checkpoint has
VOCAB_FILL = "zeros"


def model_key(key: str) -> str:
    """The model tensor a piece key belongs to (``optimizer.state.<kind>.`` stripped)."""
    if key.startswith("optimizer.state."):
        return key.split(".", 3)[3]
    return key


def is_vocab_key(key: str) -> bool:
    """True for the word embedding, the output layer, and their optimizer state."""
    return model_key(key) in VOCAB_KEYS


def vocab_rows(pieces) -> dict[str, int]:
    """Rows held of every vocabulary tensor: ``{key: 1 + last row}`` over ``pieces``
    (analytic or live, one rank's or all ranks')."""
    rows: dict[str, int] = {}
    for p in pieces:
        if is_vocab_key(p.key):
            rows[p.key] = max(rows.get(p.key, 0), p.box[0][1])
    return rows


def vocab_padding(pieces, vocab: int) -> list[Piece]:
    """The parts of ``pieces`` that are vocabulary padding (rows >= ``vocab``, the true
    vocabulary size): never looked up by a token; their values only matter through the
    output layer's softmax."""
    out = []
    for p in pieces:
        (lo, hi), rest = p.box[0], p.box[1:]
        if is_vocab_key(p.key) and hi > max(lo, vocab):
            out.append(Piece(p.key, ((max(lo, vocab), hi), *rest), p.dtype))
    return out


def split_vocab_fill(missing, old_rows: dict[str, int] | int) -> tuple[list[Piece], list[Piece]]:
    """Split slices no surviving rank holds into ``(fill, lost)``.

    ``fill``: the parts in rows no OLD layout had at all -- vocabulary padding that
    appears because a TP change grew the padded vocabulary (rows ``[old_rows, new_rows)``
    of a vocabulary tensor).  They are not lost state: the runtime fills them as
    megatron-core's resharded load does (:data:`VOCAB_FILL`: zeros, for the param, its
    fp32 main copy and both Adam moments alike).  ``lost``: everything else (real state
    whose holders are gone).  ``old_rows``: :func:`vocab_rows` of the old holdings, or one
    row count for every vocabulary key (``padded_vocab(spec, old.tp)``).
    """
    fill: list[Piece] = []
    lost: list[Piece] = []
    for p in missing:
        if not is_vocab_key(p.key):
            lost.append(p)
            continue
        rows = old_rows if isinstance(old_rows, int) else old_rows.get(p.key, 0)
        (lo, hi), rest = p.box[0], p.box[1:]
        if hi > max(lo, rows):
            fill.append(Piece(p.key, ((max(lo, rows), hi), *rest), p.dtype))
        if lo < rows:
            lost.append(Piece(p.key, ((lo, min(hi, rows)), *rest), p.dtype))
    return fill, lost
