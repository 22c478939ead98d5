"""What the next generation is: membership, layout, and the planner's inputs (pure).

The leader calls :func:`first_generation` or :func:`next_generation` with what the
coordinator says about the workers and publishes the resulting record (JSON).  Every
participant then replays :func:`plan_inputs` + :func:`etcslurm.core.planner.plan` on the
same record and gets the same plan, so nothing but this small record travels through
Redis.  No torch, no Redis here: the decisions are unit-testable.

Record fields (besides those the monitor reads, see docs/monitor.md):

``generation``, ``kind`` (``start`` | ``resize`` | ``checkpoint`` | ``stop``), ``step``,
``from``/``to``/``layout`` (layout text), ``world`` (new world size), ``assignment``
(``[{rank, worker, node, tp, pp, dp}]``), ``old_world`` (worker ids by old rank),
``union`` (everyone who takes part in the state exchange, in group-rank order),
``leaving``, ``joining``, ``dead``, ``idle`` (worker ids), ``nodes`` (worker → node),
``planner_ids`` (worker → id the planner knows it by: old rank or ``join:k``),
``scalars`` (iteration, consumed samples, scheduler... of the leader), ``reason``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from etcslurm.core.gpt_state import expand
from etcslurm.core.layout import LayoutDecision, ParallelConfig, choose_config
from etcslurm.core.models import GPTSpec
from etcslurm.core.planner import MigrationPlan, PlanInputs, message_cap, plan


@dataclass(frozen=True)
class RunSettings:
    """The parts of the run spec that decide layouts (identical on every worker)."""

    spec: GPTSpec
    optimizer: str
    global_batch: int
    micro_batch: int
    gpus_per_node: int
    staging_bytes: int
    params_dtype: str = "float32"

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


def _assignment(
    config: ParallelConfig, workers: Sequence[str], nodes: Mapping[str, str]
) -> list[dict[str, Any]]:
    out = []
    for rank, worker in enumerate(workers):
        c = config.coord(rank)
        out.append(
            {"rank": rank, "worker": worker, "node": nodes.get(worker, "?"),
             "tp": c.tp, "pp": c.pp, "dp": c.dp}
        )
    return out


def first_generation(
    settings: RunSettings, workers: Sequence[str], nodes: Mapping[str, str], step: int = 0
) -> dict[str, Any]:
    """Generation 0: the first ``used`` workers (in registration order) form the world."""
    decision = settings.choose(len(workers), None)
    world = list(workers[: decision.used_devices])
    cfg = decision.config
    return {
        "generation": 0,  # the coordinator's generation CAS starts from an empty key at 0
        "kind": "start",
        "step": step,
        "from": None,
        "to": str(cfg),
        "layout": str(cfg),
        "world": cfg.world_size,
        "assignment": _assignment(cfg, world, nodes),
        "old_world": None,
        "union": world,
        "leaving": [],
        "joining": list(world),
        "dead": [],
        "idle": list(workers[decision.used_devices:]),
        "nodes": {w: nodes.get(w, "?") for w in workers},
        "planner_ids": {},
        "reason": decision.reason,
    }


def plan_inputs(settings: RunSettings, record: Mapping[str, Any]) -> PlanInputs:
    """The planner inputs of a ``resize`` record (every participant rebuilds them)."""
    old_cfg = ParallelConfig.parse(record["from"])
    new_cfg = ParallelConfig.parse(record["to"])
    old_state = expand(settings.spec, old_cfg, settings.optimizer, settings.params_dtype)
    new_state = expand(settings.spec, new_cfg, settings.optimizer, settings.params_dtype)
    ids: Mapping[str, str] = record["planner_ids"]
    old_world: Sequence[str] = record["old_world"]
    dead = set(record["dead"])
    old_device_class = {
        str(rank): old_state.rank_class[rank]
        for rank, worker in enumerate(old_world)
        if worker not in dead
    }
    joiners = [ids[w] for w in record["union"] if ids[w].startswith("join:")]
    nodes = {ids[w]: record["nodes"][w] for w in record["union"]}
    return PlanInputs(
        old_classes=[list(c) for c in old_state.classes],
        old_device_class=old_device_class,
        new_classes=[list(c) for c in new_state.classes],
        new_rank_class=list(new_state.rank_class),
        nodes=nodes,
        leaving=sorted((ids[w] for w in record["leaving"] if w not in dead), key=int),
        joiners=joiners,
        staging_bytes=message_cap(settings.staging_bytes),  # the executor's cap is per round
    )


def worth_changing(
    settings: RunSettings,
    current: Mapping[str, Any],
    *,
    leaving: Sequence[str],
    dead: Sequence[str],
    ready: Sequence[str],
) -> bool:
    """Whether the world must change now: someone leaves or died, or the ready workers
    would give a different layout (an idle standby that fits nowhere is no reason)."""
    world = [a["worker"] for a in current["assignment"]]
    gone = (set(leaving) | set(dead)) & set(world)
    if gone:
        return True
    joiners = [w for w in ready if w not in world]
    if not joiners:
        return False
    decision = settings.choose(len(world) + len(joiners), ParallelConfig.parse(current["to"]))
    return decision.config != ParallelConfig.parse(current["to"])


def next_generation(
    settings: RunSettings,
    current: Mapping[str, Any],
    *,
    leaving: Sequence[str],
    dead: Sequence[str],
    ready: Sequence[str],
    nodes: Mapping[str, str],
    step: int,
    scalars: Mapping[str, Any] | None,
    reason: str,
) -> tuple[dict[str, Any], MigrationPlan | None]:
    """The record that follows ``current`` at step ``step`` (and the plan it implies).

    ``leaving``: world members that asked to leave; ``dead``: world members whose
    heartbeat expired or who vanished; ``ready``: live workers outside the world that can
    join (new joiners, idle standbys), in registration order.
    """
    old_world: list[str] = [a["worker"] for a in sorted(current["assignment"], key=lambda a: a["rank"])]
    old_cfg = ParallelConfig.parse(current["to"])
    gone = set(leaving) | set(dead)
    survivors = [w for w in old_world if w not in gone]
    joiners = [w for w in ready if w not in old_world]
    all_nodes = dict(current.get("nodes", {}))
    all_nodes.update(nodes)
    base = {
        "generation": int(current["generation"]) + 1,
        "step": step,
        "from": str(old_cfg),
        "old_world": old_world,
        "leaving": [w for w in old_world if w in set(leaving) and w not in set(dead)],
        "dead": [w for w in old_world if w in set(dead)],
        "nodes": {w: all_nodes.get(w, "?") for w in (*old_world, *joiners)},
        "scalars": dict(scalars or {}),
        "reason": reason,
    }
    n_avail = len(survivors) + len(joiners)
    if n_avail == 0:
        # nobody stays: write a checkpoint (leavers still hold everything) and let Slurm
        # requeue the job; a restart resumes from it
        return {
            **base, "kind": "checkpoint", "to": str(old_cfg), "layout": str(old_cfg),
            "world": old_cfg.world_size,
            "assignment": current["assignment"], "union": [w for w in old_world if w not in set(dead)],
            "joining": [], "idle": [], "planner_ids": {},
        }, None
    decision = settings.choose(n_avail, old_cfg)
    new_cfg = decision.config
    planner_ids = {w: str(r) for r, w in enumerate(old_world)}
    planner_ids.update({w: f"join:{k}" for k, w in enumerate(joiners)})
    union = [w for w in old_world if w not in set(dead)] + joiners
    record = {
        **base,
        "kind": "resize",
        "to": str(new_cfg),
        "layout": str(new_cfg),
        "world": new_cfg.world_size,
        "union": union,
        "joining": joiners,
        "planner_ids": planner_ids,
        "assignment": [],
        "idle": [],
        "layout_reason": decision.reason,
    }
    migration = plan(plan_inputs(settings, record))
    by_id = {v: k for k, v in planner_ids.items()}
    world = [by_id[d] for d in migration.assignment]
    record["assignment"] = _assignment(new_cfg, world, record["nodes"])
    record["idle"] = [w for w in union if w not in set(world) and w not in set(base["leaving"])]
    record["joining"] = [w for w in joiners if w in set(world)]
    if migration.missing:
        held_by = sorted(base["dead"])
        count = sum(len(v) for v in migration.missing.values())
        record["kind"] = "stop"
        record["reason"] = (
            f"{count} state pieces were held only by dead worker(s) {', '.join(held_by)} "
            "and no replica survives"
        )
    return record, migration
