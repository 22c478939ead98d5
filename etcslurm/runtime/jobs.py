"""From a generation record to this participant's migration job.

The one place that decides how a change runs on a participant, for the runtime's resize
and for ``etcslurm bench migrate`` alike (so the benchmark proves the path production
takes):

- ``nothing_moves``: every participant can tell from the record that no byte moves (a DP
  shrink with the replicated optimizer): no exchange group, no plan; each new member keeps
  its model and the commit barrier is the only collective;
- ``analytic``: etcslurm's own GPT, planned from the analytic model of its state (the
  inputs the decider planned from), no descriptions exchanged;
- ``live``: any other model, planned from live descriptions exchanged on the group.

``on_world`` (nobody leaves or stays idle) runs the exchange on the new world itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from etcslurm.coord.records import GenerationRecord
from etcslurm.core.layout import ParallelConfig
from etcslurm.core.plan import MigrationPlan
from etcslurm.core.state import Piece
from etcslurm.runtime.generation import LayoutSettings
from etcslurm.runtime.migration import MigrationJob
from etcslurm.runtime.plans import plan_analytically, plan_live

#: the ways a change can run on a participant (see the module docstring)
PLAN_PATHS = ("nothing_moves", "analytic", "live")


def migration_job(world: Any, settings: LayoutSettings, record: GenerationRecord,
                  worker_id: str, *, held: Sequence[tuple[Piece, Any]],
                  old: tuple[ParallelConfig, int] | None, trainee: Any,
                  select: Callable[[Piece], bool] | None = None) -> MigrationJob:
    """This worker's part in the change ``record``.

    ``world``: a :class:`~etcslurm.runtime.world.World` (its ``analytic`` flag, whether a
    model can be kept, the pieces a layout's rank holds); ``held``: the old state this
    worker read; ``old``: its old layout and rank (None for a joiner); ``trainee``: its
    old model (kept when a DP-only change moves none of its parameters); ``select``: the
    pieces to move (None: every one).
    """
    ids = record.planner_ids
    new_rank = record.rank_of(worker_id)
    layout = ParallelConfig.parse(record.to_layout)
    keep = None
    if old is not None and new_rank is not None and world.can_keep(trainee, old,
                                                                   (layout, new_rank)):
        keep = trainee
    by_rank = record.workers_by_rank()
    on_world = set(by_rank) == set(record.union)
    analytic = world.analytic
    nothing = select is None and nothing_moves(analytic, settings.optimizer, record)
    path = "nothing_moves" if nothing else ("analytic" if analytic else "live")
    if select is not None:
        held, keep = [(p, v) for p, v in held if select(p)], None

    def plan(migration: Any) -> MigrationPlan:
        if analytic:
            return plan_analytically(settings, record, migration, select)
        return plan_live(settings, record, migration)

    def expected(layout: ParallelConfig, rank: int) -> list[Piece]:
        pieces = world.expected_pieces(layout, rank)
        return [p for p in pieces if select is None or select(p)]

    return MigrationJob(
        generation=record.generation, me=ids[worker_id], new_rank=new_rank, layout=layout,
        held=list(held), members=[ids[w] for w in (by_rank if on_world else record.union)],
        on_world=on_world, scalars=dict(record.scalars) if new_rank is not None else None,
        plan=plan, old=old, expected=expected if analytic else None,
        keep=keep, nothing_moves=nothing, path=path, select=select,
    )


def nothing_moves(analytic: bool, optimizer: str, record: GenerationRecord) -> bool:
    """Whether every participant can tell from ``record`` alone that no byte moves: the
    same TP, PP, EP and expert TP, no participant without old state, the replicated optimizer, and
    the decider's plan of etcslurm's own model moves nothing."""
    if not analytic or optimizer != "adam" or not record.from_layout:
        return False
    a, b = ParallelConfig.parse(record.from_layout), ParallelConfig.parse(record.to_layout)
    if (a.tp, a.pp, a.ep, a.expert_tp) != (b.tp, b.pp, b.ep, b.expert_tp):
        return False
    if any(pid.startswith("join:") for pid in record.planner_ids.values()):
        return False
    stats = record.plan_stats or {}
    return stats.get("moved_bytes") == 0 and not stats.get("missing_bytes")
