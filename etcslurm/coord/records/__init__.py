"""Typed records: generation records, change requests and events.

Why one package: the runtime writes these, the coordinator stores them, the monitor and
the tests read them; when each built or read plain dicts of its own they disagreed (field
aliases, a record kind only one side knew).  Every record is a frozen msgspec Struct with
``to_json()`` (plain JSON data, what Redis holds) and ``from_json()``, which checks every
field and raises :class:`~etcslurm.errors.RecordError` naming the record and the field for
anything unknown, missing or of the wrong type.  JSON only; nothing is ever unpickled.

* :mod:`~etcslurm.coord.records.codec`: the one codec (:class:`Record`, ``replace``,
  ``field_summary``).
* :mod:`~etcslurm.coord.records.generation`: :class:`GenerationRecord` (with its
  :class:`Assignment` rows), what the ``gen`` key holds, and its compact stored form.
* :mod:`~etcslurm.coord.records.change`: :class:`ChangeRequest`, an operator's
  (``etcslurm resize``) or a leaving worker's request, queued in the ``changes`` list.
* :mod:`~etcslurm.coord.records.events`: one payload class per event type
  (:data:`EVENT_TYPES`), inside the :class:`Event` envelope that :func:`parse_event`
  builds from a stream entry.

docs/coordinator.md and docs/monitor.md list these fields; this package is the source.
"""

from __future__ import annotations

from etcslurm.coord.records.causes import (
    RELEASED,
    RESIZE_CAUSES,
    leave_cause,
    moved_over_lower_bound,
    resize_cause,
)
from etcslurm.coord.records.change import ChangeRequest, CheckpointRequest
from etcslurm.coord.records.codec import Record, field_summary, replace
from etcslurm.coord.records.events import (
    AUTOGROW_ACTIONS,
    EVENT_TYPES,
    Autogrow,
    ChangeRequested,
    CheckpointRequested,
    CheckpointSaving,
    CoordinatorBack,
    Error,
    Event,
    EventData,
    GenerationStart,
    JobRequeued,
    MigrationDone,
    MigrationProgress,
    MigrationRebuild,
    NodeReleased,
    RunEnd,
    RunRollback,
    RunStandby,
    Step,
    WorkerGone,
    WorkerRegistered,
    WorkerSignal,
    WorkerState,
    event_data,
    parse_event,
)
from etcslurm.coord.records.generation import (
    KINDS,
    VERSION,
    Assignment,
    GenerationRecord,
    pack_ids,
    unpack_ids,
)

__all__ = [
    "AUTOGROW_ACTIONS",
    "EVENT_TYPES",
    "KINDS",
    "RELEASED",
    "RESIZE_CAUSES",
    "VERSION",
    "Assignment",
    "Autogrow",
    "ChangeRequest",
    "ChangeRequested",
    "CheckpointRequest",
    "CheckpointRequested",
    "CheckpointSaving",
    "CoordinatorBack",
    "Error",
    "Event",
    "EventData",
    "GenerationRecord",
    "GenerationStart",
    "JobRequeued",
    "MigrationDone",
    "MigrationProgress",
    "MigrationRebuild",
    "NodeReleased",
    "Record",
    "RunEnd",
    "RunRollback",
    "RunStandby",
    "Step",
    "WorkerGone",
    "WorkerRegistered",
    "WorkerSignal",
    "WorkerState",
    "event_data",
    "field_summary",
    "leave_cause",
    "moved_over_lower_bound",
    "pack_ids",
    "parse_event",
    "replace",
    "resize_cause",
    "unpack_ids",
]
