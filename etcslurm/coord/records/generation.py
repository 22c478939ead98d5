"""Generation records: what the ``gen`` key holds, and its compact stored form.

:class:`GenerationRecord` (with its :class:`Assignment` rows) is one generation of the
run's world: the leader builds it (``runtime/generation.py``), the coordinator stores it,
every participant replays the plan from it.  The Python record spells every row out; the
JSON in Redis names each worker about once (see "the stored form" below).
"""

from __future__ import annotations

import re
from functools import cached_property
from typing import Any, ClassVar

import msgspec

from etcslurm.coord import schema
from etcslurm.coord.records.codec import Number, Record, decode, show
from etcslurm.core.layout import ParallelConfig
from etcslurm.errors import LayoutError, RecordError

#: Version of the stored form (the ``version`` field of its JSON); another is refused.
VERSION = 2
#: Kinds of generation records: the first world, a resize, a whole-run checkpoint (nobody
#: stays), a stop (state lost), the end of a finished run.
KINDS = ("start", "resize", "checkpoint", "stop", "end")
#: Worker states, in lifecycle order (``gone`` is final).
WORKER_STATES = schema.WORKER_STATES


def layout_field(text: str | None, where: str) -> None:
    """Refuse a layout field that is not of the form ``tp<N>pp<N>dp<N>``."""
    if text is None:
        return
    try:
        ParallelConfig.parse(text)
    except LayoutError as exc:
        raise RecordError(f"{where}: {exc}") from None


class Assignment(Record):
    """One rank of a generation: the worker that plays it, its node, its coordinate."""

    WHAT: ClassVar[str] = "assignment"

    rank: int
    worker: str
    node: str
    tp: int
    pp: int
    dp: int

    def __post_init__(self) -> None:
        for name in ("rank", "tp", "pp", "dp"):
            if getattr(self, name) < 0:
                raise RecordError(f"assignment of {self.worker}: {name} must be >= 0")


class GenerationRecord(Record, dict=True):
    """What the ``gen`` key holds: one generation of the run's world.

    The leader builds it (``runtime/generation.py``), every participant replays the plan
    from it.  ``from_layout``/``to_layout`` are the JSON keys ``from``/``to``.
    """

    WHAT: ClassVar[str] = "generation record"

    generation: int
    kind: str
    step: int
    from_layout: str | None = msgspec.field(name="from")
    to_layout: str = msgspec.field(name="to")
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
    published_at: Number | None = None
    version: int = VERSION

    def to_json(self) -> dict[str, Any]:
        """The stored form (see "The stored form" below): every worker is named about
        once, runs of consecutive ids ``w<a>..w<b>`` as ``[a, b]``, so the record a
        1024-worker resize publishes — and every worker reads — is a few KiB."""
        return _compact(super().to_json())

    def to_dict(self) -> dict[str, Any]:
        """The full, readable form (every assignment row spelled out with its node and
        coordinate, worker lists as plain ids): what tools, reports and tests look at.
        Not a stored form: :meth:`from_json` reads only what :meth:`to_json` writes."""
        return super().to_json()

    @classmethod
    def from_json(cls, data: Any) -> GenerationRecord:
        # the version first: another version's fields would be reported as unknown
        if isinstance(data, dict):
            version = data.get("version", VERSION)
            if version != VERSION or isinstance(version, bool):
                raise RecordError(f"generation record: version {version!r} is not supported "
                                  f"(this etcslurm reads version {VERSION})")
            data = _expand(data)
        return decode(cls, data, cls.WHAT)

    def __post_init__(self) -> None:
        what = f"generation record {self.generation}"
        if self.version != VERSION:
            raise RecordError(f"{what}: version {self.version} is not supported "
                              f"(this etcslurm reads version {VERSION})")
        if self.generation < 0:
            raise RecordError(f"{what}: field 'generation' must be >= 0")
        if self.kind not in KINDS:
            raise RecordError(f"{what}: field 'kind' must be one of {', '.join(KINDS)}, "
                              f"got {self.kind!r}")
        layout_field(self.from_layout, f"{what}: field 'from'")
        layout_field(self.to_layout, f"{what}: field 'to'")
        layout_field(self.requested, f"{what}: field 'requested'")
        if self.world < 1:
            raise RecordError(f"{what}: field 'world' must be >= 1")

    @cached_property
    def _ranks(self) -> dict[str, int]:
        # built once per record, not a scan per call: a 1024-rank world asks every worker
        return {a.worker: a.rank for a in self.assignment}

    def rank_of(self, worker: str) -> int | None:
        """``worker``'s rank in this generation, or ``None`` when it has none."""
        return self._ranks.get(worker)

    def workers_by_rank(self) -> list[str]:
        """The worker ids of the world, in rank order."""
        return [a.worker for a in sorted(self.assignment, key=lambda a: a.rank)]



# ---------------------------------------------------------------- the stored form
#
# What the ``gen`` key holds.  Why compact: every worker reads the record once per change,
# so its size times the number of workers is what a resize costs Redis and the network;
# spelled out, the record names each worker in six places (assignment rows with node and
# coordinate, old world, union, nodes, planner ids): 124 KiB at 1024 workers, 124 MiB read
# per resize.  Here:
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
                                  f"last] of w<n> numbers, got {show(item)}")
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
    """The stored form of a full (``Record.to_json``) record document."""
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
    return out


def _expand(doc: dict[str, Any]) -> dict[str, Any]:
    """The full form of a stored document (what the record's fields hold); fields it
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
                                  f"ids, got {show(ws)}")
            for w in ids:
                nodes[str(w)] = node
        out["nodes"] = nodes
    rows = doc.get("assignment")
    if isinstance(rows, list) and not any(isinstance(r, dict) for r in rows):
        workers = unpack_ids(rows, f"{what}: field 'assignment'")
        to = doc.get("to")
        if not isinstance(to, str):
            raise RecordError(f"{what}: field 'to' must be string (the layout the "
                              f"assignment's coordinates follow from), got {show(to)}")
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
                                  f"(by rank), got {show(bad)}")
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
    return out
