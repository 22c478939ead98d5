"""megatron's DDP param-and-grad buffers and the distributed optimizer's (ZeRO-1) shards
of them.

Why the buffer: the distributed optimizer does not shard params, it shards the DDP
buffer, so a rank's ``exp_avg``/``exp_avg_sq`` (and ``fp32_param`` for non-fp32 params)
are whatever params its DP slice of each bucket covers, cut at arbitrary elements.  The
layout: params in *reverse* order, each start padded to 64 elements, buckets padded to
``lcm(dp, 128)``, the shared embedding in its own bucket when PP > 1; each param's owned
``flattened_range`` becomes pieces via :func:`~etcslurm.core.state.flat_range_boxes` (keys
as the ``fully_sharded_model_space`` format names them).  A MoE model with EP > 1 keeps its
experts in a second buffer, sharded over expert DP.  With context parallelism the dense
buffer is sharded over the ``dp * cp`` ranks of a stage; an interleaved pipeline's model
chunks each have buffers of their own (only the first chunk's are bucketed, as Megatron-LM
disables bucketing for the others).
"""

from __future__ import annotations

import bisect
import math
from functools import lru_cache

from etcslurm.core.layout import ExpertCoord, ParallelConfig
from etcslurm.core.models import GPTSpec
from etcslurm.core.state import Piece
from etcslurm.megatron_state.params import (
    ParamDef,
    cached_stage_params,
    opt_kinds,
    pad,
    stage_params,
)


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
        bucket_end = pad(param_end, divisor)
        buckets.append((bucket_start, bucket_end))
        bucket_start = bucket_end
        n_in_bucket = 0
        return bucket_end

    for i in range(len(params) - 1, -1, -1):
        p = params[i]
        start = pad(start, 64)
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


def ddp_bucket_size(dp: int, pp_rank: int, overlap_grad_reduce: bool,
                    chunk: int = 0) -> int | None:
    """megatron DDP's bucket size: none without overlap, on stages after the first or
    for model chunks after the first (``dp``: the group the buffer is sharded over)."""
    if not overlap_grad_reduce or pp_rank > 0 or chunk > 0:
        return None
    return max(40_000_000, 1_000_000 * dp)


def shard_block(
    spec: GPTSpec, cfg: ParallelConfig, tp_rank: int, pp_rank: int, dp_rank: int,
    params_dtype: str, overlap_grad_reduce: bool, vocab_pad_tp: int | None,
    expert: ExpertCoord | None = None,
) -> tuple[Piece, ...]:
    """The distributed optimizer's ZeRO-1 shard of one rank, every model chunk's: of the
    dense buffer (sharded over DP x CP; ``dp_rank`` is the rank's index there,
    :meth:`ParallelConfig.shard_rank`) and, for a MoE model with EP > 1, of the expert
    buffer (sharded over expert DP; ``expert``: the rank's
    :meth:`ParallelConfig.expert_coord`)."""
    expert = expert or ExpertCoord(0, 0)
    out: tuple[Piece, ...] = ()
    etp_rank = expert.etp if cfg.etp else None
    for chunk in range(cfg.vpp):
        # the dense buffer holds no expert param when EP > 1, and with EP 1 every rank's
        # experts are expert rank 0's: one cached param list per (tp, pp) serves all ranks
        out += _buffer_shard(spec, cfg, tp_rank, pp_rank, dp_rank, params_dtype,
                             overlap_grad_reduce, vocab_pad_tp, expert=False, chunk=chunk)
        if spec.moe and cfg.ep > 1:
            out += _buffer_shard(spec, cfg, tp_rank, pp_rank, expert.edp, params_dtype,
                                 overlap_grad_reduce, vocab_pad_tp, expert=True,
                                 ep_rank=expert.ep, chunk=chunk, etp_rank=etp_rank)
    return out


def _in_expert_buffer(param: ParamDef, cfg: ParallelConfig) -> bool:
    """Whether megatron's DDP keeps ``param`` in its expert buffer (ZeRO-1-sharded over
    expert DP).  Only with EP > 1: megatron marks expert weights ``allreduce=False`` only
    when ``expert_model_parallel_size > 1``; with EP 1 they sit in the dense buffer."""
    return param.expert and cfg.ep > 1


def _buffer_shard(
    spec: GPTSpec, cfg: ParallelConfig, tp_rank: int, pp_rank: int, dp_rank: int,
    params_dtype: str, overlap_grad_reduce: bool, vocab_pad_tp: int | None, *,
    expert: bool, ep_rank: int = 0, chunk: int = 0, etp_rank: int | None = None,
) -> tuple[Piece, ...]:
    """One DP rank's ZeRO-1 shard of one DDP buffer (``dp_rank``: in the buffer's group)."""
    params = [p for p in cached_stage_params(spec, cfg, tp_rank, pp_rank, vocab_pad_tp,
                                             ep_rank, chunk, etp_rank)
              if _in_expert_buffer(p, cfg) == expert]
    kinds = opt_kinds("distributed", params_dtype)
    buckets, _, order, starts, ends = _buffer_layout_cached(
        spec, cfg, pp_rank, overlap_grad_reduce, vocab_pad_tp, expert, chunk)
    group = _shard_group(cfg, expert)
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


def _shard_group(cfg: ParallelConfig, expert: bool) -> int:
    """How many ranks a buffer is sharded over: expert DP, or the stage's DP x CP."""
    return cfg.edp if expert else cfg.dp * cfg.cp


@lru_cache(maxsize=256)
def _buffer_layout_cached(spec, cfg, pp_rank, overlap_grad_reduce, vocab_pad_tp, expert=False,
                          chunk=0):
    # sizes do not depend on the TP or EP rank, so rank 0 stands for all; a MoE model's
    # DDP keeps its expert params in a buffer of their own, sharded over expert DP
    params = [p for p in stage_params(spec, cfg, 0, pp_rank, vocab_pad_tp, chunk=chunk)
              if _in_expert_buffer(p, cfg) == expert]
    group = _shard_group(cfg, expert)
    buckets, index = buffer_layout(
        params, group, ddp_bucket_size(cfg.dp * cfg.cp, pp_rank, overlap_grad_reduce, chunk))
    # DistributedOptimizer order: buckets in order, params by buffer position
    order = sorted(range(len(params)), key=lambda i: index[i][0])
    starts = [index[i][0] for i in order]
    ends = [index[i][1] for i in order]
    return buckets, index, order, starts, ends
