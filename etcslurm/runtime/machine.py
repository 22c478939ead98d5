"""The session's protocol as an explicit state machine.

A worker is always in one :class:`Phase`.  Each non-terminal phase has one transition
function (in :mod:`etcslurm.runtime.steps`, :mod:`etcslurm.runtime.transitions` and
:mod:`etcslurm.runtime.recovery`) that does one small thing and *returns* the next
:class:`State`; :func:`drive` is the only loop.  No transition calls another, and none
loops: a wait (``FIRST``, ``WAIT``, ``HANDED_OVER``, ``RECOVER``) looks once per call,
blocking a second at most, and returns its own phase with a :class:`Waiting` (its
deadline and what it has learnt) until what it waits for has happened.  So every
failure, standby or wait cycle goes through the one loop, the stack never deepens, and
every transition can be unit-tested alone with a fake coordinator and a fake world.

::

                  ┌──────────────── WAIT ◀────────────────────┐
                  │                  ▲                          │
    START ──▶ FIRST ──▶ FOLLOW ◀─────┼─── DECIDE ◀── VOTE ◀── BOUNDARY ◀── (a step)
                         │           │                 │          │
            ┌────────────┼───────────┴─────┐       ACTIVE      FINISH ──▶ LEFT
            ▼            ▼                 ▼
          ENTER        RESIZE          CHECKPOINT ──▶ LEFT
            │            │  └──▶ HANDED_OVER ──▶ LEFT | WAIT | FOLLOW
            ▼            ▼
          ACTIVE       ACTIVE
                         │
    (a step) ──▶ RECOVER ◀┘ (a peer died: in a step, or before a commit) ──▶ FOLLOW

``BOUNDARY`` follows every step (progress, periodic checkpoints, the end of the run),
``VOTE`` is its one all-reduce (does anyone want a change?).  The terminal phases are
``ACTIVE`` (training in a world: the training loop runs until the next step boundary)
and ``LEFT`` (this worker leaves the run).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from etcslurm.coord.records import GenerationRecord
from etcslurm.hooks import NO_HOOKS, Hooks
from etcslurm.runtime.config import RunSettings, WorkerOptions, recovery_window


class Phase(enum.Enum):
    BOUNDARY = "boundary"  # a step finished: progress, periodic checkpoints, the run's end
    VOTE = "vote"  # the boundary's all-reduce: does anyone want the world to change?
    FINISH = "finish"  # the last step is done: finish the pending save, send standbys home
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
class Waiting:
    """A bounded wait in progress: when it gives up and what it has learnt so far."""

    until: float  # time.monotonic() deadline
    since: float
    # FIRST: the leader this worker watches instead of counting members itself, the
    # standby verdict (devices, why no layout fits them), members counted last
    defer_to: str | None = None
    standby: tuple[int, str] | None = None
    counted: int = 0
    # RECOVER: when the first survivor stops waiting for the others to come back
    stragglers_until: float = 0.0


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
    loss: float = 0.0  # BOUNDARY: the step's loss
    step_started: float = 0.0  # BOUNDARY: time.perf_counter() when the step began
    waiting: Waiting | None = None  # a wait in progress (its first call starts it)


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
    change_started: float | None = None  # when the pause of the current change began
    #: the step whose failed collective (every peer alive) last formed the world again
    reformed_at: int | None = None
    periodic: Any = None  # periodic checkpoints (runtime.checkpointing.Periodic), if any
    data_log: Any = None  # which samples each DP rank trains (runtime.boundary.DataLog)

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


def settle(ctx: Context, transition: Transition, state: State) -> State:
    """Call one transition until it leaves ``state``'s phase (a wait looks again until
    what it waits for happened): one phase of :func:`drive`, for tests and benchmarks
    that drive a single transition."""
    phase = state.phase
    state = transition(ctx, state)
    while state.phase is phase and state.waiting is not None:
        state = transition(ctx, state)
    return state
