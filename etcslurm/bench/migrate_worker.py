"""One process of ``etcslurm bench migrate``: old layout → (P2P | checkpoint) → new layout.

Phases (generations on the launcher's long-lived store):

0. **old world** (old devices only): build the GPT in the old layout, train a few steps,
   record the pre-migration state (raw dump, for the independent bit-exact check) and
   the replicated scalars (JSON), then save it with the checkpoint baseline -- a warm-up
   save first (its writer processes' one-off start-up cost, reported apart), then the
   timed saves.
1. **new world first**: the devices of the new layout form it and build the P2P model
   (untimed, exactly as the checkpoint path's model is built before its timed load);
   leaving and idle devices leave the old world.  The old model's tensors stay readable.
2. **exchange group** (old devices + joiners; a bare gloo/NCCL group outside the default
   world, :func:`etcslurm.groups.lifecycle.exchange_group`): every member replays the same
   plan (timed), then the executor moves the state straight into the P2P model's views,
   local slices included, through one staging arena per process that is allocated and
   touched once (its set-up reported apart), ``repeat`` times.  Leaving and idle devices
   are done after this and exit.
3. **new world**: the scalars are restored (timed, part of ``p2p_seconds``); the P2P
   state is fingerprinted and checked against the pre-migration dump; model B is built and
   loaded from the checkpoint (timed), compared bit for bit with the P2P model and trained
   ``steps_after`` steps, then the P2P model trains the same steps: losses must be
   bit-identical.  Optionally a reference model that never migrated trains from scratch.

Why the exchange needs a group of its own: megatron-core modules keep the process groups
they were built with, so the new model can only be built in the new world -- which does
not contain leaving devices.  Before this, the state was received into fresh buffers in a
union world and copied into a model built afterwards; fresh memory faults inside the
socket copy and cost 2.4-4x (docs/migration.md).
"""

from __future__ import annotations

import contextlib
import gc
import json
import shutil
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from etcslurm.bench.rawdump import GlobalState, dump
from etcslurm.bench.worker import WorkerContext
from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import GPTSpec
from etcslurm.core.state import Piece
from etcslurm.errors import StateLostError
from etcslurm.groups import lifecycle as groups
from etcslurm.runtime.migration import Migration, MigrationJob, PhaseClock, live_plan
from etcslurm.transfer.executor import DIRECT_MIN_BYTES, transport_only


def _max(value: float) -> float:
    """The maximum of ``value`` over the current world (every rank gets it)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _group_max(xg: Any, value: float, timeout: float) -> float:
    """The maximum of ``value`` over the exchange group (every member gets it)."""
    return float(groups.group_max(xg, torch.tensor([value], dtype=torch.float64), timeout).item())


def _timed_group_max(xg: Any, timeout: float, fn: Any) -> tuple[float, Any]:
    """Run ``fn`` between two all-reduces of the exchange group: the slowest member's time."""
    _group_max(xg, 0.0, timeout)
    t0 = time.perf_counter()
    out = fn()
    return _group_max(xg, time.perf_counter() - t0, timeout), out


def _timed_barrier_max(fn: Any) -> tuple[float, Any]:
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return _max(time.perf_counter() - t0), out


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def migrate(ctx: WorkerContext) -> dict[str, Any]:
    """The worker target (see the module docstring)."""
    from etcslurm.megatron import cpu_shim

    n_old = ParallelConfig.parse(ctx.config["from"]).world_size
    index = ctx.index
    device = str(index) if index < n_old else f"join:{index - n_old}"
    out: dict[str, Any] = {"device": device}
    cpu_shim.install_if_needed()
    from etcslurm.baseline.checkpoint import CheckpointMigrator

    baseline = CheckpointMigrator(async_writer=bool(ctx.config.get("async_checkpoint", True)))
    try:
        return _migrate(ctx, out, baseline, device)
    finally:
        _close(baseline)


def _close(baseline: Any) -> None:
    """Stop the checkpoint writer while a process group still exists (megatron's close
    asks for the rank); idempotent."""
    if getattr(baseline, "_etcslurm_closed", False):
        return
    baseline._etcslurm_closed = True
    if not dist.is_initialized():
        groups.configure_local()
    try:
        baseline.close()
    finally:
        groups.teardown()


def _migrate(ctx: WorkerContext, out: dict[str, Any], baseline: Any, device: str) -> dict[str, Any]:
    from etcslurm.core.plan import plan as core_plan
    from etcslurm.megatron import parallel, regroup
    from etcslurm.megatron.model import TrainHyper, build_gpt
    from etcslurm.megatron.scalars import extract_scalars
    from etcslurm.megatron.sharded_meta import local_state
    from etcslurm.megatron.train import train_step
    from etcslurm.megatron_state import rank_pieces
    from etcslurm.megatron_state.planning import gpt_inputs

    c = ctx.config
    spec = GPTSpec.from_json(c["spec"])
    old, new = ParallelConfig.parse(c["from"]), ParallelConfig.parse(c["to"])
    n_old, n_join = old.world_size, int(c.get("join", 0))
    leave = sorted({int(r) for r in c.get("leave", [])})
    optimizer, seed = c.get("optimizer", "adam"), int(c.get("seed", 1234))
    repeat = int(c.get("repeat", 1))
    timeout = float(c.get("timeout", 300))
    phase_wait = timedelta(seconds=float(c.get("phase_timeout", 3600)))
    hyper = TrainHyper(global_batch=int(c["global_batch"]))
    work = Path(c["work_dir"])
    ckpt_root = Path(c["ckpt_dir"])
    index = ctx.index
    use_ckpt = bool(c.get("checkpoint", True))

    def progress(phase: str, **info: Any) -> None:
        ctx.publish(device, {"phase": phase, "device": device, **info})

    # ---------------------------------------------------------------- 0. old world
    # the analytic plan (megatron_state): its assignment is what a runtime's decider
    # publishes; the migration then plans from the live state with it, and the two plans
    # must be identical (the analytic model describes megatron-core's state exactly)
    analytic_inputs = gpt_inputs(spec, old, new, leaving=[str(r) for r in leave],
                                 joiners=n_join, optimizer=optimizer,
                                 staging_bytes=int(c["plan_staging_bytes"]),
                                 params_dtype=spec.dtype)
    plan = core_plan(analytic_inputs)
    if plan.missing:
        raise StateLostError(f"pieces with no holder: {sorted(plan.missing)[:3]}")
    held: list[tuple[Piece, torch.Tensor]] = []
    scalars: dict[str, Any] | None = None
    trainee = state = None
    if index < n_old:
        progress("build-old")
        parallel.init_parallel(old, index, n_old, ctx.store, 0, timeout_s=timeout)
        trainee = build_gpt(spec, old, optimizer, seed, hyper=hyper)
        losses = []
        for step in range(int(c.get("steps_before", 2))):
            progress("train-old", step=step)
            losses.append(train_step(trainee))
        out["losses_before"] = losses
        state = local_state(trainee)
        held = state.items()
        out["held_bytes"] = state.nbytes
        scalars = extract_scalars(trainee)
        if c.get("verify_global", True):
            dump(work / "global", f"dev{index}", held)
        progress("checkpoint-save")
        t0 = time.perf_counter()
        if not use_ckpt:
            baseline = _NoCheckpoint(work)
        baseline.save(trainee, ckpt_root / "warmup")
        dist.barrier()
        out["checkpoint_startup_seconds"] = _max(time.perf_counter() - t0)
        saves = []
        for rep in range(repeat):
            target = ckpt_root / f"save{rep}"
            seconds, _ = _timed_barrier_max(lambda target=target: baseline.save(trainee, target))
            saves.append(seconds)
            if index == 0 and rep > 0:
                shutil.rmtree(ckpt_root / f"save{rep - 1}", ignore_errors=True)
        out["checkpoint_save_seconds"] = saves
        out["checkpoint_path"] = str(ckpt_root / f"save{repeat - 1}")
        if index == 0:
            shutil.rmtree(ckpt_root / "warmup", ignore_errors=True)
            ctx.store.set("bench/scalars", json.dumps(scalars))
            ctx.store.set("bench/old_done", "1")
    else:
        progress("waiting-for-old")
        ctx.store.wait(["bench/old_done"], phase_wait)
    # ------------------------------------- 1-2. the runtime's own migration sequence
    # (etcslurm.runtime.migration: new world and model first -- untimed, exactly as the
    # checkpoint path's model is built before its timed load --, exchange group, plan,
    # prepare, exchange ``repeat`` times, commit), each phase timed as its slowest member's
    n_union = n_old + n_join
    members = [str(r) for r in range(n_old)] + [f"join:{j}" for j in range(n_join)]
    new_rank = plan.assignment.index(device) if device in plan.assignment else None
    out["new_rank"] = new_rank
    steps_after = int(c.get("steps_after", 2))
    if new_rank is not None and scalars is None:
        scalars = json.loads(ctx.store.get("bench/scalars"))
    direct_min = int(c.get("direct_min_bytes") or DIRECT_MIN_BYTES)

    def form_and_build(generation: int, layout: ParallelConfig, rank: int) -> Any:
        progress("build-new")
        parallel.init_parallel(layout, rank, layout.world_size, ctx.store, generation,
                               timeout_s=timeout)
        return build_gpt(spec, layout, optimizer, seed, hyper=hyper)

    # as the runtime does (runtime.world.World.regroup): a DP-only change that moves none
    # of this rank's parameters keeps its model -- re-wrapped for the new groups, its
    # tensors checked, not copied onto a new model -- else the model is built anew
    keep, before = None, None
    if trainee is not None and new_rank is not None and regroup.can_keep(
            (old, index), (new, new_rank), trainee.optimizer_kind):
        keep, before = trainee, regroup.snapshot()

    def keep_model(generation: int, layout: ParallelConfig, rank: int,
                   kept: Any) -> tuple[Any, bool]:
        progress("regroup")
        assert before is not None
        parallel.init_parallel(layout, rank, layout.world_size, ctx.store, generation,
                               timeout_s=timeout)
        try:
            model = regroup.rewrap(kept, before, layout)
        except regroup.RegroupError:
            return build_gpt(spec, layout, optimizer, seed, hyper=hyper), False
        groups.retire(before)
        return model, True

    job = MigrationJob(
        generation=1, me=device, members=members, new_rank=new_rank, layout=new, held=held,
        scalars=scalars if new_rank is not None else None,
        plan=lambda m: live_plan(m, nodes=analytic_inputs.nodes,
                                 leaving=list(analytic_inputs.leaving),
                                 joiners=list(analytic_inputs.joiners),
                                 assignment=plan.assignment,
                                 staging_bytes=int(c["plan_staging_bytes"]), tp=new.tp),
        old=(old, index) if index < n_old else None,
        expected=lambda layout, rank: rank_pieces(spec, layout, rank, optimizer),
        keep=keep,
    )

    def before_exchange(m: Migration) -> None:
        if c.get("measure_bandwidth", False) and n_union >= 2:
            out["pair_bandwidth"] = _pair_bandwidth(m.group, index,
                                                    int(c.get("bandwidth_mbytes", 128)), timeout)
        # the same buffers and segments through the same group with nothing else: the
        # transport's floor (before the exchange: it leaves stale bytes in the new model)
        assert m.plan is not None and m.arena is not None
        out["transport_seconds"] = [
            _timed_group_max(m.group, timeout, lambda: transport_only(
                m.plan.messages, device, m.ranks, m.arena, held, m.needed, group=m.group,
                timeout=timeout, direct_min=direct_min))[0]
            for _ in range(repeat)
        ]

    progress("exchange-group")
    migration = Migration(
        job, store=ctx.store, form_and_build=form_and_build,
        staging_cap=int(c["staging_bytes"]), timeout=timeout, group_timeout=timeout,
        progress=lambda info: progress("p2p", **info), direct_min=direct_min,
        clock=_SlowestClock(timeout), regroup=keep_model,
    )
    result = migration.run(repeat=repeat, before_exchange=before_exchange)
    p2p_model = result.trainee
    out["analytic_equals_live"] = _same_plan(result.plan, plan, device)
    out["kept"] = result.kept
    # one-off, reported apart like the checkpoint writer's start-up: the arena's first
    # allocation and touch (with the holdings and coverage checks)
    out["arena_setup_seconds"] = result.phase("prepare")
    restore_s = result.phase("commit")
    out["plan_seconds"] = result.phase("plan")
    out["exchange_seconds"] = result.seconds["exchange"]
    out["transfer"] = result.stats.to_json()
    out["plan_stats"] = plan.stats  # the analytic whole plan's (the live one is a part)
    # the old state is no longer needed anywhere: every slice is in the new model now
    migration, result, held, trainee, state, job = None, None, [], None, None, None
    gc.collect()
    if new_rank is None:  # leaving or idle: pieces handed over, done
        _close(baseline)
        out["role"] = "leaving" if index in leave else "idle"
        progress("done")
        return out
    out["role"] = "new"
    # ---------------------------------------------------------------- 3. new world
    out["restore_seconds"] = restore_s
    p2p_live = local_state(p2p_model)
    p2p_prints = {p: _fingerprint(v) for p, v in p2p_live.items()}
    if c.get("verify_global", True):
        reference = GlobalState(work / "global")
        bad = [p for p, v in p2p_live.items() if not _bits_equal(v, reference.expected(p))]
        out["p2p_equals_pre_migration"] = not bad
        out["mismatch_p2p_vs_pre_migration"] = [p.to_json() for p in bad[:5]]
    p2p_live = None
    # --- refit oracle (bench/refit.py): megatron-core's own weights-only resharding of the
    # pre-migration weights, timed; its weights must equal the P2P model's bit for bit.
    # None (+ refit_skipped) out of its scope: one world, nobody leaves or joins.
    if c.get("refit", True):
        from etcslurm.bench import refit

        progress("refit")
        out.update(refit.oracle(
            spec, old, new, leave, n_join,
            work / "global" if c.get("verify_global", True) else None,
            p2p_model.dtype, repeat, p2p_prints, fp=_fingerprint))
    # --- end refit oracle
    # checkpoint path: build, load (timed, repeat times), compare with P2P, train, free
    ckpt_path = ckpt_root / f"save{repeat - 1}"
    if not use_ckpt:
        baseline = _NoCheckpoint(work, scalars)
    progress("build-checkpoint")
    ckpt_model = build_gpt(spec, new, optimizer, seed, hyper=hyper)
    loads = []
    for rep in range(repeat):
        progress("checkpoint-load", repeat=rep)
        seconds, _ = _timed_barrier_max(lambda m=ckpt_model: baseline.load(m, ckpt_path))
        loads.append(seconds)
    out["checkpoint_load_seconds"] = loads
    mismatched = [p for p, v in local_state(ckpt_model).items()
                  if _fingerprint(v) != p2p_prints.get(p)]
    out["p2p_equals_checkpoint"] = not mismatched if use_ckpt else None
    out["mismatch_p2p_vs_checkpoint"] = [p.to_json() for p in mismatched[:5]]
    losses_ckpt = []
    for step in range(steps_after):
        progress("train-checkpoint", step=step)
        losses_ckpt.append(train_step(ckpt_model))
    out["losses_checkpoint"] = losses_ckpt
    ckpt_model = None
    gc.collect()
    losses_p2p = []
    for step in range(steps_after):
        progress("train-p2p", step=step)
        losses_p2p.append(train_step(p2p_model))
    out["losses_p2p"] = losses_p2p
    p2p_model = None
    if c.get("reference", False):
        progress("reference")
        ref = build_gpt(spec, new, optimizer, seed, hyper=hyper)
        ref_losses = [train_step(ref) for _ in range(int(c.get("steps_before", 2)) + steps_after)]
        out["losses_reference"] = ref_losses[-steps_after:] if steps_after else []
        ref = None
    _close(baseline)
    progress("done")
    return out


def _same_plan(a: Any, b: Any, device: str) -> bool:
    """Two plans give ``device`` the same slices from elsewhere, the same local copies and
    the same missing pieces, for the same assignment (the order of slices, their packing
    into rounds and the choice between equally good replicas follow the order in which
    the pieces were described, which differs between megatron-core and the analytic model;
    the live plan covers only ``device``'s part, so only its own share is compared)."""
    def moves(p: Any) -> tuple[Any, ...]:
        sent = sorted(s for m in p.messages if m.dst == device for s in m.slices)
        local = sorted(p.local.get(device, []))
        missing = sorted(p.missing.get(device, []))
        return (list(p.assignment), sent, local, missing, sorted(p.idle))

    return moves(a) == moves(b)


def _fingerprint(t: torch.Tensor) -> str:
    """A BLAKE2b digest of a tensor's bytes: bit-exact comparison without keeping a copy."""
    import hashlib

    return hashlib.blake2b(t.detach().contiguous().view(-1).view(torch.uint8).numpy().data,
                           digest_size=16).hexdigest()


def _pair_bandwidth(xg: Any, index: int, mbytes: int, timeout: float) -> dict[str, float]:
    """Best-of-3 one-way bandwidth rank 0 -> rank 1 on the exchange group (resident
    buffers on both ends)."""
    buf = torch.ones(mbytes << 20, dtype=torch.uint8)
    wait = timedelta(seconds=timeout)
    best = float("inf")
    for _ in range(3):
        _group_max(xg, 0.0, timeout)
        t0 = time.perf_counter()
        if index == 0:
            xg.send([buf], 1, 0).wait(wait)
        elif index == 1:
            xg.recv([buf], 0, 0).wait(wait)
        best = min(best, _group_max(xg, time.perf_counter() - t0, timeout))
    return {"bytes": buf.numel(), "seconds": best, "gbps": buf.numel() / best / 1e9}


class _NoCheckpoint:
    """Stand-in for the baseline when ``checkpoint`` is off (P2P-only runs): the
    "checkpoint" model is loaded from the pre-migration dump instead."""

    def __init__(self, work: Path, scalars: dict[str, Any] | None = None) -> None:
        self.work = work
        self.scalars = scalars

    def save(self, trainee: Any, path: Path) -> None:
        del trainee, path

    def close(self) -> None:
        """Nothing to stop: no writer was started."""

    def load(self, trainee: Any, path: Path) -> None:
        from etcslurm.megatron.scalars import restore_scalars
        from etcslurm.megatron.sharded_meta import local_state

        reference = GlobalState(self.work / "global")
        for piece, view in local_state(trainee).items():
            view.copy_(reference.expected(piece))
        if self.scalars is not None:
            restore_scalars(trainee, self.scalars)


class _SlowestClock(PhaseClock):
    """Times each phase as its slowest participant's: between two all-reduces of the
    exchange group (plan, prepare, exchange), or of the new world (commit).  The build and
    the group's formation are timed locally (untimed in the report, like the checkpoint
    path's build)."""

    def __init__(self, timeout: float) -> None:
        super().__init__()
        self.timeout = timeout

    @contextlib.contextmanager
    def phase(self, name: str, migration: Migration) -> Iterator[None]:
        group, new_member = migration.group, migration.trainee is not None
        # forming the world and the exchange group are timed locally (no collective of
        # their own: members arrive at different times)
        if name in ("build", "group") or (group is None and not new_member):
            with super().phase(name, migration):
                yield
            return
        if group is not None:
            _group_max(group, 0.0, self.timeout)
        else:
            dist.barrier()
        t0 = time.perf_counter()
        yield
        seconds = time.perf_counter() - t0
        worst = (_group_max(group, seconds, self.timeout) if group is not None
                 else _max(seconds))
        self.seconds.setdefault(name, []).append(worst)
