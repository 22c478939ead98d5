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
from typing import Any

import torch
import torch.distributed as dist

from etcslurm.core.state import Piece
from etcslurm.errors import MigrationError, WaitTimeout
from etcslurm.hooks import Hooks
from etcslurm.transfer.wire import (
    DIRECT_MIN_BYTES,
    MessageLayout,
    MessageLike,
    ViewIndex,
    aligned,
    bytes_in_place,
    checksum,
    message_layout,
    staging_bytes_per_round,
    state_device,
    typed_view,
)

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
    ``direct_min``: see :data:`DIRECT_MIN_BYTES` (all ends must agree; tests lower it).
    ``hooks``: :meth:`Hooks.message_received` gets each received message before it is
    verified, with its buffers as landed (the packed buffer, then each segment's bytes).
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
    per_round = staging_bytes_per_round(mine, device, direct_min, (held_ix, needed_ix))
    arena_bytes = max(per_round.values(), default=0)
    if staging_cap is not None and arena_bytes > staging_cap:
        worst = max(per_round, key=per_round.__getitem__)
        raise MigrationError(
            f"{device}: round {worst} needs {arena_bytes} staging bytes, over the cap of "
            f"{staging_cap} (the plan's rounds do not respect the cap)"
        )
    dev = _device_of(needed_ix, held_ix)
    if arena is None or arena.numel() < arena_bytes or arena.device != dev:
        arena = torch.empty(arena_bytes, dtype=torch.uint8, device=dev)
    stats.peak_staging_bytes = arena_bytes
    wait_for = timedelta(seconds=timeout)

    for index, rnd in enumerate(all_rounds):
        t_round = time.perf_counter()
        ops: list[tuple[bool, torch.Tensor, int]] = []  # (send?, buffer, peer rank)
        recvs: list[_Incoming] = []
        sent = received = 0
        pos = 0  # arena bytes used so far in this round
        # deterministic order: by (src, dst), then the segments in layout order, so both
        # ends of every pair post the same sequence
        for msg in sorted(by_round.get(rnd, []), key=lambda m: (m.src, m.dst)):
            layout = message_layout(msg.slices, direct_min)
            send = msg.src == device
            buf, segments, staged, pos = _place(msg, layout, arena, pos,
                                                held_ix if send else needed_ix)
            stats.segments_staged += sum(staged)
            stats.segments_in_place += len(staged) - sum(staged)
            if send:
                t0 = time.perf_counter()
                for i, off in zip(layout.packed, layout.offsets, strict=True):
                    typed_view(buf, off, msg.slices[i]).copy_(held_ix.view(msg.slices[i]))
                for i, seg, was_staged in zip(layout.direct, segments, staged, strict=True):
                    if was_staged:
                        typed_view(seg, 0, msg.slices[i]).copy_(held_ix.view(msg.slices[i]))
                stats.pack_seconds += time.perf_counter() - t0
                t0 = time.perf_counter()
                words = buf[layout.payload :].view(torch.int64)
                words[0] = checksum(buf[: layout.payload])
                for k, seg in enumerate(segments, start=1):
                    words[k] = checksum(seg)
                stats.checksum_seconds += time.perf_counter() - t0
                peer = _rank(ranks, msg.dst)
                ops.extend((True, t, peer) for t in [buf, *segments])
                sent += layout.wire_bytes
                stats.messages_sent += 1
            else:
                peer = _rank(ranks, msg.src)
                ops.extend((False, t, peer) for t in [buf, *segments])
                recvs.append(_Incoming(msg, layout, buf, segments, staged))
                received += layout.wire_bytes
                stats.messages_received += 1
        t0 = time.perf_counter()
        works = _post(ops, group) if ops else []
        stats.comm_seconds += time.perf_counter() - t0
        if index == 0:  # local copies overlap with the first round's transfer
            t0 = time.perf_counter()
            for piece in local:
                needed_ix.view(piece).copy_(held_ix.view(piece))
                stats.bytes_local += piece.nbytes
            stats.local_seconds += time.perf_counter() - t0
        t0 = time.perf_counter()
        for work in works:
            _wait(work, wait_for, timeout, device, rnd, by_round.get(rnd, []))
        stats.comm_seconds += time.perf_counter() - t0
        for incoming in recvs:
            if hooks is not None:
                hooks.message_received(incoming.msg, [incoming.buf, *incoming.segments])
            t0 = time.perf_counter()
            incoming.verify()
            stats.checksum_seconds += time.perf_counter() - t0
            t0 = time.perf_counter()
            incoming.unpack(needed_ix)
            stats.unpack_seconds += time.perf_counter() - t0
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


def _place(msg: MessageLike, layout: MessageLayout, arena: torch.Tensor, pos: int, views: ViewIndex,
           ) -> tuple[torch.Tensor, list[torch.Tensor], list[bool], int]:
    """Where one message's bytes live on this end from ``pos`` in the arena on: its packed
    buffer, each segment (the view's own memory, or a staging region when the view is not
    contiguous: ``staged``), and the next free arena position."""
    buf = arena[pos : pos + layout.size]
    pos += aligned(layout.size)
    segments, staged = [], []
    for i in layout.direct:
        seg = bytes_in_place(views.view(msg.slices[i]))
        staged.append(seg is None)
        if seg is None:
            seg = arena[pos : pos + msg.slices[i].nbytes]
            pos += aligned(msg.slices[i].nbytes)
        segments.append(seg)
    return buf, segments, staged, pos


@dataclass
class _Incoming:
    """A message being received: its packed buffer and where each segment lands (the
    new view itself, or a staging region when ``staged``)."""

    msg: MessageLike
    layout: MessageLayout
    buf: torch.Tensor
    segments: list[torch.Tensor]
    staged: list[bool]

    def verify(self) -> None:
        words = self.buf[self.layout.payload :].view(torch.int64)
        parts = [(self.buf[: self.layout.payload], self.layout.packed[:1])]
        parts += [(seg, (i,)) for seg, i in zip(self.segments, self.layout.direct, strict=True)]
        for k, (data, which) in enumerate(parts):
            want, got = int(words[k]), int(checksum(data))
            if want != got:
                piece = self.msg.slices[which[0]] if which else None
                name = f"{piece.key} {list(piece.box)}" if piece else "(empty)"
                what = "packed part" if k == 0 else f"segment {k}"
                raise MigrationError(
                    f"checksum mismatch in round {self.msg.round} message {self.msg.src} -> "
                    f"{self.msg.dst} ({what}, {data.numel()} bytes, first piece {name}): "
                    f"sent {want:#x}, received {got:#x}"
                )

    def unpack(self, needed_ix: ViewIndex) -> None:
        slices = self.msg.slices
        for i, off in zip(self.layout.packed, self.layout.offsets, strict=True):
            needed_ix.view(slices[i]).copy_(typed_view(self.buf, off, slices[i]))
        for i, seg, was_staged in zip(self.layout.direct, self.segments, self.staged, strict=True):
            if was_staged:
                needed_ix.view(slices[i]).copy_(typed_view(seg, 0, slices[i]))


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
    mine = sorted((m for m in messages if device in (m.src, m.dst) and m.src != m.dst),
                  key=lambda m: (m.round, m.src, m.dst))
    for rnd in sorted({m.round for m in mine}):
        ops, pos = [], 0
        for msg in (m for m in mine if m.round == rnd):
            send = msg.src == device
            peer = _rank(ranks, msg.dst if send else msg.src)
            buf, segments, _, pos = _place(msg, message_layout(msg.slices, direct_min), arena,
                                           pos, held_ix if send else needed_ix)
            ops.extend((send, t, peer) for t in [buf, *segments])
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


def _rank(ranks: Mapping[str, int], device: str) -> int:
    try:
        return ranks[device]
    except KeyError:
        raise MigrationError(f"device {device!r} of the plan has no rank in this world") from None


def _peers(msgs: Sequence[MessageLike], device: str) -> str:
    return ", ".join(sorted({m.dst if m.src == device else m.src for m in msgs})) or "none"


def _device_of(*indexes: ViewIndex) -> torch.device:
    for ix in indexes:
        for pairs in ix._by_key.values():
            for _, tensor in pairs:
                return tensor.device
    return state_device()
