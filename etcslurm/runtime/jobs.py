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

from collections.abc import Sequence
from typing import Any

from etcslurm.coord.records import GenerationRecord
from etcslurm.core.layout import ParallelConfig
from etcslurm.core.planner import MigrationPlan, message_cap
from etcslurm.core.state import Piece
from etcslurm.errors import StateLostError
from etcslurm.runtime.generation import LayoutSettings, plan_inputs
from etcslurm.runtime.migration import MigrationJob, analytic_plan, live_plan

#: the ways a change can run on a participant (see the module docstring)
PLAN_PATHS = ("nothing_moves", "analytic", "live")


def migration_job(world: Any, settings: LayoutSettings, record: GenerationRecord,
                  worker_id: str, *, held: Sequence[tuple[Piece, Any]],
                  old: tuple[ParallelConfig, int] | None, trainee: Any) -> MigrationJob:
    """This worker's part in the change ``record``.

    ``world``: a :class:`~etcslurm.runtime.world.World` (its ``analytic`` flag, whether a
    model can be kept, the pieces a layout's rank holds); ``held``: the old state this
    worker read; ``old``: its old layout and rank (None for a joiner); ``trainee``: its
    old model (kept when a DP-only change moves none of its parameters).
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
    nothing = nothing_moves(world.analytic, settings.optimizer, record)
    path = "nothing_moves" if nothing else ("analytic" if world.analytic else "live")

    def plan(migration: Any) -> MigrationPlan:
        if world.analytic:
            return plan_analytically(settings, record, migration)
        return plan_live(settings, record, migration)

    return MigrationJob(
        generation=record.generation, me=ids[worker_id], new_rank=new_rank, layout=layout,
        held=list(held), members=[ids[w] for w in (by_rank if on_world else record.union)],
        on_world=on_world, scalars=dict(record.scalars) if new_rank is not None else None,
        plan=plan, old=old, expected=world.expected_pieces if world.analytic else None,
        keep=keep, nothing_moves=nothing, path=path,
    )


def nothing_moves(analytic: bool, optimizer: str, record: GenerationRecord) -> bool:
    """Whether every participant can tell from ``record`` alone that no byte moves: the
    same TP, PP and EP, no participant without old state, the replicated optimizer, and
    the decider's plan of etcslurm's own model moves nothing."""
    if not analytic or optimizer != "adam" or not record.from_layout:
        return False
    a, b = ParallelConfig.parse(record.from_layout), ParallelConfig.parse(record.to_layout)
    if (a.tp, a.pp, a.ep) != (b.tp, b.pp, b.ep):
        return False
    if any(pid.startswith("join:") for pid in record.planner_ids.values()):
        return False
    stats = record.plan_stats or {}
    return stats.get("moved_bytes") == 0 and not stats.get("missing_bytes")


def plan_analytically(settings: LayoutSettings, record: GenerationRecord,
                      migration: Any) -> MigrationPlan:
    """The plan of ``record`` for etcslurm's own model: from the analytic inputs the
    decider planned from, with its assignment (no descriptions exchanged; the holdings
    check compares the live state with the same model)."""
    from etcslurm.core.gpt_state import padded_vocab

    old_tp = ParallelConfig.parse(record.from_layout or record.to_layout).tp
    return analytic_plan(
        migration, plan_inputs(settings, record),
        assignment=[record.planner_ids[w] for w in record.workers_by_rank()],
        old_vocab_rows=padded_vocab(settings.spec, old_tp), totals=record.plan_stats)


def plan_live(settings: LayoutSettings, record: GenerationRecord,
              migration: Any) -> MigrationPlan:
    """The plan of ``record`` from the live state (descriptions exchanged on the exchange
    group), with the assignment the decider published."""
    ids, dead = record.planner_ids, set(record.dead)
    plan = live_plan(
        migration,
        nodes={ids[w]: record.nodes.get(w, "?") for w in record.union},
        leaving=[ids[w] for w in record.leaving if w not in dead],
        joiners=[ids[w] for w in record.union if ids[w].startswith("join:")],
        assignment=[ids[w] for w in record.workers_by_rank()],
        staging_bytes=message_cap(settings.staging_bytes),
        tp=ParallelConfig.parse(record.to_layout).tp,
    )
    lost = int(plan.stats.get("lost_pieces", 0))
    if lost:
        known = [p for pieces in plan.missing.values() for p in pieces][:1]
        raise StateLostError(
            f"generation {record.generation}: {lost} state pieces of the new layout have no "
            f"holder among the participants (first: "
            f"{known or 'in another rank’s part of the plan'})")
    return plan
