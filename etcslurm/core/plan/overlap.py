"""What each needed piece is made of: the parts of it that each old piece holds, the parts
nobody holds, and the overlap summed per (old holder set, new needer set).

Why per holder set and needer set: those sums are all the assignment needs (the bytes an
old class holds of what a new class needs add up from them), and there are far fewer of
them than (device, rank) pairs.

Precondition (true for megatron layouts): within one layout, two distinct pieces of the
same key are disjoint (shards are disjoint, replicas identical).  Where a described live
state breaks it, or a layout has rows no other had, pieces are cut exactly (:func:`_cut`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from etcslurm.core.plan.index import Index
from etcslurm.core.state import Box, Piece
from etcslurm.core.state import box_intersect_same_rank as intersect

_new_tuple = tuple.__new__

#: ``(old piece id, the part of the new piece it holds, its bytes)``
Part = tuple[int, Piece, int]


class Overlap(NamedTuple):
    """The result of :func:`cover`."""

    made_of: list[list[Part]]  # new piece id → its parts, by old piece id
    uncovered: dict[int, list[Piece]]  # new piece id → the parts no old piece holds
    terms: dict[tuple[int, int], int]  # (old holder set, new needer set) → bytes


def new_piece(key: str, box: Box, dtype: str) -> Piece:
    """``Piece(key, box, dtype)`` without the named tuple's Python-level ``__new__``: the
    planner makes ~10^6 of them."""
    return _new_tuple(Piece, (key, box, dtype))


def subtract_inside(a: Box, inter: Box) -> list[Box]:
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


def cover(old: Index, new: Index) -> Overlap:
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
    made_of: list[list[Part]] = [
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
    return Overlap(made_of, uncovered, terms)


def _cover_group(new: Index, js: list[int], rank: int, tables: list[tuple],
                 made_of: list[list[Part]], q: np.ndarray,
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]] | None:
    """:func:`cover` for the new pieces ``js`` of one (key, rank) against the old
    tables of the key (:meth:`Index.tables`): the candidates in each query's window,
    kept when they meet on every axis (axis 1 first: it rejects most); ``q``: the boxes
    of ``js``, ``(len(js), rank, 2)``.  Fills ``made_of`` and returns the pairs found
    (new id, old id, bytes) and the queries whose parts do not add up to them (to be cut
    exactly); None when nothing meets."""
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


def _cut(p: Piece, old: Index, meeting: list[int]) -> tuple[list[Part], list[Piece]]:
    """``p`` cut by the old pieces ``meeting`` it (ids, sorted), each element to the first
    that holds it: ``(parts as in cover, the boxes nobody holds)``."""
    pkey, pdt = p.key, p.dtype
    regions: list[Box] = [p.box]
    parts: list[Part] = []
    for i in meeting:
        hb = old.pieces[i].box
        nxt: list[Box] = []
        for r in regions:
            inter = intersect(r, hb)
            if inter is None:
                nxt.append(r)
                continue
            frag = new_piece(pkey, inter, pdt)
            parts.append((i, frag, frag.nbytes))
            if inter != r:
                nxt.extend(subtract_inside(r, inter))
        regions = nxt
        if not regions:
            break
    return parts, [new_piece(pkey, r, pdt) for r in regions]
