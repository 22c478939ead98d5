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
from heapq import heapreplace
from operator import attrgetter

import numpy as np
from scipy.optimize import linear_sum_assignment

from etcslurm.core.gpt_state import DEFAULT_VOCAB_PAD_TP
from etcslurm.core.state import (
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
@dataclass
class Message:
    """One coalesced transfer ``src → dst`` in ``round``; slices in canonical order."""

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


#: the order :class:`Piece` sorts in (its fields), as a C-level key (no dataclass ``__lt__``)
_piece_order = attrgetter("key", "box", "dtype")


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


_new_object = object.__new__


def _piece(key: str, box: Box, dtype: str) -> Piece:
    """``Piece(key, box, dtype)`` without the frozen dataclass' ``__init__`` (one
    ``object.__setattr__`` per field, ~3x the cost): the planner makes ~10^6 of them."""
    p = _new_object(Piece)
    d = p.__dict__
    d["key"] = key
    d["box"] = box
    d["dtype"] = dtype
    return p


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
    """Distinct pieces of one layout, the set of blocks holding each, a per-key index."""

    def __init__(self, blocks: list[list[Piece]], class_blocks: list[list[int]],
                 holders_side: bool = True):
        self.pieces: list[Piece] = []
        self.id: dict[Piece, int] = {}
        holders: list[list[int]] = []
        self.block_sets: list[frozenset[Piece]] = []
        self.block_keys: list[dict] = []  # key → pieces (holders) or key → None
        ids, plist = self.id, self.pieces
        for b, pieces in enumerate(blocks):
            for p in pieces:
                i = ids.get(p)
                if i is None:
                    ids[p] = len(plist)
                    plist.append(p)
                    holders.append([b])
                else:
                    hl = holders[i]
                    if hl[-1] != b:
                        hl.append(b)
            if holders_side:
                self.block_sets.append(frozenset(pieces))
                by_key: dict[str, list[Piece]] = {}
                for p in pieces:
                    lst = by_key.get(p.key)
                    if lst is None:
                        by_key[p.key] = [p]
                    else:
                        lst.append(p)
                for lst in by_key.values():  # in Piece order, once (fragments walks them)
                    if len(lst) > 1:
                        lst.sort(key=_piece_order)
                self.block_keys.append(by_key)
            else:
                self.block_keys.append(dict.fromkeys(p.key for p in pieces))
        self.block_bytes = [sum([p.nbytes for p in pieces]) for pieces in blocks]
        # holder block sets, interned
        self.set_id: dict[tuple[int, ...], int] = {}
        self.sets: list[tuple[int, ...]] = []
        self.piece_set: list[int] = []
        for h in holders:
            t = tuple(h)
            s = self.set_id.get(t)
            if s is None:
                s = self.set_id[t] = len(self.sets)
                self.sets.append(t)
            self.piece_set.append(s)
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
        self.by_key: dict[str, tuple[list[int], list[tuple], int]] = {}
        self._overlap_cache: dict[Piece, list[int]] = {}
        if not holders_side:  # the needing side is never searched by box
            return
        # per key: groups of pieces with the same axis-0 interval, each sorted on axis 1
        by_group: dict[str, dict[tuple[int, int], list[int]]] = defaultdict(
            lambda: defaultdict(list))
        for i, p in enumerate(plist):
            by_group[p.key][p.box[0] if p.box else (0, 1)].append(i)
        for key, groups in by_group.items():
            entries = []
            for (lo0, hi0), members in sorted(groups.items()):
                # thin (one index on axis 1) and thick pieces apart: thin ones get an exact
                # window, thick ones (few) a window as wide as the widest of them; each
                # sorted by (axis-1 start, id)
                thin: list[tuple[int, int, int]] = []
                thick: list[tuple[int, int, int]] = []
                for i in members:
                    box = plist[i].box
                    if len(box) > 1:
                        lo1, hi1 = box[1]
                        (thin if hi1 - lo1 == 1 else thick).append((lo1, i, hi1 - lo1))
                    else:
                        thick.append((0, i, 1))
                parts = []
                for sel in (thin, thick):
                    sel.sort()  # ids are unique: the width is never compared
                    parts.append(([t[1] for t in sel], [t[0] for t in sel],
                                  max([t[2] for t in sel], default=1)))
                entries.append((lo0, hi0, parts))
            max0 = max(e[1] - e[0] for e in entries)
            self.by_key[key] = ([e[0] for e in entries], entries, max0)

    def classes_of_set(self, s: int) -> list[int]:
        hit = self._cos.get(s)
        if hit is None:
            hit = self._cos[s] = sorted(
                {c for blk in self.sets[s] for c in self.classes_of_block[blk]})
        return hit

    def overlapping(self, p: Piece) -> list[int]:
        """Ids of distinct pieces of ``p.key`` that intersect ``p`` (sorted by id; cached)."""
        hit = self._overlap_cache.get(p)
        if hit is not None:
            return hit
        entry = self.by_key.get(p.key)
        out: list[int] = []
        if entry is not None:
            group_los, entries, max0 = entry
            lo, hi = p.box[0] if p.box else (0, 1)
            for g in range(bisect.bisect_left(group_los, lo - max0 + 1),
                           bisect.bisect_left(group_los, hi)):
                _, hi0, parts = entries[g]
                if hi0 <= lo:
                    continue
                for ids, los1, max1 in parts:
                    if len(p.box) > 1:
                        lo1, hi1 = p.box[1]
                        cand = ids[bisect.bisect_left(los1, lo1 - max1 + 1):
                                   bisect.bisect_left(los1, hi1)]
                    else:
                        cand = ids
                    box = p.box
                    pieces = self.pieces
                    for i in cand:  # _meets inlined (called ~10^5-10^6 times)
                        for (alo, ahi), (blo, bhi) in zip(pieces[i].box, box, strict=False):
                            if alo >= bhi or blo >= ahi:
                                break
                        else:
                            out.append(i)
        out.sort()
        self._overlap_cache[p] = out
        return out


# --------------------------------------------------------------------------- planner
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
    new = _Index(inputs.new_blocks, inputs.new_class_blocks, holders_side=False)
    leaving = set(inputs.leaving)
    dev_key = {d: _dev_key(d) for d in (*inputs.old_device_class, *inputs.joiners)}
    old_devices = sorted(inputs.old_device_class, key=dev_key.__getitem__)
    available = [d for d in old_devices if d not in leaving] + sorted(inputs.joiners, key=_dev_key)
    n_new = len(inputs.new_rank_class)
    n_oc, n_nc = len(inputs.old_class_blocks), len(inputs.new_class_blocks)

    # ---- factorised overlap: (old holder set, new needer set) → bytes
    terms: dict[tuple[int, int], int] = defaultdict(int)
    for j, p in enumerate(new.pieces):
        same = old.id.get(p)
        if same is not None:
            terms[(old.piece_set[same], new.piece_set[j])] += p.nbytes
            continue
        sn = new.piece_set[j]
        width = dtype_bytes(p.dtype)
        for i in old.overlapping(p):
            terms[(old.piece_set[i], sn)] += _common_numel(old.pieces[i].box, p.box) * width
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

    # ---- components of the class overlap graph (union-find over old+new classes)
    components = _UnionFind(n_oc + n_nc)
    find, union = components.find, components.union

    old_rep: dict[int, int] = {}
    new_rep: dict[int, int] = {}
    for (so, sn), b in sorted(terms.items()):
        if b <= 0:
            continue
        if so not in old_rep:
            cls = old.classes_of_set(so)
            for c in cls[1:]:
                union(cls[0], c)
            old_rep[so] = cls[0] if cls else -1
        if sn not in new_rep:
            cls = new.classes_of_set(sn)
            for c in cls[1:]:
                union(n_oc + cls[0], n_oc + c)
            new_rep[sn] = n_oc + cls[0] if cls else -1
        if old_rep[so] >= 0 and new_rep[sn] >= 0:
            union(old_rep[so], new_rep[sn])

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
    for comp in sorted(comp_ranks) if given is None else ():
        ranks = comp_ranks[comp]
        devs = comp_devices.get(comp, [])
        if not devs:
            continue
        d_cls = sorted({inputs.old_device_class[d] for d in devs})
        r_cls = sorted({inputs.new_rank_class[r] for r in ranks})
        ri = {c: k for k, c in enumerate(r_cls)}
        w = np.zeros((len(d_cls), len(r_cls)), dtype=np.float64)
        # each holder set's gains per rank class, once: a dense row when it reaches many
        # classes (a replicated block), else (column, bytes) pairs (a ZeRO-1 shard meets
        # one or two new shards, where a numpy call per set would cost more than the adds).
        # Every partial sum is an integer below 2**53, so the order of the float adds
        # cannot change w.
        row_cache: dict[int, np.ndarray | list[tuple[int, int]]] = {}
        for a, oc in enumerate(d_cls):
            wa = w[a]
            for so in old.sets_of_class[oc]:
                ent = row_cache.get(so)
                if ent is None:
                    acc: dict[int, int] = defaultdict(int)
                    for sn, b in terms_by_old.get(so, {}).items():
                        for c in new.classes_of_set(sn):
                            k = ri.get(c)
                            if k is not None:
                                acc[k] += b
                    if len(acc) > 8:
                        ent = np.zeros(len(r_cls), dtype=np.float64)
                        ent[list(acc)] = list(acc.values())
                    else:
                        ent = list(acc.items())
                    row_cache[so] = ent
                if isinstance(ent, list):
                    for k, b in ent:
                        wa[k] += b
                else:
                    wa += ent
        di = {c: k for k, c in enumerate(d_cls)}
        pairs_ab = _assign(w, [di[inputs.old_device_class[d]] for d in devs],
                           [ri[inputs.new_rank_class[r]] for r in ranks])
        for a, b in pairs_ab:
            assignment[ranks[b]] = devs[a]
            used.add(devs[a])
            optimal_overlap += overlap(inputs.old_device_class[devs[a]],
                                       inputs.new_rank_class[ranks[b]])
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
    new_block_keys = [set(k) for k in new.block_keys]
    old_block_keys = [set(k) for k in old.block_keys]

    def fragments(held_blocks: tuple[int, ...], nb: int):
        """(local, local_bytes, remote [(slice, old piece id)], missing, missing_bytes)."""
        rel = tuple(b for b in held_blocks if not old_block_keys[b].isdisjoint(new_block_keys[nb]))
        key = (rel, nb)
        hit = frag_cache.get(key)
        if hit is not None:
            return hit
        held_sets = [old.block_sets[b] for b in rel]
        one = held_sets[0] if len(held_sets) == 1 else None
        local: list[Piece] = []
        remote: list[tuple[Piece, int]] = []
        missing: list[Piece] = []
        old_pieces = old.pieces
        # The cuts below are box_intersect / box_subtract in the same order as ever; the
        # shortcuts only skip work whose result is known: a region inside the holder is
        # the fragment itself (nothing left over), and the whole piece as fragment is the
        # piece (no new object).
        for p in inputs.new_blocks[nb]:
            if (p in one) if one is not None else any(p in hs for hs in held_sets):
                local.append(p)
                continue
            pkey, pbox, pdt = p.key, p.box, p.dtype
            regions: list[Box] = [pbox]
            if one is not None:
                held = old.block_keys[rel[0]].get(pkey, ())
            elif not rel:
                held = ()
            else:
                held = sorted((h for b in rel for h in old.block_keys[b].get(pkey, ())),
                              key=_piece_order)
            for h in held:
                hb = h.box
                nxt: list[Box] = []
                for r in regions:
                    inter = _intersect(r, hb)
                    if inter is None:
                        nxt.append(r)
                    elif inter == r:
                        local.append(p if r is pbox else _piece(pkey, r, pdt))
                    else:
                        local.append(_piece(pkey, inter, pdt))
                        nxt.extend(_subtract_inside(r, inter))
                regions = nxt
                if not regions:
                    break
            if not regions:
                continue
            for i in old.overlapping(p):
                hb = old_pieces[i].box
                nxt = []
                for r in regions:
                    inter = _intersect(r, hb)
                    if inter is None:
                        nxt.append(r)
                    elif inter == r:
                        remote.append((p if r is pbox else _piece(pkey, r, pdt), i))
                    else:
                        remote.append((_piece(pkey, inter, pdt), i))
                        nxt.extend(_subtract_inside(r, inter))
                regions = nxt
                if not regions:
                    break
            missing.extend(_piece(pkey, r, pdt) for r in regions)
        rem = []
        for frag, i in remote:
            s = old.piece_set[i]
            cands = candidates(s)
            # the one source when there is no choice (-1: none left), else None: pick
            single = (cands[0] if cands else -1) if len(cands) < 2 else None
            rem.append((frag, s, frag.nbytes, cands, single))
        hit = (local, sum(p.nbytes for p in local), rem, missing,
               sum(p.nbytes for p in missing))
        frag_cache[key] = hit
        return hit

    picker = _SourcePicker(node_of, range(n_dev))
    send_load = picker.load
    pick = picker.pick
    pairs: dict[int, list[Piece]] = {}  # src * n_dev + dst → slices
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
        for nb in inputs.new_class_blocks[nc]:
            loc, lb, rem, miss, mb = fragments(held_blocks, nb)
            if loc:
                local_out.setdefault(d, []).extend(loc)
                local_bytes += lb
            if miss:
                missing_out.setdefault(d, []).extend(miss)
                missing_bytes += mb
            for frag, s, nbytes, cands, single in rem:
                if single is None:
                    src = pick(s, cands, node, nbytes)
                elif single < 0:  # its holders are gone (dead): a checkpoint must supply it
                    missing_out.setdefault(d, []).append(frag)
                    missing_bytes += nbytes
                    continue
                else:
                    src = single
                    send_load[src] += nbytes
                pair = src * n_dev + dd
                lst = pairs.get(pair)
                if lst is None:
                    pairs[pair] = [frag]
                    pair_bytes[pair] = nbytes
                else:
                    lst.append(frag)
                    pair_bytes[pair] += nbytes
    need_bytes = sum(new.class_bytes[c] for c in inputs.new_rank_class)

    # ---- coalesce, split under the cap, schedule rounds
    cap = inputs.staging_bytes
    chunks: list[tuple[int, int, list[Piece], int]] = []
    for pair in sorted(pairs):
        src, dst = divmod(pair, n_dev)
        slices = pairs[pair]
        slices.sort(key=_piece_order)
        total = pair_bytes[pair]
        if total <= cap:  # one message, no slice split (each is at most the total)
            chunks.append((src, dst, slices, total))
            continue
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
    # message order: (round, src, dst), one int each (a device sends once per round)
    n_pairs = n_dev * n_dev
    placed.sort(key=lambda rc: rc[0] * n_pairs + rc[1][0] * n_dev + rc[1][1])
    messages = [Message(rnd, names[src], names[dst], slices, nbytes)
                for rnd, (src, dst, slices, nbytes) in placed]

    moved = inter = peak = 0
    rounds = -1
    sent = [0] * n_dev
    recv = [0] * n_dev
    for rnd, (src, dst, _, nbytes) in placed:
        moved += nbytes
        if node_of[src] != node_of[dst]:
            inter += nbytes
        sent[src] += nbytes
        recv[dst] += nbytes
        if nbytes > peak:
            peak = nbytes
        if rnd > rounds:
            rounds = rnd
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
        "max_send_bytes": max(sent, default=0),
        "max_recv_bytes": max(recv, default=0),
        "peak_staging_bytes": peak,
        "tp_groups_split_across_nodes": _tp_split(final, inputs),
        "plan_seconds": round(time.perf_counter() - t0, 6),
    }
    if for_device is not None:
        stats["part"] = True
    return MigrationPlan(final, messages, local_out, missing_out, idle, stats)


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
    """Chooses the source of each remote slice: among its holders ``cands`` (sorted by
    device key), the least loaded (bytes given to send so far) on the receiver's node,
    else the least loaded anywhere; ties to the lowest device key.  The same choice as
    ``min(cands, key=lambda h: (nodes[h] != node, load[h], dev_key[h]))``, which was
    O(holders) per slice -- quadratic when whole stages leave and every receiver picks
    among all DP replicas of a stage.

    Here: one lazy heap of (load, device key, device) per holder set and per (holder set,
    node).  Loads only grow, so an entry whose load is out of date is too small: it
    surfaces first and is refreshed in place; O(log holders) per slice.
    """

    def __init__(self, nodes: dict[str, str], dev_key: dict[str, tuple[int, int]]):
        self.nodes = nodes
        self.dev_key = dev_key
        self.load: dict[str, int] = defaultdict(int)
        self.heaps: dict[tuple[int, str | None], list[tuple[int, tuple[int, int], str]]] = {}
        self.chosen: dict[tuple, list] = {}  # (s, node) → the heap that node picks from

    def _heap(self, s: int, node: str | None, cands: list[str]) -> list:
        h = self.heaps.get((s, node))
        if h is None:
            nodes, load, key = self.nodes, self.load, self.dev_key
            members = cands if node is None else [d for d in cands if nodes[d] == node]
            h = [(load[d], key[d], d) for d in members]
            heapq.heapify(h)
            self.heaps[(s, node)] = h
        return h

    def pick(self, s: int, cands: list, node, nbytes: int):
        """The source for ``nbytes`` from holder set ``s`` (holders ``cands``) to a device
        on ``node``; its load grows by ``nbytes``."""
        h = self.chosen.get((s, node))
        if h is None:  # the node's heap, or the global one when no holder is on the node
            h = self._heap(s, node, cands) or self._heap(s, None, cands)
            self.chosen[(s, node)] = h
        load = self.load
        was, key, d = h[0]
        cur = load[d]
        while was != cur:  # out of date (too small): refresh, look again
            heapreplace(h, (cur, key, d))
            was, key, d = h[0]
            cur = load[d]
        load[d] = cur + nbytes
        heapreplace(h, (cur + nbytes, key, d))
        return d


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
    order = [(c[0] not in leaving, -c[3], dev_key[c[0]], dev_key[c[1]], k)
             for k, c in enumerate(chunks)]
    order.sort()
    # busy rounds of each device as bits of an int: the first round free at both ends is
    # the lowest zero bit of (sending | receiving), found in C (a scan per round was
    # O(messages x rounds))
    sending: dict = defaultdict(int)
    receiving: dict = defaultdict(int)
    out = []
    for *_, k in order:
        chunk = chunks[k]
        src, dst = chunk[0], chunk[1]
        busy = sending[src] | receiving[dst]
        bit = ~busy & (busy + 1)
        sending[src] |= bit
        receiving[dst] |= bit
        out.append((bit.bit_length() - 1, chunk))
    return out


def _assign(w: np.ndarray, dev_cls: list[int], rank_cls: list[int]) -> list[tuple[int, int]]:
    """Max-weight matching of devices to ranks where device a of class ``dev_cls[a]`` gains
    ``w[dev_cls[a], rank_cls[b]]`` on rank b; only pairs with a positive gain are returned.

    Dense :func:`scipy.optimize.linear_sum_assignment` on the device × rank matrix (exact);
    classes make its rows/columns repeat, which the solver handles fast.
    """
    m = w[np.ix_(dev_cls, rank_cls)]
    rows, cols = linear_sum_assignment(m, maximize=True)
    return [(a, b) for a, b in zip(rows.tolist(), cols.tolist(), strict=True) if m[a, b] > 0]


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
