"""The transitions of the session's state machine (see :mod:`etcslurm.runtime.machine`).

Each function does one small thing and returns the next :class:`State`; none calls
another transition.  They talk to the coordinator through ``ctx.coord`` and to
torch.distributed / megatron-core only through ``ctx.world``, so unit tests drive them
with fakes (``tests/test_runtime_transitions.py``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from etcslurm.coord.coordinator import ACTIVE, JOINING
from etcslurm.coord.records import GenerationRecord
from etcslurm.coord.records import replace as replace_record
from etcslurm.core.layout import ParallelConfig
from etcslurm.core.layout_choice import NoLayoutFits
from etcslurm.errors import StateLostError, WaitTimeout
from etcslurm.runtime import checkpointing, generation
from etcslurm.runtime.config import device_memory_bytes, settled_within
from etcslurm.runtime.generation import (
    STANDBY,
    LayoutSettings,
    check_request,
    first_generation,
    merge_requests,
    next_generation,
)
from etcslurm.runtime.jobs import migration_job
from etcslurm.runtime.machine import Context, Phase, State, Waiting
from etcslurm.runtime.migration import PeerLost

log = logging.getLogger("etcslurm.runtime")

#: how often waiting workers look at the coordinator again
POLL_S = 0.05
#: the longest one look of a wait blocks (then the loop comes round again)
LOOK_S = 1.0


# ---------------------------------------------------------------------- joining
def start(ctx: Context, state: State) -> State:
    """Just registered: a new run (or one restarted from a whole-run checkpoint) forms
    its first generation; a running one is joined at a later boundary."""
    del state
    current = ctx.coord.current_generation()
    if current is None or current.kind == "checkpoint":
        return State(Phase.FIRST, record=current)
    return State(Phase.WAIT, after=current.generation - 1)


def first(ctx: Context, state: State) -> State:
    """Initial workers: the leader publishes generation 0 once ``initial_workers`` have
    registered.  ``state.record``: the ``checkpoint`` record a previous job of this run
    ended with (a requeued restart): the start record then follows it in number and
    resumes from the checkpoint.  A wait: one look per call."""
    coord, settings = ctx.coord, ctx.settings
    base = -1 if state.record is None else state.record.generation
    now = time.monotonic()
    w = state.waiting
    if w is None:  # the first look blocks on nothing
        w, pause = Waiting(until=now + ctx.options.join_timeout, since=now), 0.0
    else:
        # Only the leader counts the members (O(N), every POLL_S); the others watch the
        # leader alone (O(1)) and block on the coordinator's news, so N waiting workers
        # cost O(N) per round, not O(N^2), and all wake when generation 0 is published.
        pause = POLL_S if w.defer_to is None else 10 * POLL_S
    if coord.watch(base, timeout=pause).generation > base:
        current = coord.wait_generation(after=base, timeout=max(1.0, w.until - now))
        if ctx.worker_id in current.union:
            return State(Phase.FOLLOW, record=current)
        return State(Phase.WAIT, after=current.generation)
    if w.defer_to is None or not coord.alive(w.defer_to):
        # only workers not yet in any world: after a whole-run checkpoint the previous
        # job's workers may still be alive (leaving) while the restarted ones register
        live = {k: i for k, i in coord.live_members().items() if i["state"] == JOINING}
        leader = coord.leader()
        w = replace(w, defer_to=None if leader in (None, ctx.worker_id) else leader,
                    counted=len(live))
        # no layout fits the workers here: wait as standby for more (tried again, with
        # every live worker, whenever one more registers)
        if (leader == ctx.worker_id and len(live) >= settings.initial_workers
                and (w.standby is None or len(live) > w.standby[0])):
            w = _publish_first(ctx, base, live, w)
    if time.monotonic() > w.until:
        if w.standby is not None:
            raise WaitTimeout(f"run {ctx.options.run_id}: standby for "
                              f"{ctx.options.join_timeout:g} s: {w.standby[1]}")
        raise WaitTimeout(
            f"run {ctx.options.run_id}: only {w.counted} of {settings.initial_workers} "
            f"initial workers registered within {ctx.options.join_timeout:g} s"
        )
    return replace(state, waiting=w)


def _publish_first(ctx: Context, base: int, live: dict[str, Any], w: Waiting) -> Waiting:
    """The leader publishes the first generation of ``live``'s workers (resuming the
    run's checkpoint if it has one), or records why no layout fits them."""
    coord = ctx.coord
    workers = list(live)[: ctx.settings.initial_workers if w.standby is None else None]
    nodes = {k: str(i.get("node") or "?") for k, i in live.items()}
    try:
        record = replace_record(first_generation(layout_settings(ctx), workers, nodes),
                                generation=base + 1)
    except NoLayoutFits as exc:
        coord.emit("run.standby", devices=len(workers), reason=str(exc))
        log.warning("standby: %s", exc)
        return replace(w, standby=(len(workers), str(exc)))
    # the run's own whole-run checkpoint (a requeued run), else the one it starts from
    resume = checkpointing.pointer(ctx.options)
    if resume is None and ctx.settings.load:
        resume = checkpointing.load_pointer(ctx.settings.load)
    if resume:
        record = replace_record(record, resume=resume["path"], step=int(resume.get("step", 0)),
                         reason=f"resume from {resume['path']}; {record.reason}")
    coord.publish_generation(record)
    return w


def wait(ctx: Context, state: State) -> State:
    """A joiner (or an idle standby) waits until a generation takes it in (one look per
    call: blocked on the coordinator's news for a second at most, the signal checked
    between looks; the record read only when there is a new one)."""
    now = time.monotonic()
    w = state.waiting or Waiting(until=now + ctx.options.join_timeout, since=now)
    left = w.until - now
    if left <= 0:
        raise WaitTimeout(
            f"worker {ctx.worker_id} was not taken into run {ctx.options.run_id} "
            f"within {ctx.options.join_timeout:g} s"
        )
    if ctx.boundary.signalled:
        return State(Phase.LEFT, reason="signalled while waiting to join")
    if ctx.coord.watch(state.after, timeout=min(left, LOOK_S)).generation <= state.after:
        return replace(state, waiting=w)
    record = ctx.coord.wait_generation(after=state.after, timeout=max(left, 1.0))
    if record.kind in ("stop", "end"):
        return State(Phase.LEFT, reason=f"the run ended: {record.reason}")
    if ctx.worker_id in record.union:
        return State(Phase.FOLLOW, record=record)
    return State(Phase.WAIT, after=record.generation, waiting=w)


# ---------------------------------------------------------------------- changing
def decide(ctx: Context, state: State) -> State:
    """Everyone at a boundary that changes the world: the decider publishes the next
    generation, all wait for it."""
    assert ctx.record is not None
    ctx.change_started = ctx.boundary.signal_at or time.perf_counter()
    if state.decider is not None:  # agreed in the boundary's all-reduce: no Redis round
        decider = ctx.record.workers_by_rank()[state.decider]
    else:  # everyone is leaving: the coordinator's view decides
        decider = ctx.boundary.decider(ctx.record)
    if decider == ctx.worker_id:
        publish_next(ctx, reason="resize at step boundary")  # reads the holdings too
    else:
        # read the old state's views (the migration needs them, parallel_state still
        # exists) while the decider decides, not after: 0.02-0.03 s of every pause
        ctx.holdings()
    record = ctx.coord.wait_generation(after=ctx.record.generation,
                                       timeout=ctx.options.decide_timeout)
    return State(Phase.FOLLOW, record=record)


def follow(ctx: Context, state: State) -> State:
    """What a new generation record asks of this worker."""
    record = state.record
    assert record is not None
    if ctx.worker_id not in record.union and ctx.record is not None:
        log.warning("generation %s no longer includes %s (it was taken for dead)",
                    record.generation, ctx.worker_id)
        return State(Phase.LEFT, reason="evicted")
    if record.kind == "stop":
        raise StateLostError(f"run {ctx.options.run_id} stopped: {record.reason}")
    phase = {"checkpoint": Phase.CHECKPOINT, "start": Phase.ENTER}.get(record.kind, Phase.RESIZE)
    return State(phase, record=record)


def enter(ctx: Context, state: State) -> State:
    """A start record: form the first world (resuming a checkpoint if it names one)."""
    record = state.record
    assert record is not None
    t0 = time.perf_counter()
    rank = record.rank_of(ctx.worker_id)
    if rank is None:  # idle at start: wait to be taken in later
        return State(Phase.WAIT, after=record.generation)
    ctx.rank = rank
    ctx.forget_holdings()  # a rollback: the old model is replaced by the checkpoint's
    ctx.trainee = ctx.world.form_and_build(record.generation, ParallelConfig.parse(record.to_layout),
                                           rank)
    # before the first step, not at the first resize: a model etcslurm cannot describe
    # stops here with one line naming the first tensor it cannot handle
    ctx.world.check_describable(ctx.trainee)
    learn_shapes(ctx)
    if record.resume:
        ctx.world.load_checkpoint(ctx.trainee, record.resume)
    ctx.record = record
    ctx.coord.set_state(ACTIVE, rank=rank, generation=record.generation)
    log.info("generation %s: rank %s of %s in %.3f s", record.generation, rank,
             record.to_layout, time.perf_counter() - t0)
    return State(Phase.ACTIVE)


def resize(ctx: Context, state: State) -> State:
    """Migrate into the generation ``state.record``: the one migration sequence (new world
    and model, exchange, fill, commit); a peer lost before the commit falls back."""
    record = state.record
    assert record is not None
    gen, coord, t0 = record.generation, ctx.coord, time.perf_counter()
    new_rank = record.rank_of(ctx.worker_id)
    held, _ = ctx.holdings()  # the old model stays readable through these until the commit
    old = None
    if ctx.record is not None and ctx.rank is not None:
        old = (ParallelConfig.parse(ctx.record.to_layout), ctx.rank)
    job = migration_job(ctx.world, layout_settings(ctx), record, ctx.worker_id, held=held,
                        old=old, trainee=ctx.trainee)
    t_job = time.perf_counter()
    if new_rank is not None:
        coord.emit("migration.rebuild", gen=gen, worker=ctx.worker_id, rank=new_rank)
    progress = _progress_emitter(ctx, gen, new_rank)
    try:
        result = ctx.world.migrate(job, progress)
    except PeerLost as exc:
        ctx.world.abort()
        coord.emit("error", worker=ctx.worker_id,
                   message=f"migration to generation {gen} failed in {exc.phase}: "
                           f"{str(exc.cause)[:160]}")
        if ctx.record is None:  # a joiner holds nothing: wait to be taken in again
            return State(Phase.WAIT, after=gen)
        return State(Phase.RECOVER, error=exc, failed=record)
    if new_rank is None:
        return State(Phase.HANDED_OVER, record=record)
    old_layout = ctx.record.to_layout if ctx.record is not None else record.from_layout
    if ctx.trainee is not None and ctx.trainee is not result.trainee:
        ctx.world.retire(ctx.trainee)  # freed in the background once unreferenced
    ctx.trainee, ctx.rank, ctx.record = result.trainee, new_rank, record
    ctx.forget_holdings()
    learn_shapes(ctx)
    coord.set_state(ACTIVE, rank=new_rank, generation=gen)
    if new_rank == 0:  # past the new world's barrier: every member is complete
        coord.commit_generation(gen)
    _report_done(ctx, record, result, old_layout, t0, t_job)
    ctx.change_started = None
    return State(Phase.ACTIVE)


def _report_done(ctx: Context, record: GenerationRecord, result: Any, old_layout: str | None,
                 t0: float, t_job: float) -> None:
    """Log this rank's phases; the new rank 0 emits ``migration.done`` (the monitor's and
    the benchmarks' figures: the pause, the bytes, each phase)."""
    gen, new_rank = record.generation, ctx.rank
    seconds = time.perf_counter() - t0
    phases = {"read": t_job - t0, **{name: result.phase(name) for name in result.seconds}}
    pause = None
    if ctx.change_started is not None:
        pause = time.perf_counter() - ctx.change_started
        phases = {"decide": max(0.0, t0 - ctx.change_started), **phases}
    phases["kept"] = float(result.kept)
    log.info("generation %s: rank %s in %.3f s (%s)", gen, new_rank, seconds,
             ", ".join(f"{k} {v:.3f}" for k, v in phases.items() if k != "kept"))
    if new_rank == 0:
        plan_stats = result.plan.stats
        ctx.coord.emit("migration.done", gen=gen, seconds=seconds,
                       moved_bytes=int(plan_stats.get("moved_bytes", 0)),
                       local_bytes=int(plan_stats.get("local_bytes", 0)),
                       checkpoint_bytes=0, pause_seconds=pause,
                       transfer_seconds=result.phase("exchange"),
                       rebuild_seconds=result.phase("build") + result.phase("commit"),
                       phases=phases, **{"from": old_layout, "to": record.to_layout})


def handed_over(ctx: Context, state: State) -> State:
    """A leaver (or a worker no layout uses now) keeps its state until the new world has
    committed ``state.record`` (its rank 0 records the commit past the new world's
    barrier), so that a failed change can be planned again from it.  Bounded by the time
    a failure takes to show (after that it leaves anyway).  A wait: one look per call."""
    record = state.record
    assert record is not None
    coord, opts, gen = ctx.coord, ctx.options, record.generation
    now = time.monotonic()
    w = state.waiting
    if w is None:
        limit = settled_within(opts.dead_after, opts.collective_timeout,
                               ctx.world.notice_seconds())
        w = Waiting(until=now + limit, since=now)
        coord.hold(gen)  # should this change fail: its state is here, outside every rendezvous
    left = w.until - now
    if left <= 0:
        log.warning("generation %s was not confirmed within %.0f s; leaving anyway",
                    gen, w.until - w.since)
        return _handed_over(ctx, record)
    # blocked on the coordinator's news (O(1)); woken by the commit or a new record
    head = coord.watch(gen, timeout=min(left, LOOK_S), committed=gen - 1)
    if head.committed >= gen:
        return _handed_over(ctx, record)
    if head.generation > gen:
        latest = coord.current_generation()  # read once, only when there is one
        if latest is not None and latest.generation > gen:
            if ctx.worker_id in latest.union and latest.kind == "resize":
                return State(Phase.FOLLOW, record=latest)  # the change failed: again
            return _handed_over(ctx, record)  # planned without this worker: done here
        time.sleep(POLL_S)  # its number ran ahead of the record: look again
    return replace(state, waiting=w)


def _handed_over(ctx: Context, record: GenerationRecord) -> State:
    """The change is settled without this worker: leave, or wait as a standby."""
    ctx.forget_holdings()
    ctx.trainee = None
    if ctx.worker_id in record.leaving:
        return State(Phase.LEFT, reason="left")
    ctx.record = None  # idle: no layout uses this worker now; wait as a standby
    return State(Phase.WAIT, after=record.generation)


def checkpoint(ctx: Context, state: State) -> State:
    """Nobody survives: every rank of the old world saves a checkpoint, then leaves (and,
    under Slurm, requeues its job: the restart resumes from the checkpoint)."""
    record = state.record
    assert record is not None
    directory = checkpointing.directory(ctx.options)
    # the save moves the directory's tracker once every rank's files are complete
    ctx.world.save_checkpoint(ctx.trainee, directory)
    ctx.world.barrier()
    if ctx.rank == 0:
        why = "standby" if f"; {STANDBY}: " in record.reason else "preempted"
        ctx.coord.emit("run.end", reason=f"{why}: checkpoint written", step=record.step,
                       checkpoint=str(checkpointing.iteration_dir(directory, ctx.step)))
    ctx.world.barrier()  # the tracker exists before any job is requeued (which ends it)
    checkpointing.requeue_own_job(ctx.coord, ctx.worker_id)
    return State(Phase.LEFT, reason="checkpointed")


# ---------------------------------------------------------------------- helpers
def learn_shapes(ctx: Context) -> None:
    """A run of the user's own model learns its shapes (and optimizer) from the model
    this worker just built: what the layout policy and the decider plan from.  Every
    member reads the same model; the coordinator keeps them for workers yet to come."""
    if ctx.settings.model is not None or ctx.trainee is None:
        return
    trainee = ctx.trainee
    ctx.settings = replace(ctx.settings, model=trainee.spec, optimizer=trainee.optimizer_kind)
    ctx.world.settings = ctx.settings
    ctx.coord.record_shapes({"model": trainee.spec.to_json(),
                             "optimizer": trainee.optimizer_kind})


def layout_settings(ctx: Context) -> LayoutSettings:
    """What the layout policy and the planner need of the run settings (device memory:
    the setting, else this worker's GPU's, else no limit)."""
    return generation.layout_settings(ctx.settings, device_memory_bytes())


def publish_next(ctx: Context, reason: str, extra_dead: tuple[str, ...] = ()) -> None:
    """Decide and publish the generation after ``ctx.record`` (the decider only).

    ``extra_dead``: workers proven dead by a failed collective (see
    :meth:`Boundary.world_view`: at a boundary nobody is taken for dead).
    """
    assert ctx.record is not None
    coord = ctx.coord
    view = ctx.boundary.world_view(ctx.record)
    pending = coord.pending_changes()
    request = merge_requests(pending)
    dead = sorted(extra_dead)
    if request is not None:
        problem = check_request(layout_settings(ctx), ctx.record, request,
                                leaving=view.leaving, dead=dead, ready=view.ready)
        if problem is not None:  # ignored by next_generation; say why
            coord.emit("error", worker=ctx.worker_id,
                       message=f"change request by {request.by} ignored: {problem}")
    rollback = checkpointing.periodic_pointer(ctx.options) if ctx.settings.checkpoint_every else None
    record, _plan = next_generation(
        layout_settings(ctx), ctx.record, leaving=view.leaving, dead=dead,
        ready=view.ready, nodes=view.nodes, step=ctx.step, scalars=ctx.holdings()[1],
        reason=reason, request=request, rollback=rollback,
    )
    latest = coord.current_generation()
    if latest is not None and record.generation <= latest.generation:
        # after a failed migration the failed record is the latest
        record = replace_record(record, generation=latest.generation + 1)
    if pending:
        coord.take_changes(len(pending))
    if coord.publish_generation(record):
        log.info("published generation %s: %s", record.generation, record.reason)
        if record.kind == "checkpoint" and f"; {STANDBY}: " in record.reason:
            coord.emit("run.standby", reason=record.reason.split(f"; {STANDBY}: ", 1)[1])
        if record.kind == "start" and record.resume:  # a rollback (see next_generation)
            coord.emit("run.rollback", step=record.step, lost_steps=ctx.step - record.step,
                       checkpoint=record.resume, reason=record.reason[:200])


def _progress_emitter(ctx: Context, gen: int, new_rank: int | None) -> Any:
    """A progress callback that emits ``migration.progress`` with running totals (the
    migration adds this participant's ``total_send`` / ``total_recv`` to each report)."""
    done = {"sent": 0, "recv": 0}

    def progress(info: dict[str, Any]) -> None:
        done["sent"] += int(info.get("bytes_sent", 0))
        done["recv"] += int(info.get("bytes_received", 0))
        total_send, total_recv = int(info["total_send"]), int(info["total_recv"])
        ctx.coord.emit("migration.progress", gen=gen, worker=ctx.worker_id, rank=new_rank,
                       sent=min(done["sent"], total_send), recv=min(done["recv"], total_recv),
                       total_send=total_send, total_recv=total_recv)

    return progress
