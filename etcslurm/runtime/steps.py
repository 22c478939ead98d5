"""The transitions of a step boundary (see :mod:`etcslurm.runtime.machine`).

After every training step the session enters ``BOUNDARY``: the step's progress is
reported, a periodic checkpoint is polled or started, and the run either ends
(``FINISH``) or votes (``VOTE``: one all-reduce) on whether the world changes now, and
whether to save a checkpoint now (``etcslurm checkpoint``).  A change goes to ``DECIDE``;
no change back to ``ACTIVE``, the training loop's next step.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from etcslurm.errors import EtcslurmError
from etcslurm.runtime import checkpointing
from etcslurm.runtime.generation import end_generation, worth_changing
from etcslurm.runtime.machine import Context, Phase, State
from etcslurm.runtime.transitions import layout_settings

log = logging.getLogger("etcslurm.runtime")


def boundary(ctx: Context, state: State) -> State:
    """A step finished: pace it (demos), report it, keep periodic checkpoints going."""
    assert ctx.record is not None
    step, settings = ctx.step, ctx.settings
    elapsed = time.perf_counter() - state.step_started
    if elapsed < ctx.options.min_step_seconds:  # paced demos: give joiners time
        time.sleep(ctx.options.min_step_seconds - elapsed)
    ctx.hooks.after_step(step, elapsed)
    elapsed = max(time.perf_counter() - state.step_started, 1e-9)
    if ctx.rank == 0:
        ctx.boundary.emit_soft(
            "step", gen=ctx.record.generation, step=step, loss=float(state.loss),
            tokens_per_s=settings.global_batch * settings.model.seq / elapsed,
        )
    _log_data(ctx, step - 1, state.loss)
    periodic = ctx.periodic
    if periodic is not None:  # poll and start saves in lockstep (collectives)
        periodic.poll(ctx.world, ctx.rank)
        if periodic.due(step) and step < settings.steps:
            periodic.begin(ctx.world, ctx.trainee, step, ctx.record.to_layout, ctx.rank)
    if step >= settings.steps:
        return State(Phase.FINISH)
    return State(Phase.VOTE)


def vote(ctx: Context, state: State) -> State:
    """All ranks agree (one all-reduce) whether to change the world now, on the rank that
    decides (the lowest one not leaving), and whether to save a checkpoint now (rank 0
    saw a request; a change of world first, the request stays for a later boundary)."""
    del state
    assert ctx.record is not None
    boundary = ctx.boundary
    boundary.announce_leaving(ctx.worker_id)
    flag, request = boundary.announced, None
    if ctx.rank == 0 and not flag and boundary.reachable() and boundary.poll_due():
        try:
            flag = _leader_sees_change(ctx)
            if not flag:
                request = ctx.coord.checkpoint_request(deadline=0)
        except EtcslurmError as exc:
            boundary.failed(exc)
    change, decider, save = ctx.world.vote(flag, ctx.rank or 0,
                                           candidate=not boundary.announced,
                                           save=request is not None)
    if not change:
        if save:
            _save_now(ctx, request)
        return State(Phase.ACTIVE)
    if ctx.periodic is not None:  # the save belongs to this world: finish it first
        ctx.periodic.finish(ctx.world, ctx.rank)
    return State(Phase.DECIDE, decider=decider)


def finish_run(ctx: Context, state: State) -> State:
    """The last step is done: the pending save is finished, and rank 0 publishes the
    ``end`` record so standbys and late joiners waiting for a generation go home."""
    del state
    assert ctx.record is not None
    if ctx.periodic is not None:
        ctx.periodic.finish(ctx.world, ctx.rank)
    if ctx.rank == 0:
        ctx.boundary.flush(retry_s=None, worker=ctx.worker_id)
        ctx.coord.publish_generation(
            end_generation(ctx.record, ctx.step, reason=f"finished {ctx.step} steps"))
    return State(Phase.LEFT, reason="finished")


def _leader_sees_change(ctx: Context) -> bool:
    """Rank 0's look at the coordinator: joiners ready, a worker leaving, a request."""
    assert ctx.record is not None
    settings = layout_settings(ctx)
    view = ctx.boundary.world_view(ctx.record, deadline=0)
    request = ctx.boundary.pending_request(settings, ctx.record, view, deadline=0)
    return worth_changing(settings, ctx.record, leaving=view.leaving, dead=[],
                          ready=view.ready, request=request)


def _save_now(ctx: Context, request: Any) -> None:
    """A checkpoint asked for (``etcslurm checkpoint``): the periodic save, at this step
    (none twice at one step); rank 0 takes the request."""
    assert ctx.record is not None
    if ctx.periodic is None:  # a run without periodic saves keeps them in the same place
        ctx.periodic = checkpointing.Periodic(ctx.options, 0, ctx.settings.checkpoint_keep)
    periodic, step = ctx.periodic, ctx.step
    if periodic.last_step != step:
        periodic.begin(ctx.world, ctx.trainee, step, ctx.record.to_layout, ctx.rank)
    if ctx.rank == 0:
        path = checkpointing.iteration_dir(checkpointing.periodic_directory(ctx.options), step)
        log.info("checkpoint of step %s asked for by %s: %s", step, request.by, path)
        try:
            ctx.coord.take_checkpoint_request()
            ctx.coord.emit("checkpoint.saving", step=step, path=str(path), by=request.by)
        except EtcslurmError as exc:  # asked again at a later boundary: saved again
            ctx.boundary.failed(exc)


def _log_data(ctx: Context, step: int, loss: float) -> None:
    """Which samples this DP rank trained at ``step`` (etcslurm's own model's rule)."""
    if ctx.data_log is None or ctx.record is None:
        return
    position = ctx.world.data_position()
    if position is not None:
        ctx.data_log.write(step=step, record=ctx.record, position=position,
                           global_batch=ctx.settings.global_batch, loss=loss,
                           worker=ctx.worker_id)
