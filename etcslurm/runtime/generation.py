"""What the next generation is: membership, layout, and the planner's inputs (pure).

The leader calls :func:`first_generation` or :func:`next_generation` with what the
coordinator says about the workers (and the operator's pending change request, if any)
and publishes the resulting :class:`~etcslurm.coord.records.GenerationRecord`.  The
decider plans the change from the analytic model of the run's spec
(:func:`plan_inputs`): that gives the device → new rank assignment it publishes (the
new world forms and builds its model before any state moves, so ranks must be known
first) and tells whether state would be lost.  The participants then plan the transfer
itself from the live state with that assignment (:func:`etcslurm.runtime.migration.live_plan`),
so a model the analytic description does not match is still migrated exactly.  Nothing
but this small record travels through Redis.  No torch, no Redis here: the decisions are
unit-testable and deterministic.

The record's fields are listed in ``coord/records/generation.py`` (and docs/coordinator.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from etcslurm.coord.records import Assignment, ChangeRequest, GenerationRecord, replace
from etcslurm.core.gpt_state import expand, padded_vocab, split_vocab_fill
from etcslurm.core.layout import LayoutDecision, ParallelConfig, choose_config
from etcslurm.core.models import GPTSpec
from etcslurm.core.planner import MigrationPlan, PlanInputs, message_cap, plan
from etcslurm.core.state import Piece
from etcslurm.errors import LayoutError


@dataclass(frozen=True)
class LayoutSettings:
    """The parts of the run settings that decide layouts and plans (identical on every
    worker; built from :class:`etcslurm.runtime.config.RunSettings`)."""

    spec: GPTSpec
    optimizer: str
    global_batch: int
    micro_batch: int
    gpus_per_node: int
    staging_bytes: int
    params_dtype: str | None = None  # None: the model's own (``spec.dtype``)

    def choose(self, n_devices: int, previous: ParallelConfig | None) -> LayoutDecision:
        return choose_config(
            n_devices,
            self.spec,
            gpus_per_node=self.gpus_per_node,
            global_batch=self.global_batch,
            micro_batch=self.micro_batch,
            optimizer=self.optimizer,
            previous=previous,
        )


def layout_problems(settings: LayoutSettings, config: ParallelConfig) -> list[str]:
    """Why ``config`` cannot train this run's model and batch (empty: it can).

    The same rules as the automatic choice: heads, ffn and layers divide, TP groups fit
    inside a node, the global batch splits over DP.
    """
    out = config.problems(settings.spec)
    if settings.gpus_per_node % config.tp:
        out.append(f"tp={config.tp} does not fit a {settings.gpus_per_node}-GPU node")
    if settings.global_batch % (config.dp * settings.micro_batch):
        out.append(f"global batch {settings.global_batch} does not split over dp={config.dp} "
                   f"with micro batch {settings.micro_batch}")
    return out


def _assignment(
    config: ParallelConfig, workers: Sequence[str], nodes: Mapping[str, str]
) -> tuple[Assignment, ...]:
    out = []
    for rank, worker in enumerate(workers):
        c = config.coord(rank)
        out.append(Assignment(rank, worker, nodes.get(worker, "?"), c.tp, c.pp, c.dp))
    return tuple(out)


def first_generation(
    settings: LayoutSettings, workers: Sequence[str], nodes: Mapping[str, str], step: int = 0
) -> GenerationRecord:
    """Generation 0: the first ``used`` workers (in registration order) form the world."""
    decision = settings.choose(len(workers), None)
    world = tuple(workers[: decision.used_devices])
    cfg = decision.config
    return GenerationRecord(
        generation=0,  # the coordinator's generation CAS starts from an empty key at 0
        kind="start",
        step=step,
        from_layout=None,
        to_layout=str(cfg),
        world=cfg.world_size,
        assignment=_assignment(cfg, world, nodes),
        old_world=None,
        union=world,
        leaving=(),
        joining=world,
        dead=(),
        idle=tuple(workers[decision.used_devices:]),
        nodes={w: nodes.get(w, "?") for w in workers},
        planner_ids={},
        scalars={},
        reason=decision.reason,
    )


def end_generation(current: GenerationRecord, step: int, reason: str) -> GenerationRecord:
    """The ``end`` record a finished run publishes after ``current``: same layout, nobody
    in it, so standbys and late joiners waiting for a generation go home."""
    return replace(
        current, generation=current.generation + 1, kind="end", step=step,
        from_layout=current.to_layout, old_world=None, union=(), leaving=(), joining=(),
        dead=(), idle=(), planner_ids={}, scalars={}, reason=reason, layout_reason="",
        resume=None, plan_stats=None, published_by=None, published_at=None,
    )


def plan_inputs(settings: LayoutSettings, record: GenerationRecord) -> PlanInputs:
    """The planner inputs of a ``resize`` record (every participant rebuilds them)."""
    if record.from_layout is None or record.old_world is None:
        raise LayoutError(f"generation {record.generation} ({record.kind}) has no previous "
                          "world to plan a migration from")
    old_cfg = ParallelConfig.parse(record.from_layout)
    new_cfg = ParallelConfig.parse(record.to_layout)
    old_state = expand(settings.spec, old_cfg, settings.optimizer, settings.params_dtype)
    new_state = expand(settings.spec, new_cfg, settings.optimizer, settings.params_dtype)
    ids = record.planner_ids
    dead = set(record.dead)
    old_device_class = {
        str(rank): old_state.rank_class[rank]
        for rank, worker in enumerate(record.old_world)
        if worker not in dead
    }
    joiners = [ids[w] for w in record.union if ids[w].startswith("join:")]
    nodes = {ids[w]: record.nodes[w] for w in record.union}
    return PlanInputs(
        old_classes=[list(c) for c in old_state.classes],
        old_device_class=old_device_class,
        new_classes=[list(c) for c in new_state.classes],
        new_rank_class=list(new_state.rank_class),
        nodes=nodes,
        leaving=sorted((ids[w] for w in record.leaving if w not in dead), key=int),
        joiners=joiners,
        staging_bytes=message_cap(settings.staging_bytes),  # the executor's cap is per round
    )


def decider_plan(inputs: PlanInputs) -> MigrationPlan:
    """The decider's plan: the assignment, the whole move's byte totals, and which pieces
    are missing.

    Why a part: the decider needs the assignment (which needs the whole state's overlaps)
    and the totals, not every rank's messages; those come from one device's part of the
    plan (``plan(..., for_device=...)``: its ``messages``/``rounds`` stats are that
    part's, marked ``part``).  The device is the middle one of the old world: usually in
    an inner pipeline stage, whose part is one stage (the first and last stage are one
    part when the embedding is tied).  Only when something is missing (``missing_bytes``,
    exact in a part) does it plan the whole move, to name the missing pieces (lost state,
    or vocabulary rows to zero-fill).
    """
    old = sorted(inputs.old_device_class, key=int)
    part = plan(inputs, for_device=old[len(old) // 2])
    return plan(inputs) if part.stats["missing_bytes"] else part


def lost_pieces(migration: MigrationPlan, old_vocab_rows: int | dict[str, int]) -> list[Piece]:
    """The pieces of a plan's ``missing`` that are really lost: vocabulary rows that no
    old layout had (a TP change grew the padded vocabulary) are filled, not lost
    (:func:`etcslurm.core.gpt_state.split_vocab_fill`)."""
    missing = [p for pieces in migration.missing.values() for p in pieces]
    return split_vocab_fill(missing, old_vocab_rows)[1]


def _available(
    current: GenerationRecord, leaving: Sequence[str], dead: Sequence[str],
    ready: Sequence[str], drain: Sequence[str] = (),
) -> tuple[list[str], list[str], list[str]]:
    """(old world by rank, its survivors, the joiners) once ``drain`` counts as leaving."""
    old_world = current.workers_by_rank()
    gone = set(leaving) | set(dead) | set(drain)
    survivors = [w for w in old_world if w not in gone]
    joiners = [w for w in ready if w not in old_world and w not in set(drain)]
    return old_world, survivors, joiners


def check_request(
    settings: LayoutSettings,
    current: GenerationRecord,
    request: ChangeRequest,
    *,
    leaving: Sequence[str] = (),
    dead: Sequence[str] = (),
    ready: Sequence[str] = (),
) -> str | None:
    """Why ``request`` cannot be carried out after ``current`` now (``None``: it can).

    The caller (the leader) takes an invalid request off the queue and emits this text as
    an ``error`` event; :func:`next_generation` then ignores the request.
    """
    if current.kind not in ("start", "resize"):
        return f"generation {current.generation} is a {current.kind} record, not a running world"
    old_world, survivors, joiners = _available(current, leaving, dead, ready, request.drain)
    known = set(old_world) | set(ready) | set(leaving) | set(dead)
    strangers = [w for w in request.drain if w not in known]
    if strangers:
        return f"cannot drain {', '.join(strangers)}: not in the world nor waiting to join"
    if request.to is None or request.to == "auto":
        return None
    try:
        cfg = ParallelConfig.parse(request.to)
    except LayoutError as exc:
        return str(exc)
    problems = layout_problems(settings, cfg)
    if problems:
        return f"layout {cfg} does not suit {settings.spec.name}: {'; '.join(problems)}"
    n_avail = len(survivors) + len(joiners)
    if cfg.world_size > n_avail:
        return f"layout {cfg} needs {cfg.world_size} workers, only {n_avail} are available"
    return None


def merge_requests(requests: Sequence[ChangeRequest]) -> ChangeRequest | None:
    """The pending requests (oldest first) as one: every ``drain`` (in order, once), the
    newest ``to``; ``None`` when there are none.  The leader passes this to
    :func:`worth_changing` / :func:`next_generation` and takes all of them afterwards."""
    if not requests:
        return None
    drain = tuple(dict.fromkeys(w for r in requests for w in r.drain))
    to = next((r.to for r in reversed(requests) if r.to is not None), None)
    if len(requests) == 1:
        return requests[0]
    by = ", ".join(dict.fromkeys(r.by for r in requests))
    reason = "; ".join(r.reason for r in requests if r.reason)
    return ChangeRequest(to=to, drain=drain, by=by, ts=requests[-1].ts, reason=reason)


def worth_changing(
    settings: LayoutSettings,
    current: GenerationRecord,
    *,
    leaving: Sequence[str],
    dead: Sequence[str],
    ready: Sequence[str],
    request: ChangeRequest | None = None,
) -> bool:
    """Whether the world must change now: a valid change request is pending, someone
    leaves or died, or the ready workers would give a different layout (an idle standby
    that fits nowhere is no reason, nor is one while an operator's layout is in force)."""
    if request is not None and check_request(
            settings, current, request, leaving=leaving, dead=dead, ready=ready) is None:
        return True
    world = current.workers_by_rank()
    gone = (set(leaving) | set(dead)) & set(world)
    if gone:
        return True
    joiners = [w for w in ready if w not in world]
    if not joiners or current.requested is not None:
        return False
    now = ParallelConfig.parse(current.to_layout)
    decision = settings.choose(len(world) + len(joiners), now)
    return decision.config != now


def _target(
    settings: LayoutSettings, current: GenerationRecord, request: ChangeRequest | None,
    n_avail: int, old_cfg: ParallelConfig,
) -> tuple[ParallelConfig, str | None, str]:
    """(new layout, the operator's layout in force or None, why this layout)."""
    if request is not None and request.to not in (None, "auto"):
        cfg = ParallelConfig.parse(request.to)
        return cfg, str(cfg), f"{cfg} requested by {request.by}"
    pinned = None if request is not None and request.to == "auto" else current.requested
    if pinned is not None:
        cfg = ParallelConfig.parse(pinned)
        if cfg.world_size <= n_avail and not layout_problems(settings, cfg):
            return cfg, pinned, f"keeps {cfg}, requested earlier"
    decision = settings.choose(n_avail, old_cfg)
    why = decision.reason
    if pinned is not None:
        why = f"requested {pinned} no longer fits {n_avail} workers; {why}"
    return decision.config, None, why


def next_generation(
    settings: LayoutSettings,
    current: GenerationRecord,
    *,
    leaving: Sequence[str],
    dead: Sequence[str],
    ready: Sequence[str],
    nodes: Mapping[str, str],
    step: int,
    scalars: Mapping[str, Any] | None,
    reason: str,
    request: ChangeRequest | None = None,
    rollback: Mapping[str, Any] | None = None,
) -> tuple[GenerationRecord, MigrationPlan | None]:
    """The record that follows ``current`` at step ``step`` (and the plan it implies).

    ``leaving``: world members that asked to leave; ``dead``: world members whose
    heartbeat expired or who vanished; ``ready``: live workers outside the world that can
    join (new joiners, idle standbys), in registration order.  ``request``: the pending
    change request to carry out: its ``to`` layout is used and its ``drain`` workers
    leave, when :func:`check_request` accepts it; else it is ignored and the record's
    ``reason`` says why.  ``rollback``: the latest complete periodic checkpoint
    (``{path, step, layout}``); when dead workers took state no replica holds, the run
    starts again from it on the workers that are left (a ``start`` record that resumes
    it) instead of stopping.
    """
    problem = None
    if request is not None:
        problem = check_request(settings, current, request, leaving=leaving, dead=dead,
                                ready=ready)
        if problem is not None:
            reason = f"{reason}; change request by {request.by} ignored: {problem}"
            request = None
    drain = request.drain if request is not None else ()
    old_world, survivors, joiners = _available(current, leaving, dead, ready, drain)
    old_cfg = ParallelConfig.parse(current.to_layout)
    dead_set = set(dead)
    leave_set = set(leaving) | set(drain)
    all_nodes = dict(current.nodes)
    all_nodes.update(nodes)
    leavers = tuple(w for w in old_world if w in leave_set and w not in dead_set)
    gone_dead = tuple(w for w in old_world if w in dead_set)
    rec_nodes = {w: all_nodes.get(w, "?") for w in (*old_world, *joiners)}
    common: dict[str, Any] = dict(
        generation=current.generation + 1, step=step, from_layout=str(old_cfg),
        old_world=tuple(old_world), leaving=leavers, dead=gone_dead, nodes=rec_nodes,
        scalars=dict(scalars or {}), reason=reason,
    )
    n_avail = len(survivors) + len(joiners)
    if n_avail == 0:
        # nobody stays: write a checkpoint (leavers still hold everything) and let Slurm
        # requeue the job; a restart resumes from it
        return GenerationRecord(
            **common, kind="checkpoint", to_layout=str(old_cfg), world=old_cfg.world_size,
            assignment=current.assignment,
            union=tuple(w for w in old_world if w not in dead_set),
            joining=(), idle=(), planner_ids={}, requested=current.requested,
        ), None
    new_cfg, requested, layout_reason = _target(settings, current, request, n_avail, old_cfg)
    planner_ids = {w: str(r) for r, w in enumerate(old_world)}
    planner_ids.update({w: f"join:{k}" for k, w in enumerate(joiners)})
    union = tuple(w for w in old_world if w not in dead_set) + tuple(joiners)
    draft = GenerationRecord(
        **common, kind="resize", to_layout=str(new_cfg), world=new_cfg.world_size,
        assignment=(), union=union, joining=tuple(joiners), idle=(), planner_ids=planner_ids,
        layout_reason=layout_reason, requested=requested,
    )
    migration = decider_plan(plan_inputs(settings, draft))
    by_id = {v: k for k, v in planner_ids.items()}
    world = [by_id[d] for d in migration.assignment]
    in_world, gone = set(world), set(leavers)
    record = replace(
        draft,
        assignment=_assignment(new_cfg, world, rec_nodes),
        idle=tuple(w for w in union if w not in in_world and w not in gone),
        joining=tuple(w for w in joiners if w in in_world),
    )
    lost = lost_pieces(migration, padded_vocab(settings.spec, old_cfg.tp))
    if lost:
        why = (f"{len(lost)} state pieces were held only by dead worker(s) "
               f"{', '.join(sorted(gone_dead))} and no replica survives")
        if rollback is None:
            return replace(record, kind="stop", reason=why), migration
        available = [w for w in union if w not in set(leavers)]
        start = first_generation(settings, available, rec_nodes, step=int(rollback["step"]))
        return replace(
            start, generation=current.generation + 1, resume=str(rollback["path"]),
            from_layout=str(old_cfg), old_world=tuple(old_world), leaving=leavers,
            dead=gone_dead, reason=f"rollback to the checkpoint of step {rollback['step']} "
                                   f"({step - int(rollback['step'])} steps lost): {why}",
        ), migration
    return record, migration
