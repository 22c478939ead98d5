"""Execute a migration plan on one device: pack -> ``batch_isend_irecv`` -> verify -> unpack.

Why this shape (the ETC paper's *coalescing*): thousands of per-tensor sends are slow, so
every (src, dst) pair exchanges **one** contiguous buffer per round that holds all its
slices back to back, in the plan's canonical order (both ends derive the same layout from
the plan, so no header travels).  Rounds bound the staging memory: one arena, sized for the
busiest round and reused by every round, holds this device's send and receive buffers.

Each buffer ends with an 8-byte checksum: the wrapping 64-bit sum of the payload viewed as
int64 words (computed where the data lives -- on the GPU under NCCL -- at memory bandwidth;
crc32 via zlib runs at ~1 GB/s on one core and would cost more than the transfer).  A
mismatch raises :class:`MigrationError` naming the message and its first piece.

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

#: byte alignment of each message buffer inside the staging arena (int64 checksum views
#: need 8; 64 keeps buffers on cache lines)
_ALIGN = 64
_CHECKSUM_BYTES = 8


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
    """Where each slice of one message sits in its buffer (same on both ends)."""

    offsets: tuple[int, ...]
    payload: int  # bytes before the checksum, a multiple of 8

    @property
    def size(self) -> int:
        return self.payload + _CHECKSUM_BYTES


def message_layout(slices: Sequence[Piece]) -> _Layout:
    """Byte offsets of the slices in a packed buffer: in order, each aligned to its element
    size; payload padded to 8 bytes, then the checksum word."""
    offsets = []
    pos = 0
    for piece in slices:
        size = dtype_bytes(piece.dtype)
        pos = -(-pos // size) * size
        offsets.append(pos)
        pos += piece.nbytes
    return _Layout(tuple(offsets), -(-pos // 8) * 8)


def staging_bytes_per_round(messages: Iterable[MessageLike], device: str) -> dict[int, int]:
    """Staging bytes ``device`` needs in each round (its send + receive buffers, aligned)."""
    out: dict[int, int] = defaultdict(int)
    for msg in messages:
        if device in (msg.src, msg.dst) and msg.src != msg.dst:
            out[msg.round] += -(-message_layout(msg.slices).size // _ALIGN) * _ALIGN
    return dict(out)


def staging_arena(messages: Iterable[MessageLike], device: str, reuse: torch.Tensor | None,
                  on: torch.device | str | None = None) -> torch.Tensor:
    """The staging arena ``device`` needs for ``messages``: ``reuse`` when it is large
    enough and on ``on`` (default: :func:`state_device`), else a new one, zeroed so that
    its pages are resident before any transfer uses them.

    Why keep one: receiving into (or packing into) memory the process has not touched yet
    faults every page inside the copy; measured here, that made the exchange 2.4-4x slower
    (docs/migration.md).  A trainer keeps its arena from one migration to the next.
    """
    need = max(staging_bytes_per_round(messages, device).values(), default=0)
    on = torch.device(on) if on is not None else state_device()
    if reuse is not None and reuse.numel() >= need and reuse.device == on:
        return reuse
    return torch.zeros(need, dtype=torch.uint8, device=on)


def checksum(buf: torch.Tensor) -> torch.Tensor:
    """Wrapping 64-bit sum of a uint8 buffer (length a multiple of 8) as int64 words."""
    return buf.view(torch.int64).sum(dtype=torch.int64)


def _typed(buf: torch.Tensor, offset: int, piece: Piece) -> torch.Tensor:
    dtype = torch_dtype(piece.dtype)
    return buf[offset : offset + piece.nbytes].view(dtype).view(piece.shape)


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
    corrupt: Callable[[MessageLike, torch.Tensor], None] | None = None,
) -> TransferStats:
    """Run every message and local copy of ``device`` in the plan.

    ``messages``: all messages of the plan (others' are ignored); ``local``: the slices this
    device copies from its own holdings; ``ranks``: device id -> rank in the exchange group;
    ``held``/``needed``: this device's (Piece, view) pairs (sources / destinations).
    ``staging_cap``: bytes; a round that needs more raises before anything moves.
    ``progress`` gets a dict per round (round, rounds, bytes_sent, bytes_received, ...).
    ``group``: the default world (None), a registered group, or a bare backend from
    :func:`etcslurm.transfer.groups.exchange_group` (``ranks`` are then its ranks).
    ``arena``: a uint8 buffer the caller keeps between migrations (memory already
    resident: receiving into fresh pages costs 2.4-2.7x, docs/migration.md); used when it
    is large enough, else a new one is allocated.
    ``corrupt`` is a test hook applied to each received buffer before verification.
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
    per_round = staging_bytes_per_round(mine, device)
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
        recvs: list[tuple[MessageLike, _Layout, torch.Tensor]] = []
        sent = received = 0
        pos = 0
        # deterministic order: by (peer rank, direction) so both ends post the same pairs
        for msg in sorted(by_round.get(rnd, []), key=lambda m: (m.src, m.dst)):
            layout = message_layout(msg.slices)
            buf = arena[pos : pos + layout.size]
            pos += -(-layout.size // _ALIGN) * _ALIGN
            if msg.src == device:
                t0 = time.perf_counter()
                for piece, off in zip(msg.slices, layout.offsets, strict=True):
                    _typed(buf, off, piece).copy_(held_ix.view(piece))
                stats.pack_seconds += time.perf_counter() - t0
                t0 = time.perf_counter()
                buf[layout.payload :].view(torch.int64).fill_(checksum(buf[: layout.payload]))
                stats.checksum_seconds += time.perf_counter() - t0
                ops.append((True, buf, _rank(ranks, msg.dst)))
                sent += layout.payload
                stats.messages_sent += 1
            else:
                ops.append((False, buf, _rank(ranks, msg.src)))
                recvs.append((msg, layout, buf))
                received += layout.payload
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
            try:
                ok = work.wait(wait_for)
            except (RuntimeError, dist.DistError) as exc:
                peers = _peers(by_round.get(rnd, []), device)
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
                    f"(peers {_peers(by_round.get(rnd, []), device)})"
                )
        stats.comm_seconds += time.perf_counter() - t0
        for msg, layout, buf in recvs:
            if corrupt is not None:
                corrupt(msg, buf)
            t0 = time.perf_counter()
            want = int(buf[layout.payload :].view(torch.int64)[0])
            got = int(checksum(buf[: layout.payload]))
            stats.checksum_seconds += time.perf_counter() - t0
            if want != got:
                first = msg.slices[0] if msg.slices else None
                name = f"{first.key} {list(first.box)}" if first else "(empty)"
                raise MigrationError(
                    f"checksum mismatch in round {msg.round} message {msg.src} -> {msg.dst} "
                    f"({layout.payload} bytes, {len(msg.slices)} slices, first piece {name}): "
                    f"sent {want:#x}, received {got:#x}"
                )
            t0 = time.perf_counter()
            for piece, off in zip(msg.slices, layout.offsets, strict=True):
                needed_ix.view(piece).copy_(_typed(buf, off, piece))
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


def execute_plan(
    plan: Any,
    device: str,
    ranks: Mapping[str, int],
    held: Iterable[tuple[Piece, torch.Tensor]],
    needed: Iterable[tuple[Piece, torch.Tensor]],
    **kwargs: Any,
) -> TransferStats:
    """:func:`execute` for a core ``MigrationPlan`` (``messages`` and ``local[device]``)."""
    local = plan.local.get(device, []) if isinstance(plan.local, Mapping) else []
    return execute(plan.messages, local, device, ranks, held, needed, **kwargs)


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
