"""Typed, versioned records: generation records, events and change requests.

Why one module: the runtime writes these, the coordinator stores them, the monitor and
the tests read them; when each built or read plain dicts of its own they disagreed (field
aliases, a record kind only one side knew).  Every record here is a frozen dataclass with
``to_json()`` (plain JSON data, what Redis holds) and ``from_json()``, which checks every
field and raises :class:`~etcslurm.errors.RecordError` naming the record and the field for
anything unknown, missing or of the wrong type.  JSON only; nothing is ever unpickled.

* :class:`GenerationRecord` (with its :class:`Assignment` rows): what the ``gen`` key holds.
* One dataclass per event type (:data:`EVENT_TYPES`), inside the :class:`Event` envelope
  that :func:`parse_event` builds from a stream entry.
* :class:`ChangeRequest`: an operator's (``etcslurm resize``) or a leaving worker's
  request, queued in the ``changes`` list and also the payload of ``change.requested``.
* :class:`CheckpointRequest`: an operator's ``etcslurm checkpoint``, the ``checkpoint``
  key until the next step boundary takes it; the payload of ``checkpoint.requested``.

docs/coordinator.md and docs/monitor.md list these fields; this module is the source.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, Union

from etcslurm.coord import schema
from etcslurm.core.layout import ParallelConfig
from etcslurm.errors import LayoutError, RecordError

#: Version of the generation record format (the ``version`` field of its JSON): 2 is the
#: compact form (worker lists as id ranges, nodes grouped, coordinates and planner ids
#: derived); version 1 (every row spelled out) is still read.
VERSION = 2
READ_VERSIONS = (1, 2)
#: Kinds of generation records: the first world, a resize, a whole-run checkpoint (nobody
#: stays), a stop (state lost), the end of a finished run.
KINDS = ("start", "resize", "checkpoint", "stop", "end")
#: Worker states, in lifecycle order (``gone`` is final).
WORKER_STATES = schema.WORKER_STATES

T = TypeVar("T")


# ---------------------------------------------------------------- generic (de)serialisation


class _Record:
    """Base of every record: JSON names, field checks, ``to_json`` / ``from_json``."""

    #: Python field name -> JSON key, where they differ (``from`` is a keyword).
    JSON_NAMES: ClassVar[dict[str, str]] = {}
    #: What error messages call this record.
    WHAT: ClassVar[str] = "record"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            out[self.JSON_NAMES.get(f.name, f.name)] = _plain(getattr(self, f.name))
        return out

    @classmethod
    def from_json(cls: type[T], data: Any) -> T:
        return _build(cls, data, cls.WHAT)  # type: ignore[attr-defined]

    def __post_init__(self) -> None:
        self._check()

    def _check(self) -> None:
        """Checks across fields (after each field's type is checked); raise RecordError."""


def _plain(value: Any) -> Any:
    if isinstance(value, _Record):
        return value.to_json()
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _build(cls: type[T], data: Any, what: str) -> T:
    if not isinstance(data, dict):
        raise RecordError(f"{what}: expected a JSON object, got {type(data).__name__}")
    names = cls.JSON_NAMES  # type: ignore[attr-defined]
    fields = {names.get(f.name, f.name): f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(str(k) for k in data if k not in fields)
    if unknown:
        raise RecordError(f"{what}: unknown field {unknown[0]!r}"
                          + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for key, f in fields.items():
        if key not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise RecordError(f"{what}: missing field {key!r}")
            continue
        kwargs[f.name] = _value(data[key], hints[f.name], f"{what}: field {key!r}")
    return cls(**kwargs)


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any JSON value"
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"an object of {_type_name(typing.get_args(tp)[1])}"
    if isinstance(tp, type) and issubclass(tp, _Record):
        return f"{tp.WHAT} object"
    return {int: "integer", float: "number", str: "string", bool: "boolean"}.get(tp, str(tp))


def _value(value: Any, tp: Any, where: str) -> Any:
    """``value`` checked against (and converted to) annotation ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _value(value, arg, where)
            except RecordError:
                continue
        raise RecordError(f"{where} must be {_type_name(tp)}, got {_show(value)}")
    if tp is Any:
        return value
    if tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin is tuple:
        if isinstance(value, list | tuple):
            item = typing.get_args(tp)[0]
            if (item is str or (isinstance(item, type) and issubclass(item, _Record))) and all(
                    isinstance(v, item) for v in value):
                return tuple(value)  # worker ids, rows built already: checked at C speed
            return tuple(_value(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    elif origin is dict:
        if isinstance(value, dict):
            item = typing.get_args(tp)[1]
            if item is str and all(isinstance(v, str) for v in value.values()):
                return {str(k): v for k, v in value.items()}
            return {str(k): _value(v, item, f"{where}[{k!r}]") for k, v in value.items()}
    elif isinstance(tp, type) and issubclass(tp, _Record):
        if isinstance(value, tp):
            return value
        return _build(tp, value, where)
    raise RecordError(f"{where} must be {_type_name(tp)}, got {_show(value)}")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _layout(text: str | None, where: str) -> None:
    if text is None:
        return
    try:
        ParallelConfig.parse(text)
    except LayoutError as exc:
        raise RecordError(f"{where}: {exc}") from None


# ---------------------------------------------------------------- generation records


@dataclass(frozen=True)
class Assignment(_Record):
    """One rank of a generation: the worker that plays it, its node, its coordinate."""

    WHAT: ClassVar[str] = "assignment"

    rank: int
    worker: str
    node: str
    tp: int
    pp: int
    dp: int

    def _check(self) -> None:
        for name in ("rank", "tp", "pp", "dp"):
            if getattr(self, name) < 0:
                raise RecordError(f"assignment of {self.worker}: {name} must be >= 0")


@dataclass(frozen=True)
class GenerationRecord(_Record):
    """What the ``gen`` key holds: one generation of the run's world.

    The leader builds it (``runtime/generation.py``), every participant replays the plan
    from it.  ``from_layout``/``to_layout`` are the JSON keys ``from``/``to``.
    """

    JSON_NAMES: ClassVar[dict[str, str]] = {"from_layout": "from", "to_layout": "to"}
    WHAT: ClassVar[str] = "generation record"

    generation: int
    kind: str
    step: int
    from_layout: str | None
    to_layout: str
    world: int
    assignment: tuple[Assignment, ...]
    old_world: tuple[str, ...] | None
    union: tuple[str, ...]
    leaving: tuple[str, ...]
    joining: tuple[str, ...]
    dead: tuple[str, ...]
    idle: tuple[str, ...]
    nodes: dict[str, str]
    planner_ids: dict[str, str]
    scalars: dict[str, Any]
    reason: str
    layout_reason: str = ""
    resume: str | None = None
    plan_stats: dict[str, Any] | None = None
    #: the layout an operator asked for (``etcslurm resize --to``), kept while it fits;
    #: ``None``: the layout is chosen automatically
    requested: str | None = None
    published_by: str | None = None
    published_at: float | None = None
    version: int = VERSION

    def to_json(self) -> dict[str, Any]:
        """The compact JSON form (version 2, see :func:`_compact`): every worker is named
        about once, runs of consecutive ids ``w<a>..w<b>`` as ``[a, b]``, so the record a
        1024-worker resize publishes — and every worker reads — is a few KiB."""
        return _compact(super().to_json())

    def to_dict(self) -> dict[str, Any]:
        """The full, readable form (every assignment row spelled out with its node and
        coordinate, worker lists as plain ids): what tools, reports and tests look at.
        :meth:`from_json` reads it too (it is version 1's shape)."""
        return {**super().to_json(), "version": 1}

    @classmethod
    def from_json(cls, data: Any) -> GenerationRecord:
        # the version first: another version's fields would be reported as unknown
        if isinstance(data, dict) and data.get("version", VERSION) not in READ_VERSIONS:
            raise RecordError(f"generation record: version {data.get('version')!r} is not "
                              f"supported (this etcslurm reads versions "
                              f"{', '.join(map(str, READ_VERSIONS))})")
        if isinstance(data, dict) and data.get("version", VERSION) == 2:
            data = _expand(data)
        elif isinstance(data, dict):
            data = {**data, "version": VERSION}  # version 1: the full form, read as is
        return _build(cls, data, cls.WHAT)

    def _check(self) -> None:
        what = f"generation record {self.generation}"
        if self.version != VERSION:
            raise RecordError(f"{what}: version {self.version} is not supported "
                              f"(this etcslurm reads version {VERSION})")
        if self.generation < 0:
            raise RecordError(f"{what}: field 'generation' must be >= 0")
        if self.kind not in KINDS:
            raise RecordError(f"{what}: field 'kind' must be one of {', '.join(KINDS)}, "
                              f"got {self.kind!r}")
        _layout(self.from_layout, f"{what}: field 'from'")
        _layout(self.to_layout, f"{what}: field 'to'")
        _layout(self.requested, f"{what}: field 'requested'")
        if self.world < 1:
            raise RecordError(f"{what}: field 'world' must be >= 1")

    def rank_of(self, worker: str) -> int | None:
        """``worker``'s rank in this generation, or ``None`` when it has none.

        A dict built once per record (not a scan per call): a 1024-rank world asks this
        of every worker."""
        ranks = self.__dict__.get("_ranks")
        if ranks is None:
            ranks = {a.worker: a.rank for a in self.assignment}
            object.__setattr__(self, "_ranks", ranks)
        return ranks.get(worker)

    def workers_by_rank(self) -> list[str]:
        """The worker ids of the world, in rank order."""
        return [a.worker for a in sorted(self.assignment, key=lambda a: a.rank)]


# ---------------------------------------------------------------- the compact JSON form
#
# Version 2 of the ``gen`` key.  Why: every worker reads the record once per change, so its
# size times the number of workers is what a resize costs Redis and the network; version 1
# named each worker in six places (assignment rows with node and coordinate, old world,
# union, nodes, planner ids): 124 KiB at 1024 workers, 124 MiB read per resize.  Here:
#
# * a worker list (``assignment``, ``old_world``, ``union``, ``leaving``, ``joining``,
#   ``dead``, ``idle``) is a JSON list whose items are worker ids or ``[a, b]``: the ids
#   ``w<a>``, ``w<a+1>``, ..., ``w<b>`` (registration order makes long runs the rule);
# * ``assignment`` lists the workers by rank; each one's coordinate follows from the rank
#   and the ``to`` layout, its node from ``nodes`` (a record whose rows say otherwise keeps
#   the full rows: lossless either way);
# * ``nodes`` maps a node to its worker list;
# * ``planner_ids`` is left out when it is the rule (old rank for old members, ``join:k``
#   for the k-th other union member), written out otherwise.

_WID = re.compile(r"^w([1-9][0-9]*)$")
_ID_LISTS = ("old_world", "union", "leaving", "joining", "dead", "idle")


def pack_ids(ids: Any) -> Any:
    """``[w1, w2, w3, w7, x]`` → ``[[1, 3], "w7", "x"]`` (runs of two or more ids)."""
    out: list[Any] = []
    run: list[int] = []

    def flush() -> None:
        if len(run) >= 2:
            out.append([run[0], run[-1]])
        elif run:
            out.append(f"w{run[0]}")
        run.clear()

    for wid in ids:
        m = _WID.match(wid) if isinstance(wid, str) else None
        if m is None:
            flush()
            out.append(wid)
            continue
        n = int(m.group(1))
        if run and n != run[-1] + 1:
            flush()
        run.append(n)
    flush()
    return out


def unpack_ids(packed: Any, where: str) -> Any:
    """The inverse of :func:`pack_ids`.  Anything that is not a list is returned as it is
    (the field check then names it); a range must be two integers ``1 <= a <= b``."""
    if not isinstance(packed, list):
        return packed
    out: list[Any] = []
    for i, item in enumerate(packed):
        if isinstance(item, list):
            ok = (len(item) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                         for x in item) and 1 <= item[0] <= item[1])
            if not ok:
                raise RecordError(f"{where}[{i}] must be a worker id or a range [first, "
                                  f"last] of w<n> numbers, got {_show(item)}")
            out.extend(f"w{n}" for n in range(item[0], item[1] + 1))
        else:
            out.append(item)
    return out


def _rule_planner_ids(old_world: Any, union: Any) -> dict[str, str]:
    """Planner ids as ``runtime.generation.next_generation`` assigns them."""
    old = list(old_world or ())
    ids = {w: str(r) for r, w in enumerate(old)}
    members = set(old)
    ids.update({w: f"join:{k}" for k, w in enumerate(w for w in union if w not in members)})
    return ids


def _compact(doc: dict[str, Any]) -> dict[str, Any]:
    """The version-2 form of a full (``_Record.to_json``) record document."""
    out = dict(doc)
    nodes: dict[str, str] = doc["nodes"]
    rows = doc["assignment"]
    try:
        cfg = ParallelConfig.parse(doc["to"])
        derived = all(
            r["rank"] == i and r["node"] == nodes.get(r["worker"], "?")
            and (r["tp"], r["pp"], r["dp"]) == tuple(cfg.coord(i)) for i, r in enumerate(rows))
    except (LayoutError, KeyError, TypeError):
        derived = False
    if derived:
        out["assignment"] = pack_ids([r["worker"] for r in rows])
    for name in _ID_LISTS:
        if doc[name] is not None:
            out[name] = pack_ids(doc[name])
    grouped: dict[str, list[str]] = {}
    for worker, node in nodes.items():
        grouped.setdefault(node, []).append(worker)
    out["nodes"] = {node: pack_ids(ws) for node, ws in grouped.items()}
    if doc["planner_ids"] == _rule_planner_ids(doc["old_world"], doc["union"]):
        del out["planner_ids"]
    out["version"] = 2
    return out


def _expand(doc: dict[str, Any]) -> dict[str, Any]:
    """The full form of a version-2 document (what the dataclass fields hold); fields it
    cannot expand are passed on unchanged, so the field checks name them."""
    what = "generation record"
    out = dict(doc)
    for name in _ID_LISTS:
        if name in doc and doc[name] is not None:
            out[name] = unpack_ids(doc[name], f"{what}: field {name!r}")
    grouped = doc.get("nodes")
    if isinstance(grouped, dict):
        nodes: dict[str, Any] = {}
        for node, ws in grouped.items():
            ids = unpack_ids(ws, f"{what}: field 'nodes'[{node!r}]")
            if not isinstance(ids, list):
                raise RecordError(f"{what}: field 'nodes'[{node!r}] must be a list of worker "
                                  f"ids, got {_show(ws)}")
            for w in ids:
                nodes[str(w)] = node
        out["nodes"] = nodes
    rows = doc.get("assignment")
    if isinstance(rows, list) and not any(isinstance(r, dict) for r in rows):
        workers = unpack_ids(rows, f"{what}: field 'assignment'")
        to = doc.get("to")
        if not isinstance(to, str):
            raise RecordError(f"{what}: field 'to' must be string (the layout the "
                              f"assignment's coordinates follow from), got {_show(to)}")
        try:
            cfg = ParallelConfig.parse(to)
        except LayoutError as exc:
            raise RecordError(f"{what}: field 'to': {exc}") from None
        if cfg is not None:
            if len(workers) > cfg.world_size:
                raise RecordError(f"{what}: field 'assignment' names {len(workers)} ranks, "
                                  f"layout {cfg} has {cfg.world_size}")
            node_of = out.get("nodes") if isinstance(out.get("nodes"), dict) else {}
            bad = next((w for w in workers if not isinstance(w, str)), None) \
                if isinstance(workers, list) else workers
            if bad is not None:
                raise RecordError(f"{what}: field 'assignment' must be a list of worker ids "
                                  f"(by rank), got {_show(bad)}")
            # built here, not through the field checks: every value is derived (ints from
            # the layout, the id just checked), and this runs in every worker at a resize
            out["assignment"] = tuple(
                Assignment(i, w, str(node_of.get(w, "?")), c.tp, c.pp, c.dp)
                for i, (w, c) in enumerate(zip(workers, map(cfg.coord, range(len(workers))),
                                               strict=True)))
    if "planner_ids" not in doc and isinstance(out.get("union"), list):
        old = out.get("old_world")
        out["planner_ids"] = _rule_planner_ids(old if isinstance(old, list) else None,
                                               [w for w in out["union"] if isinstance(w, str)])
    out["version"] = VERSION
    return out


# ---------------------------------------------------------------- change requests


@dataclass(frozen=True)
class ChangeRequest(_Record):
    """A request to change the world at the next step boundary.

    ``to``: the layout asked for (``tp1pp1dp2``), ``auto`` to go back to the automatic
    choice, or ``None`` (keep choosing); ``drain``: worker ids to take out of the world
    (treated as leaving); ``by``: who asked (worker id or ``operator``); ``ts``: unix time;
    ``reason``: free text for the log.
    """

    WHAT: ClassVar[str] = "change request"

    to: str | None
    drain: tuple[str, ...]
    by: str
    ts: float
    reason: str = ""

    def _check(self) -> None:
        if self.to is None and not self.drain:
            raise RecordError("change request: needs 'to' or a non-empty 'drain'")
        if self.to is not None and self.to != "auto":
            _layout(self.to, "change request: field 'to'")


@dataclass(frozen=True)
class CheckpointRequest(_Record):
    """A request for a checkpoint at the next step boundary (the run's periodic save,
    now); ``by``: who asked, ``ts``: unix time, ``reason``: free text for the log."""

    WHAT: ClassVar[str] = "checkpoint request"

    by: str
    ts: float
    reason: str = ""


# ---------------------------------------------------------------- events


class EventData(_Record):
    """Base of the event payloads; ``TYPE`` is the stream's ``type`` field."""

    TYPE: ClassVar[str] = ""


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class WorkerState(EventData):
    """The emitting worker changed state (``Coordinator.set_state``)."""

    TYPE: ClassVar[str] = "worker.state"
    WHAT: ClassVar[str] = "worker.state event"

    state: str
    previous: str | None = None
    rank: int | None = None
    leave_deadline: float | None = None  # unix seconds

    def _check(self) -> None:
        for name in ("state", "previous"):
            value = getattr(self, name)
            if value is not None and value not in WORKER_STATES:
                raise RecordError(f"{self.WHAT}: field {name!r} must be one of "
                                  f"{', '.join(WORKER_STATES)}, got {value!r}")


@dataclass(frozen=True)
class WorkerGone(EventData):
    """The leader recorded another (dead or departed) worker as gone."""

    TYPE: ClassVar[str] = "worker.gone"
    WHAT: ClassVar[str] = "worker.gone event"

    worker: str
    reason: str = ""


@dataclass(frozen=True)
class WorkerSignal(EventData):
    """A worker got a preemption signal (``signal``: ``USR2``, ``SIGUSR2`` or a number)."""

    TYPE: ClassVar[str] = "worker.signal"
    WHAT: ClassVar[str] = "worker.signal event"

    worker: str
    signal: str | int
    node: str | None = None
    budget_s: float | None = None
    received_at: float | None = None  # unix seconds


@dataclass(frozen=True)
class GenerationStart(EventData):
    """A generation was published (``Coordinator.publish_generation``): its shown fields."""

    TYPE: ClassVar[str] = "generation.start"
    WHAT: ClassVar[str] = "generation.start event"
    JSON_NAMES: ClassVar[dict[str, str]] = {"from_layout": "from", "to_layout": "to"}

    generation: int
    kind: str
    step: int
    from_layout: str | None
    to_layout: str
    world: int
    assignment: tuple[Assignment, ...]
    leaving: tuple[str, ...] = ()
    joining: tuple[str, ...] = ()
    reason: str = ""

    @classmethod
    def of(cls, rec: GenerationRecord) -> GenerationStart:
        return cls(rec.generation, rec.kind, rec.step, rec.from_layout, rec.to_layout,
                   rec.world, rec.assignment, rec.leaving, rec.joining, rec.reason)


@dataclass(frozen=True)
class MigrationRebuild(EventData):
    """A worker starts building its model for generation ``gen``."""

    TYPE: ClassVar[str] = "migration.rebuild"
    WHAT: ClassVar[str] = "migration.rebuild event"

    gen: int
    worker: str
    rank: int | None


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class MigrationDone(EventData):
    """The migration to ``gen`` is committed (emitted by the new rank 0)."""

    TYPE: ClassVar[str] = "migration.done"
    WHAT: ClassVar[str] = "migration.done event"
    JSON_NAMES: ClassVar[dict[str, str]] = {"from_layout": "from", "to_layout": "to"}

    gen: int
    seconds: float
    moved_bytes: int
    local_bytes: int
    checkpoint_bytes: int = 0
    pause_seconds: float | None = None
    transfer_seconds: float | None = None
    rebuild_seconds: float | None = None
    from_layout: str | None = None
    to_layout: str | None = None
    #: seconds per phase of the pause on the new rank 0: ``decide`` (signal or boundary →
    #: the record), then the migration's ``build``, ``group``, ``plan``, ``prepare``,
    #: ``exchange``, ``commit``
    phases: dict[str, float] | None = None


@dataclass(frozen=True)
class Step(EventData):
    """A training step finished (emitted by rank 0)."""

    TYPE: ClassVar[str] = "step"
    WHAT: ClassVar[str] = "step event"

    gen: int
    step: int
    loss: float
    tokens_per_s: float | None = None


@dataclass(frozen=True)
class RunEnd(EventData):
    """The run ended (``Coordinator.end_run``, or the whole-run checkpoint)."""

    TYPE: ClassVar[str] = "run.end"
    WHAT: ClassVar[str] = "run.end event"

    reason: str = ""
    step: int | None = None
    keep_s: float | None = None
    checkpoint: str | None = None


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class RunStandby(EventData):
    """No allowed layout of the workers at hand fits (too few, or device memory): the run
    waits as standby for more (``reason``: one line, ``devices``: how many were here)."""

    TYPE: ClassVar[str] = "run.standby"
    WHAT: ClassVar[str] = "run.standby event"

    reason: str
    devices: int | None = None


@dataclass(frozen=True)
class Error(EventData):
    """Something failed; ``message`` says what."""

    TYPE: ClassVar[str] = "error"
    WHAT: ClassVar[str] = "error event"

    message: str
    worker: str | None = None


@dataclass(frozen=True)
class JobRequeued(EventData):
    """A worker asked Slurm to requeue its job after the whole-run checkpoint."""

    TYPE: ClassVar[str] = "job.requeued"
    WHAT: ClassVar[str] = "job.requeued event"

    worker: str
    job: str


@dataclass(frozen=True)
class ChangeRequested(EventData):
    """A :class:`ChangeRequest` was queued (same fields)."""

    TYPE: ClassVar[str] = "change.requested"
    WHAT: ClassVar[str] = "change.requested event"

    to: str | None
    drain: tuple[str, ...]
    by: str
    ts: float
    reason: str = ""

    @classmethod
    def of(cls, req: ChangeRequest) -> ChangeRequested:
        return cls(req.to, req.drain, req.by, req.ts, req.reason)


@dataclass(frozen=True)
class CheckpointRequested(EventData):
    """A :class:`CheckpointRequest` was made (same fields)."""

    TYPE: ClassVar[str] = "checkpoint.requested"
    WHAT: ClassVar[str] = "checkpoint.requested event"

    by: str
    ts: float
    reason: str = ""

    @classmethod
    def of(cls, req: CheckpointRequest) -> CheckpointRequested:
        return cls(req.by, req.ts, req.reason)


@dataclass(frozen=True)
class CheckpointSaving(EventData):
    """The step boundary took a checkpoint request: the save of ``step`` into ``path``
    began (complete once the directory's ``latest_checkpointed_iteration.txt`` names it)."""

    TYPE: ClassVar[str] = "checkpoint.saving"
    WHAT: ClassVar[str] = "checkpoint.saving event"

    step: int
    path: str
    by: str = ""


#: Every event type the runtime, coordinator and CLI write, and its payload class.
EVENT_TYPES: dict[str, type[EventData]] = {
    c.TYPE: c
    for c in (WorkerRegistered, WorkerState, WorkerGone, WorkerSignal, ChangeRequested,
              GenerationStart, MigrationRebuild, MigrationProgress, MigrationDone, Step,
              RunEnd, RunRollback, RunStandby, Error, JobRequeued, CheckpointRequested,
              CheckpointSaving)
}


def event_data(type: str, fields: dict[str, Any]) -> EventData:
    """The payload of an event of ``type`` from its fields (``Coordinator.emit``)."""
    cls = EVENT_TYPES.get(type)
    if cls is None:
        raise RecordError(f"unknown event type {type!r} (known: {', '.join(sorted(EVENT_TYPES))})")
    return cls.from_json(fields)


@dataclass(frozen=True)
class Event:
    """One entry of the ``events`` stream: who (``worker``: worker id or ``operator``)
    emitted what (``data``, typed by ``type``) when (``ts``, unix seconds); ``id``: the
    stream id."""

    type: str
    ts: float
    worker: str
    data: EventData
    id: str = field(default="")

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
        raise RecordError(f"{where}: field 'type' must be a string, got {_show(kind)}")
    ts = _value(raw.get("ts"), float, f"{where} ({kind}): field 'ts'")
    worker = _value(raw.get("worker"), str, f"{where} ({kind}): field 'worker'")
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise RecordError(f"{where}: unknown event type {kind!r}")
    data = _build(cls, raw.get("data"), f"{where} ({kind})")
    return Event(kind, ts, worker, data, eid)


def field_summary(cls: type[_Record]) -> str:
    """The JSON fields of record class ``cls`` as one Markdown line (``?``: optional), as
    docs/coordinator.md and docs/monitor.md list them (a test keeps them equal)."""
    hints = _hints(cls)
    parts = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        optional = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        name = cls.JSON_NAMES.get(f.name, f.name)
        parts.append(f"`{name}`{'?' if optional else ''}: {_doc_type(hints[f.name])}")
    return ", ".join(parts)


def _doc_type(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " \\| ".join(_doc_type(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"[{_doc_type(typing.get_args(tp)[0])}]"
    if origin is dict:
        return f"{{str: {_doc_type(typing.get_args(tp)[1])}}}"
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    return tp.__name__


__all__ = [
    "EVENT_TYPES",
    "KINDS",
    "READ_VERSIONS",
    "VERSION",
    "Assignment",
    "ChangeRequest",
    "ChangeRequested",
    "Error",
    "Event",
    "EventData",
    "GenerationRecord",
    "GenerationStart",
    "JobRequeued",
    "MigrationDone",
    "MigrationProgress",
    "MigrationRebuild",
    "RunEnd",
    "Step",
    "WorkerGone",
    "WorkerRegistered",
    "WorkerSignal",
    "WorkerState",
    "event_data",
    "field_summary",
    "pack_ids",
    "parse_event",
    "unpack_ids",
]
