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
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch.distributed as dist

from etcslurm.coord.coordinator import GONE
from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import GPTSpec
from etcslurm.errors import EtcslurmError, UsageError
from etcslurm.hooks import NO_HOOKS, Hooks
from etcslurm.redis_host.sentinel import host_address
from etcslurm.runtime import checkpointing, recovery, steps, transitions
from etcslurm.runtime.boundary import Boundary, DataLog
from etcslurm.runtime.config import Builder, RunSettings, WorkerOptions
from etcslurm.runtime.machine import Context, Phase, State, drive

log = logging.getLogger("etcslurm.runtime")

#: the transition of every non-terminal phase
TRANSITIONS = {
    Phase.BOUNDARY: steps.boundary,
    Phase.VOTE: steps.vote,
    Phase.FINISH: steps.finish_run,
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

    ``build(layout)`` returns this rank's own megatron-core objects for a layout --
    ``(model chunks, megatron optimizer, LR scheduler or None)``, built in the world and
    ``parallel_state`` the session formed for it -- and is called again for every new
    layout; without one the session trains etcslurm's GPT of ``settings.model``.
    ``on_resize(old, new)`` is called once this worker trains in a new layout (``old`` is
    ``None`` at the start): rebuild what depends on it (data iterators, loggers).
    ``hooks`` are test injection points (no-op by default).
    """

    def __init__(self, settings: RunSettings, options: WorkerOptions,
                 build: Builder | None = None, hooks: Hooks | None = None,
                 on_resize: Callable[[ParallelConfig | None, ParallelConfig], None] | None = None,
                 ) -> None:
        if build is None and settings.model is None:
            raise UsageError("RunSettings.model is needed without a builder of your own")
        self.settings = settings
        self.options = options
        self.build = build
        self.hooks = hooks or NO_HOOKS
        self.on_resize = on_resize
        self.ctx: Context | None = None
        self.finished = False
        self.exit_reason = "finished"
        self._client: Any = None
        self._step_started = time.perf_counter()
        self._layout: ParallelConfig | None = None

    # ------------------------------------------------------------------ what the loop reads
    @property
    def trainee(self) -> Any:
        """etcslurm's record of this rank's model chunks, optimizer and scheduler (a new
        object after a resize)."""
        return self.ctx.trainee if self.ctx is not None else None

    @property
    def model(self) -> list[Any]:
        """This rank's model chunks (your builder's, for the current layout)."""
        return self.trainee.model

    @property
    def optimizer(self) -> Any:
        return self.trainee.optimizer

    @property
    def scheduler(self) -> Any:
        return self.trainee.scheduler

    @property
    def objects(self) -> tuple[list[Any], Any, Any]:
        """``(model, optimizer, scheduler)`` of the current layout."""
        return self.model, self.optimizer, self.scheduler

    @property
    def progress(self) -> Any:
        """The data position your step advances: ``iteration`` (steps done) and
        ``consumed_samples``; it travels with the state at every resize and checkpoint,
        and the run ends when ``iteration`` reaches ``settings.steps``."""
        return self.trainee

    @property
    def layout(self) -> ParallelConfig | None:
        """The layout this worker trains in."""
        return self._layout

    @property
    def rank(self) -> int | None:
        return self.ctx.rank if self.ctx is not None else None

    @property
    def is_logging_rank(self) -> bool:
        """Whether this worker logs for the run (rank 0 of the current world: it moves
        to another worker when the world changes)."""
        return self.rank == 0

    @property
    def worker_id(self) -> str | None:
        return self.ctx.worker_id if self.ctx is not None else None

    @property
    def generation(self) -> int | None:
        """The generation this worker trains in (0 until the world first changes)."""
        record = self.ctx.record if self.ctx is not None else None
        return record.generation if record is not None else None

    @property
    def step_index(self) -> int:
        """The global step the next step computes."""
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
            world.prepare_checkpoints()
        if self.settings.model is None:  # a user's model already built by others
            shapes = coord.shapes()
            if shapes is not None:
                self.settings = replace(self.settings, model=GPTSpec.from_json(shapes["model"]),
                                        optimizer=str(shapes["optimizer"]))
                world.settings = self.ctx.settings = self.settings
        if opts.log_data and self.build is None:
            # which samples each DP rank trains, by etcslurm's own train_step's rule (a
            # user's loop with its own data pipeline logs its own positions)
            self.ctx.data_log = DataLog(Path(opts.run_dir) / f"data-{worker_id}.jsonl")
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
        if ctx is not None and ctx.data_log is not None:
            ctx.data_log.close()
            ctx.data_log = None

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
        elif self.ctx.record is not None:
            layout = ParallelConfig.parse(self.ctx.record.to_layout)
            if layout != self._layout:
                old, self._layout = self._layout, layout
                if self.on_resize is not None:
                    self.on_resize(old, layout)
        self._step_started = time.perf_counter()

    # ------------------------------------------------------------------ training API
    @property
    def signalled(self) -> bool:
        return self.ctx is not None and self.ctx.boundary.signalled

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Wrap one training step: a peer that fails inside it (a collective fails on a
        dead or hung peer) triggers recovery, after which the block is left normally and
        the loop redoes the step.  Any other exception is the step's own: it propagates
        with its traceback after one line saying this worker leaves the run (its peers
        carry on without it), never a retry."""
        from etcslurm.groups.failures import peer_failure

        self._step_started = time.perf_counter()
        try:
            yield
        except EtcslurmError:
            raise
        except Exception as exc:
            if not dist.is_initialized() or not peer_failure(exc):
                self.finished = True
                self.exit_reason = "failed"
                sys.stderr.write(
                    f"etcslurm worker {self.worker_id}: the training step raised "
                    f"{type(exc).__name__} (not a failure of a peer): this worker leaves "
                    "the run\n")
                raise
            self._run(State(Phase.RECOVER, error=exc))

    def step_done(self, loss: float) -> None:
        """The step boundary: publish progress, then resize if anything changed."""
        assert self.ctx is not None and self.ctx.record is not None
        self._run(State(Phase.BOUNDARY, loss=float(loss), step_started=self._step_started))


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
