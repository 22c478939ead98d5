"""Load a distributed optimizer's ``dp_reshardable`` checkpoint into any layout.

``dist_checkpointing`` reshards this format only along DP: its tensors are DDP buckets, not
params.  Here :mod:`etcslurm.megatron_state.dp_reshardable` says where every param's state
lies in the saved layout's buckets; each rank then reads, of every bucket tensor, only the
element ranges that hold pieces it needs (``dist_checkpointing.load`` of 1-D slices), and
copies each piece straight into the live optimizer through the views
:func:`~etcslurm.megatron.sharded_meta.local_state` gives -- whatever the new layout, and
for the plain (replicated) Adam as for the distributed one.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from etcslurm.core.layout import ParallelConfig
from etcslurm.core.state import box_relative
from etcslurm.errors import UsageError
from etcslurm.megatron.sharded_meta import local_state
from etcslurm.megatron_state import dp_reshardable as fmt

OPTIMIZER_PREFIX = "optimizer.state."


def _read_ranges(path: str, ranges: dict[fmt.BucketTensor, list[tuple[int, int]]],
                 kinds: list[str], lengths: dict[fmt.BucketTensor, int],
                 dtypes: dict[str, torch.dtype]) -> dict[tuple[fmt.BucketTensor, str, int],
                                                         torch.Tensor]:
    """Read ``[lo, hi)`` of every bucket tensor (each ``kind``) in one ``dist_checkpointing``
    load; keyed by ``(tensor, kind, lo)``."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    request: dict[str, Any] = {}
    for tensor, spans in ranges.items():
        for kind in kinds:
            key = tensor.key(kind)
            for lo, hi in spans:
                data = torch.empty(hi - lo, dtype=dtypes[key])
                request[f"{key}@{lo}"] = ShardedTensor(
                    key, data, data.dtype, (hi - lo,), (lengths[tensor],), (lo,),
                    axis_fragmentations=None, replica_id=0, prepend_axis_num=0,
                    allow_shape_mismatch=False, flattened_range=None)
    if not request:
        return {}
    # partial reads by design: no rank covers a tensor, several read the same elements
    loaded = dist_checkpointing.load(request, path, validate_access_integrity=False)
    out = {}
    for tensor, spans in ranges.items():
        for kind in kinds:
            for lo, _hi in spans:
                out[(tensor, kind, lo)] = loaded[f"{tensor.key(kind)}@{lo}"]
    return out


def _source(buffers: dict[tuple[fmt.BucketTensor, str, int], torch.Tensor],
            spans: dict[fmt.BucketTensor, list[tuple[int, int]]], read: fmt.Read,
            kind: str) -> torch.Tensor:
    """The elements of ``read`` as a tensor of its box's shape (a strided view)."""
    tensor = read.part.tensor
    lo = next(lo for lo, hi in spans[tensor] if lo <= read.start and read.stop <= hi)
    buf = buffers[(tensor, kind, lo)]
    shape = tuple(hi - lo for lo, hi in read.box)
    return buf.as_strided(shape, read.strides, buf.storage_offset() + read.start - lo)


def load_optimizer_state(trainee: Any, path: str | os.PathLike[str], saved: ParallelConfig,
                         shapes: dict[str, tuple[int, ...]],
                         dtypes: dict[str, torch.dtype]) -> int:
    """Fill every optimizer state tensor of ``trainee`` (fp32 main params, Adam moments)
    from the ``dp_reshardable`` checkpoint at ``path`` that layout ``saved`` wrote;
    ``shapes``/``dtypes``: its tensors' global shapes and dtypes.  Returns the bytes read.

    The model's shapes come from ``trainee.spec``; checked against the checkpoint before
    anything is read (:func:`~etcslurm.megatron_state.dp_reshardable.saved_parts`,
    ``check_shapes``).  Adam's ``step`` is not in these tensors (see the caller).
    """
    tensors = fmt.bucket_tensors(shapes)
    if not tensors:
        raise UsageError(f"{path}: no dp_reshardable optimizer tensors (a chained optimizer "
                         "of several parts is not supported)")
    spec = trainee.spec
    try:
        embedding = shapes.get(fmt.EMBEDDING_KEY)
        vocab_pad_tp = (fmt.vocab_pad_of(spec, saved, int(embedding[0]))
                        if embedding is not None else None)
        parts = fmt.saved_parts(spec, saved, tensors, vocab_pad_tp)
        fmt.check_shapes(parts, shapes)
    except fmt.FormatError as exc:
        raise UsageError(f"{path} is not a dp_reshardable checkpoint of {spec} in {saved}: "
                         f"{exc}") from None
    state = local_state(trainee)
    # the optimizer's pieces, grouped by the model tensor and box they are the state of
    targets: dict[tuple[str, tuple], dict[str, torch.Tensor]] = {}
    by_kind = {v: k for k, v in fmt.KINDS.items()}
    for piece, view in state.items():
        if not piece.key.startswith(OPTIMIZER_PREFIX):
            continue
        kind, key = piece.key[len(OPTIMIZER_PREFIX):].split(".", 1)
        targets.setdefault((key, piece.box), {})[by_kind[kind]] = view
    needed = sorted(targets)
    try:
        plan = fmt.plan_reads(needed, parts)
    except fmt.FormatError as exc:
        raise UsageError(f"{path}: {exc}") from None
    kinds = sorted({k for views in targets.values() for k in views})
    spans = fmt.merged_ranges(r for piece in plan for r in piece.reads)
    buffers = _read_ranges(str(path), spans, kinds, tensors, dtypes)

    def region(view: torch.Tensor, box: tuple, inner: tuple) -> torch.Tensor:
        return view[tuple(slice(lo, hi) for lo, hi in box_relative(box, inner))]

    with torch.no_grad():
        for (key, box), piece in zip(needed, plan, strict=True):
            for kind, view in targets[(key, box)].items():
                for read in piece.reads:
                    region(view, box, read.box).copy_(_source(buffers, spans, read, kind))
                for fill in piece.fill:
                    region(view, box, fill).zero_()
    return sum(b.numel() * b.element_size() for b in buffers.values())


def saved_step(path: str | os.PathLike[str]) -> tuple[float | None, list[dict[str, Any]]]:
    """Adam's step and the param groups (without params) of a ``dp_reshardable``
    checkpoint: its model-parallel rank 0's ``optimizer`` object (every rank's is the same
    but for the group's ``params``)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    key = "optimizer.distributed.dp_group_idx_0.optimizer"
    loaded = dist_checkpointing.load(
        {"o": ShardedObject(key, None, (1,), (0,), replica_id=0)}, str(path),
        validate_access_integrity=False)["o"]
    groups = list((loaded or {}).get("param_groups") or [])
    steps = {g["step"] for g in groups if "step" in g}
    return (float(next(iter(steps))) if len(steps) == 1 else None), groups
