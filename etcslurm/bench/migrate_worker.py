"""One process of ``etcslurm bench migrate``: for each case, old layout → (P2P |
checkpoint) → new layout, in the same processes.

A launch runs a list of cases (transitions, or repetitions of one) one after another,
so a matrix of transitions pays the processes' start-up and the checkpoint writer's
once.  Each case, on the launcher's long-lived store:

0. **old world** (old devices): the runtime's :class:`~etcslurm.runtime.world.World`
   forms it and builds etcslurm's GPT (as a run's first generation does), trains a few
   steps, reads the state (the views a resize migrates from) and dumps it (raw bytes, for
   the independent bit-exact check); then the checkpoint baseline saves it (the first
   save of a launch warms its writer up, reported apart).
1. **the decision**: every process computes the record the runtime's decider would
   publish for an operator's request of the new layout (``next_generation`` with the
   leavers and joiners), from the same inputs, so all agree without asking anyone.
2. **the migration**: :func:`etcslurm.runtime.jobs.migration_job` and
   :meth:`World.migrate` -- the runtime's own code, whichever path it takes
   (``nothing_moves``, ``analytic``, ``live``, on the world or an exchange group:
   ``plan_path``) -- observed by :class:`~etcslurm.bench.observer.SlowestObserver`.
3. **the checks** on the new world: the P2P state against the pre-migration dump; a model
   loaded from the checkpoint against the P2P one (every tensor, and everything else that
   shapes the next update: :mod:`etcslurm.bench.signature`); both trained the same steps,
   their losses and then every tensor (gradients included) compared element by element;
   optionally megatron-core's refit and a never-migrated reference.
"""

from __future__ import annotations

import gc
import hashlib
import json
import shutil
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from etcslurm.bench import signature
from etcslurm.bench.observer import SlowestObserver, world_max
from etcslurm.bench.rawdump import GlobalState, dump
from etcslurm.bench.worker import WorkerContext
from etcslurm.coord.records import ChangeRequest
from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import GPTSpec
from etcslurm.errors import UsageError
from etcslurm.groups import lifecycle as groups
from etcslurm.transfer.wire import DIRECT_MIN_BYTES

#: the node name of old device ``r`` and of joiner ``k`` (as ``etcslurm plan`` names them)
GPUS_PER_NODE = 8


def migrate(ctx: WorkerContext) -> dict[str, Any]:
    """The worker target: every case of the launch, in order (see the module docstring)."""
    from etcslurm.baseline.checkpoint import CheckpointMigrator
    from etcslurm.megatron import cpu_shim

    cpu_shim.install_if_needed()
    cases = ctx.config["cases"]
    baseline = CheckpointMigrator(async_writer=bool(ctx.config.get("async_checkpoint", True)))
    warm = {"done": False}
    out = []
    try:
        for number, case in enumerate(cases):
            try:
                out.append(_case(ctx, number, case, baseline, warm))
            except Exception as exc:
                raise RuntimeError(f"case {number} of {len(cases)} ({case['from']} → "
                                   f"{case['to']}, leave {case.get('leave')}, join "
                                   f"{case.get('join', 0)}): {exc}") from exc
            groups.teardown()
            gc.collect()
            _all_arrive(ctx, f"bench/{number}/end", float(case.get("timeout", 300)))
    finally:
        _close(baseline)
    return {"cases": out}


def _all_arrive(ctx: WorkerContext, key: str, timeout: float) -> None:
    """A barrier of every launched process on the store (no world spans them all)."""
    ctx.store.add(key, 1)
    deadline = time.monotonic() + timeout
    while int(ctx.store.add(key, 0)) < ctx.nprocs:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{key}: not every process arrived within {timeout:.0f} s")
        time.sleep(0.01)


def _close(baseline: Any) -> None:
    """Stop the checkpoint writer while a process group exists (megatron's close asks for
    the rank)."""
    if not dist.is_initialized():
        groups.configure_local()
    try:
        baseline.close()
    finally:
        groups.teardown()


def _fingerprint(t: torch.Tensor) -> str:
    """A BLAKE2b digest of a tensor's bytes: bit-exact comparison without keeping a copy."""
    return hashlib.blake2b(t.detach().contiguous().view(-1).view(torch.uint8).numpy().data,
                           digest_size=16).hexdigest()


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _settings(c: dict[str, Any]) -> Any:
    from etcslurm.runtime.config import RunSettings

    return RunSettings(model=GPTSpec.from_json(c["spec"]), optimizer=c.get("optimizer", "adam"),
                       global_batch=int(c["global_batch"]), seed=int(c.get("seed", 1234)),
                       gpus_per_node=GPUS_PER_NODE, staging_bytes=int(c["staging_bytes"]))


def _case(ctx: WorkerContext, number: int, c: dict[str, Any], baseline: Any,
          warm: dict[str, bool]) -> dict[str, Any]:
    from etcslurm.megatron.sharded_meta import is_weight, local_state
    from etcslurm.megatron.train import train_step
    from etcslurm.runtime.config import WorkerOptions
    from etcslurm.runtime.generation import layout_settings, next_generation, start_generation
    from etcslurm.runtime.jobs import migration_job
    from etcslurm.runtime.world import World

    old, new = ParallelConfig.parse(c["from"]), ParallelConfig.parse(c["to"])
    n_old, n_join = old.world_size, int(c.get("join", 0))
    index = ctx.index
    device = str(index) if index < n_old else f"join:{index - n_old}"
    out: dict[str, Any] = {"device": device}
    if index >= n_old + n_join:
        out["role"] = "unused"
        return out
    timeout = float(c.get("timeout", 300))
    steps_before, steps_after = int(c.get("steps_before", 2)), int(c.get("steps_after", 2))
    work, ckpt_path = Path(c["work_dir"]), Path(c["ckpt_dir"]) / "save"
    settings = _settings(c)
    layouts = layout_settings(settings)
    workers = [f"w{i}" for i in range(n_old + n_join)]
    nodes = {w: f"n{i // GPUS_PER_NODE}" for i, w in enumerate(workers[:n_old])}
    nodes.update({w: f"j{k // GPUS_PER_NODE}" for k, w in enumerate(workers[n_old:])})
    options = WorkerOptions(run_id=f"bench-{number}", redis_url="", node=nodes[workers[index]],
                            collective_timeout=timeout, log_data=False)
    world = World(ctx.store, settings, options,
                  direct_min=int(c.get("direct_min_bytes") or DIRECT_MIN_BYTES))
    world.analytic = world.analytic and not c.get("live_plan", False)
    weights_only = bool(c.get("weights_only"))
    use_ckpt = bool(c.get("checkpoint", True)) and not weights_only

    def progress(phase: str, **info: Any) -> None:
        ctx.publish(device, {"phase": phase, "device": device, "case": number, **info})

    # ---------------------------------------------------------------- 0. old world
    gen0 = 2 * number
    trainee, held, scalars = None, [], None
    if index < n_old:
        progress("build-old")
        trainee = world.form_and_build(gen0, old, index)
        out["losses_before"] = []
        for step in range(steps_before):
            progress("train-old", step=step)
            out["losses_before"].append(train_step(trainee))
        held, scalars = world.read_state(trainee)
        if weights_only:
            held = [(p, v) for p, v in held if is_weight(p)]
        out["held_bytes"] = sum(v.numel() * v.element_size() for _, v in held)
        if c.get("verify_global", True):
            dump(work / "global", f"dev{index}", held)
        if use_ckpt:
            progress("checkpoint-save")
            # the writer's one-off start-up, reported apart: once in a launch on each
            # process (the save is collective: all warm up if one has not yet)
            if world_max(0.0 if warm["done"] else 1.0) > 0:
                t0 = time.perf_counter()
                baseline.save(trainee, Path(c["ckpt_dir"]) / "warmup")
                dist.barrier()
                out["checkpoint_startup_seconds"] = world_max(time.perf_counter() - t0)
                warm["done"] = True
            dist.barrier()
            t0 = time.perf_counter()
            baseline.save(trainee, ckpt_path)
            dist.barrier()
            out["checkpoint_save_seconds"] = world_max(time.perf_counter() - t0)
        if index == 0:
            shutil.rmtree(Path(c["ckpt_dir"]) / "warmup", ignore_errors=True)
            ctx.store.set(f"bench/{number}/scalars", json.dumps(scalars))
    else:
        progress("waiting-for-old")
        ctx.store.wait([f"bench/{number}/scalars"], timedelta(seconds=timeout * 4))
        scalars = json.loads(ctx.store.get(f"bench/{number}/scalars"))
    # ------------------------------------------ 1. the record the decider would publish
    start = start_generation(old, workers[:n_old], nodes, generation=gen0, step=steps_before)
    request = ChangeRequest(to=str(new), drain=(), by="bench", ts=0.0)
    record, _ = next_generation(
        layouts, start, leaving=[workers[r] for r in c.get("leave", [])], dead=(),
        ready=workers[n_old:], nodes=nodes, step=steps_before, scalars=scalars,
        reason="bench", request=request)
    if record.kind != "resize" or record.to_layout != str(new):
        raise UsageError(f"the decider would not migrate {old} → {new}: {record.reason}")
    # ---------------------------------------------------- 2. the runtime's migration
    job = migration_job(world, layouts, record, workers[index], held=held,
                        old=(old, index) if index < n_old else None, trainee=trainee,
                        select=is_weight if weights_only else None)
    observer = SlowestObserver(timeout, measure_bandwidth=bool(c.get("measure_bandwidth")),
                               bandwidth_mbytes=int(c.get("bandwidth_mbytes", 128)))
    progress("migrate")
    result = world.migrate(job, lambda info: progress("p2p", **info), observer)
    out.update(observer.measured)
    out.update(new_rank=job.new_rank, kept=result.kept, plan_path=job.path,
               on_world=job.on_world, plan_stats=record.plan_stats,
               plan_seconds=result.phase("plan"), exchange_seconds=result.phase("exchange"),
               restore_seconds=result.phase("commit"),
               arena_setup_seconds=result.phase("prepare"), transfer=result.stats.to_json(),
               moved_here=sum(m.nbytes for m in result.plan.messages if m.dst == device))
    p2p = result.trainee
    del result, job, held, trainee
    gc.collect()
    if p2p is None:  # leaving or idle: pieces handed over, done
        out["role"] = "leaving" if index in set(c.get("leave", [])) else "idle"
        progress("done")
        return out
    out["role"] = "new"
    # ---------------------------------------------------------------- 3. the checks
    p2p_state = local_state(p2p).items()
    if weights_only:  # the optimizer state did not move: only the weights are checked
        p2p_state = [(p, v) for p, v in p2p_state if is_weight(p)]
    p2p_prints = {p: _fingerprint(v) for p, v in p2p_state}
    if c.get("verify_global", True):
        reference = GlobalState(work / "global")
        bad = [p for p, v in p2p_state if not _bits_equal(v, reference.expected(p))]
        out["p2p_equals_pre_migration"] = not bad
        out["mismatch_p2p_vs_pre_migration"] = [p.to_json() for p in bad[:5]]
    del p2p_state
    if c.get("refit", True):
        from etcslurm.bench import refit

        progress("refit")
        out.update(refit.oracle(settings.model, old, new, list(c.get("leave", [])), n_join,
                                work / "global" if c.get("verify_global", True) else None,
                                p2p.dtype, 1, p2p_prints, fp=_fingerprint))
    if weights_only:
        progress("done")
        return out
    progress("build-checkpoint")
    other = world.build_model(new)
    progress("checkpoint-load")
    dist.barrier()
    t0 = time.perf_counter()
    if use_ckpt:
        baseline.load(other, ckpt_path)
    else:  # P2P only: the comparison model is filled from the pre-migration dump
        _load_dump(other, work / "global", scalars)
    dist.barrier()
    out["checkpoint_load_seconds"] = world_max(time.perf_counter() - t0)
    mismatched = [p for p, v in local_state(other).items() if _fingerprint(v) != p2p_prints.get(p)]
    out["p2p_equals_checkpoint"] = not mismatched
    out["mismatch_p2p_vs_checkpoint"] = [p.to_json() for p in mismatched[:5]]
    out["signature_differences"] = signature.signature_differences(
        signature.update_signature(p2p), signature.update_signature(other))
    progress("train-after")
    out["losses_checkpoint"] = [train_step(other) for _ in range(steps_after)]
    out["losses_p2p"] = [train_step(p2p) for _ in range(steps_after)]
    out["after_steps"] = signature.compare_states(signature.tensors(p2p),
                                                  signature.tensors(other))
    out["after_steps_equal"] = signature.states_equal(out["after_steps"])
    out["signature_differences_after"] = signature.signature_differences(
        signature.update_signature(p2p), signature.update_signature(other))
    del other, p2p
    gc.collect()
    if c.get("reference", False):
        progress("reference")
        ref = world.build_model(new)
        losses = [train_step(ref) for _ in range(steps_before + steps_after)]
        out["losses_reference"] = losses[steps_before:]
        del ref
    progress("done")
    return out


def _load_dump(trainee: Any, directory: Path, scalars: dict[str, Any] | None) -> None:
    """Fill ``trainee`` from the pre-migration dump (the oracle where the checkpoint path
    cannot load the state: optimizer state saved with EP > 1 into EP 1)."""
    from etcslurm.megatron.adapter import finish_restore
    from etcslurm.megatron.sharded_meta import local_state

    reference = GlobalState(directory)
    with torch.no_grad():
        for piece, view in local_state(trainee).items():
            view.copy_(reference.expected(piece))
    if scalars is not None:
        finish_restore(trainee, scalars)
