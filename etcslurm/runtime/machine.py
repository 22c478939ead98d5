"""The session's protocol as an explicit state machine.

A worker is always in one :class:`Phase`.  Each non-terminal phase has one transition
function (in :mod:`etcslurm.runtime.transitions` and :mod:`etcslurm.runtime.recovery`)
that does one small thing and *returns* the next :class:`State`; :func:`drive` is the
only loop.  No transition calls another, so a failure or standby cycle never deepens the
stack, and every transition can be unit-tested alone with a fake coordinator and a fake
world.

::

    START ──▶ FIRST ──▶ FOLLOW ◀── WAIT ◀──────────────┐
      │                  │  ▲                          │
      └──────▶ WAIT      │  └── DECIDE (boundary)      │
                         ▼                             │
        ENTER | RESIZE | CHECKPOINT | LEFT             │
          │       │  └──▶ HANDED_OVER ──▶ LEFT | WAIT ─┘
          ▼       ▼            │
        ACTIVE  ACTIVE         └──▶ FOLLOW (the change failed, planned again)
                  │
         RECOVER ◀┘ (a peer died: from a step, or before a commit) ──▶ FOLLOW | WAIT

The terminal phases are ``ACTIVE`` (training in a world: the training loop runs until
the next step boundary) and ``LEFT`` (this worker leaves the run).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from etcslurm.coord.records import GenerationRecord
from etcslurm.hooks import NO_HOOKS, Hooks
from etcslurm.runtime.config import RunSettings, WorkerOptions, recovery_window


class Phase(enum.Enum):
    START = "start"  # registered: find where the run is
    FIRST = "first"  # an initial worker: generation 0 is published (by the leader)
    WAIT = "wait"  # outside every world: wait for a generation that takes this worker
    DECIDE = "decide"  # at a boundary that changes the world: the decider publishes
    FOLLOW = "follow"  # a new generation record: what does it ask of this worker?
    ENTER = "enter"  # a start record: form the first (or resumed) world
    RESIZE = "resize"  # migrate the state into the new world
    HANDED_OVER = "handed_over"  # a leaver or idle worker: wait for the commit
    RECOVER = "recover"  # a collective or a change failed: rebuild from the survivors
    CHECKPOINT = "checkpoint"  # the whole run leaves: write a checkpoint, requeue
    ACTIVE = "active"  # terminal: in a world, training
    LEFT = "left"  # terminal: this worker leaves the run


TERMINAL = frozenset({Phase.ACTIVE, Phase.LEFT})


@dataclass(frozen=True)
class State:
    """A phase and what its transition needs."""

    phase: Phase
    record: GenerationRecord | None = None  # FOLLOW/ENTER/RESIZE/HANDED_OVER/CHECKPOINT
    after: int = -1  # WAIT: the last generation seen
    error: BaseException | None = None  # RECOVER: what failed
    failed: GenerationRecord | None = None  # RECOVER: the change that broke off, if any
    reason: str = ""  # LEFT: why (finished, left, evicted, checkpointed, ...)
    decider: int | None = None  # DECIDE: the rank that publishes (from the boundary's vote)


@dataclass
class MigrationReport:
    """What one generation change cost on this worker (kept for the demo's summary)."""

    generation: int
    kind: str
    from_layout: str | None
    to_layout: str
    seconds: float = 0.0
    transfer_seconds: float = 0.0
    rebuild_seconds: float = 0.0
    moved_bytes: int = 0
    local_bytes: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    pause_seconds: float | None = None


@dataclass
class Context:
    """What the transitions share: this worker's identity, its parts, its current state.

    ``coord`` is a :class:`~etcslurm.coord.coordinator.Coordinator` (or a fake in unit
    tests), ``world`` a :class:`~etcslurm.runtime.world.World` (or a fake), ``boundary`` a
    :class:`~etcslurm.runtime.boundary.Boundary`.
    """

    settings: RunSettings
    options: WorkerOptions
    coord: Any
    world: Any
    boundary: Any
    worker_id: str
    hooks: Hooks = NO_HOOKS
    record: GenerationRecord | None = None  # the generation this worker trains in
    trainee: Any = None  # its model, optimizer, scheduler
    rank: int | None = None
    #: the old state, read once per change and kept until the next commit: a change that
    #: fails is planned again from it, after ``parallel_state`` was torn down
    held: list[Any] | None = None
    held_scalars: dict[str, Any] | None = None
    reports: list[MigrationReport] = field(default_factory=list)
    change_started: float | None = None  # when the pause of the current change began
    periodic: Any = None  # periodic checkpoints (runtime.checkpointing.Periodic), if any

    @property
    def step(self) -> int:
        """The global step the next training step computes."""
        return int(self.trainee.iteration) if self.trainee is not None else 0

    def holdings(self) -> tuple[list[Any], dict[str, Any] | None]:
        """(pieces + views, scalars) of this worker's state, read once per change."""
        if self.held is None:
            if self.trainee is None:
                return [], None
            self.held, self.held_scalars = self.world.read_state(self.trainee)
        return self.held, self.held_scalars

    def forget_holdings(self) -> None:
        self.held, self.held_scalars = None, None

    def recovery_window(self) -> float:
        """How long a survivor of a failure waits for the next generation
        (:func:`~etcslurm.runtime.config.recovery_window`)."""
        opts = self.options
        return recovery_window(opts.dead_after, opts.collective_timeout,
                               self.world.notice_seconds())


Transition = Callable[[Context, State], State]


def drive(ctx: Context, state: State, table: Mapping[Phase, Transition]) -> State:
    """Run transitions until a terminal phase; the only loop of the protocol."""
    while state.phase not in TERMINAL:
        state = table[state.phase](ctx, state)
    return state


def describe(state: State) -> dict[str, Any]:
    """A short JSON-able form of ``state`` (logs, tests)."""
    out: dict[str, Any] = {"phase": state.phase.value}
    if state.record is not None:
        out["generation"] = state.record.generation
    if state.phase is Phase.WAIT:
        out["after"] = state.after
    if state.reason:
        out["reason"] = state.reason
    return out
