"""The migration planner: old holdings + new needs → who plays which rank, what moves.

Pure and deterministic (no torch.distributed, no clocks in the result except
``stats.plan_seconds``): every rank replays :func:`plan` on the same
:class:`PlanInputs` JSON and gets the same :class:`MigrationPlan`.

Scale comes from *classes*: devices with identical holdings (e.g. all DP replicas of a
(tp, pp) coordinate under plain Adam) are interchangeable, so overlaps are computed per
class pair, factorised by the sets of classes that hold/need each distinct piece, and the
assignment is one :func:`scipy.optimize.linear_sum_assignment` per connected component of
the class overlap graph.

Precondition (true for megatron layouts): within one layout, two distinct pieces of the
same key are disjoint (shards are disjoint, replicas identical).
"""

from __future__ import annotations

import bisect
import gc
import heapq
import json
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from heapq import heappop, heappush, heapreplace
from itertools import accumulate, chain, pairwise
from operator import itemgetter
from typing import NamedTuple

import numpy as np
from scipy.optimize import linear_sum_assignment
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from etcslurm.core.gpt_state import DEFAULT_VOCAB_PAD_TP
from etcslurm.core.state import (
    DTYPE_BYTES,
    Box,
    Piece,
    dtype_bytes,
    locate,
)
from etcslurm.core.state import (
    box_intersect_same_rank as _intersect,
)
from etcslurm.errors import UsageError

__all__ = ["Message", "MigrationPlan", "PlanInputs", "locate", "plan", "plan_for_gpt"]

Slice = Piece


# --------------------------------------------------------------------------- inputs
@dataclass
class PlanInputs:
    """Everything the plan depends on (what the coordinator publishes).

    Holdings come as *blocks* of pieces and classes made of blocks (devices of one class
    hold identical state), e.g. from :func:`etcslurm.core.gpt_state.expand`.  Passing
    ``old_classes``/``new_classes`` (lists of pieces) instead makes every class one block.
    """

    old_device_class: dict[str, int] = field(default_factory=dict)  # old device → class
    new_rank_class: list[int] = field(default_factory=list)  # new rank → class
    nodes: dict[str, str] = field(default_factory=dict)  # every device → node name
    leaving: list[str] = field(default_factory=list)
    joiners: list[str] = field(default_factory=list)
    staging_bytes: int = 512 * 2**20
    tp: int = 1  # new TP size (for the TP-groups-split statistic)
    old_blocks: list[list[Piece]] | None = None
    old_class_blocks: list[list[int]] | None = None
    new_blocks: list[list[Piece]] | None = None
    new_class_blocks: list[list[int]] | None = None
    old_classes: list[list[Piece]] | None = None
    new_classes: list[list[Piece]] | None = None

    def __post_init__(self) -> None:
        if self.old_blocks is None:
            if self.old_classes is None:
                raise UsageError("PlanInputs needs old_blocks+old_class_blocks or old_classes")
            self.old_blocks = [list(c) for c in self.old_classes]
            self.old_class_blocks = [[i] for i in range(len(self.old_blocks))]
        if self.new_blocks is None:
            if self.new_classes is None:
                raise UsageError("PlanInputs needs new_blocks+new_class_blocks or new_classes")
            self.new_blocks = [list(c) for c in self.new_classes]
            self.new_class_blocks = [[i] for i in range(len(self.new_blocks))]
        self.old_classes = self.new_classes = None  # blocks are the one representation

    def old_pieces(self, cls: int) -> list[Piece]:
        """Pieces of old class ``cls``."""
        return [p for b in self.old_class_blocks[cls] for p in self.old_blocks[b]]

    def new_pieces(self, cls: int) -> list[Piece]:
        """Pieces of new class ``cls``."""
        return [p for b in self.new_class_blocks[cls] for p in self.new_blocks[b]]

    def validate(self) -> None:
        for d in self.leaving:
            if d not in self.old_device_class:
                raise UsageError(f"leaving device {d!r} is not an old device")
        for d in self.joiners:
            if d in self.old_device_class:
                raise UsageError(f"joiner {d!r} is also an old device")
        avail = len(self.old_device_class) - len(set(self.leaving)) + len(self.joiners)
        if avail < len(self.new_rank_class):
            raise UsageError(
                f"the new layout needs {len(self.new_rank_class)} devices but only {avail} "
                f"remain ({len(self.old_device_class)} old - {len(set(self.leaving))} leaving "
                f"+ {len(self.joiners)} joining)"
            )
        if self.staging_bytes < 1:
            raise UsageError("staging cap must be positive")
        for d in (*self.old_device_class, *self.joiners):
            if d not in self.nodes:
                raise UsageError(f"no node given for device {d!r}")

    def to_json(self) -> dict:
        return {
            "old_blocks": [[p.to_json() for p in c] for c in self.old_blocks],
            "old_class_blocks": self.old_class_blocks,
            "old_device_class": self.old_device_class,
            "new_blocks": [[p.to_json() for p in c] for c in self.new_blocks],
            "new_class_blocks": self.new_class_blocks,
            "new_rank_class": list(self.new_rank_class),
            "nodes": self.nodes,
            "leaving": list(self.leaving),
            "joiners": list(self.joiners),
            "staging_bytes": self.staging_bytes,
            "tp": self.tp,
        }

    @classmethod
    def from_json(cls, d: dict) -> PlanInputs:
        def pieces(key: str) -> list[list[Piece]] | None:
            return None if key not in d else [[Piece.from_json(p) for p in c] for c in d[key]]

        def ints(key: str) -> list[list[int]] | None:
            return None if key not in d else [[int(x) for x in c] for c in d[key]]

        return cls(
            old_device_class={k: int(v) for k, v in d["old_device_class"].items()},
            new_rank_class=[int(x) for x in d["new_rank_class"]],
            nodes=dict(d["nodes"]),
            leaving=list(d["leaving"]),
            joiners=list(d["joiners"]),
            staging_bytes=int(d["staging_bytes"]),
            tp=int(d.get("tp", 1)),
            old_blocks=pieces("old_blocks"),
            old_class_blocks=ints("old_class_blocks"),
            new_blocks=pieces("new_blocks"),
            new_class_blocks=ints("new_class_blocks"),
            old_classes=pieces("old_classes"),
            new_classes=pieces("new_classes"),
        )


# --------------------------------------------------------------------------- output
class Message(NamedTuple):
    """One coalesced transfer ``src → dst`` in ``round``; slices in canonical order.

    A named tuple: a plan at 8k devices has tens of thousands of them."""

    round: int
    src: str
    dst: str
    slices: list[Slice]
    nbytes: int

    def to_json(self) -> dict:
        return {"round": self.round, "src": self.src, "dst": self.dst,
                "slices": [s.to_json() for s in self.slices], "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, d: dict) -> Message:
        return cls(d["round"], d["src"], d["dst"], [Piece.from_json(s) for s in d["slices"]],
                   d["nbytes"])


@dataclass
class MigrationPlan:
    """``assignment[new_rank] = device``; messages; local copies; missing pieces; stats."""

    assignment: list[str]
    messages: list[Message]
    local: dict[str, list[Slice]]
    missing: dict[str, list[Slice]]  # destination device → pieces nobody holds
    idle: list[str]
    stats: dict

    def to_json(self) -> dict:
        return {
            "assignment": self.assignment,
            "messages": [m.to_json() for m in self.messages],
            "local": {d: [s.to_json() for s in v] for d, v in self.local.items()},
            "missing": {d: [s.to_json() for s in v] for d, v in self.missing.items()},
            "idle": self.idle,
            "stats": self.stats,
        }

    def dumps(self, with_time: bool = True) -> str:
        d = self.to_json()
        if not with_time:
            d["stats"] = {k: v for k, v in d["stats"].items() if k != "plan_seconds"}
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, d: dict) -> MigrationPlan:
        return cls(
            assignment=list(d["assignment"]),
            messages=[Message.from_json(m) for m in d["messages"]],
            local={k: [Piece.from_json(s) for s in v] for k, v in d["local"].items()},
            missing={k: [Piece.from_json(s) for s in v] for k, v in d["missing"].items()},
            idle=list(d["idle"]),
            stats=dict(d["stats"]),
        )

    def messages_for(self, device: str) -> tuple[list[Message], list[Message]]:
        """(sends, receives) of one device, in round order."""
        sends = [m for m in self.messages if m.src == device]
        recvs = [m for m in self.messages if m.dst == device]
        return sends, recvs


def message_cap(staging_bytes: int) -> int:
    """The largest message (payload bytes) to plan for a device's staging memory of
    ``staging_bytes``.

    Why half, less 1/32: a device sends at most one and receives at most one message per
    round (:func:`_schedule`), and the executor's buffers add alignment and checksum words
    (one 8-byte word per message and per segment of at least 1 MiB: far under 1/32).
    """
    return max(1, staging_bytes // 2 - staging_bytes // 32)


def _dev_key(d: str) -> tuple[int, int]:
    """Old ranks numerically, then joiners numerically (deterministic device order)."""
    if d.startswith("join:"):
        return (1, int(d[5:]))
    return (0, int(d))


def _meets(a: Box, b: Box) -> bool:
    """Whether two boxes of the same rank share an element (:func:`box_intersect` is not None)."""
    for (alo, ahi), (blo, bhi) in zip(a, b, strict=False):  # noqa: SIM110 (faster than all())
        if alo >= bhi or blo >= ahi:
            return False
    return True


def _common_numel(a: Box, b: Box) -> int:
    """Elements two boxes of the same rank share (``box_numel(box_intersect(a, b))``)."""
    n = 1
    for (alo, ahi), (blo, bhi) in zip(a, b, strict=False):
        lo = alo if alo > blo else blo
        hi = ahi if ahi < bhi else bhi
        if lo >= hi:
            return 0
        n *= hi - lo
    return n


_new_tuple = tuple.__new__
_key_of = itemgetter(0)
_box_of = itemgetter(1)
_dtype_of = itemgetter(2)


def _coords(pieces: list[Piece], rank: int) -> np.ndarray:
    """The boxes of ``pieces`` (all of ``rank`` axes) as an ``(n, rank, 2)`` array, read
    in C (chained iterators), not one Python step per coordinate."""
    n = len(pieces)
    flat = chain.from_iterable(chain.from_iterable(map(_box_of, pieces)))
    return np.fromiter(flat, dtype=np.int64, count=2 * rank * n).reshape(n, rank, 2)


def _piece(key: str, box: Box, dtype: str) -> Piece:
    """``Piece(key, box, dtype)`` without the named tuple's Python-level ``__new__``: the
    planner makes ~10^6 of them."""
    return _new_tuple(Piece, (key, box, dtype))


def _subtract_inside(a: Box, inter: Box) -> list[Box]:
    """``box_subtract(a, b)`` given ``inter = box_intersect(a, b)`` (not None): the same
    boxes in the same order, without intersecting again."""
    out: list[Box] = []
    rest = list(a)
    for d, ((lo, hi), (ilo, ihi)) in enumerate(zip(a, inter, strict=True)):
        if lo < ilo:
            out.append((*rest[:d], (lo, ilo), *rest[d + 1:]))
        if ihi < hi:
            out.append((*rest[:d], (ihi, hi), *rest[d + 1:]))
        rest[d] = (ilo, ihi)
    return out


# --------------------------------------------------------------------------- index
class _Index:
    """Distinct pieces of one layout, the set of blocks holding each, and their boxes as
    arrays (per rank: the pieces of each key, for finding the pieces a box meets).

    Why columns and C-level idioms (dict.setdefault in a comprehension, map, numpy): at
    8k devices with ZeRO-1 shards this sees ~70 000 pieces a side, and a Python step per
    piece per property (hash, size, box) was a quarter of the planner's time.
    """

    def __init__(self, blocks: list[list[Piece]], class_blocks: list[list[int]]):
        flat = list(chain.from_iterable(blocks))
        #: distinct pieces, in order of first appearance, and their ids
        self.id: dict[Piece, int] = {}
        setdefault = self.id.setdefault
        ids = self.id
        member = [setdefault(p, len(ids)) for p in flat]  # one hash per piece of a block
        self.pieces: list[Piece] = list(self.id)
        n = len(self.pieces)
        sizes = list(map(len, blocks))
        ends = list(accumulate(sizes))
        #: the distinct pieces of each block, as ids
        self.block_members: list[list[int]] = [member[e - k:e] for e, k in
                                               zip(ends, sizes, strict=True)]
        # columns: key id, rank, element size, boxes per rank
        self.key_id: dict[str, int] = {}
        kset = self.key_id.setdefault
        kid = np.asarray([kset(k, len(self.key_id)) for k in map(_key_of, self.pieces)],
                         dtype=np.int64)
        self.kid = kid
        dtypes = set(map(_dtype_of, self.pieces))
        for dt in dtypes:
            dtype_bytes(dt)  # an unknown dtype: one clear error
        width = np.fromiter(map(DTYPE_BYTES.__getitem__, map(_dtype_of, self.pieces)),
                            dtype=np.int64, count=n)
        self.width = width  # element size of each distinct piece
        rank = np.fromiter(map(len, map(_box_of, self.pieces)), dtype=np.int64, count=n)
        numel = np.ones(n, dtype=np.int64)
        #: rank → (ids of the pieces of that rank, their boxes (m, rank, 2))
        self.boxes: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for r in np.unique(rank).tolist():
            rows = np.flatnonzero(rank == r)
            box = _coords([self.pieces[i] for i in rows.tolist()], r)
            self.boxes[r] = (rows, box)
            if r:
                numel[rows] = np.prod(box[:, :, 1] - box[:, :, 0], axis=1)
        piece_bytes = numel * width
        self.piece_bytes: list[int] = piece_bytes.tolist()
        member_arr = np.asarray(member, dtype=np.int64)
        running = np.concatenate(([0], np.cumsum(piece_bytes[member_arr])))
        end_arr = np.asarray(ends, dtype=np.int64)
        self.block_bytes: list[int] = (running[end_arr] - running[end_arr - np.asarray(
            sizes, dtype=np.int64)]).tolist() if blocks else []
        #: the keys each block holds pieces of
        self.block_keys: list[frozenset[str]] = [frozenset(map(_key_of, b)) for b in blocks]
        # the blocks holding each distinct piece: one for most; sorted, without repeats
        owner = np.repeat(np.arange(len(blocks), dtype=np.int64), sizes)
        count = np.bincount(member_arr, minlength=n)
        by_piece = np.argsort(member_arr, kind="stable")  # by piece, blocks ascending
        first = np.concatenate(([0], np.cumsum(count)[:-1])).astype(np.int64)
        single = [(b,) for b in range(len(blocks))]
        holders: list[tuple[int, ...]] = [single[b] for b in
                                          owner[by_piece[first]].tolist()] if n else []
        owners = owner[by_piece]
        for i in np.flatnonzero(count > 1).tolist():
            holders[i] = tuple(sorted(set(owners[first[i]:first[i] + count[i]].tolist())))
        # holder block sets, interned in order of first appearance
        self.set_id: dict[tuple[int, ...], int] = {}
        sset = self.set_id.setdefault
        self.piece_set: list[int] = [sset(t, len(self.set_id)) for t in holders]
        self.sets: list[tuple[int, ...]] = list(self.set_id)
        # classes of each block, sets of each block and class
        self.classes_of_block: list[list[int]] = [[] for _ in blocks]
        for c, bl in enumerate(class_blocks):
            for blk in bl:
                self.classes_of_block[blk].append(c)
        sets_of_block: list[list[int]] = [[] for _ in blocks]
        for s, members in enumerate(self.sets):
            for blk in members:
                sets_of_block[blk].append(s)
        self.sets_of_class: list[list[int]] = [
            sorted({s for blk in bl for s in sets_of_block[blk]}) for bl in class_blocks
        ]
        self.class_bytes = [sum(self.block_bytes[blk] for blk in bl) for bl in class_blocks]
        self._cos: dict[int, list[int]] = {}
        self._tables: dict[tuple[int, int], list[tuple]] = {}
        self._by_key: dict[int, dict[int, np.ndarray]] = {}

    def classes_of_set(self, s: int) -> list[int]:
        hit = self._cos.get(s)
        if hit is None:
            hit = self._cos[s] = sorted(
                {c for blk in self.sets[s] for c in self.classes_of_block[blk]})
        return hit

    def rows_by_key(self, rank: int) -> dict[int, np.ndarray]:
        """Positions in ``boxes[rank]`` of each key's pieces (key id → positions)."""
        hit = self._by_key.get(rank)
        if hit is None:
            rows = self.boxes[rank][0] if rank in self.boxes else np.zeros(0, np.int64)
            kid = self.kid[rows]
            order = np.argsort(kid, kind="stable")
            cuts = np.flatnonzero(np.diff(kid[order])) + 1
            hit = {int(kid[g[0]]): g for g in np.split(order, cuts) if len(g)}
            self._by_key[rank] = hit
        return hit

    def tables(self, key: str, rank: int) -> list[tuple]:
        """The pieces of ``key`` with ``rank`` axes as arrays, for :func:`_cover_group`:
        a list of ``(ids, lo, hi, sort keys, widest, span)``, each sorted by its keys.

        Why not one table sorted by axis 0: axis 0 of a layer-stacked tensor is the layer
        (one index wide), so a window on it holds every piece of the layer -- ~60 per
        query at 8k devices with ZeRO-1 shards, 3 million candidates.  When every piece
        is one index wide on axis 0, the key is ``lo0 * span + lo1`` instead (a window on
        axis 1 within the layer), and pieces one row high (a shard's partial rows) are
        apart from the taller ones, so each table's window is as wide as its own widest
        piece on axis 1 (``span = 0``: keyed by axis 0 alone).
        """
        k = self.key_id.get(key)
        if k is None:
            return []
        hit = self._tables.get((k, rank))
        if hit is None:
            pos = self.rows_by_key(rank).get(k)
            if pos is None:
                hit = []
            else:
                rows, box = self.boxes[rank]
                hit = _tables(rows[pos], box[pos, :, 0], box[pos, :, 1], rank)
            self._tables[(k, rank)] = hit
        return hit


def _tables(ids: np.ndarray, lo: np.ndarray, hi: np.ndarray, rank: int) -> list[tuple]:
    """:meth:`_Index.tables` from the arrays of one (key, rank)."""
    if rank == 0:
        return [(ids, lo, hi, None, 0, 0)]
    width = hi - lo
    if rank == 1 or int(width[:, 0].max()) != 1:
        order = np.argsort(lo[:, 0], kind="stable")
        return [(ids[order], lo[order], hi[order], lo[order, 0], int(width[:, 0].max()), 0)]
    span = int(hi[:, 1].max()) + 1
    out = []
    thin = width[:, 1] == 1
    for sel in (thin, ~thin):
        if not sel.any():
            continue
        keys = lo[sel, 0] * span + lo[sel, 1]
        order = np.argsort(keys, kind="stable")
        out.append((ids[sel][order], lo[sel][order], hi[sel][order], keys[order],
                    int(width[sel, 1].max()), span))
    return out


# --------------------------------------------------------------------------- planner
def _components(old: _Index, new: _Index, terms: dict[tuple[int, int], int],
                n_oc: int) -> list[int]:
    """Each class's component, named by its smallest member (old class ``c`` is node
    ``c``, new class ``c`` node ``n_oc + c``): the classes of one holder set, of one needer
    set, and a holder set's with a needer set's where they share bytes, are connected.

    Why scipy's ``connected_components``, not union-find: with the distributed optimizer
    every device is a class, and ~50 000 Python-level unions were 5 % of the plan at 8k
    devices.  Named by the smallest member, as union-find with the smaller root winning
    named them, so components are visited in the same order.
    """
    n = n_oc + len(new.sets_of_class)
    live = [k for k, b in terms.items() if b > 0]
    head = [-1] * (len(old.sets) + len(new.sets))  # a set's first class as a node, or -1
    src: list[int] = []
    dst: list[int] = []
    for s_ in {so for so, _ in live}:
        cls = old.classes_of_set(s_)
        if cls:
            head[s_] = cls[0]
            src.extend(cls[1:])
            dst.extend([cls[0]] * (len(cls) - 1))
    shift = len(old.sets)
    for s_ in {sn for _, sn in live}:
        cls = new.classes_of_set(s_)
        if cls:
            head[shift + s_] = n_oc + cls[0]
            src.extend(n_oc + c for c in cls[1:])
            dst.extend([n_oc + cls[0]] * (len(cls) - 1))
    heads = np.asarray(head, dtype=np.int64)
    a = heads[np.fromiter((so for so, _ in live), dtype=np.int64, count=len(live))]
    b = heads[shift + np.fromiter((sn for _, sn in live), dtype=np.int64, count=len(live))]
    both = (a >= 0) & (b >= 0)
    rows = np.concatenate((np.asarray(src, dtype=np.int64), a[both]))
    cols = np.concatenate((np.asarray(dst, dtype=np.int64), b[both]))
    graph = coo_matrix((np.ones(len(rows), dtype=np.int8), (rows, cols)), shape=(n, n))
    _, label = connected_components(graph, directed=False)
    smallest = np.full(label.max() + 1 if n else 0, n, dtype=np.int64)
    np.minimum.at(smallest, label, np.arange(n, dtype=np.int64))
    return smallest[label].tolist()


class _UnionFind:
    """Disjoint sets of ``0..n-1`` (path halving; the smaller root wins: deterministic)."""

    __slots__ = ("parent",)

    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def plan(inputs: PlanInputs, assignment: list[str] | None = None, *,
         for_device: str | None = None) -> MigrationPlan:
    """Compute the migration plan (see module docstring).

    ``assignment`` (new rank → device), when given, replaces step (a): the runtime plans
    from the live state after the new world is built, so the assignment the decider
    published is fixed by then; sources, messages and rounds are planned for it.

    ``for_device``: plan only the part of the move ``device`` takes part in (a rank needs
    no more).  The class overlap graph's components are independent parts: a holder's
    send load and its rounds' send slot are spent only on receivers in its old class's
    component, a receiver's receive slot only on messages of its new class's component.
    So the messages with ``for_device`` at either end (rounds included), its local copies
    and its missing pieces are exactly the whole plan's; sources, messages and rounds are
    computed for those two components only.  ``stats["part"]`` is True and the stats that
    come from sources and rounds (messages, rounds, send/receive maxima, staging,
    inter-node bytes) describe that part; the assignment is the whole one.  Without an
    assignment (the decider: the assignment needs the whole state) the byte totals
    (moved, local, missing, the bounds) are still the whole move's, from the overlap
    terms; with one, the state outside the part is not even indexed
    (:func:`_device_part`) and the totals are the part's too.
    """
    if assignment is not None:
        _check_assignment(inputs, assignment)
    if for_device is not None and not (for_device in inputs.old_device_class
                                       or for_device in inputs.joiners):
        raise UsageError(f"for_device {for_device!r} is neither an old device nor a joiner")
    t0 = time.perf_counter()
    # Why no garbage collector: planning allocates millions of small tuples and pieces and
    # frees almost none of them before it returns, so every generation-2 pass walks the
    # whole growing heap for nothing (~40 % of the time at 8k devices).  The planner builds
    # no reference cycles; collection resumes on return.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        if for_device is not None and assignment is not None:
            inputs = _device_part(inputs, assignment, for_device)
        return _plan(inputs, assignment, t0, for_device)
    finally:
        if was_enabled:
            gc.enable()


def _plan(inputs: PlanInputs, assignment: list[str] | None, t0: float,
          for_device: str | None) -> MigrationPlan:
    """:func:`plan` with the garbage collector off (``t0``: when the clock started)."""
    inputs.validate()
    old = _Index(inputs.old_blocks, inputs.old_class_blocks)
    new = _Index(inputs.new_blocks, inputs.new_class_blocks)
    leaving = set(inputs.leaving)
    dev_key = {d: _dev_key(d) for d in (*inputs.old_device_class, *inputs.joiners)}
    old_devices = sorted(inputs.old_device_class, key=dev_key.__getitem__)
    available = [d for d in old_devices if d not in leaving] + sorted(inputs.joiners, key=_dev_key)
    n_new = len(inputs.new_rank_class)
    n_oc, n_nc = len(inputs.old_class_blocks), len(inputs.new_class_blocks)

    # ---- what each distinct new piece is made of (see _cover), then the factorised
    # overlap: (old holder set, new needer set) → bytes
    made_of, uncovered, terms = _cover(old, new)
    piece_set = old.piece_set
    terms_by_old: dict[int, dict[int, int]] = defaultdict(dict)
    for (so, sn), b in terms.items():
        terms_by_old[so][sn] = b

    def overlap(oc: int | None, nc: int) -> int:
        if oc is None:
            return 0
        total = 0
        for so in old.sets_of_class[oc]:
            row = terms_by_old.get(so)
            if row:
                for sn in new.sets_of_class[nc]:
                    total += row.get(sn, 0)
        return total

    # ---- components of the class overlap graph (old classes 0..n_oc-1, then new ones)
    find = _components(old, new, terms, n_oc).__getitem__

    comp_devices: dict[int, list[str]] = defaultdict(list)
    for d in available:
        c = inputs.old_device_class.get(d)
        if c is not None:
            comp_devices[find(c)].append(d)
    comp_ranks: dict[int, list[int]] = defaultdict(list)
    for r, nc in enumerate(inputs.new_rank_class):
        comp_ranks[find(n_oc + nc)].append(r)

    # ---- assignment per component (maximise bytes in place)
    given = assignment
    assignment: list[str | None] = [None] * n_new
    used: set[str] = set()
    optimal_overlap = 0
    gains = _Gains(old, new, terms, find) if given is None else None
    for comp in sorted(comp_ranks) if gains is not None else ():
        ranks = comp_ranks[comp]
        devs = comp_devices.get(comp, [])
        if not devs:
            continue
        d_cls = sorted({inputs.old_device_class[d] for d in devs})
        r_cls = sorted({inputs.new_rank_class[r] for r in ranks})
        ri = {c: k for k, c in enumerate(r_cls)}
        w = gains.matrix(comp, d_cls, r_cls)
        di = {c: k for k, c in enumerate(d_cls)}
        pairs_ab = _assign(w, [di[inputs.old_device_class[d]] for d in devs],
                           [ri[inputs.new_rank_class[r]] for r in ranks])
        dev_row = [di[inputs.old_device_class[d]] for d in devs]
        rank_col = [ri[inputs.new_rank_class[r]] for r in ranks]
        for a, b in pairs_ab:  # w holds exact integers (see above)
            assignment[ranks[b]] = devs[a]
            used.add(devs[a])
            optimal_overlap += int(w[dev_row[a], rank_col[b]])
    if given is not None:
        assignment = list(given)
        used = set(given)
        optimal_overlap = sum(overlap(inputs.old_device_class.get(d), inputs.new_rank_class[r])
                              for r, d in enumerate(given))
    rest = [d for d in available if d not in used]
    k = 0
    for r in range(n_new):
        if assignment[r] is None:
            assignment[r] = rest[k]
            k += 1
    final: list[str] = [a for a in assignment if a is not None]
    idle = list(rest[k:])

    # ---- naive: new rank i → device "i" when it remains, else the next free device
    naive_overlap = 0
    avail_set = set(available)
    naive_used = {str(r) for r in range(n_new) if str(r) in avail_set}
    spare = iter(d for d in available if d not in naive_used)
    for r in range(n_new):
        d = str(r) if str(r) in avail_set else next(spare)
        naive_overlap += overlap(inputs.old_device_class.get(d), inputs.new_rank_class[r])

    # ---- sources
    # devices as ints in device-key order from here on: ties "to the lowest device key"
    # become ties to the lowest int, and a (src, dst) pair is one int ``src * n_dev + dst``
    # whose order is the (src, dst) device-key order
    names = sorted(dev_key, key=dev_key.__getitem__)
    did = {d: k for k, d in enumerate(names)}
    n_dev = len(names)
    node_id: dict[str, int] = {}
    node_of = [node_id.setdefault(inputs.nodes[d], len(node_id)) for d in names]
    devices_of_class: dict[int, list[int]] = defaultdict(list)
    for d in old_devices:
        devices_of_class[inputs.old_device_class[d]].append(did[d])
    cand_cache: dict[int, list[int]] = {}

    def candidates(s: int) -> list[int]:
        hit = cand_cache.get(s)
        if hit is None:
            hit = sorted(d for c in old.classes_of_set(s) for d in devices_of_class[c])
            cand_cache[s] = hit
        return hit

    frag_cache: dict[tuple, tuple] = {}
    old_sets, new_members = old.sets, new.block_members

    def fragments(held_blocks: tuple[int, ...], nb: int):
        """What a device holding ``held_blocks`` does for new block ``nb``: (local slices,
        their bytes, remote runs, missing slices, their bytes).  A remote *run* is
        ``(holder set, its live holders, slices, prefix byte sums)``: the slices that set
        holds, in piece order (runs in holder-set order)."""
        nkeys = new.block_keys[nb]
        rel = tuple(b for b in held_blocks if not old.block_keys[b].isdisjoint(nkeys))
        key = (rel, nb)
        hit = frag_cache.get(key)
        if hit is not None:
            return hit
        rel_set = set(rel)
        held_here: dict[int, bool] = {}  # holder set → whether one of ``rel`` is in it
        local: list[Piece] = []
        remote: dict[int, list[tuple[Piece, int]]] = defaultdict(list)
        missing: list[Piece] = []
        local_bytes = 0
        for j in new_members[nb]:
            for i, frag, n in made_of[j]:
                s = piece_set[i]
                here = held_here.get(s)
                if here is None:
                    here = held_here[s] = not rel_set.isdisjoint(old_sets[s])
                if here:
                    local.append(frag)
                    local_bytes += n
                else:
                    remote[s].append((frag, n))
            gap = uncovered.get(j)
            if gap:
                missing.extend(gap)
        runs = []
        for s in sorted(remote):
            pairs_ = remote[s]
            pairs_.sort()
            sl = [x for x, _ in pairs_]
            sizes = [n for _, n in pairs_]
            runs.append((s, candidates(s), sl, list(accumulate(sizes, initial=0)), sizes,
                         max(sizes)))
        hit = (local, local_bytes, runs, missing, sum([x.nbytes for x in missing]))
        frag_cache[key] = hit
        return hit

    picker = _SourcePicker(node_of, n_dev, inputs.staging_bytes)
    load = picker.load
    take = picker.take
    # (src * n_dev + dst) → runs (slices, start, stop) it carries, and their bytes
    pairs: dict[int, list[tuple[list[Piece], list[int], list[int], int, int, int]]] = {}
    pair_bytes: dict[int, int] = {}
    local_out: dict[str, list[Piece]] = {}
    missing_out: dict[str, list[Piece]] = {}
    local_bytes = missing_bytes = 0
    planned: set[int] | None = None  # the new classes whose ranks are planned (None: all)
    if for_device is not None:
        roots = set()
        if for_device in inputs.old_device_class:
            roots.add(find(inputs.old_device_class[for_device]))
        if for_device in final:
            roots.add(find(n_oc + inputs.new_rank_class[final.index(for_device)]))
        planned = {c for c in range(n_nc) if find(n_oc + c) in roots}
    for r in range(n_new):
        d = final[r]
        nc = inputs.new_rank_class[r]
        if planned is not None and nc not in planned:
            continue
        oc = inputs.old_device_class.get(d)
        held_blocks = tuple(inputs.old_class_blocks[oc]) if oc is not None else ()
        dd = did[d]
        node = node_of[dd]
        prev = -1  # the source of this receiver's previous run (kept while it is fair)
        for nb in inputs.new_class_blocks[nc]:
            loc, lb, runs, miss, mb = fragments(held_blocks, nb)
            if loc:
                local_out.setdefault(d, []).extend(loc)
                local_bytes += lb
            if miss:
                missing_out.setdefault(d, []).extend(miss)
                missing_bytes += mb
            for s, cands, sl, cum, sizes, biggest in runs:
                n = len(sl)
                if len(cands) < 2:
                    if not cands:  # its holders are gone (dead): a checkpoint must supply it
                        missing_out.setdefault(d, []).extend(sl)
                        missing_bytes += cum[n]
                        continue
                    prev = cands[0]
                    spans = ((prev, 0, n),)
                    load[prev] += cum[n]
                else:
                    spans = []
                    start = 0
                    while start < n:
                        prev, stop = take(s, cands, node, prev, cum, start)
                        spans.append((prev, start, stop))
                        start = stop
                for src, start, stop in spans:
                    pair = src * n_dev + dd
                    nbytes = cum[stop] - cum[start]
                    run = (sl, cum, sizes, start, stop, biggest)
                    lst = pairs.get(pair)
                    if lst is None:
                        pairs[pair] = [run]
                        pair_bytes[pair] = nbytes
                    else:
                        lst.append(run)
                        pair_bytes[pair] += nbytes
    need_bytes = sum(new.class_bytes[c] for c in inputs.new_rank_class)

    # ---- coalesce, split under the cap, schedule rounds
    cap = inputs.staging_bytes
    chunks: list[tuple[int, int, list[Piece], int]] = []
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
                for part in ((sl,) if sl.nbytes <= cap else _split_to_cap(sl, cap)):
                    if cur and cur_bytes + part.nbytes > cap:
                        chunks.append((src, dst, cur, cur_bytes))
                        cur, cur_bytes = [], 0
                    cur.append(part)
                    cur_bytes += part.nbytes
            if cur:
                chunks.append((src, dst, cur, cur_bytes))
    placed = _schedule(chunks, {did[d] for d in leaving}, range(n_dev))
    # message order: (round, src, dst) (a device sends once per round)
    rnd_arr = np.fromiter((rc[0] for rc in placed), dtype=np.int64, count=len(placed))
    src_arr = np.fromiter((rc[1][0] for rc in placed), dtype=np.int64, count=len(placed))
    dst_arr = np.fromiter((rc[1][1] for rc in placed), dtype=np.int64, count=len(placed))
    size_arr = np.fromiter((rc[1][3] for rc in placed), dtype=np.int64, count=len(placed))
    order = np.lexsort((dst_arr, src_arr, rnd_arr)).tolist()
    messages = [_new_tuple(Message, (placed[k][0], names[placed[k][1][0]],
                                     names[placed[k][1][1]], placed[k][1][2], placed[k][1][3]))
                for k in order]

    nodes_arr = np.asarray(node_of, dtype=np.int64)
    moved = int(size_arr.sum())
    inter = int(size_arr[nodes_arr[src_arr] != nodes_arr[dst_arr]].sum()) if len(placed) else 0
    sent = np.bincount(src_arr, weights=size_arr, minlength=n_dev) if len(placed) else [0]
    recv = np.bincount(dst_arr, weights=size_arr, minlength=n_dev) if len(placed) else [0]
    peak = int(size_arr.max()) if len(placed) else 0
    rounds = int(rnd_arr.max()) if len(placed) else -1
    if for_device is not None and given is None:
        # the whole state was indexed (the decider): the whole move's byte totals, not the
        # part's -- every needed element is in place, arrives, or is missing
        missing_bytes = _missing_bytes(inputs, old, new, terms)
        local_bytes = optimal_overlap
        moved = need_bytes - optimal_overlap - missing_bytes
    state_bytes = sum(old.class_bytes[c] for c in inputs.old_device_class.values())
    stats = {
        "state_bytes": state_bytes,
        "needed_bytes": need_bytes,
        "moved_bytes": moved,
        "local_bytes": local_bytes,
        "inter_node_bytes": inter,
        "lower_bound_moved_bytes": need_bytes - optimal_overlap - missing_bytes,
        "naive_moved_bytes": need_bytes - naive_overlap - missing_bytes,
        "missing_bytes": missing_bytes,
        "messages": len(messages),
        "rounds": 1 + rounds,
        "max_send_bytes": int(max(sent, default=0)),
        "max_recv_bytes": int(max(recv, default=0)),
        "peak_staging_bytes": peak,
        "tp_groups_split_across_nodes": _tp_split(final, inputs),
        "plan_seconds": round(time.perf_counter() - t0, 6),
    }
    if for_device is not None:
        stats["part"] = True
    return MigrationPlan(final, messages, local_out, missing_out, idle, stats)


def _cover(old: _Index, new: _Index) -> tuple[list[list[tuple[int, Piece, int]]],
                                             dict[int, list[Piece]],
                                             dict[tuple[int, int], int]]:
    """What each distinct new piece is made of: ``made_of[j]`` lists ``(old piece id,
    the part of new piece j it holds, bytes)`` by old id; ``uncovered[j]`` the parts of j
    no old piece holds (absent when there are none); and the overlap summed per
    (old holder set, new needer set).

    Distinct old pieces of one key are disjoint (megatron layouts: shards are disjoint,
    replicas identical), so the part an old piece holds is one box, the intersection,
    and the parts add up to the piece when the old layout holds all of it -- checked by
    elements.  When they do not (rows no old layout had, or old pieces that overlap each
    other, which a described live state could in principle contain) the piece is cut
    exactly instead (:func:`_cut`).

    The boxes that meet are found per (key, rank) with numpy (:func:`_cover_group`).
    Pieces identical to an old one (a layout change keeps most of them) skip all of it.
    """
    pieces, piece_bytes = new.pieces, new.piece_bytes
    sames = list(map(old.id.get, pieces))
    made_of: list[list[tuple[int, Piece, int]]] = [
        [(i, p, n)] if i is not None else []
        for i, p, n in zip(sames, pieces, piece_bytes, strict=True)]
    kept = [j for j, i in enumerate(sames) if i is not None]
    pair_new = [np.asarray(kept, dtype=np.int64)]
    pair_old = [np.asarray([sames[j] for j in kept], dtype=np.int64)]
    pair_bytes = [np.asarray([piece_bytes[j] for j in kept], dtype=np.int64)]
    uncovered: dict[int, list[Piece]] = {}
    recut: list[int] = []
    fresh = np.asarray([i is None for i in sames], dtype=bool)
    key_names = list(new.key_id)
    for rank, (rows, box) in new.boxes.items():
        pos = np.flatnonzero(fresh[rows])  # pieces of this rank no old piece equals
        if not len(pos):
            continue
        kid = new.kid[rows[pos]]
        order = np.argsort(kid, kind="stable")
        for g in np.split(order, np.flatnonzero(np.diff(kid[order])) + 1):
            sel = pos[g]
            js = rows[sel].tolist()
            found = _cover_group(new, js, rank, old.tables(key_names[kid[g[0]]], rank),
                                 made_of, box[sel])
            if found is None:
                recut.extend(js)
                continue
            qj, qi, qb, short = found
            recut.extend(short)
            pair_new.append(qj)
            pair_old.append(qi)
            pair_bytes.append(qb)
    for j in recut:
        parts = made_of[j]
        made_of[j], gap = _cut(pieces[j], old, sorted({i for i, _, _ in parts}))
        if gap:
            uncovered[j] = gap
        pair_new.append(np.full(len(made_of[j]), j, dtype=np.int64))
        pair_old.append(np.asarray([i for i, _, _ in made_of[j]], dtype=np.int64))
        pair_bytes.append(np.asarray([n for _, _, n in made_of[j]], dtype=np.int64))
    # overlap terms, summed exactly (int64) per (old holder set, new needer set)
    so = np.asarray(old.piece_set, dtype=np.int64)[np.concatenate(pair_old)]
    sn = np.asarray(new.piece_set, dtype=np.int64)[np.concatenate(pair_new)]
    nbytes = np.concatenate(pair_bytes)
    width = max(len(new.sets), 1)
    code = so * width + sn
    order = np.argsort(code, kind="stable")
    code, nbytes = code[order], nbytes[order]
    starts = np.flatnonzero(np.concatenate(([True], code[1:] != code[:-1]))) if len(code) \
        else np.zeros(0, dtype=np.int64)
    sums = np.add.reduceat(nbytes, starts) if len(code) else nbytes
    terms = {divmod(c, width): b for c, b in zip(code[starts].tolist(), sums.tolist(),
                                                  strict=True)}
    return made_of, uncovered, terms


def _cover_group(new: _Index, js: list[int], rank: int, tables: list[tuple],
                 made_of: list[list[tuple[int, Piece, int]]], q: np.ndarray,
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]] | None:
    """:func:`_cover` for the new pieces ``js`` of one (key, rank) against the old
    tables of the key (:meth:`_Index.tables`): the candidates in each query's window,
    kept when they meet on every axis (axis 1 first: it rejects most); ``q``: the boxes
    of ``js``, ``(len(js), rank, 2)``.  Fills ``made_of`` and returns the pairs found (new id, old id, bytes) and the queries whose
    parts do not add up to them (to be cut exactly); None when nothing meets."""
    pieces = new.pieces
    if rank == 0:  # scalars: every old one of the key is the same (empty) box
        if not tables:
            return None
        ids = sorted(tables[0][0].tolist())
        qj, qi, qb = [], [], []
        for j in js:
            n = new.piece_bytes[j]
            made_of[j].extend((i, pieces[j], n) for i in ids)
            qj += [j] * len(ids)
            qi += ids
            qb += [n] * len(ids)
        return (np.asarray(qj, dtype=np.int64), np.asarray(qi, dtype=np.int64),
                np.asarray(qb, dtype=np.int64), [j for j in js if len(ids) != 1])
    qlo, qhi = q[:, :, 0], q[:, :, 1]
    found = []
    for ids, olo, ohi, keys, widest, span in tables:
        if span:  # keyed by (axis 0, axis 1); a query wider than one index on axis 0
            # takes every piece of its layers
            one = qhi[:, 0] - qlo[:, 0] == 1
            start = np.where(one, qlo[:, 0] * span + np.maximum(qlo[:, 1] - widest + 1, 0),
                             qlo[:, 0] * span)
            stop = np.where(one, qlo[:, 0] * span + qhi[:, 1], qhi[:, 0] * span)
        else:
            start, stop = qlo[:, 0] - widest + 1, qhi[:, 0]
        first = np.searchsorted(keys, start, "left")
        count = np.maximum(np.searchsorted(keys, stop, "left") - first, 0)
        total = int(count.sum())
        if not total:
            continue
        qi = np.repeat(np.arange(len(js)), count)
        ci = np.arange(total) + np.repeat(first - (np.cumsum(count) - count), count)
        axis = 1 if rank > 1 else 0
        near = (olo[ci, axis] < qhi[qi, axis]) & (qlo[qi, axis] < ohi[ci, axis])
        qi, ci = qi[near], ci[near]
        lo = np.maximum(olo[ci], qlo[qi])
        hi = np.minimum(ohi[ci], qhi[qi])
        meets = (lo < hi).all(axis=1)
        found.append((qi[meets], ids[ci[meets]], lo[meets], hi[meets]))
    if not found:
        return None
    qi, oid, lo, hi = (np.concatenate(x) for x in zip(*found, strict=True))
    order = np.lexsort((oid, qi))
    qi, oid, lo, hi = qi[order], oid[order], lo[order], hi[order]
    numel = np.prod(hi - lo, axis=1)
    # parts that do not add up to their query: cut exactly (by elements: exact in float64)
    covered = np.bincount(qi, weights=numel, minlength=len(js))
    short = np.flatnonzero(covered != np.prod(qhi - qlo, axis=1)).tolist()
    whole = ((lo == qlo[qi]) & (hi == qhi[qi])).all(axis=1)
    js_arr = np.asarray(js, dtype=np.int64)
    nbytes = numel * new.width[js_arr][qi]
    # the parts that are not the whole new piece need their box as tuples: built from one
    # flat row per part (a comprehension, not a numpy call per part)
    cut = ~whole
    boxes = iter(_boxes(np.stack([lo[cut], hi[cut]], axis=2).reshape(-1, 2 * rank).tolist(),
                        rank))
    key = pieces[js[0]][0]
    for x, i, n, w in zip(qi.tolist(), oid.tolist(), nbytes.tolist(), whole.tolist(),
                          strict=True):
        p = pieces[js[x]]
        made_of[js[x]].append((i, p, n) if w else
                              (i, _new_tuple(Piece, (key, next(boxes), p[2])), n))
    if short:
        drop = np.isin(qi, short)
        qi, oid, nbytes = qi[~drop], oid[~drop], nbytes[~drop]
    return js_arr[qi], oid, nbytes, [js[x] for x in short]


def _boxes(rows: list[list[int]], rank: int) -> list[Box]:
    """Boxes from flat ``[lo0, hi0, lo1, hi1, ...]`` rows."""
    if rank == 3:
        return [((a, b), (c, d), (e, f)) for a, b, c, d, e, f in rows]
    if rank == 2:
        return [((a, b), (c, d)) for a, b, c, d in rows]
    return [tuple(zip(r[::2], r[1::2], strict=True)) for r in rows]


def _cut(p: Piece, old: _Index, meeting: list[int]) -> tuple[list[tuple[int, Piece, int]],
                                                                list[Piece]]:
    """``p`` cut by the old pieces ``meeting`` it (ids, sorted), each element to the first
    that holds it: ``(parts as in _cover, the boxes nobody holds)``."""
    pkey, pdt = p.key, p.dtype
    regions: list[Box] = [p.box]
    parts: list[tuple[int, Piece, int]] = []
    for i in meeting:
        hb = old.pieces[i].box
        nxt: list[Box] = []
        for r in regions:
            inter = _intersect(r, hb)
            if inter is None:
                nxt.append(r)
                continue
            frag = _piece(pkey, inter, pdt)
            parts.append((i, frag, frag.nbytes))
            if inter != r:
                nxt.extend(_subtract_inside(r, inter))
        regions = nxt
        if not regions:
            break
    return parts, [_piece(pkey, r, pdt) for r in regions]


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


def _missing_bytes(inputs: PlanInputs, old: _Index, new: _Index,
                   terms: dict[tuple[int, int], int]) -> int:
    """The bytes the new ranks need that no live old device holds, without the sources.

    Distinct old pieces are disjoint, so the overlap terms of the holder sets that have a
    live device count each covered element once.
    """
    live = set(inputs.old_device_class.values())
    covered: dict[int, int] = defaultdict(int)  # needer set → bytes some live device holds
    for (so, sn), b in terms.items():
        if not live.isdisjoint(old.classes_of_set(so)):
            covered[sn] += b
    return sum(new.class_bytes[nc] - sum(covered.get(sn, 0) for sn in new.sets_of_class[nc])
               for nc in inputs.new_rank_class)


def _device_part(inputs: PlanInputs, assignment: list[str], device: str) -> PlanInputs:
    """``inputs`` without the blocks of the plan's parts ``device`` takes no part in.

    Why: a rank's part is a fraction of the state, and building the index and the overlap
    terms of the whole state (all that :func:`_plan` does before it knows the components)
    is most of a rank's planning time at scale.  The parts are found coarsely here, with
    no box overlaps: two pieces can only share elements when they share a key and their
    axis-0 ranges meet, so *cells* (a key and a maximal run of meeting axis-0 ranges of
    either layout) joined by the classes that hold or need them form components that are
    each a union of the planner's own (overlap) components.  Whole blocks of other
    components are dropped (a block belongs to one: its classes all meet its cells); the
    devices, classes and ranks stay, so every tie-break is the whole plan's, and
    :func:`_plan` then narrows to the exact components itself.
    """
    sides = ((inputs.old_blocks, inputs.old_class_blocks),
             (inputs.new_blocks, inputs.new_class_blocks))
    ranges: dict[str, set[tuple[int, int]]] = defaultdict(set)
    block_spans: list[list[set[tuple[str, tuple[int, int]]]]] = []
    for blocks, _ in sides:
        spans = []
        for pieces in blocks:
            span = {(p.key, p.box[0] if p.box else (0, 1)) for p in pieces}
            for key, rng in span:
                ranges[key].add(rng)
            spans.append(span)
        block_spans.append(spans)
    cell_of: dict[tuple[str, tuple[int, int]], int] = {}
    for key in sorted(ranges):
        hi_run = None
        for rng in sorted(ranges[key]):
            if hi_run is None or rng[0] >= hi_run:  # a new run of meeting ranges
                cell = len(cell_of)
                hi_run = rng[1]
            else:
                hi_run = max(hi_run, rng[1])
            cell_of[(key, rng)] = cell
    n_cells = len(cell_of)
    parts = _UnionFind(n_cells + len(inputs.old_class_blocks) + len(inputs.new_class_blocks))
    find, union = parts.find, parts.union

    block_cell: list[list[int | None]] = []
    for spans in block_spans:
        reps: list[int | None] = []
        for span in spans:
            cells = {cell_of[c] for c in span}
            first = min(cells) if cells else None
            for c in cells:
                union(first, c)
            reps.append(first)
        block_cell.append(reps)
    offset = n_cells
    for (_, class_blocks), reps in zip(sides, block_cell, strict=True):
        for c, bl in enumerate(class_blocks):
            for b in bl:
                if reps[b] is not None:
                    union(offset + c, reps[b])
        offset += len(class_blocks)
    mine = set()
    if device in inputs.old_device_class:
        mine.add(find(n_cells + inputs.old_device_class[device]))
    if device in assignment:
        rank = assignment.index(device)
        mine.add(find(n_cells + len(inputs.old_class_blocks) + inputs.new_rank_class[rank]))

    def keep(blocks: list[list[Piece]], reps: list[int | None]) -> list[list[Piece]]:
        return [pieces if r is not None and find(r) in mine else []
                for pieces, r in zip(blocks, reps, strict=True)]

    return PlanInputs(
        old_device_class=inputs.old_device_class, new_rank_class=inputs.new_rank_class,
        nodes=inputs.nodes, leaving=inputs.leaving, joiners=inputs.joiners,
        staging_bytes=inputs.staging_bytes, tp=inputs.tp,
        old_blocks=keep(inputs.old_blocks, block_cell[0]),
        old_class_blocks=inputs.old_class_blocks,
        new_blocks=keep(inputs.new_blocks, block_cell[1]),
        new_class_blocks=inputs.new_class_blocks,
    )


def _check_assignment(inputs: PlanInputs, assignment: list[str]) -> None:
    """A given assignment must place every new rank on a distinct available device."""
    leaving = set(inputs.leaving)
    available = {d for d in inputs.old_device_class if d not in leaving} | set(inputs.joiners)
    if len(assignment) != len(inputs.new_rank_class):
        raise UsageError(f"assignment has {len(assignment)} devices, the new layout "
                         f"{len(inputs.new_rank_class)} ranks")
    bad = [d for d in assignment if d not in available]
    if bad or len(set(assignment)) != len(assignment):
        raise UsageError(f"assignment {assignment} uses unavailable or repeated devices {bad}")


class _SourcePicker:
    """Chooses where each remote slice comes from, a run of slices at a time.

    The rule, per slice (a receiver's slices in its runs' order): its candidates are the
    live holders on the receiver's node, or every live holder when none is on it; the
    *best* is the least loaded (bytes given to send so far; ties to the lowest device);
    the slice goes to the source of the receiver's previous slice when that is a
    candidate whose load is at most the best's plus ``slack``, else to the best.

    Why sticky: choosing the least loaded holder for every slice balances the senders,
    but spreads one receiver's state over every holder (a pipeline stage leaving at 8k
    devices: each receiver got ~120 messages from as many senders, in 314 rounds, since a
    device receives one message per round).  Keeping the previous source while it is
    within one message (``slack``: the message cap) of the best keeps each holder's load
    within a message of the least loaded one, and a receiver's state comes in runs of
    about a message each: as balanced, an order of magnitude fewer messages and rounds.

    Fast: a run of slices with the same holders goes to one source until the load bound
    is crossed, found by bisection in the run's prefix byte sums (``cum``); one lazy heap
    of (load, device) per holder set and per (holder set, node).  Loads only grow, so an
    entry whose load is out of date is too small: it surfaces first and is refreshed in
    place.  ``tests/test_core_planner.py`` checks the whole plan against a slice-by-slice
    linear version of the rule.
    """

    def __init__(self, node_of: list[int], n_dev: int, slack: int):
        self.node_of = node_of
        self.slack = slack
        self.load: list[int] = [0] * n_dev
        self.heaps: dict[tuple[int, int | None], list[tuple[int, int]]] = {}
        # (holder set, node) → (the heap that node picks from, the set's holders, whether
        # the heap is the node's own)
        self.chosen: dict[tuple[int, int], tuple[list[tuple[int, int]], frozenset[int],
                                                 bool]] = {}
        self.holders: dict[int, frozenset[int]] = {}
        self.by_node: dict[int, dict[int, list[int]]] = {}

    def _heap(self, s: int, node: int | None, cands: list[int]) -> list[tuple[int, int]]:
        h = self.heaps.get((s, node))
        if h is None:
            load = self.load
            if node is None:
                members = cands
            else:  # the set's holders by node, grouped once for every node that asks
                by_node = self.by_node.get(s)
                if by_node is None:
                    by_node = self.by_node[s] = defaultdict(list)
                    node_of = self.node_of
                    for d in cands:
                        by_node[node_of[d]].append(d)
                members = by_node.get(node, ())
            h = [(load[d], d) for d in members]
            heapq.heapify(h)
            self.heaps[(s, node)] = h
        return h

    def _top(self, h: list[tuple[int, int]]) -> tuple[int, int]:
        """The heap's least loaded device, its entry refreshed."""
        load = self.load
        was, d = h[0]
        cur = load[d]
        while was != cur:  # out of date (too small): refresh, look again
            heapreplace(h, (cur, d))
            was, d = h[0]
            cur = load[d]
        return was, d

    def take(self, s: int, cands: list[int], node: int, prev: int, cum: list[int],
             start: int) -> tuple[int, int]:
        """The source of slices ``start, start+1, ...`` of a run from holder set ``s``
        (live holders ``cands``) to a device on ``node`` whose previous slice came from
        ``prev``, and where its share ends: ``(source, stop)``; its load grows by the
        bytes of slices ``[start, stop)`` (``cum``: the run's prefix byte sums)."""
        ent = self.chosen.get((s, node))
        if ent is None:  # the node's heap, or the global one when no holder is on the node
            h = self._heap(s, node, cands)
            on_node = bool(h)
            h = h or self._heap(s, None, cands)
            holders = self.holders.get(s)
            if holders is None:
                holders = self.holders[s] = frozenset(cands)
            ent = self.chosen[(s, node)] = (h, holders, on_node)
        h, holders, on_node = ent
        load, slack = self.load, self.slack
        best_load, best = self._top(h)
        if (prev != best and prev in holders and (not on_node or self.node_of[prev] == node)
                and load[prev] <= best_load + slack):
            src, others, popped = prev, best_load, False
        else:
            src, popped = best, True
            heappop(h)
            others = self._top(h)[0] if h else None
        n = len(cum) - 1
        if others is None:
            stop = n
        else:  # slice k goes to src while its load before k is at most others + slack
            stop = bisect.bisect_right(cum, cum[start] + others + slack - load[src], start, n)
            stop = max(stop, start + 1)
        load[src] += cum[stop] - cum[start]
        if popped:
            heappush(h, (load[src], src))
        return src, stop


def _schedule(chunks: list[tuple[str, str, list[Piece], int]], leaving: Iterable[str],
              dev_key: dict[str, tuple[int, int]] | None = None,
              ) -> list[tuple[int, tuple[str, str, list[Piece], int]]]:
    """Give every message a round: a device sends at most one and receives at most one
    message per round (so its staging stays under the cap), first fit.

    Why this order: rounds are the devices' only sync points, and the exchange takes about
    as long as its rounds' largest messages in sequence.  Placing the largest messages first,
    each in the earliest round where both its sender and its receiver are free, puts
    independent pairs' big messages side by side in the same rounds (a pair's chunks no
    longer queue behind another pair's: DP grow by two replicas ran in 7 rounds one pair at
    a time, now 4 with both pairs at once).  Leaving devices' messages go first so leavers
    are done early.  Deterministic: ties broken by device ids and chunk order.
    """
    leaving = set(leaving)
    if dev_key is None:
        dev_key = {d: _dev_key(d) for c in chunks for d in c[:2]}
    if isinstance(dev_key, range):  # int devices (the planner's own): sort with numpy
        n = len(chunks)
        src = np.fromiter((c[0] for c in chunks), dtype=np.int64, count=n)
        dst = np.fromiter((c[1] for c in chunks), dtype=np.int64, count=n)
        size = np.fromiter((c[3] for c in chunks), dtype=np.int64, count=n)
        stays = np.fromiter((c[0] not in leaving for c in chunks), dtype=bool, count=n)
        order = np.lexsort((np.arange(n), dst, src, -size, stays)).tolist()
        sending = [0] * len(dev_key)
        receiving = [0] * len(dev_key)
    else:
        keyed = [(c[0] not in leaving, -c[3], dev_key[c[0]], dev_key[c[1]], k)
                 for k, c in enumerate(chunks)]
        keyed.sort()
        order = [t[-1] for t in keyed]
        sending = defaultdict(int)
        receiving = defaultdict(int)
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


class _Gains:
    """The bytes each old class holds of what each new class needs, as the dense matrix of
    one component at a time (the assignment's weights).

    Why not class by class: with the distributed optimizer every device is a class, and
    adding each ZeRO-1 shard's one or two overlap terms into a row in Python was most of
    the assignment's time at 16k devices.  A term whose holder set and needer set are one
    class each (a shard meeting a shard) is one entry, a term of a few classes a few:
    those are summed in with one ``np.bincount`` per component; the few terms of widely
    replicated pieces (a model slice every DP replica holds) are added as dense blocks.  Every partial sum is an integer below
    2**53, so the float adds are exact in any order.
    """

    def __init__(self, old: _Index, new: _Index, terms: dict[tuple[int, int], int],
                 find) -> None:
        self.old, self.new = old, new
        n_oc = len(old.sets_of_class)
        self.n_oc, self.n_nc = n_oc, len(new.sets_of_class)
        self.find = find
        single_old = _single_class(old)
        single_new = _single_class(new)
        so = np.fromiter((k[0] for k in terms), dtype=np.int64, count=len(terms))
        sn = np.fromiter((k[1] for k in terms), dtype=np.int64, count=len(terms))
        nbytes = np.fromiter(terms.values(), dtype=np.float64, count=len(terms))
        oc, nc = single_old[so], single_new[sn]
        narrow = (oc >= 0) & (nc >= 0)
        comp_of = np.fromiter((find(c) for c in range(n_oc)), dtype=np.int64, count=n_oc)
        # the other terms: expanded to (old class, new class) entries when they are few,
        # else kept to be added as one dense block
        self.wide: dict[int, list[tuple[list[int], list[int], int]]] = defaultdict(list)
        extra_o: list[np.ndarray] = [oc[narrow]]
        extra_n: list[np.ndarray] = [nc[narrow]]
        extra_b: list[np.ndarray] = [nbytes[narrow]]
        for t in np.flatnonzero(~narrow).tolist():
            o_cls = old.classes_of_set(int(so[t]))
            n_cls = new.classes_of_set(int(sn[t]))
            if not o_cls or not n_cls:
                continue
            if len(o_cls) * len(n_cls) > 4096:
                self.wide[find(o_cls[0])].append((o_cls, n_cls, int(nbytes[t])))
                continue
            extra_o.append(np.repeat(np.asarray(o_cls, dtype=np.int64), len(n_cls)))
            extra_n.append(np.tile(np.asarray(n_cls, dtype=np.int64), len(o_cls)))
            extra_b.append(np.full(len(o_cls) * len(n_cls), nbytes[t]))
        oc_n, nc_n, b_n = (np.concatenate(x) for x in (extra_o, extra_n, extra_b))
        comp_n = comp_of[oc_n]
        order = np.argsort(comp_n, kind="stable")
        comp_n, oc_n, nc_n, b_n = comp_n[order], oc_n[order], nc_n[order], b_n[order]
        cuts = np.flatnonzero(np.diff(comp_n)) + 1
        self.entries = {int(g[0]): (o, n, b) for g, o, n, b in zip(
            np.split(comp_n, cuts), np.split(oc_n, cuts), np.split(nc_n, cuts),
            np.split(b_n, cuts), strict=True) if len(g)}

    def matrix(self, comp: int, d_cls: list[int], r_cls: list[int]) -> np.ndarray:
        """``w[i, j]``: bytes old class ``d_cls[i]`` holds of what new class ``r_cls[j]``
        needs (classes of component ``comp``)."""
        w = np.zeros((len(d_cls), len(r_cls)), dtype=np.float64)
        pos_o = np.full(self.n_oc, -1, dtype=np.int64)
        pos_o[d_cls] = np.arange(len(d_cls))
        pos_n = np.full(self.n_nc, -1, dtype=np.int64)
        pos_n[r_cls] = np.arange(len(r_cls))
        hit = self.entries.get(comp)
        if hit is not None:
            o, n, b = hit
            rows, cols = pos_o[o], pos_n[n]
            keep = (rows >= 0) & (cols >= 0)
            flat = rows[keep] * len(r_cls) + cols[keep]
            w += np.bincount(flat, weights=b[keep], minlength=w.size).reshape(w.shape)
        for o_cls, n_cls, b in self.wide.get(comp, ()):
            rows, cols = pos_o[o_cls], pos_n[n_cls]
            rows, cols = np.sort(rows[rows >= 0]), np.sort(cols[cols >= 0])
            if len(rows) and len(cols):
                rs, cs = _as_slice(rows), _as_slice(cols)
                if isinstance(rs, slice) and isinstance(cs, slice):
                    w[rs, cs] += b  # in place, strided: a model slice's DP replicas
                else:
                    w[np.ix_(rows, cols)] += b
        return w


def _as_slice(idx: np.ndarray) -> slice | np.ndarray:
    """Sorted positions as a slice when they are evenly spaced, else as they are."""
    if len(idx) == 1:
        return slice(int(idx[0]), int(idx[0]) + 1)
    step = int(idx[1] - idx[0])
    if step > 0 and (np.diff(idx) == step).all():
        return slice(int(idx[0]), int(idx[-1]) + 1, step)
    return idx


def _single_class(index: _Index) -> np.ndarray:
    """For each holder set of ``index``: its one class when it is one block of one class,
    else -1."""
    block_class = np.asarray([cl[0] if len(cl) == 1 else -1 for cl in index.classes_of_block]
                             + [-1], dtype=np.int64)
    one_block = np.asarray([t[0] if len(t) == 1 else -1 for t in index.sets], dtype=np.int64)
    return block_class[one_block] if len(one_block) else one_block


def _assign(w: np.ndarray, dev_cls: list[int], rank_cls: list[int]) -> list[tuple[int, int]]:
    """Max-weight matching of devices to ranks where device a of class ``dev_cls[a]`` gains
    ``w[dev_cls[a], rank_cls[b]]`` on rank b; only pairs with a positive gain are returned.

    :func:`scipy.optimize.linear_sum_assignment` (exact) on the device × rank matrix --
    or on each of its blocks when :func:`_blocks` proves that solving them apart is
    optimal (an 8k-device stage: 8 solves of 96 × 128 instead of one of 768 × 1024,
    ~20x less).  Classes make rows/columns repeat, which the solver handles fast.
    """
    dev = np.asarray(dev_cls, dtype=np.int64)
    rank = np.asarray(rank_cls, dtype=np.int64)
    parts = _blocks(w, dev, rank)
    if parts is None:
        parts = [(np.arange(len(dev)), np.arange(len(rank)))]
    pairs: list[tuple[int, int]] = []
    for rows, cols in parts:
        if not len(rows) or not len(cols):
            continue
        m = w[np.ix_(dev[rows], rank[cols])]
        sub_r, sub_c = linear_sum_assignment(m, maximize=True)
        keep = m[sub_r, sub_c] > 0
        pairs.extend(zip(rows[sub_r[keep]].tolist(), cols[sub_c[keep]].tolist(), strict=True))
    pairs.sort()
    return pairs


def _blocks(w: np.ndarray, dev: np.ndarray, rank: np.ndarray,
            ) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """Blocks of devices and ranks that can be matched apart, optimally, or None.

    Why it is exact: say devices are at least as many as ranks, so every matching the
    solver returns uses every rank.  If each block has at least as many devices as ranks
    and its smallest entry is no smaller than the largest entry outside the blocks, then
    any matching can be turned into one inside the blocks that is worth at least as
    much: keep its pairs inside blocks, and give each rank it matched across blocks a
    free device of its own block (there is one: the block has enough devices), which
    gains at least as much as the cross pair did.  (Fewer devices than ranks: the same
    with the roles swapped.)  Both conditions are checked here (the second as: every
    block entry is at least a threshold, every other entry below it), so how the blocks
    are guessed does not matter for exactness: for a threshold taken in one of the
    widest gaps between the first row's values (or the values of the class that gains
    least at best), a class joins the block of the first class it gains at least the
    threshold with.  With the distributed
    optimizer each TP rank of a stage is such a block: its model slice is worth far more
    than the shards of TP-replicated norm weights that tie the stage together.  Small
    matrices are not worth checking.
    """
    if len(dev) * len(rank) < 20_000:
        return None
    # the widest gaps of the first row, then of the class that gains least at best (on
    # the side with fewer members, which must all be in blocks): gpt-70b's first and last
    # stage, tied by the embedding, whose first row does not see the last stage's gap
    weakest = (w[:, int(np.argmin(w.max(axis=0)))] if len(dev) >= len(rank) else
               w[int(np.argmin(w.max(axis=1)))])
    for threshold in dict.fromkeys(_thresholds(w[0]) + _thresholds(weakest)):
        blocks = _blocks_at(w, dev, rank, w >= threshold)
        if blocks is not None:
            return blocks
    return None


def _thresholds(row: np.ndarray, tries: int = 3) -> list[float]:
    """Thresholds to try, between a block's gains and the rest, from one row's values:
    in the widest gaps (by ratio) between its distinct values, widest first."""
    values = np.unique(row)
    if len(values) < 2:
        return []
    lo, hi = values[:-1], values[1:]
    with np.errstate(divide="ignore"):
        ratio = np.where(lo > 0, hi / np.where(lo > 0, lo, 1), np.inf)
    order = np.argsort(-ratio, kind="stable")[:tries]
    return [float(hi[k]) for k in order]


def _blocks_at(w: np.ndarray, dev: np.ndarray, rank: np.ndarray, big: np.ndarray,
               ) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """:func:`_blocks` for one threshold (``big``: the entries at or above it)."""
    # a class alone on the side with fewer members (nothing at or above the threshold) is
    # a block with more of that side than of the other: not valid, said at once (the
    # checks below say the same, after a slow argmax down the columns)
    if len(dev) >= len(rank) and not big.any(axis=0).all():
        return None
    if len(dev) <= len(rank) and not big.any(axis=1).all():
        return None
    first_col = np.argmax(big, axis=1)
    # -1: nothing at or above the threshold, a block of its own
    row_label = np.where(big[np.arange(w.shape[0]), first_col], first_col, -1)
    # a column: the label of its first row at or above the threshold.  From the first row
    # of each label when they are few (a bool argmax down the columns of the whole matrix
    # was 25 ms at 3072 x 3072); the same labels wherever the blocks turn out valid
    labels, first = np.unique(row_label, return_index=True)
    first = first[labels >= 0]
    rows = first if len(first) <= 256 else np.arange(w.shape[0])
    first_row = rows[np.argmax(big[rows], axis=0)]
    has_big = big[first_row, np.arange(w.shape[1])]
    col_label = np.where(has_big, first_col[first_row], -1)
    labels, row_label, col_label = _relabel(row_label, col_label)
    n_blocks = len(labels)
    if n_blocks < 2:
        return None
    # every entry of a block above the threshold, every other entry below it: then the
    # smallest block entry is above the largest other one
    if not np.array_equal(big, row_label[:, None] == col_label[None, :]):
        return None
    rows_of = np.bincount(row_label[dev], minlength=n_blocks)
    cols_of = np.bincount(col_label[rank], minlength=n_blocks)
    if len(dev) >= len(rank) and (rows_of < cols_of).any():
        return None
    if len(dev) < len(rank) and (rows_of > cols_of).any():
        return None
    dev_block, rank_block = row_label[dev], col_label[rank]
    return [(np.flatnonzero(dev_block == k), np.flatnonzero(rank_block == k))
            for k in range(n_blocks)]


def _relabel(row_label: np.ndarray, col_label: np.ndarray,
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Block labels 0..k-1 for rows and columns; each one labelled -1 gets one alone."""
    rows, cols = row_label.copy(), col_label.copy()
    lone_r, lone_c = rows < 0, cols < 0
    rows[lone_r] = -1 - np.arange(int(lone_r.sum()))
    cols[lone_c] = -1 - int(lone_r.sum()) - np.arange(int(lone_c.sum()))
    labels, inverse = np.unique(np.concatenate([rows, cols]), return_inverse=True)
    return labels, inverse[:len(rows)], inverse[len(rows):]


def _tp_split(assignment: list[str], inputs: PlanInputs) -> int:
    tp = max(1, inputs.tp)
    return sum(
        len({inputs.nodes[d] for d in assignment[g:g + tp]}) > 1
        for g in range(0, len(assignment), tp)
    )


def _split_to_cap(p: Piece, cap: int) -> list[Piece]:
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
            out.extend(_split_to_cap(Piece(p.key, sub, p.dtype), cap))
        return out
    step = max(1, cap // row_bytes)
    return [Piece(p.key, (*box[:axis], (i, min(hi, i + step)), *box[axis + 1:]), p.dtype)
            for i in range(lo, hi, step)]


# --------------------------------------------------------------------------- GPT helper
def gpt_inputs(
    spec, old, new, leaving=(), joiners: int = 0, gpus_per_node: int = 8,
    optimizer: str = "adam", staging_bytes: int = 512 * 2**20, params_dtype: str | None = None,
    vocab_pad_tp: int | None = DEFAULT_VOCAB_PAD_TP,
) -> PlanInputs:
    """:class:`PlanInputs` for a GPT spec moving from layout ``old`` to ``new``.

    Old devices are ``"0".."N-1"`` on nodes ``n{rank // gpus_per_node}``; joiners
    ``join:k`` fill new nodes ``j{k // gpus_per_node}``.
    """
    from etcslurm.core.gpt_state import expand

    a = expand(spec, old, optimizer, params_dtype, vocab_pad_tp=vocab_pad_tp)
    b = expand(spec, new, optimizer, params_dtype, vocab_pad_tp=vocab_pad_tp)
    n_old = old.world_size
    for d in leaving:
        if not 0 <= int(d) < n_old:
            raise UsageError(f"leaving device {d} is out of range 0-{n_old - 1}")
    nodes = {str(r): f"n{r // gpus_per_node}" for r in range(n_old)}
    join_ids = [f"join:{k}" for k in range(joiners)]
    nodes.update({j: f"j{k // gpus_per_node}" for k, j in enumerate(join_ids)})
    return PlanInputs(
        old_blocks=[list(x) for x in a.blocks],
        old_class_blocks=[list(x) for x in a.class_blocks],
        old_device_class={str(r): a.rank_class[r] for r in range(n_old)},
        new_blocks=[list(x) for x in b.blocks],
        new_class_blocks=[list(x) for x in b.class_blocks],
        new_rank_class=list(b.rank_class),
        nodes=nodes,
        leaving=sorted({str(int(d)) for d in leaving}, key=int),
        joiners=join_ids,
        staging_bytes=staging_bytes,
        tp=new.tp,
    )


def plan_for_gpt(spec, old, new, leaving=(), joiners: int = 0, gpus_per_node: int = 8,
                 optimizer: str = "adam", staging_bytes: int = 512 * 2**20,
                 params_dtype: str | None = None,
                 vocab_pad_tp: int | None = DEFAULT_VOCAB_PAD_TP) -> MigrationPlan:
    """Convenience: :func:`gpt_inputs` then :func:`plan`."""
    return plan(gpt_inputs(spec, old, new, leaving, joiners, gpus_per_node, optimizer,
                           staging_bytes, params_dtype, vocab_pad_tp=vocab_pad_tp))
