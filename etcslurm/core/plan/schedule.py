"""How the slices travel: one coalesced message per (src, dst) pair, split under the
staging cap, each given a round in which its sender sends and its receiver receives
nothing else.

Why rounds: a device then stages at most one outgoing and one incoming message at a time
(:func:`message_cap`), and the rounds are the devices' only sync points, so the exchange
takes about as long as its rounds' largest messages in sequence.
"""

from __future__ import annotations

import bisect
from itertools import accumulate, pairwise
from typing import NamedTuple

import numpy as np

from etcslurm.core.plan.inputs import Devices
from etcslurm.core.plan.output import Message
from etcslurm.core.plan.sources import Routes
from etcslurm.core.state import Piece

_new_tuple = tuple.__new__

#: ``(src, dst, slices, bytes)`` of one message before it has a round (devices as ints)
Chunk = tuple[int, int, list[Piece], int]


def message_cap(staging_bytes: int) -> int:
    """The largest message (payload bytes) to plan for a device's staging memory of
    ``staging_bytes``.

    Why half, less 1/32: a device sends at most one and receives at most one message per
    round (:func:`first_fit`), and the executor's buffers add alignment and checksum words
    (one 8-byte word per message and per segment of at least 1 MiB: far under 1/32).
    """
    return max(1, staging_bytes // 2 - staging_bytes // 32)


class Schedule(NamedTuple):
    """The result of :func:`schedule`: the messages in ``(round, src, dst)`` order, and
    per message in placing order its round, sender, receiver (device ints) and bytes."""

    messages: list[Message]
    round: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    size: np.ndarray


def schedule(routes: Routes, devices: Devices, cap: int) -> Schedule:
    """:func:`coalesce` the routes under ``cap``, place them in rounds (:func:`first_fit`,
    leavers' messages first), and name the devices."""
    names = devices.names
    placed = first_fit(coalesce(routes, len(names), cap),
                       {devices.id[d] for d in devices.leaving}, len(names))
    n = len(placed)
    rnd = np.fromiter((rc[0] for rc in placed), dtype=np.int64, count=n)
    src = np.fromiter((rc[1][0] for rc in placed), dtype=np.int64, count=n)
    dst = np.fromiter((rc[1][1] for rc in placed), dtype=np.int64, count=n)
    size = np.fromiter((rc[1][3] for rc in placed), dtype=np.int64, count=n)
    order = np.lexsort((dst, src, rnd)).tolist()  # a device sends once per round
    messages = [_new_tuple(Message, (placed[k][0], names[placed[k][1][0]],
                                     names[placed[k][1][1]], placed[k][1][2], placed[k][1][3]))
                for k in order]
    return Schedule(messages, rnd, src, dst, size)


def coalesce(routes: Routes, n_dev: int, cap: int) -> list[Chunk]:
    """One message per (src, dst) pair, in pair order, its slices in one canonical order;
    a pair over ``cap`` is cut into messages of at most ``cap`` bytes (greedy prefixes;
    slices larger than the cap are split themselves)."""
    chunks: list[Chunk] = []
    pairs, pair_bytes = routes.pairs, routes.pair_bytes
    for pair in sorted(pairs):
        src, dst = divmod(pair, n_dev)
        runs = pairs[pair]
        total = pair_bytes[pair]
        if len(runs) == 1:
            sl, cum, _, start, stop, biggest = runs[0]
            slices = sl[start:stop]
            if total > cap:
                cum = cum[start:stop + 1]
        else:  # several runs (blocks, holder sets), each sorted: one canonical order
            slices, sizes = _merge_runs(runs)
            cum = list(accumulate(sizes, initial=0))
            biggest = max(r[5] for r in runs)
        if total <= cap:  # one message, no slice split (each is at most the total)
            chunks.append((src, dst, slices, total))
        elif biggest <= cap:  # greedy: each message the longest prefix that fits
            n, a = len(slices), 0
            while a < n:
                b = bisect.bisect_right(cum, cum[a] + cap, a + 1, n + 1) - 1
                chunks.append((src, dst, slices[a:b], cum[b] - cum[a]))
                a = b
        else:
            cur: list[Piece] = []
            cur_bytes = 0
            for sl in slices:
                for part in ((sl,) if sl.nbytes <= cap else split_to_cap(sl, cap)):
                    if cur and cur_bytes + part.nbytes > cap:
                        chunks.append((src, dst, cur, cur_bytes))
                        cur, cur_bytes = [], 0
                    cur.append(part)
                    cur_bytes += part.nbytes
            if cur:
                chunks.append((src, dst, cur, cur_bytes))
    return chunks


def first_fit(chunks: list[Chunk], leaving: set[int], n_dev: int) -> list[tuple[int, Chunk]]:
    """Give every message a round: a device sends at most one and receives at most one
    message per round (so its staging stays under the cap), first fit.

    Why this order: placing the largest messages first, each in the earliest round where
    both its sender and its receiver are free, puts independent pairs' big messages side
    by side in the same rounds (a pair's chunks do not queue behind another pair's: DP
    grow by two replicas takes 4 rounds with both pairs at once, where one pair at a time
    took 7).  Leaving devices' messages go first so leavers are done early.
    Deterministic: ties broken by device ints (their key order) and chunk order.
    """
    n = len(chunks)
    src = np.fromiter((c[0] for c in chunks), dtype=np.int64, count=n)
    dst = np.fromiter((c[1] for c in chunks), dtype=np.int64, count=n)
    size = np.fromiter((c[3] for c in chunks), dtype=np.int64, count=n)
    stays = np.fromiter((c[0] not in leaving for c in chunks), dtype=bool, count=n)
    order = np.lexsort((np.arange(n), dst, src, -size, stays)).tolist()
    sending = [0] * n_dev
    receiving = [0] * n_dev
    # busy rounds of each device as bits of an int: the first round free at both ends is
    # the lowest zero bit of (sending | receiving), found in C (a scan per round was
    # O(messages x rounds))
    out = []
    for k in order:
        chunk = chunks[k]
        s, d = chunk[0], chunk[1]
        busy = sending[s] | receiving[d]
        bit = ~busy & (busy + 1)
        sending[s] |= bit
        receiving[d] |= bit
        out.append((bit.bit_length() - 1, chunk))
    return out


def _merge_runs(runs: list[tuple]) -> tuple[list[Piece], list[int]]:
    """The slices of several runs ``(slices, cum, sizes, start, stop, biggest)`` in one
    canonical (sorted) order, with their sizes.  Runs of different blocks rarely
    interleave (a model block's keys against a ZeRO-1 shard's): then they are ordered
    by their first slices and joined, comparing k slices instead of sorting them all."""
    parts = sorted((sl[start], sl[start:stop], sz[start:stop])
                   for sl, _, sz, start, stop, _ in runs)
    if all(a[1][-1] < b[0] for a, b in pairwise(parts)):
        return ([x for _, sl, _ in parts for x in sl], [n for _, _, sz in parts for n in sz])
    both = sorted(zip([x for _, sl, _ in parts for x in sl],
                      [n for _, _, sz in parts for n in sz], strict=True))
    return [x for x, _ in both], [n for _, n in both]


def split_to_cap(p: Piece, cap: int) -> list[Piece]:
    """Split a slice into boxes of at most ``cap`` bytes (rows of the outermost axis that
    has more than one index first); each part stays inside the original slice."""
    if p.nbytes <= cap:
        return [p]
    box = p.box
    axis = next((i for i, (lo, hi) in enumerate(box) if hi - lo > 1), None)
    if axis is None:  # a single element larger than the cap
        return [p]
    lo, hi = box[axis]
    row_bytes = p.nbytes // (hi - lo)
    if row_bytes > cap:
        out = []
        for i in range(lo, hi):
            sub = (*box[:axis], (i, i + 1), *box[axis + 1:])
            out.extend(split_to_cap(Piece(p.key, sub, p.dtype), cap))
        return out
    step = max(1, cap // row_bytes)
    return [Piece(p.key, (*box[:axis], (i, min(hi, i + step)), *box[axis + 1:]), p.dtype)
            for i in range(lo, hi, step)]
