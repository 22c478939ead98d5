"""The index of one layout's holdings: its distinct pieces, the blocks and classes that
hold each, and their boxes as arrays.

Why an index: devices with identical holdings (every DP replica of a (tp, pp) coordinate
under plain Adam) share a class, and classes share blocks, so everything after this stage
works on distinct pieces and on *holder sets* (the blocks holding a piece) instead of on
devices: the planner's work grows with distinct holdings, not with devices.
"""

from __future__ import annotations

from itertools import accumulate, chain
from operator import itemgetter

import numpy as np

from etcslurm.core.state import DTYPE_BYTES, Piece, dtype_bytes

key_of = itemgetter(0)
box_of = itemgetter(1)
dtype_of = itemgetter(2)


def _coords(pieces: list[Piece], rank: int) -> np.ndarray:
    """The boxes of ``pieces`` (all of ``rank`` axes) as an ``(n, rank, 2)`` array, read
    in C (chained iterators), not one Python step per coordinate."""
    n = len(pieces)
    flat = chain.from_iterable(chain.from_iterable(map(box_of, pieces)))
    return np.fromiter(flat, dtype=np.int64, count=2 * rank * n).reshape(n, rank, 2)


class Index:
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
        kid = np.asarray([kset(k, len(self.key_id)) for k in map(key_of, self.pieces)],
                         dtype=np.int64)
        self.kid = kid
        dtypes = set(map(dtype_of, self.pieces))
        for dt in dtypes:
            dtype_bytes(dt)  # an unknown dtype: one clear error
        width = np.fromiter(map(DTYPE_BYTES.__getitem__, map(dtype_of, self.pieces)),
                            dtype=np.int64, count=n)
        self.width = width  # element size of each distinct piece
        rank = np.fromiter(map(len, map(box_of, self.pieces)), dtype=np.int64, count=n)
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
        self.block_keys: list[frozenset[str]] = [frozenset(map(key_of, b)) for b in blocks]
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
        """The pieces of ``key`` with ``rank`` axes as arrays, for
        :func:`~etcslurm.core.plan.overlap.cover`: a list of ``(ids, lo, hi, sort keys,
        widest, span)``, each sorted by its keys.

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
    """:meth:`Index.tables` from the arrays of one (key, rank)."""
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


