"""The planner: :func:`plan`, the composition of the stages.

inputs (:mod:`.inputs`, :mod:`.part`) → index (:mod:`.index`, :mod:`.overlap`) → assign
(:mod:`.assign`, :mod:`.matching`) → sources (:mod:`.sources`, :mod:`.picker`) → schedule
(:mod:`.schedule`) → stats (:mod:`.stats`); each stage a function of the earlier stages'
results, each result a named type.
"""

from __future__ import annotations

import gc
import time

from etcslurm.core.plan.assign import assign
from etcslurm.core.plan.index import Index
from etcslurm.core.plan.inputs import PlanInputs, check_assignment, devices_of
from etcslurm.core.plan.output import MigrationPlan
from etcslurm.core.plan.overlap import cover
from etcslurm.core.plan.part import device_part
from etcslurm.core.plan.schedule import schedule
from etcslurm.core.plan.sources import sources
from etcslurm.core.plan.stats import statistics
from etcslurm.errors import UsageError


def plan(inputs: PlanInputs, assignment: list[str] | None = None, *,
         for_device: str | None = None) -> MigrationPlan:
    """The migration plan of ``inputs``: who plays which new rank, and what moves.

    ``assignment`` (new rank → device), when given, replaces the assignment stage: the
    runtime plans from the live state after the new world is built, so the assignment
    the decider published is fixed by then; sources, messages and rounds are planned for
    it.

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
    (:func:`~etcslurm.core.plan.part.device_part`) and the totals are the part's too.
    """
    if assignment is not None:
        check_assignment(inputs, assignment)
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
            inputs = device_part(inputs, assignment, for_device)
        return _stages(inputs, assignment, for_device, t0)
    finally:
        if was_enabled:
            gc.enable()


def _stages(inputs: PlanInputs, given: list[str] | None, for_device: str | None,
            t0: float) -> MigrationPlan:
    inputs.validate()
    devices = devices_of(inputs)
    old = Index(inputs.old_blocks, inputs.old_class_blocks)
    new = Index(inputs.new_blocks, inputs.new_class_blocks)
    overlap = cover(old, new)
    chosen = assign(inputs, devices, old, new, overlap.terms, given)
    routes = sources(inputs, devices, old, new, overlap, chosen, for_device)
    sched = schedule(routes, devices, inputs.staging_bytes)
    stats = statistics(inputs, devices, old, new, overlap.terms, chosen, routes, sched,
                       given=given is not None, for_device=for_device, t0=t0)
    return MigrationPlan(chosen.ranks, sched.messages, routes.local, routes.missing,
                         chosen.idle, stats)
