"""This process's distributed side, as the session's transitions see it.

Everything that touches torch.distributed, megatron-core or the model goes through
:class:`World`: forming a generation's world and building its model, the step boundary's
one all-reduce, reading the state a rank holds, running the migration sequence, saving
and loading checkpoints.  The transitions in :mod:`etcslurm.runtime.transitions` only
decide; unit tests drive them with a fake world (``tests/fakes.py``) and a fake
coordinator, the multi-process tests with this one.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from etcslurm.core.layout import ParallelConfig
from etcslurm.core.state import Piece
from etcslurm.groups import lifecycle as groups
from etcslurm.groups.bounds import rendezvous_fails_within
from etcslurm.hooks import NO_HOOKS, Hooks
from etcslurm.runtime.config import Builder, RunSettings, WorkerOptions
from etcslurm.runtime.migration import Migration, MigrationJob, MigrationResult, Observer
from etcslurm.transfer.wire import DIRECT_MIN_BYTES

log = logging.getLogger("etcslurm.runtime")


class World:
    """torch.distributed worlds, megatron-core ``parallel_state`` and the model built in
    them, on one long-lived store (one ``PrefixStore`` per generation)."""

    def __init__(self, store: dist.Store, settings: RunSettings, options: WorkerOptions,
                 build: Builder | None = None, hooks: Hooks = NO_HOOKS,
                 direct_min: int = DIRECT_MIN_BYTES) -> None:
        self.store = store
        #: slices of at least this many bytes travel as segments of their own
        #: (:data:`etcslurm.transfer.wire.DIRECT_MIN_BYTES`)
        self.direct_min = direct_min
        self.settings = settings
        self.options = options
        self.build = build
        self.hooks = hooks
        #: the longest world formation + model build seen: how long the members of an
        #: exchange group may take to arrive (they build the new model first)
        self.build_seconds = 0.0
        #: the staging arena, kept from one migration to the next (resident memory)
        self.arena: torch.Tensor | None = None
        #: no builder of the user's: the model is etcslurm's own GPT of ``settings.model``,
        #: whose pieces are known analytically (the migration checks the live ones)
        self.analytic = build is None
        self._periodic: Any = None  # the async checkpoint writer of periodic saves
        #: seconds of the last world formation and build, by part (world, groups, build)
        self.last_build: dict[str, float] = {}
        #: the trainee this process built last (weakly: a leaver's model must be freed)
        #: and megatron's groups it was built in
        self._groups: tuple[weakref.ref[Any], Any] | None = None

    @property
    def group_timeout(self) -> float:
        """An exchange group's timeout: its members arrive once their new model is built."""
        return self.options.collective_timeout + 2 * self.build_seconds

    def notice_seconds(self) -> float:
        """The longest a member of a change may take to notice that the change failed: a
        rendezvous that meets a hung peer fails only after several times its timeout
        (:func:`~etcslurm.groups.bounds.rendezvous_fails_within`).  A survivor waiting
        for another to act on a failure allows for it."""
        return rendezvous_fails_within(self.group_timeout)

    # ------------------------------------------------------------------ worlds
    def _form(self, generation: int, layout: ParallelConfig, rank: int) -> None:
        """Start ``generation``'s world as ``rank`` and megatron's groups for ``layout``
        (timed apart: ``last_build["world"]`` and ``["groups"]``)."""
        from etcslurm.megatron import cpu_shim
        from etcslurm.megatron.parallel import init_model_parallel, init_world

        self.hooks.before_new_world(generation)
        cpu_shim.install_if_needed()
        t0 = time.perf_counter()
        init_world(rank, layout.world_size, self.store, f"{generation}t",
                   timeout_s=self.options.collective_timeout)
        t1 = time.perf_counter()
        init_model_parallel(layout, self.options.collective_timeout)
        self.last_build = {"world": t1 - t0, "groups": time.perf_counter() - t1}

    def _built(self, trainee: Any, t0: float) -> Any:
        """Bookkeeping after a build: timings, and the groups ``trainee`` was built in (a
        later DP-only change maps its modules' group references from them, even after
        a failure tore this world down)."""
        from etcslurm.megatron.regroup import snapshot

        self.last_build["build"] = time.perf_counter() - t0
        self.build_seconds = max(self.build_seconds, sum(self.last_build.values()))
        try:
            self._groups = (weakref.ref(trainee), snapshot())
        except TypeError:  # a user's builder may return a tuple: never kept
            self._groups = None
        return trainee

    def form_and_build(self, generation: int, layout: ParallelConfig, rank: int) -> Any:
        """Start ``generation``'s world as ``rank`` and build the model of ``layout``."""
        self._form(generation, layout, rank)
        t0 = time.perf_counter()
        return self._built(self.build_model(layout), t0)

    def can_keep(self, trainee: Any, old: tuple[ParallelConfig, int],
                 new: tuple[ParallelConfig, int]) -> bool:
        """Whether ``trainee`` (this world's model, ``old`` = its layout and rank) can be
        kept as rank ``new``: a data-parallel-only change that moves none of its
        parameters, with the replicated optimizer (:func:`etcslurm.megatron.regroup.can_keep`),
        and a model etcslurm's own builder made (a user's model is rebuilt)."""
        from etcslurm.megatron.model import Trainee
        from etcslurm.megatron.regroup import can_keep

        known = self._groups is not None and self._groups[0]() is trainee
        return (known and self.analytic and isinstance(trainee, Trainee)
                and can_keep(old, new, trainee.optimizer_kind))

    def regroup(self, generation: int, layout: ParallelConfig, rank: int,
                old: Any) -> tuple[Any, bool]:
        """Start ``generation``'s world and keep ``old``'s model in it (new groups, DDP,
        optimizer; same parameters and Adam state: :mod:`etcslurm.megatron.regroup`);
        returns ``(model, kept)``.

        A model that turns out not to be keepable is built anew (``kept`` is False: the
        migration then fills it from ``old``'s tensors).
        """
        from etcslurm.megatron.regroup import RegroupError, rewrap

        assert self._groups is not None and self._groups[0]() is old
        before = self._groups[1]
        # from here on ``old``'s module is being changed (its group references, its DDP
        # hooks): if this change fails, ``old`` is no longer a model that can be kept
        # (its state stays readable, so the next attempt builds anew and copies it)
        self._groups = None
        self._form(generation, layout, rank)
        t0 = time.perf_counter()
        try:
            trainee = rewrap(old, before, layout)
        except RegroupError as exc:
            log.warning("generation %s: model not kept (%s); building it anew", generation, exc)
            return self._build_after_form(layout, t0), False
        groups.retire(before)  # the old world's groups: their destructors off the pause
        return self._built(trainee, t0), True

    def _build_after_form(self, layout: ParallelConfig, t0: float) -> Any:
        return self._built(self.build_model(layout), t0)

    def build_model(self, layout: ParallelConfig) -> Any:
        """This rank's model of ``layout`` (its world and megatron's groups are formed):
        etcslurm's GPT of the run's spec, or the user's builder's objects, as a
        :class:`~etcslurm.megatron.model.Trainee` whose optimizer state exists (torch's
        Adam creates it lazily at the first step; a migration or a checkpoint load writes
        into it, so a user's builder need not do this itself)."""
        from etcslurm.megatron.adam_state import init_optimizer_state
        from etcslurm.megatron.adopt import as_trainee
        from etcslurm.megatron.model import TrainHyper, build_gpt

        s = self.settings
        if self.build is None:
            if s.model is None:
                from etcslurm.errors import UsageError

                raise UsageError("RunSettings.model is needed without a builder of your own")
            hyper = TrainHyper(lr=s.lr, global_batch=s.global_batch, micro_batch=s.micro_batch)
            return build_gpt(s.model, layout, optimizer=s.optimizer, seed=s.seed, hyper=hyper)
        trainee = as_trainee(self.build(layout), layout, seed=s.seed,
                             global_batch=s.global_batch, micro_batch=s.micro_batch)
        init_optimizer_state(trainee)
        return trainee

    def abort(self) -> None:
        """Drop every process group at once (a peer died, or the worker leaves)."""
        groups.abort()

    def retire(self, trainee: Any) -> None:
        """A model replaced at a resize: dropped in the background once unreferenced (it
        holds the old world's groups, whose destructors take ~14 ms each with gloo)."""
        groups.retire(trainee)

    def vote(self, change: bool, rank: int, candidate: bool,
             save: bool = False) -> tuple[bool, int | None, bool]:
        """The step boundary's one all-reduce: whether any rank wants a change, the
        lowest rank that stays (``candidate``: not leaving) -- the decider, known to
        every rank without asking the coordinator -- and whether any rank wants a
        checkpoint saved now."""
        t = torch.tensor([1 if change else 0, -rank if candidate else -(1 << 62),
                          1 if save else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        lowest = -int(t[1].item())
        return bool(t[0].item()), (lowest if lowest < (1 << 62) else None), bool(t[2].item())

    def barrier(self) -> None:
        dist.barrier()

    # ------------------------------------------------------------------ state
    def read_state(self, trainee: Any) -> tuple[list[tuple[Piece, torch.Tensor]], dict[str, Any]]:
        """(views of every piece ``trainee`` holds, its replicated scalars); needs the
        trainee's ``parallel_state`` to still exist."""
        from etcslurm.megatron.adapter import local_state
        from etcslurm.megatron.scalars import extract_scalars

        return local_state(trainee).items(), extract_scalars(trainee)

    def check_describable(self, trainee: Any) -> None:
        """Refuse, with one line, a model whose state etcslurm cannot describe (it could
        not be migrated at the first resize)."""
        from etcslurm.errors import MigrationError, UsageError
        from etcslurm.megatron.sharded_meta import check_describable

        try:
            check_describable(trainee)
        except MigrationError as exc:
            raise UsageError(f"this model cannot be made elastic: {exc}") from None

    def expected_pieces(self, layout: ParallelConfig, rank: int) -> Iterable[Piece]:
        """The pieces the planner assumes ``rank`` of ``layout`` holds."""
        from etcslurm.megatron_state import rank_pieces

        return rank_pieces(self.settings.model, layout, rank, self.settings.optimizer)

    def migrate(self, job: MigrationJob,
                progress: Callable[[dict[str, Any]], None] | None = None,
                observer: Observer | None = None) -> MigrationResult:
        """Run the migration sequence for ``job`` (the arena is kept for the next one);
        ``observer`` times its phases (default: this participant's wall clock).

        ``job.keep``: this participant's model, kept through :meth:`regroup` (a DP-only
        change); the result's ``seconds`` then split ``build`` into ``world`` (the
        default group), ``groups`` (megatron's) and ``build`` (model or re-wrap)."""
        self.last_build = {}

        migration = Migration(
            job, store=self.store, form_and_build=self.form_and_build, regroup=self.regroup,
            staging_cap=self.settings.staging_bytes, timeout=self.options.collective_timeout,
            group_timeout=self.group_timeout,
            arena=self.arena, hooks=self.hooks, progress=progress,
            direct_min=self.direct_min, observer=observer,
        )
        try:
            result = migration.run()
        finally:
            self.arena = migration.arena
        if self.last_build and "build" in result.seconds:
            result.seconds["build"] = [self.last_build.get("build", 0.0)]
            result.seconds["world"] = [self.last_build.get("world", 0.0)]
            result.seconds["groups"] = [self.last_build.get("groups", 0.0)]
        return result

    def data_position(self) -> tuple[int, int] | None:
        """(DP size, DP rank) when this rank logs the samples its replica trains (tensor
        rank 0 of the first pipeline stage), else ``None``."""
        from megatron.core import parallel_state as ps

        if ps.get_tensor_model_parallel_rank() != 0 or not ps.is_pipeline_first_stage():
            return None
        return ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, trainee: Any, save_dir: Path) -> None:
        """One synchronous save into ``save_dir`` (Megatron-LM's layout) under a preemption
        deadline (an async writer would first start a writer process, seconds on a busy
        node)."""
        from etcslurm.baseline.checkpoint import CheckpointMigrator

        CheckpointMigrator(async_writer=False).save(trainee, save_dir)

    def prepare_checkpoints(self) -> None:
        """Start the periodic checkpoints' writer before this worker takes part in a
        world: every rank's first save then finds its writer warm, and none holds the
        others past the collective timeout while its writer starts."""
        if self._periodic is None:
            from etcslurm.baseline.checkpoint import CheckpointMigrator

            self._periodic = CheckpointMigrator(async_writer=True)
            self._periodic.start_writer()

    def save_async(self, trainee: Any, save_dir: Path) -> None:
        """Start a periodic checkpoint into ``save_dir`` (megatron-core's persistent async
        writer; the tracker moves once it is complete)."""
        self.prepare_checkpoints()
        assert self._periodic is not None
        self._periodic.save_async(trainee, save_dir)

    def checkpoint_poll(self, blocking: bool) -> bool:
        """Whether the pending periodic checkpoint is complete (a collective)."""
        return self._periodic is None or self._periodic.poll(blocking)

    def abandon_checkpoint(self) -> None:
        """Forget a save that can no longer be finalised (a peer died): its writer is
        stopped (it could only wait for peers that are gone); a fresh one serves the
        next save."""
        if self._periodic is not None:
            self._periodic.abandon()
        self._periodic = None

    def stop_checkpoint_writer(self) -> None:
        """Stop the periodic checkpoint writer process (at the end of the worker; a save
        still pending was either finished at the run's end or cannot be finished)."""
        self.abandon_checkpoint()

    def load_checkpoint(self, trainee: Any, path: str) -> None:
        """Load a Megatron-LM / megatron-core checkpoint of any layout into ``trainee``."""
        from etcslurm.baseline.checkpoint import load_checkpoint

        load_checkpoint(trainee, path)
