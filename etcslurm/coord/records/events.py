"""Events: one typed payload per type of the ``events`` stream, and its envelope.

The runtime, the coordinator and the CLI write them (``Coordinator.emit`` checks every
payload against its class here), the monitor reads them (:func:`parse_event`).  The
types and fields are listed in docs/monitor.md, "Event payloads".
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from etcslurm.coord.records.change import ChangeRequest, CheckpointRequest
from etcslurm.coord.records.codec import Number, Record, check, decode, show
from etcslurm.coord.records.generation import WORKER_STATES, Assignment, GenerationRecord
from etcslurm.errors import RecordError


class EventData(Record):
    """Base of the event payloads; ``TYPE`` is the stream's ``type`` field."""

    TYPE: ClassVar[str] = ""


class WorkerRegistered(EventData):
    """A worker joined the run (``Coordinator.register``); it starts as ``joining``."""

    TYPE: ClassVar[str] = "worker.registered"
    WHAT: ClassVar[str] = "worker.registered event"

    host: str | None = None
    node: str | None = None
    pid: int | None = None
    device: str | None = None
    address: str | None = None
    slurm_job: str | None = None
    slurm_step: str | None = None


class WorkerState(EventData):
    """The emitting worker changed state (``Coordinator.set_state``)."""

    TYPE: ClassVar[str] = "worker.state"
    WHAT: ClassVar[str] = "worker.state event"

    state: str
    previous: str | None = None
    rank: int | None = None
    leave_deadline: Number | None = None  # unix seconds

    def __post_init__(self) -> None:
        for name in ("state", "previous"):
            value = getattr(self, name)
            if value is not None and value not in WORKER_STATES:
                raise RecordError(f"{self.WHAT}: field {name!r} must be one of "
                                  f"{', '.join(WORKER_STATES)}, got {value!r}")


class WorkerGone(EventData):
    """The leader recorded another (dead or departed) worker as gone."""

    TYPE: ClassVar[str] = "worker.gone"
    WHAT: ClassVar[str] = "worker.gone event"

    worker: str
    reason: str = ""


class WorkerSignal(EventData):
    """A worker got a preemption signal (``signal``: ``USR2``, ``SIGUSR2`` or a number)."""

    TYPE: ClassVar[str] = "worker.signal"
    WHAT: ClassVar[str] = "worker.signal event"

    worker: str
    signal: str | int
    node: str | None = None
    budget_s: Number | None = None
    received_at: Number | None = None  # unix seconds


class GenerationStart(EventData):
    """A generation was published (``Coordinator.publish_generation``): its shown fields."""

    TYPE: ClassVar[str] = "generation.start"
    WHAT: ClassVar[str] = "generation.start event"

    generation: int
    kind: str
    step: int
    from_layout: str | None = msgspec.field(name="from")
    to_layout: str = msgspec.field(name="to")
    world: int
    assignment: tuple[Assignment, ...]
    leaving: tuple[str, ...] = ()
    joining: tuple[str, ...] = ()
    reason: str = ""

    @classmethod
    def of(cls, rec: GenerationRecord) -> GenerationStart:
        return cls(rec.generation, rec.kind, rec.step, rec.from_layout, rec.to_layout,
                   rec.world, rec.assignment, rec.leaving, rec.joining, rec.reason)


class MigrationRebuild(EventData):
    """A worker starts building its model for generation ``gen``."""

    TYPE: ClassVar[str] = "migration.rebuild"
    WHAT: ClassVar[str] = "migration.rebuild event"

    gen: int
    worker: str
    rank: int | None


class MigrationProgress(EventData):
    """Bytes one worker sent/received so far in the migration to ``gen`` (cumulative)."""

    TYPE: ClassVar[str] = "migration.progress"
    WHAT: ClassVar[str] = "migration.progress event"

    gen: int
    worker: str
    rank: int | None  # None: a worker without a rank in the new world (a leaver)
    sent: int
    recv: int
    total_send: int
    total_recv: int


class MigrationDone(EventData):
    """The migration to ``gen`` is committed (emitted by the new rank 0)."""

    TYPE: ClassVar[str] = "migration.done"
    WHAT: ClassVar[str] = "migration.done event"

    gen: int
    seconds: Number
    moved_bytes: int
    local_bytes: int
    checkpoint_bytes: int = 0
    pause_seconds: Number | None = None
    transfer_seconds: Number | None = None
    rebuild_seconds: Number | None = None
    from_layout: str | None = msgspec.field(name="from", default=None)
    to_layout: str | None = msgspec.field(name="to", default=None)
    #: seconds per phase of the pause on the new rank 0: ``decide`` (signal or boundary →
    #: the record), then the migration's ``build``, ``group``, ``plan``, ``prepare``,
    #: ``exchange``, ``commit``
    phases: dict[str, Number] | None = None


class Step(EventData):
    """A training step finished (emitted by rank 0)."""

    TYPE: ClassVar[str] = "step"
    WHAT: ClassVar[str] = "step event"

    gen: int
    step: int
    loss: Number
    tokens_per_s: Number | None = None


class RunEnd(EventData):
    """The run ended (``Coordinator.end_run``, or the whole-run checkpoint)."""

    TYPE: ClassVar[str] = "run.end"
    WHAT: ClassVar[str] = "run.end event"

    reason: str = ""
    step: int | None = None
    keep_s: Number | None = None
    checkpoint: str | None = None


class NodeReleased(EventData):
    """A worker leaves because Slurm wants its node back soon without a signal: the node
    is draining, or a reservation that is not the job's starts on it (``reason`` says
    which); it hands its state over at the next step boundary like a signalled one."""

    TYPE: ClassVar[str] = "node.released"
    WHAT: ClassVar[str] = "node.released event"

    worker: str
    reason: str
    node: str | None = None
    budget_s: Number | None = None


#: what an autogrow decision did (``etcslurm autogrow``)
AUTOGROW_ACTIONS = ("start", "submit", "cancel", "backoff", "stop")


class Autogrow(EventData):
    """A decision of ``etcslurm autogrow``: it submitted a one-node grow job, cancelled
    pending ones, backed off, started or stopped (``reason`` says why); ``nodes``: the
    run's nodes (in use + starting) it counted, ``idle``: idle nodes it saw."""

    TYPE: ClassVar[str] = "autogrow"
    WHAT: ClassVar[str] = "autogrow event"

    action: str
    reason: str
    jobs: tuple[str, ...] = ()
    nodes: int | None = None
    max_nodes: int | None = None
    idle: int | None = None
    pending: int | None = None

    def __post_init__(self) -> None:
        if self.action not in AUTOGROW_ACTIONS:
            raise RecordError(f"{self.WHAT}: field 'action' must be one of "
                              f"{', '.join(AUTOGROW_ACTIONS)}, got {self.action!r}")


class CheckpointRequested(EventData):
    """A :class:`CheckpointRequest` was made (same fields)."""

    TYPE: ClassVar[str] = "checkpoint.requested"
    WHAT: ClassVar[str] = "checkpoint.requested event"

    by: str
    ts: Number
    reason: str = ""

    @classmethod
    def of(cls, req: CheckpointRequest) -> CheckpointRequested:
        return cls(req.by, req.ts, req.reason)


class CheckpointSaving(EventData):
    """The step boundary took a checkpoint request: the save of ``step`` into ``path``
    began (complete once the directory's ``latest_checkpointed_iteration.txt`` names it)."""

    TYPE: ClassVar[str] = "checkpoint.saving"
    WHAT: ClassVar[str] = "checkpoint.saving event"

    step: int
    path: str
    by: str = ""


class RunStandby(EventData):
    """No allowed layout of the workers at hand fits (too few, or device memory): the run
    waits as standby for more (``reason``: one line, ``devices``: how many were here)."""

    TYPE: ClassVar[str] = "run.standby"
    WHAT: ClassVar[str] = "run.standby event"

    reason: str
    devices: int | None = None


class RunRollback(EventData):
    """Dead workers took state no replica holds: the run goes on from the latest complete
    periodic checkpoint (``step``), on the workers that are left; ``lost_steps`` are
    trained again."""

    TYPE: ClassVar[str] = "run.rollback"
    WHAT: ClassVar[str] = "run.rollback event"

    step: int
    lost_steps: int
    checkpoint: str
    reason: str = ""


class Error(EventData):
    """Something failed; ``message`` says what."""

    TYPE: ClassVar[str] = "error"
    WHAT: ClassVar[str] = "error event"

    message: str
    worker: str | None = None


class CoordinatorBack(EventData):
    """The coordinator answers a worker again after an outage.  ``failed_calls``: the calls
    of that worker that met it unreachable (one: reachability is then judged by the
    heartbeat, so no later step waits for it); ``kept_events``: the events kept meanwhile,
    sent now with their own times."""

    TYPE: ClassVar[str] = "coordinator.back"
    WHAT: ClassVar[str] = "coordinator.back event"

    worker: str | None
    unreachable_s: Number
    failed_calls: int
    kept_events: int


class JobRequeued(EventData):
    """A worker asked Slurm to requeue its job after the whole-run checkpoint."""

    TYPE: ClassVar[str] = "job.requeued"
    WHAT: ClassVar[str] = "job.requeued event"

    worker: str
    job: str


class ChangeRequested(EventData):
    """A :class:`ChangeRequest` was queued (same fields)."""

    TYPE: ClassVar[str] = "change.requested"
    WHAT: ClassVar[str] = "change.requested event"

    to: str | None
    drain: tuple[str, ...]
    by: str
    ts: Number
    reason: str = ""

    @classmethod
    def of(cls, req: ChangeRequest) -> ChangeRequested:
        return cls(req.to, req.drain, req.by, req.ts, req.reason)


#: Every event type the runtime, coordinator and CLI write, and its payload class.
EVENT_TYPES: dict[str, type[EventData]] = {
    c.TYPE: c
    for c in (WorkerRegistered, WorkerState, WorkerGone, WorkerSignal, NodeReleased,
              ChangeRequested, GenerationStart, MigrationRebuild, MigrationProgress,
              MigrationDone, Step, RunEnd, RunRollback, RunStandby, Error, JobRequeued,
              Autogrow, CheckpointRequested, CheckpointSaving, CoordinatorBack)
}


def event_data(type: str, fields: dict[str, Any]) -> EventData:
    """The payload of an event of ``type`` from its fields (``Coordinator.emit``)."""
    cls = EVENT_TYPES.get(type)
    if cls is None:
        raise RecordError(f"unknown event type {type!r} (known: {', '.join(sorted(EVENT_TYPES))})")
    return cls.from_json(fields)


class Event(msgspec.Struct, frozen=True):
    """One entry of the ``events`` stream: who (``worker``: worker id or ``operator``)
    emitted what (``data``, typed by ``type``) when (``ts``, unix seconds); ``id``: the
    stream id."""

    type: str
    ts: float
    worker: str
    data: EventData
    id: str = ""

    def subject(self) -> str | None:
        """The worker the event is about: the payload's ``worker``, else the emitter's."""
        who = getattr(self.data, "worker", None)
        if who:
            return str(who)
        return None if self.worker in ("", "operator") else self.worker


def parse_event(raw: dict[str, Any]) -> Event:
    """An :class:`Event` from a stream entry ``{id?, type, ts, worker, data}``.

    Unknown types and malformed fields raise :class:`RecordError` naming them.
    """
    if not isinstance(raw, dict):
        raise RecordError(f"event: expected a JSON object, got {type(raw).__name__}")
    eid = str(raw.get("id", ""))
    where = f"event {eid}" if eid else "event"
    kind = raw.get("type")
    if not isinstance(kind, str):
        raise RecordError(f"{where}: field 'type' must be a string, got {show(kind)}")
    ts = check(raw.get("ts"), Number, f"{where} ({kind}): field 'ts'")
    worker = check(raw.get("worker"), str, f"{where} ({kind}): field 'worker'")
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise RecordError(f"{where}: unknown event type {kind!r}")
    data = decode(cls, raw.get("data"), f"{where} ({kind})")
    return Event(kind, ts, worker, data, eid)
