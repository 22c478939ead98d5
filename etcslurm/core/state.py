"""The state model: what a rank holds, as boxes of global tensors.

Everything the planner reasons about is a :class:`Piece`: the elements of one global tensor
(``key``, as megatron-core's ``ShardedTensor.key``) inside a half-open N-D index box, in
global coordinates.  A distributed-optimizer shard is a *flattened range* of a rank's local
box; :func:`flat_range_boxes` turns it into at most ``2*ndim-1`` boxes, each contiguous in
the flat shard, so sender and receiver can both take views of them.

Pure Python: no torch, no numpy needed (the planner vectorises on its own).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

Box = tuple[tuple[int, int], ...]

#: element sizes of the dtypes the state uses (torch dtype names without ``torch.``)
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "uint8": 1,
    "int8": 1,
    "bool": 1,
}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None


def box_numel(box: Box) -> int:
    n = 1
    for lo, hi in box:  # a plain loop: ~2x math.prod over a generator (planner hot path)
        n *= hi - lo
    return n


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def box_intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of the same tensor, or None when it is empty."""
    if len(a) != len(b):
        raise ValueError(f"boxes of different rank: {a} and {b}")
    return box_intersect_same_rank(a, b)


def box_intersect_same_rank(a: Box, b: Box) -> Box | None:
    """:func:`box_intersect` for boxes known to share a rank (the planner's hot path:
    pieces of one key always do), without the check."""
    out = []
    for (alo, ahi), (blo, bhi) in zip(a, b, strict=False):
        lo = alo if alo > blo else blo
        hi = ahi if ahi < bhi else bhi
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def box_contains(outer: Box, inner: Box) -> bool:
    return len(outer) == len(inner) and all(
        olo <= ilo and ihi <= ohi for (olo, ohi), (ilo, ihi) in zip(outer, inner, strict=True)
    )


def box_relative(outer: Box, inner: Box) -> Box:
    """``inner`` in the local coordinates of ``outer`` (which must contain it)."""
    return tuple((ilo - olo, ihi - olo) for (olo, _), (ilo, ihi) in zip(outer, inner, strict=True))


def box_subtract(a: Box, b: Box) -> list[Box]:
    """``a`` minus ``b`` as disjoint boxes (at most ``2*ndim``), in a canonical order."""
    inter = box_intersect(a, b)
    if inter is None:
        return [a]
    out: list[Box] = []
    rest = list(a)
    for d, ((lo, hi), (ilo, ihi)) in enumerate(zip(a, inter, strict=True)):
        if lo < ilo:
            out.append((*rest[:d], (lo, ilo), *rest[d + 1 :]))
        if ihi < hi:
            out.append((*rest[:d], (ihi, hi), *rest[d + 1 :]))
        rest[d] = (ilo, ihi)
    return out


class Piece(NamedTuple):
    """Elements of global tensor ``key`` inside the half-open N-D ``box``.

    A named tuple, not a dataclass: the planner hashes, compares and creates ~10^6 of
    them at 8k devices, and a tuple does all three in C (a frozen dataclass's hash and
    ``__eq__`` are Python calls).  Order and equality are the fields' as a tuple.
    """

    key: str
    box: Box
    dtype: str

    @property
    def numel(self) -> int:
        return box_numel(self.box)

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES.get(self.dtype) or dtype_bytes(self.dtype)
        for lo, hi in self.box:  # box_numel inlined (planner hot path)
            n *= hi - lo
        return n

    @property
    def shape(self) -> tuple[int, ...]:
        return box_shape(self.box)

    def intersect(self, other: Piece) -> Piece | None:
        """The common elements of two pieces of the same tensor (None if disjoint)."""
        if other.key != self.key:
            return None
        box = box_intersect(self.box, other.box)
        return None if box is None else Piece(self.key, box, self.dtype)

    def contains(self, other: Piece) -> bool:
        return other.key == self.key and box_contains(self.box, other.box)

    def to_json(self) -> list:
        return [self.key, [list(r) for r in self.box], self.dtype]

    @classmethod
    def from_json(cls, data: Sequence) -> Piece:
        key, box, dtype = data
        return cls(key, tuple((int(lo), int(hi)) for lo, hi in box), dtype)


def flat_range_boxes(box: Box, start: int, stop: int) -> list[Box]:
    """The elements ``[start, stop)`` of ``box`` flattened row-major, as boxes.

    At most ``2*ndim-1`` boxes (a partial row, whole rows, a partial row, recursively),
    listed in flat order, each contiguous in the flat range -- the decomposition of a
    distributed-optimizer shard (megatron's ``flattened_range``).
    """
    n = box_numel(box)
    if not 0 <= start <= stop <= n:
        raise ValueError(f"flat range [{start}, {stop}) outside a box of {n} elements")
    if start == stop:
        return []
    if len(box) == 0:
        return [box]
    # strides[d] = elements in one index step of axis d
    strides = [1] * len(box)
    for d in range(len(box) - 2, -1, -1):
        strides[d] = strides[d + 1] * (box[d + 1][1] - box[d + 1][0])
    return _flat(box, 0, start, stop, strides)


def _flat(box: Box, d: int, start: int, stop: int, strides: list[int]) -> list[Box]:
    lo0 = box[d][0]
    if d == len(box) - 1:
        return [((lo0 + start, lo0 + stop),)]
    inner = strides[d]
    rest = box[d + 1:]
    first_row, last_row = start // inner, (stop - 1) // inner
    if first_row == last_row:
        row = (lo0 + first_row, lo0 + first_row + 1)
        if start % inner == 0 and stop - start == inner:
            return [(row, *rest)]
        return [(row, *sub) for sub in
                _flat(box, d + 1, start - first_row * inner, stop - first_row * inner, strides)]
    out: list[Box] = []
    full_lo = first_row
    if start % inner:
        row = (lo0 + first_row, lo0 + first_row + 1)
        out.extend((row, *sub) for sub in _flat(box, d + 1, start % inner, inner, strides))
        full_lo = first_row + 1
    full_hi = last_row + 1 if stop % inner == 0 else last_row
    if full_lo < full_hi:
        out.append(((lo0 + full_lo, lo0 + full_hi), *rest))
    if stop % inner:
        row = (lo0 + last_row, lo0 + last_row + 1)
        out.extend((row, *sub) for sub in _flat(box, d + 1, 0, stop % inner, strides))
    return out


def flat_range_pieces(key: str, box: Box, dtype: str, start: int, stop: int) -> list[Piece]:
    """:func:`flat_range_boxes` as pieces of ``key``."""
    return [Piece(key, b, dtype) for b in flat_range_boxes(box, start, stop)]


def locate(piece: Piece, pieces: Iterable[Piece]) -> tuple[Piece, Box]:
    """The piece of ``pieces`` that contains ``piece``, and ``piece``'s box relative to it.

    Sender and receiver use this to turn a planned slice into a view of a local tensor.
    Raises KeyError when no piece contains it (a plan/holdings mismatch -- a bug).
    """
    for holder in pieces:
        if holder.key == piece.key and box_contains(holder.box, piece.box):
            return holder, box_relative(holder.box, piece.box)
    raise KeyError(f"no held piece contains {piece.key} {piece.box}")


def total_bytes(pieces: Iterable[Piece]) -> int:
    return sum(p.nbytes for p in pieces)
