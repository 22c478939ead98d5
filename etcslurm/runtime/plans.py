"""Where a migration's plan comes from: the analytic model of etcslurm's own GPT, or the
live state the participants describe to each other (any other model).

Both give every participant its own part of the one deterministic plan, with the
assignment the decider published; what only the whole plan knows (is anything lost, the
whole move's bytes) comes from the decider's record or is summed over the group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from etcslurm.coord.records import GenerationRecord
from etcslurm.core.layout import ParallelConfig
from etcslurm.core.plan import MigrationPlan, PlanInputs, message_cap
from etcslurm.core.state import Piece
from etcslurm.errors import MigrationError, StateLostError
from etcslurm.runtime.generation import LayoutSettings, plan_inputs
from etcslurm.runtime.migration import Migration


def live_plan(migration: Migration, *, nodes: dict[str, str], leaving: list[str],
              joiners: list[str], assignment: list[str], staging_bytes: int,
              tp: int = 1) -> MigrationPlan:
    """The plan from the live state: every participant describes what it holds and needs,
    the descriptions are exchanged on the exchange group, and every participant plans on
    the same inputs with the published ``assignment`` (new rank → planner id).  Works for
    any model whose state :func:`etcslurm.megatron.sharded_meta.local_state` describes.

    Each participant plans only its own part of the move (``plan(..., for_device=me)``:
    its messages, copies and missing pieces are the whole plan's, at a fraction of the
    cost at scale).  What only the whole plan knows is summed over the group, each
    participant adding its own share: ``stats["lost_pieces"]`` (the same verdict
    everywhere; the pieces themselves are in ``missing`` where they are known),
    ``moved_bytes`` and ``local_bytes`` (the whole move's, as reported)."""
    from etcslurm.core.descriptions import inputs_from_descriptions
    from etcslurm.core.plan import plan
    from etcslurm.transfer.describe import exchange_descriptions, sum_over

    job = migration.job
    held = [p for p, _ in job.held] if job.old is not None else None
    needed = [p for p, _ in migration.needed] if job.new_rank is not None else None
    found = exchange_descriptions(migration.group, job.me, held, needed, job.new_rank,
                                  migration.timeout)
    if sorted(found.needed) != list(range(len(assignment))):
        raise MigrationError(
            f"generation {job.generation}: new ranks {sorted(found.needed)} described their "
            f"state, the layout has {len(assignment)}")
    inputs = inputs_from_descriptions(
        found.held, [found.needed[r] for r in range(len(assignment))], nodes=nodes,
        leaving=leaving, joiners=joiners, staging_bytes=staging_bytes, tp=tp)
    result = plan(inputs, assignment=assignment, for_device=job.me)
    _split_fill(migration, result, [p for pieces in found.held.values() for p in pieces])
    me = job.me
    lost, moved, local = sum_over(migration.group, [
        len(result.missing.get(me, [])),
        sum(m.nbytes for m in result.messages if m.dst == me),
        sum(p.nbytes for p in result.local.get(me, [])),
    ], migration.timeout)
    result.stats.update(lost_pieces=lost, moved_bytes=moved, local_bytes=local)
    return result


def analytic_plan(migration: Migration, inputs: PlanInputs, *, assignment: list[str],
                  old_vocab_rows: int, totals: Mapping[str, Any] | None = None) -> MigrationPlan:
    """The plan from the analytic model of etcslurm's own GPT: ``inputs`` are the ones
    the decider planned from (:func:`etcslurm.runtime.generation.plan_inputs`), rebuilt
    from the record by every participant, and ``assignment`` the one it published.

    Why not :func:`live_plan`: describing the state to each other is an all-gather of
    every participant's description (and an all-reduce of the totals) on the exchange
    group, 0.03-0.06 s of a gpt-tiny resize's pause, to learn what the analytic
    model already says.  It stays exact because ``prepare``'s holdings check compares
    this participant's live pieces, old and new, with the same analytic model (a model
    that differs is refused before anything moves), and the decider's verdict covers the
    whole move: a ``resize`` record loses nothing (else it would be a ``stop`` or a
    rollback), so a lost piece here is a bug (:class:`MigrationError`).  Vocabulary rows
    no old layout had are zero-filled (``migration.fill``).  ``totals``: the decider's
    whole-move ``moved_bytes``/``local_bytes`` (the record's ``plan_stats``), reported
    instead of this part's."""
    from etcslurm.core.plan import plan
    from etcslurm.megatron_state import split_vocab_fill

    job = migration.job
    result = plan(inputs, assignment=assignment, for_device=job.me)
    for device, pieces in result.missing.items():
        fill, lost = split_vocab_fill(pieces, old_vocab_rows)
        if lost:
            raise MigrationError(
                f"generation {job.generation}: {device} needs {lost[0]} (and "
                f"{len(lost) - 1} more pieces) that no participant holds, but the decider "
                "found nothing lost")
        if device == job.me:
            migration.fill = fill
    result.missing = {}
    result.stats["lost_pieces"] = 0
    for key in ("moved_bytes", "local_bytes"):
        if totals and totals.get(key) is not None:
            result.stats[key] = int(totals[key])
    return result


def _split_fill(migration: Migration, result: MigrationPlan, old_pieces: list[Piece]) -> None:
    """Vocabulary rows that no old rank ever held are not lost: they are zero-filled
    (``migration.fill``); ``result.missing`` keeps only what is really lost."""
    from etcslurm.megatron_state import split_vocab_fill, vocab_rows

    if not result.missing:
        return
    old_rows = vocab_rows(old_pieces)
    lost: dict[str, list[Piece]] = {}
    for device, pieces in result.missing.items():
        fill, really_lost = split_vocab_fill(pieces, old_rows)
        if device == migration.job.me:
            migration.fill = fill
        if really_lost:
            lost[device] = really_lost
    result.missing = lost


def plan_analytically(settings: LayoutSettings, record: GenerationRecord, migration: Any,
                      select: Callable[[Piece], bool] | None = None) -> MigrationPlan:
    """The plan of ``record`` for etcslurm's own model: from the analytic inputs the
    decider planned from, with its assignment (no descriptions exchanged; the holdings
    check compares the live state with the same model); ``select``: only these pieces
    (the decider's totals are then not this move's)."""
    from etcslurm.megatron_state import padded_vocab

    old_tp = ParallelConfig.parse(record.from_layout or record.to_layout).tp
    inputs = plan_inputs(settings, record)
    if select is not None:
        inputs = dataclasses.replace(
            inputs, old_blocks=[[p for p in b if select(p)] for b in inputs.old_blocks or []],
            new_blocks=[[p for p in b if select(p)] for b in inputs.new_blocks or []])
    return analytic_plan(
        migration, inputs, assignment=[record.planner_ids[w] for w in record.workers_by_rank()],
        old_vocab_rows=padded_vocab(settings.spec, old_tp),
        totals=record.plan_stats if select is None else None)


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
