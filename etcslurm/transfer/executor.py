"""Execute a migration plan on one device: pack -> send/recv -> verify -> unpack.

Why this shape (the ETC paper's *coalescing*): thousands of per-tensor sends are slow, so
every (src, dst) pair exchanges **one** packed buffer per round that holds its small
slices back to back, in the plan's canonical order (both ends derive the same layout from
the plan, so no header travels).  A slice of at least ``DIRECT_MIN_BYTES`` is not copied
into that buffer: it travels as a segment of its own, posted in the same batch, straight
from the sender's tensor into the receiver's (a per-send cost of microseconds against
milliseconds of payload).  Where a view is not contiguous on one end, that end alone
stages the segment through the arena; the bytes on the wire are the same.  Measured on
the 2-core machine the exchange is memory-bound, and every packing copy avoided is
bandwidth the transfer gets back (docs/migration.md).  Rounds bound the staging memory:
one arena, sized for the busiest round and reused by every round, holds this device's
packed buffers and staged segments.

Each packed buffer ends with checksum words -- one for its packed payload, one per
segment: the wrapping 64-bit sum of the bytes viewed as int64 words (computed where the
data lives -- on the GPU under NCCL -- at memory bandwidth; crc32 via zlib runs at ~1 GB/s
on one core and would cost more than the transfer).  A mismatch raises
:class:`MigrationError` naming the message and its piece.

Local slices (this device keeps or already holds the data) are plain ``copy_`` between
views and overlap with the network transfer.  Every wait is bounded by ``timeout``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from etcslurm.core.state import Piece, box_contains, box_relative, dtype_bytes
from etcslurm.errors import MigrationError, WaitTimeout
from etcslurm.hooks import Hooks

#: byte alignment of each message buffer inside the staging arena (int64 checksum views
#: need 8; 64 keeps buffers on cache lines)
_ALIGN = 64
_CHECKSUM_BYTES = 8
#: slices of at least this many bytes (and a multiple of 8) travel as segments of their
#: own instead of being packed; every end of the same migration must use the same value
DIRECT_MIN_BYTES = 1 << 20
#: on the CPU (gloo) a segment travels in parts of at most this many bytes (a multiple of
#: 8), each with its own checksum word: the sender sums a part just before posting it and
#: the receiver as soon as it has landed, so each sum reads bytes still in the cache
#: (one core here: ~60 GB/s from the L3 cache, ~15 GB/s from memory); every end agrees,
#: as they all hold their state on the same kind of device (:func:`part_bytes_on`)
PART_BYTES = 4 << 20
#: a segment in one part: on a GPU the sums are kernels queued beside the transfer, and
#: more parts would only be more NCCL calls
WHOLE = 1 << 62


class MessageLike(Protocol):
    """What the executor needs of a planner ``Message``."""

    round: int
    src: str
    dst: str
    slices: Sequence[Piece]


ProgressFn = Callable[[dict[str, Any]], None]


@dataclass
class TransferStats:
    """What one device did during a migration (all times in seconds)."""

    device: str
    rounds: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    segments_in_place: int = 0  # sent from / received into the model's own memory
    segments_staged: int = 0  # through the arena (the view was not contiguous)
    peak_staging_bytes: int = 0
    seconds: float = 0.0
    pack_seconds: float = 0.0
    comm_seconds: float = 0.0
    checksum_seconds: float = 0.0
    unpack_seconds: float = 0.0
    local_seconds: float = 0.0
    per_round: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


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
class _Layout:
    """How one message travels (same on both ends): the ``direct`` slices, each a segment
    of its own, cut into ``parts`` of at most :data:`PART_BYTES`; then the packed buffer
    -- the ``packed`` slices at ``offsets``, then one checksum word for them and one per
    part."""

    packed: tuple[int, ...]  # indices into the message's slices
    offsets: tuple[int, ...]  # byte offset of each packed slice in the buffer
    direct: tuple[int, ...]  # indices of the slices sent as segments of their own
    direct_bytes: tuple[int, ...]
    payload: int  # packed bytes before the checksum words, a multiple of 8
    #: (segment number from 0, first byte, end byte) of each part, in wire order
    parts: tuple[tuple[int, int, int], ...] = ()

    @property
    def size(self) -> int:
        """Bytes of the packed buffer (payload and checksum words)."""
        return self.payload + _CHECKSUM_BYTES * (1 + len(self.parts))

    @property
    def staging(self) -> int:
        """Arena bytes the message may need: its buffer, then room to stage every segment
        (used only where a view is not contiguous)."""
        return _aligned(self.size) + sum(_aligned(n) for n in self.direct_bytes)

    @property
    def wire_bytes(self) -> int:
        return self.payload + sum(self.direct_bytes)


def part_bytes_on(device: torch.device) -> int:
    """The part size for state on ``device``: :data:`PART_BYTES` on the CPU, else whole
    segments (:data:`WHOLE`)."""
    return PART_BYTES if device.type == "cpu" else WHOLE


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def message_layout(slices: Sequence[Piece], direct_min: int = DIRECT_MIN_BYTES,
                   part_bytes: int | None = None) -> _Layout:
    """The layout of a message: slices of at least ``direct_min`` bytes (a multiple of 8)
    are segments of their own, cut into parts of at most ``part_bytes`` (default
    :data:`PART_BYTES`); the others are packed in order, each aligned to its element
    size, the payload padded to 8 bytes, then the checksum words."""
    part_bytes = PART_BYTES if part_bytes is None else part_bytes
    packed, offsets, direct, direct_bytes = [], [], [], []
    parts: list[tuple[int, int, int]] = []
    pos = 0
    for index, piece in enumerate(slices):
        nbytes = piece.nbytes
        if nbytes >= direct_min and nbytes % 8 == 0:
            parts.extend((len(direct), lo, min(lo + part_bytes, nbytes))
                         for lo in range(0, nbytes, part_bytes))
            direct.append(index)
            direct_bytes.append(nbytes)
            continue
        size = dtype_bytes(piece.dtype)
        pos = -(-pos // size) * size
        packed.append(index)
        offsets.append(pos)
        pos += nbytes
    return _Layout(tuple(packed), tuple(offsets), tuple(direct), tuple(direct_bytes),
                   -(-pos // 8) * 8, tuple(parts))


def staging_bytes_per_round(messages: Iterable[MessageLike], device: str,
                            direct_min: int = DIRECT_MIN_BYTES,
                            views: tuple[ViewIndex, ViewIndex] | None = None,
                            part_bytes: int | None = None) -> dict[int, int]:
    """Staging bytes ``device`` needs in each round: its messages' packed buffers, plus
    room for the segments it must stage.  Without ``views`` (held, needed) every segment
    counts (the most a plan can need: what the planner's cap guarantees); with them only
    the segments whose view is not contiguous."""
    out: dict[int, int] = defaultdict(int)
    for msg in messages:
        if device not in (msg.src, msg.dst) or msg.src == msg.dst:
            continue
        layout = message_layout(msg.slices, direct_min, part_bytes)
        if views is None:
            out[msg.round] += layout.staging
            continue
        index = views[0] if msg.src == device else views[1]
        out[msg.round] += _aligned(layout.size) + sum(
            _aligned(msg.slices[i].nbytes) for i in layout.direct
            if _bytes_in_place(index.view(msg.slices[i])) is None)
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
    on = torch.device(on) if on is not None else state_device()
    per_round = staging_bytes_per_round(messages, device, direct_min, views, part_bytes_on(on))
    need = max(per_round.values(), default=0)
    if reuse is not None and reuse.numel() >= need and reuse.device == on:
        return reuse
    return torch.zeros(need, dtype=torch.uint8, device=on)


def checksum(buf: torch.Tensor) -> torch.Tensor:
    """Wrapping 64-bit sum of a uint8 buffer (length a multiple of 8) as int64 words."""
    return buf.view(torch.int64).sum(dtype=torch.int64)


def _typed(buf: torch.Tensor, offset: int, piece: Piece) -> torch.Tensor:
    dtype = torch_dtype(piece.dtype)
    return buf[offset : offset + piece.nbytes].view(dtype).view(piece.shape)


def _bytes_in_place(view: torch.Tensor) -> torch.Tensor | None:
    """``view``'s own memory as flat bytes, when it can travel (and be checksummed) in
    place: contiguous and 8-byte aligned; else None (the segment is staged)."""
    if not view.is_contiguous() or view.data_ptr() % 8:
        return None
    return view.reshape(-1).view(torch.uint8)


def execute(
    messages: Sequence[MessageLike],
    local: Sequence[Piece],
    device: str,
    ranks: Mapping[str, int],
    held: Iterable[tuple[Piece, torch.Tensor]],
    needed: Iterable[tuple[Piece, torch.Tensor]],
    *,
    staging_cap: int | None = None,
    timeout: float = 60.0,
    progress: ProgressFn | None = None,
    group: dist.ProcessGroup | dist.Backend | None = None,
    arena: torch.Tensor | None = None,
    direct_min: int = DIRECT_MIN_BYTES,
    hooks: Hooks | None = None,
    part_bytes: int | None = None,
) -> TransferStats:
    """Run every message and local copy of ``device`` in the plan.

    ``messages``: all messages of the plan (others' are ignored); ``local``: the slices this
    device copies from its own holdings; ``ranks``: device id -> rank in the exchange group;
    ``held``/``needed``: this device's (Piece, view) pairs (sources / destinations).
    ``staging_cap``: bytes; a round that needs more raises before anything moves.
    ``progress`` gets a dict per round (round, rounds, bytes_sent, bytes_received, ...).
    ``group``: the default world (None), a registered group, or a bare backend from
    :func:`etcslurm.groups.lifecycle.exchange_group` (``ranks`` are then its ranks).
    ``arena``: a uint8 buffer the caller keeps between migrations (memory already
    resident: receiving into fresh pages costs 2.4-2.7x, docs/migration.md); used when it
    is large enough, else a new one is allocated.
    ``direct_min``: see :data:`DIRECT_MIN_BYTES` (all ends must agree; tests lower it);
    ``part_bytes``: see :data:`PART_BYTES` (None: :func:`part_bytes_on` the state's device).
    ``hooks``: :meth:`Hooks.buffer_received` gets each part of a received message as it
    lands, before it is summed (part 0: the packed buffer, which lands last; k: the
    message's part k, segments cut into :func:`part_bytes_on` the state's device).
    """
    start = time.perf_counter()
    stats = TransferStats(device=device)
    mine = [m for m in messages if device in (m.src, m.dst) and m.src != m.dst]
    held_ix = ViewIndex(held, f"held ({device})")
    needed_ix = ViewIndex(needed, f"needed ({device})")
    by_round: dict[int, list[MessageLike]] = defaultdict(list)
    for msg in mine:
        by_round[msg.round].append(msg)
    all_rounds = sorted({m.round for m in messages}) or [0]
    stats.rounds = len(all_rounds)
    dev = _device_of(needed_ix, held_ix)
    part_bytes = part_bytes_on(dev) if part_bytes is None else part_bytes
    per_round = staging_bytes_per_round(mine, device, direct_min, (held_ix, needed_ix),
                                        part_bytes)
    arena_bytes = max(per_round.values(), default=0)
    if staging_cap is not None and arena_bytes > staging_cap:
        worst = max(per_round, key=per_round.__getitem__)
        raise MigrationError(
            f"{device}: round {worst} needs {arena_bytes} staging bytes, over the cap of "
            f"{staging_cap} (the plan's rounds do not respect the cap)"
        )
    if arena is None or arena.numel() < arena_bytes or arena.device != dev:
        arena = torch.empty(arena_bytes, dtype=torch.uint8, device=dev)
    stats.peak_staging_bytes = arena_bytes
    wait_for = timedelta(seconds=timeout)

    for index, rnd in enumerate(all_rounds):
        t_round = time.perf_counter()
        batch: list[tuple[bool, torch.Tensor, int]] = []  # (send?, buffer, peer rank)
        posted: list[_Posted] = []  # in post order
        sent = received = 0
        pos = 0  # arena bytes used so far in this round
        # deterministic order: by (src, dst), then each message's parts in wire order
        # (segments, then the packed buffer), so both ends of every pair post the same
        # sequence
        for msg in sorted(by_round.get(rnd, []), key=lambda m: (m.src, m.dst)):
            layout = message_layout(msg.slices, direct_min, part_bytes)
            send = msg.src == device
            buf, segments, staged, pos = _place(msg, layout, arena, pos,
                                                held_ix if send else needed_ix)
            stats.segments_staged += sum(staged)
            stats.segments_in_place += len(staged) - sum(staged)
            parcel = _Parcel(msg, layout, buf, segments, staged)
            peer = _rank(ranks, msg.dst if send else msg.src)
            if send:
                t0 = time.perf_counter()
                parcel.pack(held_ix)
                stats.pack_seconds += time.perf_counter() - t0
                sent += layout.wire_bytes
                stats.messages_sent += 1
            else:
                received += layout.wire_bytes
                stats.messages_received += 1
            for part, tensor in parcel.wire():
                if send:  # each part's checksum word right before the part is posted
                    t0 = time.perf_counter()
                    parcel.sign(part)
                    stats.checksum_seconds += time.perf_counter() - t0
                incoming = None if send else parcel
                if _one_by_one(group):  # on the wire while the next part is summed
                    t0 = time.perf_counter()
                    work = _post([(send, tensor, peer)], group)[0]
                    stats.comm_seconds += time.perf_counter() - t0
                    posted.append(_Posted(work, incoming, part))
                else:
                    batch.append((send, tensor, peer))
                    posted.append(_Posted(None, incoming, part))
        if batch:
            t0 = time.perf_counter()
            works = iter(_post(batch, group))
            posted = [_Posted(next(works), p.incoming, p.part) for p in posted]
            stats.comm_seconds += time.perf_counter() - t0
        if index == 0:  # local copies overlap with the first round's transfer
            t0 = time.perf_counter()
            for piece in local:
                needed_ix.view(piece).copy_(held_ix.view(piece))
                stats.bytes_local += piece.nbytes
            stats.local_seconds += time.perf_counter() - t0
        # in post order: each received part is summed as soon as it has landed (while
        # the next one is on the wire); a message is verified and unpacked once its
        # packed buffer -- its last part, which carries the checksum words -- is in.  A
        # mismatch is raised once the round's transfers are done (its peers' sends and
        # receives with this device complete first, as they would without it)
        bad: MigrationError | None = None
        for item in posted:
            t0 = time.perf_counter()
            _wait(item.work, wait_for, timeout, device, rnd, by_round.get(rnd, []))
            stats.comm_seconds += time.perf_counter() - t0
            parcel_in = item.incoming
            if parcel_in is None:
                continue
            if hooks is not None:
                hooks.buffer_received(parcel_in.msg, item.part, parcel_in.part(item.part))
            t0 = time.perf_counter()
            parcel_in.landed(item.part)
            stats.checksum_seconds += time.perf_counter() - t0
            if item.part != 0:
                continue
            try:
                parcel_in.verify()
            except MigrationError as exc:
                bad = bad or exc
                continue
            t0 = time.perf_counter()
            parcel_in.unpack(needed_ix)
            stats.unpack_seconds += time.perf_counter() - t0
        if bad is not None:
            raise bad
        stats.bytes_sent += sent
        stats.bytes_received += received
        info = {
            "device": device,
            "round": rnd,
            "round_index": index,
            "rounds": len(all_rounds),
            "bytes_sent": sent,
            "bytes_received": received,
            "staging_bytes": pos,
            "seconds": time.perf_counter() - t_round,
        }
        stats.per_round.append(info)
        if progress is not None:
            progress(info)
    if arena.is_cuda:
        torch.cuda.synchronize(arena.device)
    stats.seconds = time.perf_counter() - start
    return stats


def _place(msg: MessageLike, layout: _Layout, arena: torch.Tensor, pos: int, views: ViewIndex,
           ) -> tuple[torch.Tensor, list[torch.Tensor], list[bool], int]:
    """Where one message's bytes live on this end from ``pos`` in the arena on: its packed
    buffer, each segment (the view's own memory, or a staging region when the view is not
    contiguous: ``staged``), and the next free arena position."""
    buf = arena[pos : pos + layout.size]
    pos += _aligned(layout.size)
    segments, staged = [], []
    for i in layout.direct:
        seg = _bytes_in_place(views.view(msg.slices[i]))
        staged.append(seg is None)
        if seg is None:
            seg = arena[pos : pos + msg.slices[i].nbytes]
            pos += _aligned(msg.slices[i].nbytes)
        segments.append(seg)
    return buf, segments, staged, pos


@dataclass
class _Posted:
    """One posted part of a round: its work (None until a batch is posted), the parcel
    when this end receives it, and which part it is (0: the packed buffer, k: segment k)."""

    work: Any
    incoming: _Parcel | None
    part: int


@dataclass
class _Parcel:
    """One message on this end: its packed buffer and each segment's memory (the view
    itself, or a staging region when ``staged``).  On the wire the segments' parts go
    first, in layout order, then the packed buffer: the buffer carries the checksum
    words, so the sender posts each part as soon as its word is computed, and the
    receiver sums each part as soon as it has landed (while the next is in flight)."""

    msg: MessageLike
    layout: _Layout
    buf: torch.Tensor
    segments: list[torch.Tensor]
    staged: list[bool]
    #: received: the checksum of each part as it landed (0: packed payload, k: part k)
    got: dict[int, int] = field(default_factory=dict)

    def wire(self) -> list[tuple[int, torch.Tensor]]:
        """(part, bytes) in the order they travel: parts 1.. (the segments'), then 0."""
        return [*((k, self.part(k)) for k in range(1, len(self.layout.parts) + 1)),
                (0, self.buf)]

    def part(self, k: int) -> torch.Tensor:
        if k == 0:
            return self.buf
        seg, lo, hi = self.layout.parts[k - 1]
        return self.segments[seg][lo:hi]

    def _data(self, k: int) -> torch.Tensor:
        return self.buf[: self.layout.payload] if k == 0 else self.part(k)

    def _words(self) -> torch.Tensor:
        return self.buf[self.layout.payload :].view(torch.int64)

    def pack(self, held_ix: ViewIndex) -> None:
        """Copy the small slices into the packed buffer, staged segments into the arena."""
        slices = self.msg.slices
        for i, off in zip(self.layout.packed, self.layout.offsets, strict=True):
            _typed(self.buf, off, slices[i]).copy_(held_ix.view(slices[i]))
        for i, seg, was_staged in zip(self.layout.direct, self.segments, self.staged, strict=True):
            if was_staged:
                _typed(seg, 0, slices[i]).copy_(held_ix.view(slices[i]))

    def sign(self, k: int) -> None:
        """Sender: write part ``k``'s checksum word (the packed payload's is part 0)."""
        self._words()[k] = checksum(self._data(k))

    def landed(self, k: int) -> None:
        """Receiver: part ``k`` has landed; sum it now, while later parts are in flight."""
        self.got[k] = int(checksum(self._data(k)))

    def verify(self) -> None:
        """Every part landed: compare each sum with the word the sender computed."""
        words = self._words()
        for k in range(len(self.layout.parts) + 1):
            want, got = int(words[k]), self.got[k]
            if want != got:
                raise MigrationError(
                    f"checksum mismatch in round {self.msg.round} message {self.msg.src} -> "
                    f"{self.msg.dst} ({self._what(k)}): sent {want:#x}, received {got:#x}"
                )

    def _what(self, k: int) -> str:
        """Part ``k`` in words: the packed part and its first piece, or the segment, the
        bytes of it the part holds, and its piece."""
        if k == 0:
            first = self.layout.packed[:1]
            piece = self.msg.slices[first[0]] if first else None
            name = f"{piece.key} {list(piece.box)}" if piece else "(empty)"
            return f"packed part, {self.layout.payload} bytes, first piece {name}"
        seg, lo, hi = self.layout.parts[k - 1]
        piece = self.msg.slices[self.layout.direct[seg]]
        size = (f"{hi - lo} bytes" if (lo, hi) == (0, piece.nbytes)
                else f"bytes {lo}-{hi} of {piece.nbytes}")
        return f"segment {seg + 1}, {size}, first piece {piece.key} {list(piece.box)}"

    def unpack(self, needed_ix: ViewIndex) -> None:
        slices = self.msg.slices
        for i, off in zip(self.layout.packed, self.layout.offsets, strict=True):
            needed_ix.view(slices[i]).copy_(_typed(self.buf, off, slices[i]))
        for i, seg, was_staged in zip(self.layout.direct, self.segments, self.staged, strict=True):
            if was_staged:
                needed_ix.view(slices[i]).copy_(_typed(seg, 0, slices[i]))


def _wait(work: Any, wait_for: timedelta, timeout: float, device: str, rnd: int,
          msgs: Sequence[MessageLike]) -> None:
    """Wait for one posted send/recv; a late or lost peer becomes a named error."""
    try:
        ok = work.wait(wait_for)
    except (RuntimeError, dist.DistError) as exc:
        peers = _peers(msgs, device)
        if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            raise WaitTimeout(
                f"{device}: round {rnd} transfer did not finish within {timeout:.0f} s "
                f"(peers {peers}): {exc}"
            ) from exc
        raise MigrationError(
            f"{device}: round {rnd} transfer failed, a peer was lost (peers {peers}): "
            f"{str(exc).splitlines()[0][:300]}"
        ) from exc
    if ok is False:
        raise WaitTimeout(
            f"{device}: round {rnd} transfer did not finish within {timeout:.0f} s "
            f"(peers {_peers(msgs, device)})"
        )


def transport_only(
    messages: Sequence[MessageLike],
    device: str,
    ranks: Mapping[str, int],
    arena: torch.Tensor,
    held: Iterable[tuple[Piece, torch.Tensor]],
    needed: Iterable[tuple[Piece, torch.Tensor]],
    *,
    group: dist.ProcessGroup | dist.Backend | None = None,
    timeout: float = 60.0,
    direct_min: int = DIRECT_MIN_BYTES,
    part_bytes: int | None = None,
) -> float:
    """Post exactly the buffers and segments :func:`execute` would, from and into the same
    memory, round by round, with no packing, checksum, unpacking or local copies; returns
    the seconds.  It overwrites ``needed`` (and the arena) with whatever was sent.

    Why: it is what the transport alone needs for this plan, on this machine, with every
    pair of a round active at once -- the floor any executor of the plan sits on.  The
    benchmark reports the exchange against it (the executor's own cost) and against the
    idle-pair bound (max bytes received / one pair's bandwidth).
    """
    start = time.perf_counter()
    wait_for = timedelta(seconds=timeout)
    held_ix = ViewIndex(held, f"held ({device})")
    needed_ix = ViewIndex(needed, f"needed ({device})")
    part_bytes = part_bytes_on(arena.device) if part_bytes is None else part_bytes
    mine = sorted((m for m in messages if device in (m.src, m.dst) and m.src != m.dst),
                  key=lambda m: (m.round, m.src, m.dst))
    for rnd in sorted({m.round for m in mine}):
        ops, pos = [], 0
        for msg in (m for m in mine if m.round == rnd):
            send = msg.src == device
            peer = _rank(ranks, msg.dst if send else msg.src)
            layout = message_layout(msg.slices, direct_min, part_bytes)
            buf, segments, staged, pos = _place(msg, layout, arena, pos,
                                                held_ix if send else needed_ix)
            parcel = _Parcel(msg, layout, buf, segments, staged)
            ops.extend((send, t, peer) for _, t in parcel.wire())
        for work in _post(ops, group):
            _wait(work, wait_for, timeout, device, rnd, mine)
    if arena.is_cuda:
        torch.cuda.synchronize(arena.device)
    return time.perf_counter() - start


def check_fills(
    needed: Iterable[tuple[Piece, torch.Tensor]],
    local: Iterable[Piece],
    messages: Iterable[MessageLike],
    device: str,
    what: str = "new state",
) -> int:
    """Check, before anything moves, that the local slices and the messages to ``device``
    cover every byte of ``needed`` (the views of a freshly built model, whose values are
    only initialisation until then); returns those bytes.

    The executor writes only planned slices, so a plan that misses a piece would leave it
    silently at its initial values: this turns that into a :class:`MigrationError`.
    """
    total = sum(p.nbytes for p, _ in needed)
    filled = sum(p.nbytes for p in local) + sum(
        p.nbytes for m in messages if m.dst == device and m.src != device for p in m.slices)
    if filled != total:
        raise MigrationError(
            f"{what}: the plan fills {filled} of the {total} bytes it holds "
            "(the plan does not cover its state)"
        )
    return filled


def _post(ops: Sequence[tuple[bool, torch.Tensor, int]],
          group: dist.ProcessGroup | dist.Backend | None) -> list[Any]:
    """Post a round's sends and receives at once.  A world or registered group goes through
    ``batch_isend_irecv`` (NCCL coalesces them into one group call); a bare backend gets
    them posted directly, in the same order on both ends of every pair (the messages are
    sorted by (src, dst) everywhere), so even uncoalesced NCCL cannot deadlock."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return dist.batch_isend_irecv([
            dist.P2POp(dist.isend if send else dist.irecv, buf, peer, group)
            for send, buf, peer in ops
        ])
    return [group.send([buf], peer, 0) if send else group.recv([buf], peer, 0)
            for send, buf, peer in ops]


def _one_by_one(group: dist.ProcessGroup | dist.Backend | None) -> bool:
    """Whether sends and receives are posted one at a time as they are ready (a bare
    backend), rather than a round's all at once (``batch_isend_irecv``: the default world
    or a registered group, which NCCL coalesces into one group call)."""
    return not (group is None or isinstance(group, dist.ProcessGroup))


def _rank(ranks: Mapping[str, int], device: str) -> int:
    try:
        return ranks[device]
    except KeyError:
        raise MigrationError(f"device {device!r} of the plan has no rank in this world") from None


def _peers(msgs: Sequence[MessageLike], device: str) -> str:
    return ", ".join(sorted({m.dst if m.src == device else m.src for m in msgs})) or "none"


def state_device() -> torch.device:
    """Where model state lives: this process's GPU when there is one (NCCL), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _device_of(*indexes: ViewIndex) -> torch.device:
    for ix in indexes:
        for pairs in ix._by_key.values():
            for _, tensor in pairs:
                return tensor.device
    return state_device()
