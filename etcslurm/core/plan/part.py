"""One device's part of the inputs: the blocks of the parts of the plan a device takes
no part in, dropped before anything is indexed.

Why: a rank at a resize needs only its own messages, copies and missing pieces, and they
depend only on the overlap components of its old class and of its new rank's class.
Building the index and the overlap of the whole state is most of a rank's planning time
at scale, so a rank that knows the assignment narrows the inputs first, coarsely (no box
overlaps), to a superset of its components; the planner then narrows to the exact ones.
"""

from __future__ import annotations

from collections import defaultdict

from etcslurm.core.plan.inputs import PlanInputs
from etcslurm.core.state import Piece


class UnionFind:
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


def device_part(inputs: PlanInputs, assignment: list[str], device: str) -> PlanInputs:
    """``inputs`` without the blocks of the plan's parts ``device`` takes no part in.

    Why: a rank's part is a fraction of the state, and building the index and the overlap
    terms of the whole state (all the planner does before it knows the components)
    is most of a rank's planning time at scale.  The parts are found coarsely here, with
    no box overlaps: two pieces can only share elements when they share a key and their
    axis-0 ranges meet, so *cells* (a key and a maximal run of meeting axis-0 ranges of
    either layout) joined by the classes that hold or need them form components that are
    each a union of the planner's own (overlap) components.  Whole blocks of other
    components are dropped (a block belongs to one: its classes all meet its cells); the
    devices, classes and ranks stay, so every tie-break is the whole plan's, and
    the planner then narrows to the exact components itself.
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
    parts = UnionFind(n_cells + len(inputs.old_class_blocks) + len(inputs.new_class_blocks))
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
