"""Which device plays which new rank: the one that already holds the most of what the
rank needs (the bytes that then stay in place), and the naive baseline to compare with.

Why components: the classes that share bytes (through the holder and needer sets of the
overlap) form the components of a graph; a device of one component holds nothing a rank
of another needs, so each component is one exact matching (:mod:`.matching`) of its own,
and the later stages use the same components to plan one device's part alone.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import numpy as np
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from etcslurm.core.plan.index import Index
from etcslurm.core.plan.inputs import Devices, PlanInputs
from etcslurm.core.plan.matching import match

Terms = dict[tuple[int, int], int]


class Assignment(NamedTuple):
    """The result of :func:`assign`."""

    ranks: list[str]  # new rank → device
    idle: list[str]  # available devices with no new rank
    #: class → its component: old class ``c`` is ``c``, new class ``c`` is ``n_oc + c``
    component: list[int]
    in_place: int  # bytes the new ranks need that their devices hold already
    naive_in_place: int  # the same for the naive assignment


def assign(inputs: PlanInputs, devices: Devices, old: Index, new: Index, terms: Terms,
           given: list[str] | None) -> Assignment:
    """The assignment maximising the bytes in place, one matching per component, or the
    ``given`` one (checked by the caller); devices no rank needs anything of fill the
    ranks left over, in device order.

    The naive baseline (for the statistics): new rank ``i`` on device ``"i"`` when it
    remains, else on the next free device.
    """
    n_oc = len(inputs.old_class_blocks)
    component = components(old, new, terms, n_oc)
    by_old: dict[int, dict[int, int]] = defaultdict(dict)
    for (so, sn), b in terms.items():
        by_old[so][sn] = b
    classes = inputs.old_device_class
    if given is None:
        chosen, in_place = _optimal(inputs, devices, old, new, terms, component)
    else:
        chosen = list(given)
        in_place = sum(_in_place(old, new, by_old, classes.get(d), inputs.new_rank_class[r])
                       for r, d in enumerate(given))
    used = set(chosen)
    rest = [d for d in devices.available if d not in used]
    k = 0
    for r in range(len(chosen)):
        if chosen[r] is None:
            chosen[r] = rest[k]
            k += 1
    available = set(devices.available)
    n_new = len(inputs.new_rank_class)
    naive_used = {str(r) for r in range(n_new) if str(r) in available}
    spare = iter(d for d in devices.available if d not in naive_used)
    naive = 0
    for r in range(n_new):
        d = str(r) if str(r) in available else next(spare)
        naive += _in_place(old, new, by_old, classes.get(d), inputs.new_rank_class[r])
    return Assignment(chosen, list(rest[k:]), component, in_place, naive)


def _optimal(inputs: PlanInputs, devices: Devices, old: Index, new: Index, terms: Terms,
             component: list[int]) -> tuple[list, int]:
    """The optimal assignment (None where no device gains anything) and its bytes in
    place."""
    n_oc = len(inputs.old_class_blocks)
    comp_devices: dict[int, list[str]] = defaultdict(list)
    for d in devices.available:
        c = inputs.old_device_class.get(d)
        if c is not None:
            comp_devices[component[c]].append(d)
    comp_ranks: dict[int, list[int]] = defaultdict(list)
    for r, nc in enumerate(inputs.new_rank_class):
        comp_ranks[component[n_oc + nc]].append(r)
    chosen: list[str | None] = [None] * len(inputs.new_rank_class)
    in_place = 0
    gains = Gains(old, new, terms, component)
    for comp in sorted(comp_ranks):
        ranks = comp_ranks[comp]
        devs = comp_devices.get(comp, [])
        if not devs:
            continue
        d_cls = sorted({inputs.old_device_class[d] for d in devs})
        r_cls = sorted({inputs.new_rank_class[r] for r in ranks})
        ri = {c: k for k, c in enumerate(r_cls)}
        w = gains.matrix(comp, d_cls, r_cls)
        di = {c: k for k, c in enumerate(d_cls)}
        dev_row = [di[inputs.old_device_class[d]] for d in devs]
        rank_col = [ri[inputs.new_rank_class[r]] for r in ranks]
        for a, b in match(w, dev_row, rank_col):  # w holds exact integers (see Gains)
            chosen[ranks[b]] = devs[a]
            in_place += int(w[dev_row[a], rank_col[b]])
    return chosen, in_place


def _in_place(old: Index, new: Index, by_old: dict[int, dict[int, int]], oc: int | None,
              nc: int) -> int:
    """Bytes old class ``oc`` (None: a joiner) holds of what new class ``nc`` needs."""
    if oc is None:
        return 0
    total = 0
    for so in old.sets_of_class[oc]:
        row = by_old.get(so)
        if row:
            for sn in new.sets_of_class[nc]:
                total += row.get(sn, 0)
    return total


def components(old: Index, new: Index, terms: Terms, n_oc: int) -> list[int]:
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


class Gains:
    """The bytes each old class holds of what each new class needs, as the dense matrix of
    one component at a time (the assignment's weights).

    Why not class by class: with the distributed optimizer every device is a class, and
    adding each ZeRO-1 shard's one or two overlap terms into a row in Python was most of
    the assignment's time at 16k devices.  A term whose holder set and needer set are one
    class each (a shard meeting a shard) is one entry, a term of a few classes a few:
    those are summed in with one ``np.bincount`` per component; the few terms of widely
    replicated pieces (a model slice every DP replica holds) are added as dense blocks.
    Every partial sum is an integer below 2**53, so the float adds are exact in any order.
    """

    def __init__(self, old: Index, new: Index, terms: Terms, component: list[int]) -> None:
        self.old, self.new = old, new
        n_oc = len(old.sets_of_class)
        self.n_oc, self.n_nc = n_oc, len(new.sets_of_class)
        single_old = _single_class(old)
        single_new = _single_class(new)
        so = np.fromiter((k[0] for k in terms), dtype=np.int64, count=len(terms))
        sn = np.fromiter((k[1] for k in terms), dtype=np.int64, count=len(terms))
        nbytes = np.fromiter(terms.values(), dtype=np.float64, count=len(terms))
        oc, nc = single_old[so], single_new[sn]
        narrow = (oc >= 0) & (nc >= 0)
        comp_of = np.asarray(component[:n_oc], dtype=np.int64)
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
                self.wide[component[o_cls[0]]].append((o_cls, n_cls, int(nbytes[t])))
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


def _single_class(index: Index) -> np.ndarray:
    """For each holder set of ``index``: its one class when it is one block of one class,
    else -1."""
    block_class = np.asarray([cl[0] if len(cl) == 1 else -1 for cl in index.classes_of_block]
                             + [-1], dtype=np.int64)
    one_block = np.asarray([t[0] if len(t) == 1 else -1 for t in index.sets], dtype=np.int64)
    return block_class[one_block] if len(one_block) else one_block
