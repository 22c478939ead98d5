"""The transitions of the session's state machine (see :mod:`etcslurm.runtime.machine`).

Each function does one small thing and returns the next :class:`State`; none calls
another transition.  They talk to the coordinator through ``ctx.coord`` and to
torch.distributed / megatron-core only through ``ctx.world``, so unit tests drive them
with fakes (``tests/test_runtime_transitions.py``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from etcslurm.coord.coordinator import ACTIVE, JOINING
from etcslurm.coord.records import GenerationRecord, replace
from etcslurm.core.layout import ParallelConfig
from etcslurm.core.planner import MigrationPlan
from etcslurm.errors import StateLostError, WaitTimeout
from etcslurm.runtime import checkpointing
from etcslurm.runtime.config import settled_within
from etcslurm.runtime.generation import (
    LayoutSettings,
    check_request,
    first_generation,
    merge_requests,
    next_generation,
)
from etcslurm.runtime.machine import Context, MigrationReport, Phase, State
from etcslurm.runtime.migration import MigrationJob, PeerLost, analytic_plan, live_plan

log = logging.getLogger("etcslurm.runtime")

#: how often waiting workers look at the coordinator again
POLL_S = 0.05


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
    resumes from the checkpoint."""
    coord, settings = ctx.coord, ctx.settings
    base = -1 if state.record is None else state.record.generation
    deadline = time.monotonic() + ctx.options.join_timeout
    # Only the leader counts the members (O(N), every POLL_S); the others watch the
    # leader alone (O(1)) and block on the coordinator's news, so N waiting workers cost
    # O(N) per round, not O(N^2), and all of them wake when generation 0 is published.
    live: dict[str, Any] = {}
    defer_to: str | None = None
    wait_s = 0.0
    while True:
        if coord.watch(base, timeout=wait_s).generation > base:
            break
        if defer_to is None or not coord.alive(defer_to):
            # only workers not yet in any world: after a whole-run checkpoint the previous
            # job's workers may still be alive (leaving) while the restarted ones register
            live = {w: i for w, i in coord.live_members().items() if i["state"] == JOINING}
            leader = coord.leader()
            defer_to = None if leader in (None, ctx.worker_id) else leader
            if leader == ctx.worker_id and len(live) >= settings.initial_workers:
                workers = list(live)[: settings.initial_workers]
                nodes = {w: str(i.get("node") or "?") for w, i in live.items()}
                record = replace(first_generation(layout_settings(ctx), workers, nodes),
                                 generation=base + 1)
                resume = checkpointing.pointer(ctx.options)
                if resume:
                    record = replace(record, resume=resume["path"],
                                     step=int(resume.get("step", 0)),
                                     reason=f"resume from {resume['path']}; {record.reason}")
                if coord.publish_generation(record):
                    wait_s = 0.0
                    continue
        if time.monotonic() > deadline:
            raise WaitTimeout(
                f"run {ctx.options.run_id}: only {len(live)} of {settings.initial_workers} "
                f"initial workers registered within {ctx.options.join_timeout:g} s"
            )
        wait_s = POLL_S if defer_to is None else 10 * POLL_S
    current = coord.wait_generation(after=base, timeout=max(1.0, deadline - time.monotonic()))
    if ctx.worker_id in current.union:
        return State(Phase.FOLLOW, record=current)
    return State(Phase.WAIT, after=current.generation)


def wait(ctx: Context, state: State) -> State:
    """A joiner (or an idle standby) waits until a generation takes it in."""
    end = time.monotonic() + ctx.options.join_timeout
    after = state.after
    while True:
        left = end - time.monotonic()
        if left <= 0:
            raise WaitTimeout(
                f"worker {ctx.worker_id} was not taken into run {ctx.options.run_id} "
                f"within {ctx.options.join_timeout:g} s"
            )
        if ctx.boundary.signalled:
            return State(Phase.LEFT, reason="signalled while waiting to join")
        # O(1) while nothing happens (blocked on the coordinator's news, the signal
        # checked every second); the record is read once, when there is a new one
        if ctx.coord.watch(after, timeout=min(left, 1.0)).generation <= after:
            continue
        record = ctx.coord.wait_generation(after=after, timeout=max(left, 1.0))
        after = record.generation
        if record.kind in ("stop", "end"):
            return State(Phase.LEFT, reason=f"the run ended: {record.reason}")
        if ctx.worker_id in record.union:
            return State(Phase.FOLLOW, record=record)


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
    if record.resume:
        ctx.world.load_checkpoint(ctx.trainee, record.resume)
    ctx.record = record
    ctx.coord.set_state(ACTIVE, rank=rank, generation=record.generation)
    ctx.reports.append(MigrationReport(record.generation, "start", None, record.to_layout,
                                       seconds=time.perf_counter() - t0))
    return State(Phase.ACTIVE)


def resize(ctx: Context, state: State) -> State:
    """Migrate into the generation ``state.record``: the one migration sequence (new world
    and model, exchange, fill, commit); a peer lost before the commit falls back."""
    record = state.record
    assert record is not None
    gen, coord, t0 = record.generation, ctx.coord, time.perf_counter()
    ids = record.planner_ids
    me, new_rank = ids[ctx.worker_id], record.rank_of(ctx.worker_id)
    held, _ = ctx.holdings()  # the old model stays readable through these until the commit
    old = None
    if ctx.record is not None and ctx.rank is not None:
        old = (ParallelConfig.parse(ctx.record.to_layout), ctx.rank)
    layout = ParallelConfig.parse(record.to_layout)
    keep = None  # a DP-only change that moves none of this rank's parameters: keep them
    if old is not None and new_rank is not None and ctx.world.can_keep(
            ctx.trainee, old, (layout, new_rank)):
        keep = ctx.trainee
    world = record.workers_by_rank()
    # nobody leaves or stays idle: the exchange can run on the new world itself
    on_world = set(world) == set(record.union)
    planner = _analytic_plan if ctx.world.analytic else _live_plan
    job = MigrationJob(
        generation=gen, me=me, new_rank=new_rank, layout=layout, held=held,
        members=[ids[w] for w in (world if on_world else record.union)], on_world=on_world,
        scalars=dict(record.scalars) if new_rank is not None else None,
        plan=lambda m: planner(ctx, record, m), old=old,
        expected=ctx.world.expected_pieces if ctx.world.analytic else None,
        keep=keep, nothing_moves=_nothing_moves(ctx, record),
    )
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
    coord.set_state(ACTIVE, rank=new_rank, generation=gen)
    if new_rank == 0:  # past the new world's barrier: every member is complete
        coord.commit_generation(gen)
    stats, plan_stats = result.stats, result.plan.stats
    report = MigrationReport(
        gen, "resize", old_layout, record.to_layout, seconds=time.perf_counter() - t0,
        transfer_seconds=result.phase("exchange"),
        rebuild_seconds=result.phase("build") + result.phase("commit"),
        moved_bytes=int(plan_stats.get("moved_bytes", 0)),
        local_bytes=int(plan_stats.get("local_bytes", 0)),
        sent_bytes=stats.bytes_sent, received_bytes=stats.bytes_received,
    )
    phases = {"read": t_job - t0, **{name: result.phase(name) for name in result.seconds}}
    if ctx.change_started is not None:
        report.pause_seconds = time.perf_counter() - ctx.change_started
        phases = {"decide": max(0.0, t0 - ctx.change_started), **phases}
    phases["kept"] = float(result.kept)
    ctx.reports.append(report)
    log.info("generation %s: rank %s in %.3f s (%s)", gen, new_rank, report.seconds,
             ", ".join(f"{k} {v:.3f}" for k, v in phases.items() if k != "kept"))
    if new_rank == 0:
        coord.emit("migration.done", gen=gen, seconds=report.seconds,
                   moved_bytes=report.moved_bytes, local_bytes=report.local_bytes,
                   checkpoint_bytes=0, pause_seconds=report.pause_seconds,
                   transfer_seconds=report.transfer_seconds,
                   rebuild_seconds=report.rebuild_seconds, phases=phases,
                   **{"from": old_layout, "to": record.to_layout})
    ctx.change_started = None
    return State(Phase.ACTIVE)


def handed_over(ctx: Context, state: State) -> State:
    """A leaver (or a worker no layout uses now) keeps its state until the new world has
    committed ``state.record`` (its rank 0 records the commit past the new world's
    barrier), so that a failed change can be planned again from it.  Bounded by the time
    a failure takes to show (after that it leaves anyway)."""
    record = state.record
    assert record is not None
    coord, opts = ctx.coord, ctx.options
    limit = settled_within(opts.dead_after, opts.collective_timeout,
                           ctx.world.notice_seconds())
    end = time.monotonic() + limit
    gen = record.generation
    coord.hold(gen)  # should this change fail: its state is here, outside every rendezvous
    while True:
        left = end - time.monotonic()
        if left <= 0:
            log.warning("generation %s was not confirmed within %.0f s; leaving anyway",
                        gen, limit)
            break
        # blocked on the coordinator's news (O(1)); woken by the commit or a new record
        head = coord.watch(gen, timeout=left, committed=gen - 1)
        if head.committed >= gen:
            break
        if head.generation > gen:
            latest = coord.current_generation()  # read once, only when there is one
            if latest is not None and latest.generation > gen:
                if ctx.worker_id in latest.union and latest.kind == "resize":
                    return State(Phase.FOLLOW, record=latest)  # the change failed: again
                break  # planned without this worker (from the new state): done here
            time.sleep(POLL_S)  # its number ran ahead of the record: look again
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
    target = directory / f"step{record.step:08d}"
    ctx.world.save_checkpoint(ctx.trainee, target)
    ctx.world.barrier()
    if ctx.rank == 0:
        checkpointing.write_pointer(directory, target, record.step, record.from_layout)
        ctx.coord.emit("run.end", reason="preempted: checkpoint written", step=record.step,
                       checkpoint=str(target))
    ctx.world.barrier()  # latest.json exists before any job is requeued (which ends it)
    checkpointing.requeue_own_job(ctx.coord, ctx.worker_id)
    return State(Phase.LEFT, reason="checkpointed")


# ---------------------------------------------------------------------- helpers
def layout_settings(ctx: Context) -> LayoutSettings:
    """What the layout policy and the planner need of the run settings."""
    s = ctx.settings
    return LayoutSettings(spec=s.model, optimizer=s.optimizer, global_batch=s.global_batch,
                          micro_batch=s.micro_batch, gpus_per_node=s.gpus_per_node,
                          staging_bytes=s.staging_bytes)


def _nothing_moves(ctx: Context, record: GenerationRecord) -> bool:
    """Whether every participant can tell from ``record`` alone that no byte moves: the
    same TP, PP and EP, no participant without old state, the replicated optimizer, and
    the decider's plan of etcslurm's own model moves nothing.  Then each new member keeps
    its model (a DP shrink) and nobody forms an exchange group or replays the plan."""
    if not ctx.world.analytic or ctx.settings.optimizer != "adam" or not record.from_layout:
        return False
    a, b = ParallelConfig.parse(record.from_layout), ParallelConfig.parse(record.to_layout)
    if (a.tp, a.pp, getattr(a, "ep", 1)) != (b.tp, b.pp, getattr(b, "ep", 1)):
        return False
    if any(pid.startswith("join:") for pid in record.planner_ids.values()):
        return False
    stats = record.plan_stats or {}
    return stats.get("moved_bytes") == 0 and not stats.get("missing_bytes")


def _analytic_plan(ctx: Context, record: GenerationRecord, migration: Any) -> MigrationPlan:
    """The plan of ``record`` for etcslurm's own model: from the analytic inputs the
    decider planned from, with its assignment (no descriptions exchanged; the holdings
    check compares the live state with the same model)."""
    from etcslurm.core.gpt_state import padded_vocab
    from etcslurm.runtime.generation import plan_inputs

    settings = layout_settings(ctx)
    old_tp = ParallelConfig.parse(record.from_layout or record.to_layout).tp
    return analytic_plan(
        migration, plan_inputs(settings, record),
        assignment=[record.planner_ids[w] for w in record.workers_by_rank()],
        old_vocab_rows=padded_vocab(settings.spec, old_tp), totals=record.plan_stats)


def _live_plan(ctx: Context, record: GenerationRecord, migration: Any) -> MigrationPlan:
    """The plan of ``record`` from the live state (descriptions exchanged on the exchange
    group), with the assignment the decider published."""
    from etcslurm.core.planner import message_cap

    ids, dead = record.planner_ids, set(record.dead)
    plan = live_plan(
        migration,
        nodes={ids[w]: record.nodes.get(w, "?") for w in record.union},
        leaving=[ids[w] for w in record.leaving if w not in dead],
        joiners=[ids[w] for w in record.union if ids[w].startswith("join:")],
        assignment=[ids[w] for w in record.workers_by_rank()],
        staging_bytes=message_cap(ctx.settings.staging_bytes),
        tp=ParallelConfig.parse(record.to_layout).tp,
    )
    lost = int(plan.stats.get("lost_pieces", 0))
    if lost:
        known = [p for pieces in plan.missing.values() for p in pieces][:1]
        raise StateLostError(
            f"generation {record.generation}: {lost} state pieces of the new layout have no "
            f"holder among the participants (first: "
            f"{known or 'in another rank’s part of the plan'})")
    return plan


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
    record, migration = next_generation(
        layout_settings(ctx), ctx.record, leaving=view.leaving, dead=dead,
        ready=view.ready, nodes=view.nodes, step=ctx.step, scalars=ctx.holdings()[1],
        reason=reason, request=request, rollback=rollback,
    )
    latest = coord.current_generation()
    if latest is not None and record.generation <= latest.generation:
        # after a failed migration the failed record is the latest
        record = replace(record, generation=latest.generation + 1)
    if migration is not None:
        record = replace(record, plan_stats={k: migration.stats.get(k) for k in (
            "moved_bytes", "local_bytes", "state_bytes", "messages", "rounds",
            "lower_bound_moved_bytes", "missing_bytes", "part")})
    if pending:
        coord.take_changes(len(pending))
    if coord.publish_generation(record):
        log.info("published generation %s: %s", record.generation, record.reason)
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
