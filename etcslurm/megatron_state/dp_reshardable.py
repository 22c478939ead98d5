"""The distributed optimizer's ``dp_reshardable`` checkpoint format, decoded analytically.

megatron-core's DistributedOptimizer saves its state in this format by default (Megatron-LM
without ``--dist-ckpt-optim-fully-reshardable``): the DDP buffer itself, one 1-D tensor per
model-parallel rank, buffer, dtype, bucket and state kind::

    optimizer.distributed.dp_group_idx_{i}.gbuf_idx_{g}.dtype_{d}.bucket_idx_{b}.{kind}

of the bucket's unpadded length, each DP rank writing its contiguous shard.  ``i`` is the
rank in the model-parallel group, ``tp_rank + tp * pp_rank``; ``g`` the model chunk's
buffer; ``kind`` is ``param`` (the fp32 main param), ``exp_avg`` or ``exp_avg_sq``.  Inside
a bucket the elements are in the buffer's order: params in reverse ``named_parameters``
order, each start padded to 64 elements (the gaps hold garbage).

Nothing in the checkpoint says which param lies where: megatron reads it back through its
own live buffer, so it can load only into the same TP and PP.  Here the saved layout's
params come from the analytic model (:mod:`.params`), their places from the bucket lengths
the checkpoint records (:func:`place_in_buckets`, which checks that they fit exactly), and
every param's local tensor becomes :class:`SavedPart`\\ s -- boxes of a global tensor
stored row-major at an offset of one bucket tensor.  :func:`plan_reads` then says, for the
pieces any rank of any layout needs, which element ranges to read and where they land
(vocabulary rows a larger TP pads are zeroed, as megatron-core's own resharded load leaves
them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import GPTSpec
from etcslurm.core.state import Box, box_intersect, box_numel
from etcslurm.megatron_state.params import (
    DEFAULT_VOCAB_PAD_TP,
    ParamDef,
    pad,
    padded_vocab,
    stage_params,
)
from etcslurm.megatron_state.vocab import is_vocab_key

SHARDING_TYPE = "dp_reshardable"
#: the state kinds of a bucket, and the ``optimizer.state.<kind>`` each one fills
KINDS = {"param": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
#: megatron pads every param's start in the buffer to this many elements
PARAM_ALIGN = 64
_KEY = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
                  r"\.bucket_idx_(\d+)\.([A-Za-z0-9_]+)$")
EMBEDDING_KEY = "embedding.word_embeddings.weight"


class FormatError(ValueError):
    """The checkpoint is not what its saved layout and the model say it should be."""


@dataclass(frozen=True, order=True)
class BucketTensor:
    """One bucket of one model-parallel rank's buffer (all its state kinds)."""

    group: int  # dp_group_idx: the rank in the model-parallel group
    gbuf: int  # the buffer: one per model chunk
    dtype: str  # megatron's (param dtype, grad dtype) as it prints it
    bucket: int

    def key(self, kind: str) -> str:
        return (f"optimizer.distributed.dp_group_idx_{self.group}.gbuf_idx_{self.gbuf}"
                f".dtype_{self.dtype}.bucket_idx_{self.bucket}.{kind}")


def model_parallel_index(cfg: ParallelConfig, tp_rank: int, pp_rank: int) -> int:
    """megatron's ``dp_group_idx`` of the (tp, pp) rank: its rank in the model-parallel
    group (TP fastest)."""
    return tp_rank + cfg.tp * pp_rank


def bucket_tensors(shapes: Mapping[str, Sequence[int]]) -> dict[BucketTensor, int]:
    """The bucket tensors among a checkpoint's tensors (key → global shape), with their
    lengths; every kind of a bucket must be there with one length."""
    lengths: dict[BucketTensor, dict[str, int]] = {}
    for key, shape in shapes.items():
        m = _KEY.match(key)
        if m is None:
            continue
        group, gbuf, dtype, bucket, kind = m.groups()
        if len(shape) != 1:
            raise FormatError(f"{key}: a bucket tensor of shape {tuple(shape)}, not 1-D")
        lengths.setdefault(BucketTensor(int(group), int(gbuf), dtype, int(bucket)),
                           {})[kind] = int(shape[0])
    out = {}
    for tensor, by_kind in sorted(lengths.items()):
        missing = sorted(set(KINDS) - set(by_kind))
        if missing or len(set(by_kind.values())) != 1:
            raise FormatError(f"{tensor.key('*')}: kinds {sorted(by_kind)} of lengths "
                              f"{sorted(set(by_kind.values()))} (want {sorted(KINDS)}, one length)")
        out[tensor] = next(iter(by_kind.values()))
    return out


def place_in_buckets(params: Sequence[ParamDef], sizes: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(bucket, start, end)`` inside its bucket of every param in ``params`` order, from
    the buckets' unpadded lengths (megatron's ``per_bucket_numel_unpadded``).

    The buffer's rule (``_ParamAndGradBuffer``): params in reverse order, each start padded
    to :data:`PARAM_ALIGN`; a bucket ends at its last param's end, or -- for a param that
    must start a bucket of its own (a shared embedding) -- at that param's padded start.
    Whatever the bucket size was, the lengths then say where each bucket ends; a param that
    would cross one, or lengths left over, mean the model or the layout is not the one
    that saved (:class:`FormatError`).
    """
    out: dict[int, tuple[int, int, int]] = {}
    bucket, pos, count = 0, 0, 0
    for i in range(len(params) - 1, -1, -1):
        if bucket >= len(sizes):
            raise FormatError(f"{len(params)} params do not fit into buckets of {list(sizes)}")
        start = pad(pos, PARAM_ALIGN)
        if count and start == sizes[bucket]:  # the bucket closed at this param's start
            bucket, start, count = bucket + 1, 0, 0
            if bucket >= len(sizes):
                raise FormatError(f"{len(params)} params do not fit into buckets of "
                                  f"{list(sizes)}")
        end = start + params[i].numel
        if end > sizes[bucket]:
            raise FormatError(f"{params[i].key} ({params[i].numel} elements at {start}) "
                              f"crosses the end of bucket {bucket} ({sizes[bucket]} elements)")
        out[i] = (bucket, start, end)
        count += 1
        if end == sizes[bucket]:
            bucket, pos, count = bucket + 1, 0, 0
        else:
            pos = end
    if bucket != len(sizes) or count:
        raise FormatError(f"buckets of {list(sizes)} elements, but the params fill only "
                          f"{bucket} of them")
    return [out[i] for i in range(len(params))]


@dataclass(frozen=True)
class SavedPart:
    """``box`` of global tensor ``key``, stored row-major in ``tensor`` from ``offset``."""

    tensor: BucketTensor
    offset: int
    key: str
    box: Box


def vocab_pad_of(spec: GPTSpec, cfg: ParallelConfig, rows: int) -> int | None:
    """The vocabulary pre-padding (``vocab_pad_tp`` of :func:`padded_vocab`) that gives the
    saved embedding its ``rows`` under ``cfg``: etcslurm's (a multiple of 128·8) or plain
    megatron's (128·tp)."""
    for vocab_pad_tp in (DEFAULT_VOCAB_PAD_TP, None):
        if padded_vocab(spec, cfg.tp, vocab_pad_tp) == rows:
            return vocab_pad_tp
    raise FormatError(f"the checkpoint's embedding has {rows} rows; {spec} under tp{cfg.tp} "
                      f"has {padded_vocab(spec, cfg.tp)} (padded for tp8) or "
                      f"{padded_vocab(spec, cfg.tp, None)}")


def saved_parts(spec: GPTSpec, cfg: ParallelConfig, tensors: Mapping[BucketTensor, int],
                vocab_pad_tp: int | None = DEFAULT_VOCAB_PAD_TP) -> list[SavedPart]:
    """Where every param's optimizer state lies in a ``dp_reshardable`` checkpoint that
    layout ``cfg`` saved (``tensors``: :func:`bucket_tensors`).

    One part per param box (a SwiGLU ``linear_fc1`` has two), of one model-parallel rank:
    a box saved by several ranks (replicated norms, the tied embedding of the last stage)
    is kept once, from the lowest rank.  Checked: the checkpoint has exactly the ranks of
    ``cfg`` (``dp_group_idx`` ``0 .. tp·pp-1``), one buffer each, and the params of every
    rank fill its buckets exactly.
    """
    if spec.moe and cfg.ep > 1:
        raise FormatError("a mixture-of-experts checkpoint with expert parallelism (a buffer "
                          "of its own per expert-parallel rank) is not supported")
    by_group: dict[int, dict[int, list[tuple[BucketTensor, int]]]] = {}
    for tensor, length in sorted(tensors.items()):
        by_group.setdefault(tensor.group, {}).setdefault(tensor.gbuf, []).append((tensor, length))
    want = set(range(cfg.tp * cfg.pp))
    if set(by_group) != want:
        raise FormatError(f"the checkpoint's optimizer has model-parallel ranks "
                          f"{sorted(by_group)}; {cfg} has {sorted(want)}")
    seen: set[tuple[str, Box]] = set()
    out: list[SavedPart] = []
    for group in sorted(by_group):
        buffers = by_group[group]
        if set(buffers) != {0}:
            raise FormatError(f"model-parallel rank {group} saved buffers {sorted(buffers)}: "
                              "several model chunks (virtual pipeline stages) are not "
                              "supported yet")
        buckets = buffers[0]
        if [t.bucket for t, _ in buckets] != list(range(len(buckets))):
            raise FormatError(f"model-parallel rank {group}: buckets "
                              f"{[t.bucket for t, _ in buckets]} are not 0..{len(buckets) - 1}")
        pp_rank, tp_rank = divmod(group, cfg.tp)
        params = stage_params(spec, cfg, tp_rank, pp_rank, vocab_pad_tp)
        try:
            places = place_in_buckets(params, [n for _, n in buckets])
        except FormatError as exc:
            raise FormatError(f"model-parallel rank {group} (tp {tp_rank}, pp {pp_rank}) of "
                              f"{cfg}: {exc}") from None
        for param, (bucket, start, _end) in zip(params, places, strict=True):
            offset = start
            for box in param.boxes:
                if (param.key, box) not in seen:
                    seen.add((param.key, box))
                    out.append(SavedPart(buckets[bucket][0], offset, param.key, box))
                offset += box_numel(box)
    return out


def check_shapes(parts: Iterable[SavedPart], shapes: Mapping[str, Sequence[int]]) -> None:
    """Every param the parts place is a tensor of the checkpoint's model with the global
    shape the parts span (a model other than the one that saved fails here)."""
    extent: dict[str, list[int]] = {}
    for part in parts:
        hi = [h for _lo, h in part.box]
        old = extent.setdefault(part.key, hi)
        extent[part.key] = [max(a, b) for a, b in zip(old, hi, strict=True)]
    for key, want in sorted(extent.items()):
        got = shapes.get(key)
        if got is None:
            raise FormatError(f"the checkpoint has no model tensor {key}")
        if list(got) != want:
            raise FormatError(f"model tensor {key}: {list(got)} in the checkpoint, "
                              f"{want} in the model")


def _strides(box: Box) -> tuple[int, ...]:
    out, n = [], 1
    for lo, hi in reversed(box):
        out.append(n)
        n *= hi - lo
    return tuple(reversed(out))


@dataclass(frozen=True)
class Read:
    """The elements of ``box`` (global coordinates, inside ``part.box``) in the bucket
    tensor: from element ``start``, with ``strides`` (the part's row-major strides);
    ``[start, stop)`` is the smallest contiguous range of the tensor holding them."""

    part: SavedPart
    box: Box

    @property
    def strides(self) -> tuple[int, ...]:
        return _strides(self.part.box)

    def _flat(self, index: Sequence[int]) -> int:
        return self.part.offset + sum(
            (i - lo) * s for i, (lo, _hi), s in zip(index, self.part.box, self.strides, strict=True))

    @property
    def start(self) -> int:
        return self._flat([lo for lo, _ in self.box])

    @property
    def stop(self) -> int:
        return self._flat([hi - 1 for _, hi in self.box]) + 1


@dataclass(frozen=True)
class PieceReads:
    """What fills one needed piece: ``reads``, and ``fill`` -- boxes of vocabulary rows
    the saved layout did not have (padding of a larger TP), zeroed as megatron-core's
    resharded load leaves them."""

    reads: tuple[Read, ...]
    fill: tuple[Box, ...] = ()


def plan_reads(needed: Sequence[tuple[str, Box]],
               parts: Sequence[SavedPart]) -> list[PieceReads]:
    """For each needed ``(key, box)``: the reads that together hold exactly its elements
    (and the vocabulary padding rows beyond the saved ones).

    Raises :class:`FormatError` when some of its elements are in no part (a tensor the
    saved optimizer did not hold) or in more than one.
    """
    by_key: dict[str, list[SavedPart]] = {}
    rows: dict[str, int] = {}
    for part in parts:
        by_key.setdefault(part.key, []).append(part)
        rows[part.key] = max(rows.get(part.key, 0), part.box[0][1])
    out = []
    for key, box in needed:
        fill: list[Box] = []
        held = box
        if is_vocab_key(key) and key in rows and box[0][1] > rows[key]:
            (lo, hi), rest = box[0], box[1:]
            fill.append(((max(lo, rows[key]), hi), *rest))
            held = ((lo, rows[key]), *rest) if lo < rows[key] else ()
        reads = []
        for part in by_key.get(key, ()) if held else ():
            inter = box_intersect(part.box, held)
            if inter is not None:
                reads.append(Read(part, inter))
        covered = sum(box_numel(r.box) for r in reads)
        if covered != (box_numel(held) if held else 0):
            raise FormatError(f"optimizer state of {key} {list(box)}: the checkpoint holds "
                              f"{covered} of its {box_numel(box)} elements")
        out.append(PieceReads(tuple(reads), tuple(fill)))
    return out


def merged_ranges(reads: Iterable[Read]) -> dict[BucketTensor, list[tuple[int, int]]]:
    """The disjoint element ranges of each bucket tensor that ``reads`` touch."""
    spans: dict[BucketTensor, list[tuple[int, int]]] = {}
    for read in reads:
        spans.setdefault(read.part.tensor, []).append((read.start, read.stop))
    out = {}
    for tensor, ranges in sorted(spans.items()):
        merged: list[tuple[int, int]] = []
        for lo, hi in sorted(ranges):
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        out[tensor] = merged
    return out
