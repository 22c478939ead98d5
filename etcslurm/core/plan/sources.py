"""Where every needed slice comes from: a copy on the device itself, a live holder
(:class:`~etcslurm.core.plan.picker.SourcePicker`: on the receiver's node first, then the
least loaded), or nobody (missing: a checkpoint or the vocabulary fill must supply it).

Why by (relevant held blocks, new block): under plain Adam thousands of receivers hold the
same blocks and need the same block, so what is local, remote and missing for them is
worked out once (:class:`Fragments`) and only the choice of sources is per receiver.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import accumulate
from typing import NamedTuple

from etcslurm.core.plan.assign import Assignment
from etcslurm.core.plan.index import Index
from etcslurm.core.plan.inputs import Devices, PlanInputs
from etcslurm.core.plan.overlap import Overlap
from etcslurm.core.plan.picker import SourcePicker
from etcslurm.core.state import Piece

#: what a (src, dst) pair carries of one remote run: ``(slices, prefix byte sums, sizes,
#: start, stop, largest size)``: the run's slices ``[start, stop)``
Carried = tuple[list[Piece], list[int], list[int], int, int, int]


class Routes(NamedTuple):
    """The result of :func:`sources`."""

    pairs: dict[int, list[Carried]]  # src * n_dev + dst → what it carries
    pair_bytes: dict[int, int]  # src * n_dev + dst → its bytes
    local: dict[str, list[Piece]]  # device → the slices it copies from itself
    missing: dict[str, list[Piece]]  # device → the slices nobody live holds
    local_bytes: int
    missing_bytes: int


class Fragments:
    """What a device holding some old blocks does for one new block: ``(local slices,
    their bytes, remote runs, missing slices, their bytes)``, cached.

    A remote *run* is ``(holder set, its live holders, slices, prefix byte sums, sizes,
    largest size)``: the slices that set holds, in piece order (runs in holder-set order).
    """

    def __init__(self, old: Index, new: Index, cover: Overlap,
                 devices_of_class: dict[int, list[int]]):
        self.old, self.new, self.cover = old, new, cover
        self.devices_of_class = devices_of_class
        self.cache: dict[tuple, tuple] = {}
        self.holders: dict[int, list[int]] = {}

    def candidates(self, s: int) -> list[int]:
        """The live devices of holder set ``s``, ascending."""
        hit = self.holders.get(s)
        if hit is None:
            of = self.devices_of_class
            hit = sorted(d for c in self.old.classes_of_set(s) for d in of[c])
            self.holders[s] = hit
        return hit

    def of(self, held_blocks: tuple[int, ...], nb: int) -> tuple:
        old, new = self.old, self.new
        nkeys = new.block_keys[nb]
        rel = tuple(b for b in held_blocks if not old.block_keys[b].isdisjoint(nkeys))
        key = (rel, nb)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        made_of, uncovered = self.cover.made_of, self.cover.uncovered
        piece_set, old_sets = old.piece_set, old.sets
        rel_set = set(rel)
        held_here: dict[int, bool] = {}  # holder set → whether one of ``rel`` is in it
        local: list[Piece] = []
        remote: dict[int, list[tuple[Piece, int]]] = defaultdict(list)
        missing: list[Piece] = []
        local_bytes = 0
        for j in new.block_members[nb]:
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
            runs.append((s, self.candidates(s), sl, list(accumulate(sizes, initial=0)), sizes,
                         max(sizes)))
        hit = (local, local_bytes, runs, missing, sum([x.nbytes for x in missing]))
        self.cache[key] = hit
        return hit


def planned_classes(inputs: PlanInputs, chosen: Assignment,
                    for_device: str | None) -> set[int] | None:
    """The new classes whose ranks are planned: all (None), or, for one device's part,
    those of the components of its old class and of its new rank's class."""
    if for_device is None:
        return None
    n_oc = len(inputs.old_class_blocks)
    find = chosen.component.__getitem__
    roots = set()
    if for_device in inputs.old_device_class:
        roots.add(find(inputs.old_device_class[for_device]))
    if for_device in chosen.ranks:
        roots.add(find(n_oc + inputs.new_rank_class[chosen.ranks.index(for_device)]))
    return {c for c in range(len(inputs.new_class_blocks)) if find(n_oc + c) in roots}


def sources(inputs: PlanInputs, devices: Devices, old: Index, new: Index, cover: Overlap,
            chosen: Assignment, for_device: str | None) -> Routes:
    """A source for every slice the new ranks need, grouped by (src, dst) pair, for every
    rank or only those of ``for_device``'s part (:func:`planned_classes`)."""
    did, node_of = devices.id, devices.node_of
    n_dev = len(devices.names)
    devices_of_class: dict[int, list[int]] = defaultdict(list)
    for d in devices.old:
        devices_of_class[inputs.old_device_class[d]].append(did[d])
    fragments = Fragments(old, new, cover, devices_of_class).of
    picker = SourcePicker(node_of, n_dev, inputs.staging_bytes)
    load = picker.load
    take = picker.take
    pairs: dict[int, list[Carried]] = {}
    pair_bytes: dict[int, int] = {}
    local_out: dict[str, list[Piece]] = {}
    missing_out: dict[str, list[Piece]] = {}
    local_bytes = missing_bytes = 0
    planned = planned_classes(inputs, chosen, for_device)
    for r, d in enumerate(chosen.ranks):
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
    return Routes(pairs, pair_bytes, local_out, missing_out, local_bytes, missing_bytes)
