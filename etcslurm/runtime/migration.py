"""The one migration sequence: new world and model first, exchange, fill, commit.

Both the runtime (a resize) and ``etcslurm bench migrate`` run :meth:`Migration.run`, so
the bit-exact tests of the benchmark prove the code that runs in production.  The phases,
in order, on every participant (old members and joiners):

1. ``build``: a member of the new layout forms the new world and builds the (empty:
   not initialised, :func:`etcslurm.megatron.model.weights_filled_later`) model and
   optimizer of its layout, or re-wraps the kept one; a leaver (or an idle worker) tears
   its world down and keeps only its old model's tensors, still readable.  ``describe``: the pieces
   the new model needs, with a view of each (megatron-core's sharded state dict).
2. ``group``: the exchange group over old members + joiners, outside the new world
   (megatron-core modules keep the groups they were built in, and the new world does not
   contain leavers).  Members arrive once their model is built, so its timeout includes
   the longest build seen.  When the participants are exactly the new world
   (``job.on_world``), a gloo world's own backend serves, with the same probe and bound.
3. ``plan``: every participant computes (replays) the same deterministic plan: from the
   analytic model for etcslurm's own GPT (:func:`analytic_plan`), else from live
   descriptions exchanged on the group (:func:`live_plan`).
4. ``prepare``: the live pieces must be what the plan assumed (old and new: the holdings
   check), the staging arena is sized, and a plan that would leave part of the new model
   unwritten is refused before anything moves.
5. ``exchange``: local copies and the coalesced, checksummed P2P messages, straight into
   the new model; ``close``: the exchange group's connections are released.
6. ``commit``: the new model gets the replicated scalars (Adam step, scheduler, counters)
   and the new world passes a barrier: past it every new member is complete.

A peer lost in ``build``, ``group``, ``exchange`` or ``commit`` raises :class:`PeerLost`
(the old model is untouched: the caller can fall back to it); anything else (a plan that
does not match the state) is a bug and propagates as it is.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from etcslurm.core.layout import ParallelConfig
from etcslurm.core.plan import MigrationPlan
from etcslurm.core.state import Piece
from etcslurm.errors import MigrationError, WaitTimeout
from etcslurm.groups import lifecycle as groups
from etcslurm.hooks import NO_HOOKS, Hooks
from etcslurm.transfer.executor import TransferStats, check_fills, execute
from etcslurm.transfer.wire import DIRECT_MIN_BYTES, staging_arena

PHASES = ("build", "describe", "group", "plan", "prepare", "exchange", "close", "commit")

#: the failures of a peer (death, timeout) as torch.distributed and our waits report them
PEER_FAILURES = (RuntimeError, dist.DistError, WaitTimeout)


class PeerLost(MigrationError):
    """A peer failed during phase ``phase``; the old state is intact (nothing committed)."""

    def __init__(self, phase: str, cause: BaseException) -> None:
        super().__init__(f"{phase}: {str(cause)[:300]}")
        self.phase = phase
        self.cause = cause


@dataclass
class MigrationJob:
    """One participant's part in one migration.

    ``me``: the id the planner knows this participant by (old rank, or ``join:k``);
    ``members``: the planner ids of every participant in exchange-group order.
    ``held``: (piece, view) of the old state this participant holds (read while the old
    ``parallel_state`` still existed), ``scalars``: the replicated scalars to restore in
    the new model.  ``plan(migration)`` computes the plan once the exchange group exists
    and the new model is built (``migration.group``, ``migration.needed``): from live
    descriptions exchanged on that group (:func:`live_plan`), or analytically.  ``expected``: the pieces the plan assumes a rank of a layout holds
    (the holdings check); ``None`` skips it.
    """

    generation: int
    me: str
    members: list[str]
    new_rank: int | None
    layout: ParallelConfig
    held: list[tuple[Piece, torch.Tensor]]
    scalars: dict[str, Any] | None
    plan: Callable[[Migration], MigrationPlan]
    old: tuple[ParallelConfig, int] | None = None
    expected: Callable[[ParallelConfig, int], Iterable[Piece]] | None = None
    #: this participant's old model, to be kept (re-wrapped for the new groups) instead
    #: of built anew: a data-parallel-only change that moves none of its parameters
    keep: Any = None
    #: every participant knows from the record that no byte moves (a DP shrink with the
    #: replicated optimizer): no exchange group, no plan, no exchange -- each new member
    #: keeps its model, and the commit barrier is the only collective
    nothing_moves: bool = False
    #: the participants are exactly the new world's members and ``members`` is in
    #: new-rank order: on gloo the exchange runs on the new world itself
    #: (:func:`etcslurm.groups.lifecycle.world_exchange`), not on a group of its own
    on_world: bool = False
    #: which of the runtime's paths this job takes (``runtime.jobs.PLAN_PATHS``), reported
    path: str = "analytic"
    #: the pieces this migration moves (None: every one); e.g. the weights alone, to
    #: reshard a model for inference as megatron-core's refit does
    select: Callable[[Piece], bool] | None = None


@dataclass
class MigrationResult:
    """What a migration produced on this participant."""

    trainee: Any | None  # the new model (None on a leaver or idle worker)
    plan: MigrationPlan
    stats: TransferStats
    seconds: dict[str, list[float]] = field(default_factory=dict)  # per phase (repeats)
    kept: bool = False  # the old model was kept (re-wrapped), not built anew

    def phase(self, name: str) -> float:
        """Seconds of ``name`` (summed over repeats)."""
        return sum(self.seconds.get(name, []))


class Observer:
    """What a migration tells whoever watches it: how long each phase took on this
    participant, and the moment its plan is prepared (before anything moves).

    The runtime uses this one; the benchmark's times each phase as its slowest
    participant's and measures the transport's floor at :meth:`prepared`.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}

    @contextlib.contextmanager
    def phase(self, name: str, migration: Migration) -> Iterator[None]:
        del migration
        t0 = time.perf_counter()
        yield
        self.seconds.setdefault(name, []).append(time.perf_counter() - t0)

    def prepared(self, migration: Migration) -> None:
        """The plan is prepared (arena sized, fills checked); nothing has moved yet."""


class Migration:
    """Runs the phases of one :class:`MigrationJob` in order (see the module docstring).

    ``form_and_build(generation, layout, rank)`` starts the new world and returns the
    built model; ``regroup(generation, layout, rank, old)`` starts it and returns
    ``(model, kept)``: ``old``'s model re-wrapped for it and ``True``, or a model built
    anew and ``False`` (used when ``job.keep`` is set); ``store`` is the
    long-lived store exchange groups form on.
    ``arena``: the staging arena kept from the previous migration (resident memory).
    """

    def __init__(
        self,
        job: MigrationJob,
        *,
        store: dist.Store,
        form_and_build: Callable[[int, ParallelConfig, int], Any],
        staging_cap: int | None,
        timeout: float,
        group_timeout: float,
        arena: torch.Tensor | None = None,
        hooks: Hooks = NO_HOOKS,
        progress: Callable[[dict[str, Any]], None] | None = None,
        direct_min: int = DIRECT_MIN_BYTES,
        observer: Observer | None = None,
        regroup: Callable[[int, ParallelConfig, int, Any], tuple[Any, bool]] | None = None,
    ) -> None:
        self.job = job
        self.store = store
        self.form_and_build = form_and_build
        self.regroup = regroup
        self.staging_cap = staging_cap
        self.timeout = timeout
        self.group_timeout = group_timeout
        self.arena = arena
        self.hooks = hooks
        self.progress = progress
        self.direct_min = direct_min
        self.observer = observer or Observer()
        self.trainee: Any = None
        #: the new model is the old one, re-wrapped (its tensors are the held ones)
        self.kept = False
        self.group: Any = None
        #: ``group`` is the new world's own backend (not closed with the migration)
        self.shared = False
        self.plan: MigrationPlan | None = None
        self.local: list[Piece] = []
        self.needed: list[tuple[Piece, torch.Tensor]] = []
        #: slices of the new model no old rank ever held (vocabulary rows a TP change
        #: added): zeroed as megatron-core's resharded load leaves them, not received
        self.fill: list[Piece] = []

    @property
    def ranks(self) -> dict[str, int]:
        """Planner id → rank in the exchange group."""
        return {d: i for i, d in enumerate(self.job.members)}

    def run(self) -> MigrationResult:
        """All phases in order."""
        from etcslurm.megatron.model import weights_filled_later

        job, observer = self.job, self.observer
        # the new model is filled by this migration (``prepare`` refuses a plan that
        # leaves any of it unwritten), so its random init would be work thrown away
        with observer.phase("build", self), _peer_phase("build"), weights_filled_later():
            if job.new_rank is None:
                groups.teardown()  # a leaver (or idle): it only needs the exchange group
            elif job.keep is not None and self.regroup is not None:
                self.trainee, self.kept = self.regroup(job.generation, job.layout,
                                                       job.new_rank, job.keep)
            else:
                self.trainee = self.form_and_build(job.generation, job.layout, job.new_rank)
        if job.nothing_moves:
            return self._commit_kept()
        with observer.phase("describe", self):
            self.needed = _local_state(self.trainee)
            if job.select is not None:
                self.needed = [(p, v) for p, v in self.needed if job.select(p)]
        exchanged = False
        try:
            with observer.phase("group", self), _peer_phase("group"):
                self.group = self._exchange_group()
            with observer.phase("plan", self), _peer_phase("plan"):
                self.plan = job.plan(self)
            with observer.phase("prepare", self):
                self._prepare()
            self._report({})
            observer.prepared(self)
            with observer.phase("exchange", self), _peer_phase("exchange", MigrationError):
                stats = self._exchange()
            exchanged = True
        finally:
            with observer.phase("close", self):  # after a failure at once: the retry's sockets
                if not self.shared:  # the world's own backend is not ours to close
                    groups.close_exchange_group(self.group, now=not exchanged)
            self.group = None
        with observer.phase("commit", self), _peer_phase("commit"):
            self._commit()
        assert self.plan is not None
        return MigrationResult(self.trainee, self.plan, stats, dict(observer.seconds),
                               kept=self.kept)

    def _commit_kept(self) -> MigrationResult:
        """Nothing moves between participants: each new member kept its model (the same
        parameters and Adam state as before), or -- one that could not be kept, e.g.
        after a failed change had begun to re-wrap it -- built it anew and copies its own
        old tensors in; then the commit is all that is left."""
        job = self.job
        where = f"generation {job.generation}, rank {job.new_rank}"
        if self.trainee is not None:
            with self.observer.phase("fill", self):
                if self.kept and job.expected is not None:
                    # its tensors are the held ones: only check that they are every piece
                    # the new rank needs (describing the model again and copying it onto
                    # itself cost ~0.07 s of a DP shrink's pause on gpt-tiny)
                    _check_held(job.held, job.expected(job.layout, job.new_rank), where)
                else:
                    _copy_own(job.held, _local_state(self.trainee), where)
        with self.observer.phase("commit", self), _peer_phase("commit"):
            self._commit()
        self.plan = MigrationPlan(assignment=[], messages=[], local={}, missing={}, idle=[],
                                  stats={"moved_bytes": 0})
        return MigrationResult(self.trainee, self.plan, TransferStats(device=job.me),
                               dict(self.observer.seconds), kept=self.kept)

    # ------------------------------------------------------------------ phases
    def _exchange_group(self) -> Any:
        """The group the state moves on: the new world's own (``job.on_world`` on a gloo
        world: no second rendezvous) or an exchange group of the participants."""
        job = self.job
        me = job.members.index(job.me)
        if job.on_world and dist.is_initialized() and dist.get_backend() == "gloo":
            if me != job.new_rank or len(job.members) != dist.get_world_size():
                raise MigrationError(
                    f"generation {job.generation}: {job.me} is member {me} of "
                    f"{len(job.members)}, but rank {job.new_rank} of a world of "
                    f"{dist.get_world_size()}: the exchange cannot run on the world")
            self.shared = True
            return groups.world_exchange(job.generation, self.group_timeout)
        return groups.exchange_group(self.store, job.generation, me, len(job.members),
                                     timeout=self.group_timeout)

    def _prepare(self) -> None:
        job, plan = self.job, self.plan
        assert plan is not None
        if job.expected is not None and job.old is not None:
            check_holdings([p for p, _ in job.held], job.expected(*job.old), "old", job.old)
        if job.expected is not None and job.new_rank is not None:
            new = (job.layout, job.new_rank)
            check_holdings([p for p, _ in self.needed], job.expected(*new), "new", new)
        self.local = list(plan.local.get(job.me, [])) if job.new_rank is not None else []
        kept = _kept_pieces(job.held, self.needed) if job.keep is not None else []
        if kept:  # a kept model's own tensors: copying them onto themselves is a no-op
            boxes = _boxes_by_tensor(kept)
            self.local = [p for p in self.local if not _within(p, boxes)]
        if self.fill:
            from etcslurm.megatron.sharded_meta import LocalState, zero_fill

            zero_fill(LocalState([p for p, _ in self.needed], [v for _, v in self.needed]),
                      self.fill)
        self.arena = staging_arena(plan.messages, job.me, self.arena, direct_min=self.direct_min,
                                   held=job.held, needed=self.needed)
        # a plan that misses part of the new model is a bug, not a failure to fall back from
        check_fills(self.needed, [*self.local, *self.fill, *kept], plan.messages, job.me,
                    f"generation {job.generation}, rank {job.new_rank}")

    def _exchange(self) -> TransferStats:
        job, plan = self.job, self.plan
        assert plan is not None

        def progress(info: dict[str, Any]) -> None:
            self._report(info)
            if "round_index" in info:
                self.hooks.after_round(job.generation, int(info["round_index"]))

        return execute(
            plan.messages, self.local, job.me, self.ranks, job.held, self.needed,
            staging_cap=self.staging_cap, timeout=self.timeout, group=self.group,
            arena=self.arena, direct_min=self.direct_min, progress=progress, hooks=self.hooks,
        )

    def _report(self, info: dict[str, Any]) -> None:
        """Forward a progress report, with this participant's totals added."""
        if self.progress is None or self.plan is None:
            return
        me = self.job.me
        mine = [m for m in self.plan.messages if me in (m.src, m.dst) and m.src != m.dst]
        self.progress({**info, "total_send": sum(m.nbytes for m in mine if m.src == me),
                       "total_recv": sum(m.nbytes for m in mine if m.dst == me)})

    def _commit(self) -> None:
        from etcslurm.megatron.adapter import finish_restore

        if self.trainee is None:
            return
        if self.job.scalars is not None:
            finish_restore(self.trainee, self.job.scalars)
        dist.barrier()  # past it, every new member is complete


def _kept_pieces(held: list[tuple[Piece, torch.Tensor]],
                 needed: list[tuple[Piece, torch.Tensor]]) -> list[Piece]:
    """The pieces of the new model that are the old model's own memory (a kept model):
    the same piece, viewed through the same storage, offset, shape and strides."""
    by_piece = {p: v for p, v in held}
    same = []
    for piece, view in needed:
        old = by_piece.get(piece)
        if (old is not None and old.data_ptr() == view.data_ptr()
                and old.shape == view.shape and old.stride() == view.stride()
                and old.dtype == view.dtype):
            same.append(piece)
    return same


def _check_held(held: list[tuple[Piece, torch.Tensor]], needed: Iterable[Piece],
                where: str) -> None:
    """A kept model must hold every piece its new rank needs (else nothing-moves was a
    wrong decision): :class:`MigrationError` naming the first one it lacks."""
    have = {p for p, _ in held}
    missing = [p for p in needed if p not in have]
    if missing:
        raise MigrationError(
            f"{where}: nothing was to move, but this rank does not hold {missing[0]} "
            f"(and {len(missing) - 1} more pieces)")


def _copy_own(held: list[tuple[Piece, torch.Tensor]],
              needed: list[tuple[Piece, torch.Tensor]], where: str) -> int:
    """Fill ``needed`` from this process's own ``held`` pieces (the same piece: a change
    in which nothing moves between ranks); views of the same memory are skipped.  Returns
    the bytes copied.  A needed piece this process does not hold is a wrong decision
    that nothing moves: :class:`MigrationError` naming it (nothing is half-written that
    the old state would miss: the old tensors are only read)."""
    _check_held(held, [p for p, _ in needed], where)
    by_piece = {p: v for p, v in held}
    copied = 0
    with torch.no_grad():
        for piece, view in needed:
            src = by_piece[piece]
            if src.data_ptr() == view.data_ptr() and src.stride() == view.stride():
                continue
            view.copy_(src)
            copied += view.numel() * view.element_size()
    return copied


def _boxes_by_tensor(pieces: list[Piece]) -> dict[tuple[str, str], list[Piece]]:
    """``pieces`` by (key, dtype): :func:`_within` then looks at one tensor's pieces, not
    at all of them (a kept gpt-tiny: 156 local pieces × 156 kept ones were 0.03 s)."""
    out: dict[tuple[str, str], list[Piece]] = {}
    for p in pieces:
        out.setdefault((p.key, p.dtype), []).append(p)
    return out


def _within(piece: Piece, boxes: dict[tuple[str, str], list[Piece]]) -> bool:
    """Whether ``piece`` lies inside one of ``boxes``' pieces (same tensor, box contained)."""
    return any(
        len(p.box) == len(piece.box)
        and all(a0 <= b0 and b1 <= a1 for (a0, a1), (b0, b1) in zip(p.box, piece.box, strict=True))
        for p in boxes.get((piece.key, piece.dtype), ()))


def _local_state(trainee: Any) -> list[tuple[Piece, torch.Tensor]]:
    """(piece, view) of every tensor of a freshly built model (empty for a leaver)."""
    if trainee is None:
        return []
    from etcslurm.megatron.sharded_meta import local_state

    return local_state(trainee).items()


@contextlib.contextmanager
def _peer_phase(phase: str, *also: type[BaseException]) -> Iterator[None]:
    """Turn a peer's failure inside ``phase`` into :class:`PeerLost`."""
    try:
        yield
    except PeerLost:
        raise
    except (*PEER_FAILURES, *also) as exc:
        raise PeerLost(phase, exc) from exc


def check_holdings(live: list[Piece], expected: Iterable[Piece], what: str,
                   where: tuple[ParallelConfig, int]) -> None:
    """The live pieces of a rank must be the ones the plan assumed (else the plan is wrong
    for this model: refuse before anything moves)."""
    planned, got = set(expected), set(live)
    if planned != got:
        extra = sorted(got - planned)[:2]
        lacking = sorted(planned - got)[:2]
        raise MigrationError(
            f"{what} layout {where[0]} rank {where[1]}: live state differs from the planned "
            f"state (live only: {extra}; planned only: {lacking})"
        )
