"""``ElasticSession``: the step-boundary hook a training loop calls.

A worker process opens a session; the session registers with the Redis coordinator,
waits for a generation that includes it, builds its model for that generation's layout,
and hands it to the training loop.  At every step boundary (:meth:`ElasticSession.step_done`)
the world agrees, with one tiny all-reduce, whether anything changed: a worker got a
preemption signal, new workers are ready to join, a worker died, or an operator asked
(``etcslurm resize``).  If so the session runs its state machine
(:mod:`etcslurm.runtime.machine`) until this worker trains again or leaves: the decider
publishes the next generation, every participant replays the planner on it, the new
world forms and builds its model, the state moves peer to peer straight into that model,
the new world commits, the leavers exit, and training goes on at the same step with the
same global batch.

The typical loop (see the README)::

    with ElasticSession(settings, options) as session:
        while not session.finished:
            with session.step():                       # a peer failure inside: recover, redo
                loss = train_step(session.trainee)
                session.step_done(loss)
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from etcslurm.coord.coordinator import GONE
from etcslurm.coord.sentinel import host_address
from etcslurm.errors import EtcslurmError
from etcslurm.hooks import NO_HOOKS, Hooks
from etcslurm.runtime import checkpointing, recovery, transitions
from etcslurm.runtime.boundary import Boundary, DataLog
from etcslurm.runtime.config import Builder, RunSettings, WorkerOptions, default_builder
from etcslurm.runtime.generation import end_generation
from etcslurm.runtime.machine import Context, MigrationReport, Phase, State, drive

log = logging.getLogger("etcslurm.runtime")

#: the transition of every non-terminal phase
TRANSITIONS = {
    Phase.START: transitions.start,
    Phase.FIRST: transitions.first,
    Phase.WAIT: transitions.wait,
    Phase.DECIDE: transitions.decide,
    Phase.FOLLOW: transitions.follow,
    Phase.ENTER: transitions.enter,
    Phase.RESIZE: transitions.resize,
    Phase.HANDED_OVER: transitions.handed_over,
    Phase.CHECKPOINT: transitions.checkpoint,
    Phase.RECOVER: recovery.recover,
}


class ElasticSession:
    """One worker's membership in an elastic run; see the module docstring.

    ``build(model, layout, settings)`` returns the rank's model chunks, optimizer and
    scheduler for a layout (default: etcslurm's megatron-core GPT); ``hooks`` are test
    injection points (no-op by default).
    """

    def __init__(self, settings: RunSettings, options: WorkerOptions,
                 build: Builder | None = None, hooks: Hooks | None = None) -> None:
        self.settings = settings
        self.options = options
        self.build = build or default_builder
        self.hooks = hooks or NO_HOOKS
        self.ctx: Context | None = None
        self.finished = False
        self.exit_reason = "finished"
        self._client: Any = None
        self._data_log: DataLog | None = None
        self._step_started = time.perf_counter()

    # ------------------------------------------------------------------ what the loop reads
    @property
    def trainee(self) -> Any:
        """This rank's model chunks, optimizer and scheduler (a new object after a resize)."""
        return self.ctx.trainee if self.ctx is not None else None

    @property
    def rank(self) -> int | None:
        return self.ctx.rank if self.ctx is not None else None

    @property
    def worker_id(self) -> str | None:
        return self.ctx.worker_id if self.ctx is not None else None

    @property
    def reports(self) -> list[MigrationReport]:
        return self.ctx.reports if self.ctx is not None else []

    @property
    def step_index(self) -> int:
        """The global step the next ``train_step`` computes."""
        return self.ctx.step if self.ctx is not None else 0

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> ElasticSession:
        try:
            self.start()
        except BaseException:  # __exit__ is not called for a failed __enter__
            self.close(GONE)
            raise
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.close(GONE)

    def start(self) -> None:
        """Register, wait for a generation that takes this worker, enter it."""
        from etcslurm.coord.client import connect
        from etcslurm.coord.coordinator import Coordinator
        from etcslurm.coord.store import RedisStore
        from etcslurm.job.signals import trap_for_job
        from etcslurm.megatron.cpu_shim import install_if_needed
        from etcslurm.runtime.world import World

        install_if_needed()
        import etcslurm.megatron.adapter  # noqa: F401
        from etcslurm.megatron.parallel import warm_up

        # before registering: a joiner that is taken in must be ready at once, not spend
        # seconds of everyone's pause importing megatron and freezing its objects
        warm_up()

        opts = self.options
        self._client = connect(opts.redis_url, opts.password_file)
        coord = Coordinator(self._client, opts.run_id, spec=self.settings.to_json(),
                            heartbeat_interval=opts.heartbeat_interval,
                            dead_after=opts.dead_after)
        if self.settings.tensorboard_dir:  # scalars of the events this worker emits as rank 0
            from etcslurm.runtime.tensorboard import Scalars
            coord.observers.append(Scalars(coord, self.settings.tensorboard_dir))
        boundary = Boundary(coord, opts)
        boundary.install(trap_for_job(opts.signals, opts.leave_budget, boundary.on_signal))
        # address: this node's IP, so the monitor can name the node of a coordinator site
        worker_id = coord.register({"node": opts.node, "device": "cpu",
                                    "address": host_address()})
        log.info("registered as %s on %s", worker_id, opts.node)
        store = RedisStore(self._client, opts.run_id, "pg")
        world = World(store, self.settings, opts, self.build, self.hooks)
        self.ctx = Context(self.settings, opts, coord, world, boundary, worker_id, self.hooks)
        if self.settings.checkpoint_every:
            self.ctx.periodic = checkpointing.Periodic(opts, self.settings.checkpoint_every,
                                                       self.settings.checkpoint_keep)
        if opts.log_data and self.build is default_builder:
            # which samples each DP rank trains, by etcslurm's own train_step's rule (a
            # user's loop with its own data pipeline logs its own positions)
            self._data_log = DataLog(Path(opts.run_dir) / f"data-{worker_id}.jsonl")
        self._run(State(Phase.START))

    def close(self, state: str = GONE) -> None:
        """Leave the coordinator and tear every process group down (idempotent)."""
        from etcslurm.groups import lifecycle as groups

        ctx = self.ctx
        if ctx is not None:  # a periodic checkpoint writer must not outlive the worker
            ctx.world.stop_checkpoint_writer()
        groups.abort()
        if ctx is not None and ctx.boundary.trap is not None:
            ctx.boundary.uninstall()
            with contextlib.suppress(Exception):
                if ctx.boundary.backlog:  # events kept through an outage: a last try
                    ctx.boundary.flush(retry_s=5, worker=ctx.worker_id)
                ctx.coord.close(state)
        if self._data_log is not None:
            self._data_log.close()
            self._data_log = None

    def _run(self, state: State) -> None:
        """Drive the state machine from ``state`` until this worker trains or leaves."""
        assert self.ctx is not None
        try:
            final = drive(self.ctx, state, TRANSITIONS)
        except EtcslurmError:
            self.finished = True
            raise
        if final.phase is Phase.LEFT:
            # this worker is done here (it handed its state over, was sent home, ...): the
            # training loop ends at its `while not session.finished`
            log.info("leaving the run: %s", final.reason)
            self.finished = True
            self.exit_reason = final.reason if final.reason in (
                "left", "evicted", "checkpointed") else "finished"
        self._step_started = time.perf_counter()

    # ------------------------------------------------------------------ training API
    @property
    def signalled(self) -> bool:
        return self.ctx is not None and self.ctx.boundary.signalled

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Wrap one training step: a peer that dies inside it triggers recovery, after
        which the block is left normally (the step is then redone by the loop)."""
        self._step_started = time.perf_counter()
        try:
            yield
        except (RuntimeError, dist.DistError) as exc:
            if isinstance(exc, EtcslurmError) or not dist.is_initialized():
                raise
            self._run(State(Phase.RECOVER, error=exc))

    def step_done(self, loss: float) -> None:
        """The step boundary: publish progress, then resize if anything changed."""
        ctx = self.ctx
        assert ctx is not None and ctx.record is not None
        step = ctx.step
        elapsed = time.perf_counter() - self._step_started
        if elapsed < self.options.min_step_seconds:  # paced demos: give joiners time
            time.sleep(self.options.min_step_seconds - elapsed)
        self.hooks.after_step(step, elapsed)
        elapsed = max(time.perf_counter() - self._step_started, 1e-9)
        if ctx.rank == 0:
            ctx.boundary.emit_soft(
                "step", gen=ctx.record.generation, step=step, loss=float(loss),
                tokens_per_s=self.settings.global_batch * self.settings.model.seq / elapsed,
            )
        self._log_data(step - 1, loss)
        periodic = ctx.periodic
        if periodic is not None:  # poll and start saves in lockstep (collectives)
            periodic.poll(ctx.world, ctx.rank)
            if periodic.due(step) and step < self.settings.steps:
                periodic.start(ctx.world, ctx.trainee, step, ctx.record.to_layout, ctx.rank)
        if step >= self.settings.steps:
            if periodic is not None:
                periodic.finish(ctx.world, ctx.rank)
            self.finished = True
            self.exit_reason = "finished"
            if ctx.rank == 0:  # standbys and late joiners waiting for a generation: go home
                ctx.boundary.flush(retry_s=None, worker=ctx.worker_id)
                ctx.coord.publish_generation(
                    end_generation(ctx.record, step, reason=f"finished {step} steps"))
            return
        change, decider = self._boundary_change()
        if change:
            if periodic is not None:  # the save belongs to this world: finish it first
                periodic.finish(ctx.world, ctx.rank)
            self._run(State(Phase.DECIDE, decider=decider))
        self._step_started = time.perf_counter()

    def _boundary_change(self) -> tuple[bool, int | None]:
        """All ranks agree (one all-reduce) whether to change the world now, and on the
        rank that decides (the lowest one not leaving)."""
        ctx = self.ctx
        assert ctx is not None and ctx.record is not None
        boundary = ctx.boundary
        boundary.announce_leaving(ctx.worker_id)
        flag = boundary.announced
        if ctx.rank == 0 and not flag and boundary.reachable() and boundary.poll_due():
            try:
                flag = self._leader_sees_change()
            except EtcslurmError as exc:
                boundary.failed(exc)
        return ctx.world.vote(flag, ctx.rank or 0, candidate=not boundary.announced)

    def _leader_sees_change(self) -> bool:
        from etcslurm.runtime.generation import worth_changing

        ctx = self.ctx
        assert ctx is not None and ctx.record is not None
        settings = transitions.layout_settings(ctx)
        view = ctx.boundary.world_view(ctx.record, deadline=0)
        request = ctx.boundary.pending_request(settings, ctx.record, view, deadline=0)
        return worth_changing(settings, ctx.record, leaving=view.leaving, dead=[],
                              ready=view.ready, request=request)

    def _log_data(self, step: int, loss: float) -> None:
        ctx = self.ctx
        if self._data_log is None or ctx is None or ctx.record is None:
            return
        position = ctx.world.data_position()
        if position is not None:
            self._data_log.write(step=step, record=ctx.record, position=position,
                                 global_batch=self.settings.global_batch, loss=loss,
                                 worker=ctx.worker_id)


def run_worker(settings: RunSettings, options: WorkerOptions,
               train_step: Callable[[Any], float] | None = None,
               build: Builder | None = None, hooks: Hooks | None = None) -> int:
    """The whole elastic training loop of one worker; returns its exit code."""
    if train_step is None:
        from etcslurm.megatron.train import train_step
    session = ElasticSession(settings, options, build=build, hooks=hooks)
    try:
        with session:
            while not session.finished:
                with session.step():
                    loss = train_step(session.trainee)
                    session.step_done(loss)
    except EtcslurmError as exc:
        sys.stderr.write(f"etcslurm worker {session.worker_id}: {exc}\n")
        session.close(GONE)
        return exc.exit_code
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    return 0
