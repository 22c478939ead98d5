"""The immutable snapshot of a run that the monitor draws (:class:`RunView` and its parts).

Built by :func:`etcslurm.monitor.snapshot.snapshot` from a
:class:`~etcslurm.monitor.model.RunModel`; plain data, so ``etcslurm status --json``
and the renderers read the same thing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

#: Events kept in the log (the live view shows the newest that fit).
LOG_LINES = 200
#: Losses kept for the trend sparkline.
LOSS_HISTORY = 32

STATES = ("active", "joining", "leaving", "gone")


@dataclass(frozen=True)
class Refused:
    """A stream entry that :func:`~etcslurm.coord.records.parse_event` refused."""

    id: str
    ts: float
    type: str
    message: str


@dataclass
class DeviceView:
    """One worker (a device) and the rank it plays in the current generation."""

    worker: str
    node: str
    state: str
    rank: int | None = None
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    seconds_left: float | None = None


@dataclass
class NodeView:
    name: str
    devices: list[DeviceView]


@dataclass
class RankProgress:
    """Bytes one rank has sent and received in a migration, with its rate and ETA."""

    rank: int | None
    worker: str
    sent: int
    recv: int
    total_send: int
    total_recv: int
    fraction: float
    gbps: float | None
    eta_s: float | None


@dataclass
class MigrationView:
    gen: int
    from_layout: str | None
    to_layout: str | None
    done: bool
    seconds: float | None
    bytes_done: int
    bytes_total: int
    moved_bytes: int | None
    local_bytes: int | None
    checkpoint_bytes: int | None
    pause_seconds: float | None
    ranks: list[RankProgress]


@dataclass
class LogLine:
    ts: float
    type: str
    text: str
    count: int = 1
    template: str = field(default="", repr=False)
    who: list[str] = field(default_factory=list, repr=False)


@dataclass
class RunView:
    """Everything the monitor shows; ``to_json()`` is ``etcslurm status --json``."""

    run: str
    phase: str
    gen: int | None
    layout: str | None
    world: int | None
    step: int | None
    tokens_per_s: float | None
    loss: float | None
    loss_trend: str
    loss_history: list[float]
    nodes: list[NodeView]
    migration: MigrationView | None
    events: list[LogLine]
    last_event_ts: float | None
    #: a replicated coordinator's primary, ``"ip:port (node n3), 2 replicas"``; ``None``
    #: for a single Redis server
    coordinator: str | None = None
    #: resizes so far by cause (``records.RESIZE_CAUSES``)
    resizes: dict[str, int] = field(default_factory=dict)
    last_step_ts: float | None = None  # when rank 0 reported the last step
    #: the last migration's bytes moved ÷ the planner's lower bound (1.0: optimal)
    moved_vs_lower_bound: float | None = None
    failovers: int = 0  # changes of the coordinator's primary this model saw

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["events"] = [
            {k: e[k] for k in ("ts", "type", "text", "count")} for e in out["events"]
        ]
        return out
