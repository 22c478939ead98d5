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
from etcslurm.core.layout import ParallelConfig
from etcslurm.core.layout_choice import (
    LayoutDecision,
    LayoutFilter,
    LayoutRules,
    NoLayoutFits,
    assess,
    choose,
)
from etcslurm.core.memory import DEFAULT_MARGIN, TrainingSetup
from etcslurm.core.models import GPTSpec
from etcslurm.core.plan import MigrationPlan, PlanInputs, message_cap, plan
from etcslurm.core.state import Piece
from etcslurm.errors import LayoutError
from etcslurm.megatron_state import expand, padded_vocab, split_vocab_fill
from etcslurm.runtime.config import RunSettings

#: the decider's plan totals a record carries (``plan_stats``): what every participant
#: reports, and what tells it that nothing moves
PLAN_STATS = ("moved_bytes", "local_bytes", "state_bytes", "messages", "rounds",
              "lower_bound_moved_bytes", "missing_bytes", "part")

#: marks the reason of a checkpoint record written because no layout fits the workers
#: that stay (they and the restart wait as standby)
STANDBY = "standby"


@dataclass(frozen=True)
class LayoutSettings:
    """The parts of the run settings that decide layouts and plans (identical on every
    worker; built from :class:`etcslurm.runtime.config.RunSettings`).

    ``device_memory_bytes``: per device (None: no limit); ``memory_margin``, ``recompute``:
    see :mod:`etcslurm.core.memory`; ``min_world``, ``max_world``, ``layouts`` (allowed:
    layouts or fixed sizes such as ``tp=8``) and ``first_layout``: the user's limits.
    """

    spec: GPTSpec | None  # None: a user's model not built yet (shapes unknown)
    optimizer: str
    global_batch: int
    micro_batch: int
    gpus_per_node: int
    staging_bytes: int
    params_dtype: str | None = None  # None: the model's own (``spec.dtype``)
    device_memory_bytes: int | None = None
    memory_margin: float = DEFAULT_MARGIN
    recompute: str = "selective"
    min_world: int = 1
    max_world: int | None = None
    layouts: tuple[str, ...] = ()
    first_layout: str | None = None
    cp: int = 1
    vpp: int = 1

    @property
    def rules(self) -> LayoutRules:
        setup = TrainingSetup(optimizer=self.optimizer, micro_batch=self.micro_batch,
                              global_batch=self.global_batch, recompute=self.recompute,
                              params_dtype=self.params_dtype)
        return LayoutRules(setup=setup, gpus_per_node=self.gpus_per_node,
                           device_memory_bytes=self.device_memory_bytes,
                           memory_margin=self.memory_margin,
                           allowed=tuple(LayoutFilter.parse(x) for x in self.layouts),
                           min_world=self.min_world, max_world=self.max_world,
                           cp=self.cp, vpp=self.vpp)

    def choose(self, n_devices: int, previous: ParallelConfig | None) -> LayoutDecision:
        """The layout for ``n_devices`` (the first layout, if set, when there is no
        previous one); :class:`NoLayoutFits` when none fits."""
        first = None
        if previous is None and self.first_layout is not None:
            first = ParallelConfig.parse(self.first_layout)
        if self.global_batch % self.micro_batch:
            raise LayoutError(f"global batch {self.global_batch} is not a multiple of "
                              f"micro batch {self.micro_batch}")
        if self.spec is None:
            return self._before_shapes(n_devices, first)
        return choose(n_devices, self.spec, self.rules, previous, first)

    def _before_shapes(self, n_devices: int, first: ParallelConfig | None) -> LayoutDecision:
        """The first layout of a user's model whose shapes are not known yet (they are
        read from it once built): the first layout set, else pure data parallel on as
        many devices as the batch and the limits allow."""
        top = min(n_devices, self.max_world or n_devices)
        if first is None:
            used = next((d for d in range(top, 0, -1)
                         if self.global_batch % (d * self.micro_batch) == 0), 1)
            first, why = ParallelConfig(1, 1, used), "data parallel: the model's shapes are "
            why += "read from it once built"
        else:
            why = "the first layout set"
        if first.world_size > n_devices or first.world_size < self.min_world:
            raise NoLayoutFits(f"{n_devices} devices: the first layout {first} needs "
                               f"{first.world_size} (min_world {self.min_world})")
        used = first.world_size
        return LayoutDecision(first, used, tuple(range(used, n_devices)),
                              f"{first} on {used} of {n_devices} devices; {why}",
                              self.global_batch // (first.dp * self.micro_batch))


def layout_settings(settings: RunSettings,
                    device_memory: int | None = None) -> LayoutSettings:
    """What the layout policy and the planner need of the run settings; the memory per
    device is the setting's, else ``device_memory`` (this worker's GPU's), else none."""
    s = settings
    memory = s.gpu_memory_bytes if s.gpu_memory_bytes is not None else device_memory
    return LayoutSettings(spec=s.model, optimizer=s.optimizer, global_batch=s.global_batch,
                          micro_batch=s.micro_batch, gpus_per_node=s.gpus_per_node,
                          staging_bytes=s.staging_bytes, device_memory_bytes=memory,
                          memory_margin=s.memory_margin, recompute=s.recompute,
                          min_world=s.min_world, max_world=s.max_world, layouts=s.layouts,
                          first_layout=s.first_layout, cp=s.cp, vpp=s.vpp)


def layout_problems(settings: LayoutSettings, config: ParallelConfig) -> list[str]:
    """Why ``config`` cannot train this run's model and batch (empty: it can).

    The same rules as the automatic choice: heads, ffn and layers divide, TP groups fit
    inside a node, the allowed layouts and world limits, the global batch splits over DP,
    the busiest rank fits device memory.
    """
    return list(assess(config, settings.spec, settings.rules).problems)


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
    return start_generation(decision.config, workers, nodes, step=step,
                            reason=decision.reason)


def start_generation(layout: ParallelConfig, workers: Sequence[str],
                     nodes: Mapping[str, str], *, generation: int = 0, step: int = 0,
                     reason: str = "") -> GenerationRecord:
    """A ``start`` record: the first ``layout.world_size`` of ``workers`` form a world in
    ``layout``, the rest stay idle."""
    used = layout.world_size
    world = tuple(workers[:used])
    return GenerationRecord(
        generation=generation,  # the coordinator's generation CAS starts from an empty key at 0
        kind="start",
        step=step,
        from_layout=None,
        to_layout=str(layout),
        world=used,
        assignment=_assignment(layout, world, nodes),
        old_world=None,
        union=world,
        leaving=(),
        joining=world,
        dead=(),
        idle=tuple(workers[used:]),
        nodes={w: nodes.get(w, "?") for w in workers},
        planner_ids={},
        scalars={},
        reason=reason,
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
    (:func:`etcslurm.megatron_state.split_vocab_fill`)."""
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
    try:
        decision = settings.choose(len(world) + len(joiners), now)
    except NoLayoutFits:
        return False
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
    checkpoint = GenerationRecord(
        **common, kind="checkpoint", to_layout=str(old_cfg), world=old_cfg.world_size,
        assignment=current.assignment, union=tuple(w for w in old_world if w not in dead_set),
        joining=(), idle=(), planner_ids={}, requested=current.requested,
    )
    if n_avail == 0:
        # nobody stays: write a checkpoint (leavers still hold everything) and let Slurm
        # requeue the job; a restart resumes from it
        return checkpoint, None
    try:
        new_cfg, requested, layout_reason = _target(settings, current, request, n_avail,
                                                    old_cfg)
    except NoLayoutFits as exc:
        # the workers left cannot hold the model: the same whole-run checkpoint; the
        # restart waits as standby until a layout fits (see transitions.first)
        return replace(checkpoint, reason=f"{reason}; {STANDBY}: {exc}"), None
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
    record = replace(record, plan_stats={k: migration.stats.get(k) for k in PLAN_STATS})
    lost = lost_pieces(migration, padded_vocab(settings.spec, old_cfg.tp))
    if lost:
        why = (f"{len(lost)} state pieces were held only by dead worker(s) "
               f"{', '.join(sorted(gone_dead))} and no replica survives")
        if rollback is None:
            return replace(record, kind="stop", reason=why), migration
        available = [w for w in union if w not in set(leavers)]
        try:
            start = first_generation(settings, available, rec_nodes,
                                     step=int(rollback["step"]))
        except NoLayoutFits as exc:
            return replace(record, kind="stop", reason=f"{why}; no rollback: {exc}"), migration
        return replace(
            start, generation=current.generation + 1, resume=str(rollback["path"]),
            from_layout=str(old_cfg), old_world=tuple(old_world), leaving=leavers,
            dead=gone_dead, plan_stats=record.plan_stats,
            reason=f"rollback to the checkpoint of step {rollback['step']} "
                                   f"({step - int(rollback['step'])} steps lost): {why}",
        ), migration
    return record, migration
