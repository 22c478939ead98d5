"""What a plan costs, against what it could cost: bytes moved against the lower bound
(the optimal assignment's) and the naive assignment, messages, rounds, the busiest sender
and receiver, staging, bytes between nodes.

Why the bounds beside the plan: they are what the property tests and the benchmarks
check (moved equals the lower bound; the naive baseline is what a planner that ignores
locality would move).
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np

from etcslurm.core.plan.assign import Assignment, Terms
from etcslurm.core.plan.index import Index
from etcslurm.core.plan.inputs import Devices, PlanInputs
from etcslurm.core.plan.schedule import Schedule
from etcslurm.core.plan.sources import Routes


def statistics(inputs: PlanInputs, devices: Devices, old: Index, new: Index, terms: Terms,
               chosen: Assignment, routes: Routes, sched: Schedule, *, given: bool,
               for_device: str | None, t0: float) -> dict:
    """The plan's ``stats`` (``t0``: when its clock started).

    A part (``for_device``) describes only that part's messages and rounds; its byte
    totals are the whole move's when the whole state was indexed (no ``given``
    assignment: the decider), else the part's.
    """
    placed = len(sched.size)
    size, src, dst = sched.size, sched.src, sched.dst
    n_dev = len(devices.names)
    nodes = np.asarray(devices.node_of, dtype=np.int64)
    need_bytes = sum(new.class_bytes[c] for c in inputs.new_rank_class)
    moved = int(size.sum())
    inter = int(size[nodes[src] != nodes[dst]].sum()) if placed else 0
    sent = np.bincount(src, weights=size, minlength=n_dev) if placed else [0]
    recv = np.bincount(dst, weights=size, minlength=n_dev) if placed else [0]
    peak = int(size.max()) if placed else 0
    rounds = int(sched.round.max()) if placed else -1
    local_bytes, missing_bytes = routes.local_bytes, routes.missing_bytes
    if for_device is not None and not given:
        # the whole state was indexed (the decider): the whole move's byte totals, not the
        # part's -- every needed element is in place, arrives, or is missing
        missing_bytes = missing_total(inputs, old, new, terms)
        local_bytes = chosen.in_place
        moved = need_bytes - chosen.in_place - missing_bytes
    stats = {
        "state_bytes": sum(old.class_bytes[c] for c in inputs.old_device_class.values()),
        "needed_bytes": need_bytes,
        "moved_bytes": moved,
        "local_bytes": local_bytes,
        "inter_node_bytes": inter,
        "lower_bound_moved_bytes": need_bytes - chosen.in_place - missing_bytes,
        "naive_moved_bytes": need_bytes - chosen.naive_in_place - missing_bytes,
        "missing_bytes": missing_bytes,
        "messages": len(sched.messages),
        "rounds": 1 + rounds,
        "max_send_bytes": int(max(sent, default=0)),
        "max_recv_bytes": int(max(recv, default=0)),
        "peak_staging_bytes": peak,
        "tp_groups_split_across_nodes": _tp_split(chosen.ranks, inputs),
        "plan_seconds": round(time.perf_counter() - t0, 6),
    }
    if for_device is not None:
        stats["part"] = True
    return stats


def missing_total(inputs: PlanInputs, old: Index, new: Index, terms: Terms) -> int:
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


def _tp_split(assignment: list[str], inputs: PlanInputs) -> int:
    """How many new TP groups span more than one node."""
    tp = max(1, inputs.tp)
    return sum(
        len({inputs.nodes[d] for d in assignment[g:g + tp]}) > 1
        for g in range(0, len(assignment), tp)
    )
