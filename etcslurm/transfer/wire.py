"""The wire format of a migration's messages, the same on both ends (no header travels).

A message between two devices is one packed buffer -- its small slices back to back in
the plan's order, each aligned to its element size, then one checksum word for them and
one per segment -- and its large slices (``DIRECT_MIN_BYTES`` and up), each a segment of
its own sent straight from the sender's tensor into the receiver's.  The staging arena
holds a device's packed buffers (and the segments whose view is not contiguous) for the
busiest round.  :mod:`etcslurm.transfer.executor` sends and receives in this format.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from etcslurm.core.state import Piece, box_contains, box_relative, dtype_bytes
from etcslurm.errors import MigrationError

#: byte alignment of each message buffer inside the staging arena (int64 checksum views
#: need 8; 64 keeps buffers on cache lines)
_ALIGN = 64
_CHECKSUM_BYTES = 8
#: slices of at least this many bytes (and a multiple of 8) travel as segments of their
#: own instead of being packed; every end of the same migration must use the same value
DIRECT_MIN_BYTES = 1 << 20


class MessageLike(Protocol):
    """What the executor needs of a planner ``Message``."""

    round: int
    src: str
    dst: str
    slices: Sequence[Piece]


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise MigrationError(f"unknown dtype {name!r} in plan")
    return dtype


class ViewIndex:
    """(Piece, tensor) pairs of one device, found by containment.

    Each tensor has the piece's box shape (a view into a live parameter or optimizer
    state, or a flat distributed-optimizer range reshaped to its box); a planned slice
    becomes a view of the one piece that contains it.
    """

    def __init__(self, pairs: Iterable[tuple[Piece, torch.Tensor]], what: str) -> None:
        self.what = what
        self._by_key: dict[str, list[tuple[Piece, torch.Tensor]]] = defaultdict(list)
        for piece, tensor in pairs:
            if tuple(tensor.shape) != piece.shape:
                raise MigrationError(
                    f"{what} view of {piece.key} {piece.box} has shape {tuple(tensor.shape)}, "
                    f"expected {piece.shape}"
                )
            self._by_key[piece.key].append((piece, tensor))

    def view(self, piece: Piece) -> torch.Tensor:
        for holder, tensor in self._by_key.get(piece.key, ()):
            if box_contains(holder.box, piece.box):
                rel = box_relative(holder.box, piece.box)
                return tensor[tuple(slice(lo, hi) for lo, hi in rel)]
        raise MigrationError(
            f"plan/holdings mismatch: no {self.what} piece contains {piece.key} {piece.box}"
        )


@dataclass(frozen=True)
class MessageLayout:
    """How one message travels (same on both ends): the packed buffer -- the ``packed``
    slices at ``offsets``, then one checksum word for them and one per segment -- followed
    by the ``direct`` slices, each a segment of its own."""

    packed: tuple[int, ...]  # indices into the message's slices
    offsets: tuple[int, ...]  # byte offset of each packed slice in the buffer
    direct: tuple[int, ...]  # indices of the slices sent as segments of their own
    direct_bytes: tuple[int, ...]
    payload: int  # packed bytes before the checksum words, a multiple of 8

    @property
    def size(self) -> int:
        """Bytes of the packed buffer (payload and checksum words)."""
        return self.payload + _CHECKSUM_BYTES * (1 + len(self.direct))

    @property
    def staging(self) -> int:
        """Arena bytes the message may need: its buffer, then room to stage every segment
        (used only where a view is not contiguous)."""
        return aligned(self.size) + sum(aligned(n) for n in self.direct_bytes)

    @property
    def wire_bytes(self) -> int:
        return self.payload + sum(self.direct_bytes)


def aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def message_layout(slices: Sequence[Piece], direct_min: int = DIRECT_MIN_BYTES) -> MessageLayout:
    """The layout of a message: slices of at least ``direct_min`` bytes (a multiple of 8)
    are segments of their own; the others are packed in order, each aligned to its
    element size, the payload padded to 8 bytes, then the checksum words."""
    packed, offsets, direct, direct_bytes = [], [], [], []
    pos = 0
    for index, piece in enumerate(slices):
        nbytes = piece.nbytes
        if nbytes >= direct_min and nbytes % 8 == 0:
            direct.append(index)
            direct_bytes.append(nbytes)
            continue
        size = dtype_bytes(piece.dtype)
        pos = -(-pos // size) * size
        packed.append(index)
        offsets.append(pos)
        pos += nbytes
    return MessageLayout(tuple(packed), tuple(offsets), tuple(direct), tuple(direct_bytes),
                   -(-pos // 8) * 8)


def staging_bytes_per_round(messages: Iterable[MessageLike], device: str,
                            direct_min: int = DIRECT_MIN_BYTES,
                            views: tuple[ViewIndex, ViewIndex] | None = None) -> dict[int, int]:
    """Staging bytes ``device`` needs in each round: its messages' packed buffers, plus
    room for the segments it must stage.  Without ``views`` (held, needed) every segment
    counts (the most a plan can need: what the planner's cap guarantees); with them only
    the segments whose view is not contiguous."""
    out: dict[int, int] = defaultdict(int)
    for msg in messages:
        if device not in (msg.src, msg.dst) or msg.src == msg.dst:
            continue
        layout = message_layout(msg.slices, direct_min)
        if views is None:
            out[msg.round] += layout.staging
            continue
        index = views[0] if msg.src == device else views[1]
        out[msg.round] += aligned(layout.size) + sum(
            aligned(msg.slices[i].nbytes) for i in layout.direct
            if bytes_in_place(index.view(msg.slices[i])) is None)
    return dict(out)


def staging_arena(messages: Iterable[MessageLike], device: str, reuse: torch.Tensor | None,
                  on: torch.device | str | None = None,
                  direct_min: int = DIRECT_MIN_BYTES,
                  held: Iterable[tuple[Piece, torch.Tensor]] | None = None,
                  needed: Iterable[tuple[Piece, torch.Tensor]] | None = None) -> torch.Tensor:
    """The staging arena ``device`` needs for ``messages``: ``reuse`` when it is large
    enough and on ``on`` (default: :func:`state_device`), else a new one, zeroed so that
    its pages are resident before any transfer uses them.  Given this device's ``held``
    and ``needed`` views it is sized exactly (segments sent or received in place take no
    room), else for the worst case.

    Why keep one: receiving into (or packing into) memory the process has not touched yet
    faults every page inside the copy; measured here, that made the exchange 2.4-4x slower
    (docs/migration.md).  A trainer keeps its arena from one migration to the next.
    """
    views = None
    if held is not None or needed is not None:
        views = (ViewIndex(held or [], f"held ({device})"),
                 ViewIndex(needed or [], f"needed ({device})"))
    per_round = staging_bytes_per_round(messages, device, direct_min, views)
    need = max(per_round.values(), default=0)
    on = torch.device(on) if on is not None else state_device()
    if reuse is not None and reuse.numel() >= need and reuse.device == on:
        return reuse
    return torch.zeros(need, dtype=torch.uint8, device=on)


def checksum(buf: torch.Tensor) -> torch.Tensor:
    """Wrapping 64-bit sum of a uint8 buffer (length a multiple of 8) as int64 words."""
    return buf.view(torch.int64).sum(dtype=torch.int64)


def typed_view(buf: torch.Tensor, offset: int, piece: Piece) -> torch.Tensor:
    dtype = torch_dtype(piece.dtype)
    return buf[offset : offset + piece.nbytes].view(dtype).view(piece.shape)


def bytes_in_place(view: torch.Tensor) -> torch.Tensor | None:
    """``view``'s own memory as flat bytes, when it can travel (and be checksummed) in
    place: contiguous and 8-byte aligned; else None (the segment is staged)."""
    if not view.is_contiguous() or view.data_ptr() % 8:
        return None
    return view.reshape(-1).view(torch.uint8)


def state_device() -> torch.device:
    """Where model state lives: this process's GPU when there is one (NCCL), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
