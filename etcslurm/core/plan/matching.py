"""Max-weight matching of devices to new ranks, exact, split into blocks where that is
provably optimal.

Why blocks: with the distributed optimizer every device is a class, so one component's
matrix is device × rank (768 × 1024 for a pipeline stage at 8k devices); each TP rank of
the stage is a block whose model slice is worth far more than anything outside it, and
solving the blocks apart is ~20x faster than one solve, with the same value.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment


def match(w: np.ndarray, dev_cls: list[int], rank_cls: list[int]) -> list[tuple[int, int]]:
    """Max-weight matching of devices to ranks where device a of class ``dev_cls[a]`` gains
    ``w[dev_cls[a], rank_cls[b]]`` on rank b; only pairs with a positive gain are returned.

    :func:`scipy.optimize.linear_sum_assignment` (exact) on the device × rank matrix --
    or on each of its blocks when :func:`blocks` proves that solving them apart is
    optimal (an 8k-device stage: 8 solves of 96 × 128 instead of one of 768 × 1024,
    ~20x less).  Classes make rows/columns repeat, which the solver handles fast.
    """
    dev = np.asarray(dev_cls, dtype=np.int64)
    rank = np.asarray(rank_cls, dtype=np.int64)
    parts = blocks(w, dev, rank)
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


def blocks(w: np.ndarray, dev: np.ndarray, rank: np.ndarray,
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
    threshold with.  With the distributed optimizer each TP rank of a stage is such a
    block: its model slice is worth far more than the shards of TP-replicated norm
    weights that tie the stage together.  Small matrices are not worth checking.
    """
    if len(dev) * len(rank) < 20_000:
        return None
    # the widest gaps of the first row, then of the class that gains least at best (on
    # the side with fewer members, which must all be in blocks): gpt-70b's first and last
    # stage, tied by the embedding, whose first row does not see the last stage's gap
    weakest = (w[:, int(np.argmin(w.max(axis=0)))] if len(dev) >= len(rank) else
               w[int(np.argmin(w.max(axis=1)))])
    for threshold in dict.fromkeys(_thresholds(w[0]) + _thresholds(weakest)):
        found = _blocks_at(w, dev, rank, w >= threshold)
        if found is not None:
            return found
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
    """:func:`blocks` for one threshold (``big``: the entries at or above it)."""
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
