"""Synthetic-tensor workers: the executor and process groups without megatron.

Used by the executor tests (correctness, checksum detection, timeouts, ten migrations in
a row without leaks), the fault matrix's corrupted-message row and
``benchmarks/receive_memory.py``.  Each global tensor's values are a deterministic
function of its key, so every rank can check what it received without anyone sending
the expected values.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from etcslurm.bench.worker import WorkerContext
from etcslurm.core.state import Piece
from etcslurm.errors import EtcslurmError
from etcslurm.groups import lifecycle as groups
from etcslurm.testing.faults import CorruptOnce
from etcslurm.transfer.executor import execute
from etcslurm.transfer.wire import staging_bytes_per_round


@dataclass(frozen=True)
class SynthMessage:
    """Same fields as the planner's ``Message``."""

    round: int
    src: str
    dst: str
    slices: tuple[Piece, ...] = field(default=())

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.slices)


SHAPES = {"t": ((16, 12), "float32"), "u": ((24,), "int64"), "v": ((8, 8), "bfloat16")}


def global_tensor(key: str) -> torch.Tensor:
    """The deterministic value of global tensor ``key`` (``t3``, ``u0``, ...)."""
    shape, dtype = SHAPES[key[0]]
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    values = torch.randn(shape, generator=gen) * 100
    return values.to(getattr(torch, dtype))


def _box_of(piece: Piece) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in piece.box)


def synthetic_plan(n: int, scale: int = 1) -> tuple[list[SynthMessage], dict[str, list[Piece]]]:
    """Device ``s`` holds tensors ``t{s}``, ``u{s}``, ``v{s}`` whole; device ``d`` needs
    column block ``d`` of each of them from every ``s`` (a message per pair, two rounds)
    and its own block locally."""
    del scale
    messages: list[SynthMessage] = []
    local: dict[str, list[Piece]] = {}
    for d in range(n):
        for s in range(n):
            slices = needed_pieces(s, d, n)
            if s == d:
                local[str(d)] = slices
            else:
                messages.append(SynthMessage((s + d) % 2, str(s), str(d), tuple(slices)))
    return messages, local


def needed_pieces(s: int, d: int, n: int) -> list[Piece]:
    tcols = 12 // n
    return [
        Piece(f"t{s}", ((0, 16), (d * tcols, (d + 1) * tcols)), "float32"),
        Piece(f"u{s}", ((d * 24 // n, (d + 1) * 24 // n),), "int64"),
        Piece(f"v{s}", ((1, 7), (d, d + 1)), "bfloat16"),
    ]


def _holdings(me: int, n: int, strided: bool = False,
              ) -> tuple[list[tuple[Piece, torch.Tensor]], list[tuple[Piece, torch.Tensor]]]:
    """This device's whole tensors, and zeroed destinations for what it needs (with
    ``strided``, the 2-D destinations are transposed views: not contiguous)."""
    held = []
    for key in (f"t{me}", f"u{me}", f"v{me}"):
        t = global_tensor(key)
        held.append((Piece(key, tuple((0, s) for s in t.shape), str(t.dtype)[6:]), t))
    needed = []
    for s in range(n):
        for piece in needed_pieces(s, me, n):
            dtype = getattr(torch, piece.dtype)
            if strided and len(piece.shape) == 2:
                dest = torch.zeros(piece.shape[::-1], dtype=dtype).t()
            else:
                dest = torch.zeros(piece.shape, dtype=dtype)
            needed.append((piece, dest))
    return held, needed


def _check(needed: list[tuple[Piece, torch.Tensor]]) -> bool:
    return all(torch.equal(t, global_tensor(p.key)[_box_of(p)]) for p, t in needed)


def executor_selftest(ctx: WorkerContext) -> dict[str, Any]:
    """All executor checks in one set of processes (process start-up is the slow part)."""
    n, me, dev = ctx.nprocs, ctx.index, str(ctx.index)
    ranks = {str(i): i for i in range(n)}
    messages, local = synthetic_plan(n)
    out: dict[str, Any] = {"usage": []}
    cap = max(staging_bytes_per_round(messages, dev).values())
    gen = 0
    # 1. correctness, progress events, staging under the cap -- ten times in a row, each
    #    in a fresh generation, measuring threads / fds / RSS after each teardown
    events: list[dict[str, Any]] = []
    for _ in range(int(ctx.config.get("repeats", 10))):
        groups.configure(ctx.store, gen, me, n, "gloo", timeout=30)
        held, needed = _holdings(me, n)
        stats = execute(messages, local[dev], dev, ranks, held, needed,
                        staging_cap=cap, timeout=30, progress=events.append)
        out.setdefault("exact", []).append(_check(needed))
        groups.teardown()
        out["usage"].append(groups.resource_usage())
        gen += 1
    out["stats"] = stats.to_json()
    out["cap"] = cap
    out["progress_events"] = events[: stats.rounds]
    # 1b. slices as segments of their own (``direct_min`` lowered so that the synthetic
    #     tensors' t and u slices qualify; v's 12 bytes stay packed): sent in place where
    #     the view is contiguous (u), staged where not (t on the sender; t on the receiver,
    #     whose destinations are transposed views), exact either way
    groups.configure(ctx.store, gen, me, n, "gloo", timeout=30)
    gen += 1
    held, needed = _holdings(me, n, strided=True)
    seg_stats = execute(messages, local[dev], dev, ranks, held, needed, timeout=30,
                        direct_min=8)
    out["segments_exact"] = _check(needed)
    out["segments_stats"] = seg_stats.to_json()
    groups.teardown()
    # 2. a corrupted byte on device 1 is detected and named: in the packed buffer (default
    #    layout), and in a segment (the last one of the message: u0)
    for name, direct_min in (("corrupt_error", None), ("corrupt_segment_error", 8)):
        groups.configure(ctx.store, gen, me, n, "gloo", timeout=30)
        gen += 1
        held, needed = _holdings(me, n)
        hooks = CorruptOnce(src="0", dst="1", offset=3, mask=0x10)
        extra = {} if direct_min is None else {"direct_min": direct_min}
        try:
            execute(messages, local[dev], dev, ranks, held, needed, timeout=30,
                    hooks=hooks, **extra)
            out[name] = None
        except EtcslurmError as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        groups.teardown()
    # 3. a peer that never sends: the receiver's wait ends with a clear error
    groups.configure(ctx.store, gen, me, n, "gloo", timeout=30)
    gen += 1
    lonely = [SynthMessage(0, "0", "1", tuple(needed_pieces(0, 1, n)))] if me == 1 else []
    held, needed = _holdings(me, n)
    t0 = time.perf_counter()
    try:
        execute(lonely, [], dev, ranks, held, needed, timeout=float(ctx.config.get("wait", 3)))
        out["timeout_error"] = None
    except EtcslurmError as exc:
        out["timeout_error"] = f"{type(exc).__name__}: {exc}"
    out["timeout_seconds"] = time.perf_counter() - t0
    if me != 1:  # stay connected until the receiver's wait has run out
        time.sleep(float(ctx.config.get("wait", 3)) + 2)
    groups.abort()
    # the same processes still form a new world and migrate correctly afterwards
    groups.configure(ctx.store, gen, me, n, "gloo", timeout=30)
    held, needed = _holdings(me, n)
    execute(messages, local[dev], dev, ranks, held, needed, timeout=30)
    out["exact_after_abort"] = _check(needed)
    groups.teardown()
    # 4. on bare exchange groups (no default world, as the benchmark runs it) with an arena
    #    the caller keeps: exact every time, the caller's arena is the one packed into,
    #    and closing each group leaks nothing
    arena = torch.empty(cap, dtype=torch.uint8)
    for i in range(5):
        arena.zero_()
        xg = groups.exchange_group(ctx.store, f"selftest{i}", me, n, "gloo", timeout=30)
        held, needed = _holdings(me, n)
        execute(messages, local[dev], dev, ranks, held, needed, timeout=30, group=xg,
                arena=arena)
        out.setdefault("exchange_exact", []).append(_check(needed))
        out.setdefault("exchange_arena_used", []).append(bool(arena.any()))
        groups.close_exchange_group(xg, now=True)  # measured at once: not retired
        out.setdefault("exchange_usage", []).append(groups.resource_usage())
    return out


def receive_memory(ctx: WorkerContext) -> dict[str, Any]:
    """Gloo throughput by receive memory: resident (touched before) vs freshly allocated,
    one pair (0 -> 1) vs two pairs at once (0 -> 1, 2 -> 3); best of ``repeat`` each.

    Why: the migration's exchange receives into memory allocated for it, and every page
    of that memory faults (and is zeroed) inside the socket copy.
    """
    me, n = ctx.index, ctx.nprocs
    nbytes = int(ctx.config.get("mbytes", 512)) << 20
    groups.configure(ctx.store, int(ctx.config.get("generation", 0)), me, n, timeout=120)
    send = torch.ones(nbytes, dtype=torch.uint8)
    resident = torch.ones(nbytes, dtype=torch.uint8)
    out: dict[str, Any] = {}
    for pairs_name, pairs in (("one pair", [(0, 1)]), ("two pairs", [(0, 1), (2, 3)])):
        for memory in ("resident", "fresh"):
            best = float("inf")
            for _ in range(int(ctx.config.get("repeat", 3))):
                target = torch.empty(nbytes, dtype=torch.uint8) if memory == "fresh" else resident
                ops = [dist.P2POp(dist.isend, send, d) for s, d in pairs if s == me]
                ops += [dist.P2POp(dist.irecv, target, s) for s, d in pairs if d == me]
                dist.barrier()
                t0 = time.perf_counter()
                for work in dist.batch_isend_irecv(ops) if ops else []:
                    work.wait()
                dist.barrier()
                best = min(best, time.perf_counter() - t0)
                del target
            out[f"{pairs_name}, {memory}"] = {"seconds": best,
                                              "gbps": len(pairs) * nbytes / best / 1e9}
    groups.teardown()
    return out
