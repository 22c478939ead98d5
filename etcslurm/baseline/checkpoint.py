"""Checkpoints with megatron-core ``dist_checkpointing``, in Megatron-LM's layout: the
baseline migration, the fallback, and the way in and out of etcslurm.

Why it is here: P2P migration is only worth something measured against what a
megatron-core job does today — save a distributed checkpoint and load it resharded into
the new layout — run with megatron-core's own fastest settings, so the comparison is fair:

- ``torch_dist`` format, ``FullyParallelSaveStrategyWrapper`` / ``...LoadStrategyWrapper``
  over the data-parallel group (every DP replica writes/reads a share), cached
  distribution and checkpoint structure for repeated saves of one layout;
- asynchronous save through a *persistent* writer process per rank
  (``AsyncCallsQueue(persistent=True)``), awaited before the save counts as done; the
  writer fsyncs every file.  The writer's start-up (≈3 s, first save only) is reported
  apart (``SaveReport.first``), as a job that checkpoints regularly has it running;
- the distributed optimizer saved ``fully_reshardable`` (the only sharding type that
  reshards across TP/PP on the torch-Adam fallback).

Every save is Megatron-LM's (:mod:`.megatron_lm`): ``SAVE_DIR/iter_NNNNNNN/`` and
``SAVE_DIR/latest_checkpointed_iteration.txt`` (written by rank 0 once every rank's files
are complete), the common state Megatron-LM writes (``args`` with the layout and
``consumed_train_samples``, ``iteration``, ``opt_param_scheduler``, ``rng_state``), so a
Megatron-LM or plain megatron-core loop loads it in any layout.  A load takes such a
checkpoint from anyone, in any layout: ``fully_reshardable`` or a plain optimizer through
``dist_checkpointing``, the distributed optimizer's ``dp_reshardable`` (Megatron-LM's
default, which ``dist_checkpointing`` reshards only along DP) through
:mod:`.dp_reshardable`.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from etcslurm.baseline import megatron_lm
from etcslurm.baseline.writer import results_queue_dying_with_us, route_writer_through_shim
from etcslurm.errors import MigrationError, WaitTimeout
from etcslurm.megatron.adam_state import fix_step_alias
from etcslurm.megatron.distopt_checkpoint import patch_distributed_optimizer_checkpointing
from etcslurm.megatron.model import Trainee

log = logging.getLogger("etcslurm.baseline")

DISTOPT_SHARDING = "fully_reshardable"
#: the distributed optimizer's formats a save can write (``dp_reshardable``: Megatron-LM's
#: default, for tests and measurements; a TP/PP change then needs etcslurm to load it)
DISTOPT_SHARDINGS = ("fully_reshardable", "dp_reshardable")


def default_dir(run_dir: str | os.PathLike[str] | None = None) -> Path:
    """A local-disk folder for checkpoints: ``<run_dir>/ckpt`` or one under ``$TMPDIR``."""
    if run_dir is not None:
        return Path(run_dir) / "ckpt"
    return Path(os.environ.get("TMPDIR", "/tmp")) / f"etcslurm-ckpt-{os.getuid()}"


@dataclass
class SaveReport:
    seconds: float  # the whole save: plan + write + fsync + finalize, on this rank
    first: bool  # this save started the persistent writer (one-off start-up included)
    path: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LoadReport:
    seconds: float
    path: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def content_metadata(trainee: Trainee, sharding: str = DISTOPT_SHARDING) -> dict[str, Any]:
    """The content metadata Megatron-LM saves with a checkpoint (and passes to every
    ``sharded_state_dict``): the distributed optimizer's format, no prefix for a chained
    optimizer of one part."""
    metadata: dict[str, Any] = {"singleton_local_shards": False,
                                "chained_optim_avoid_prefix": True}
    if trainee.distributed:
        metadata["distrib_optim_sharding_type"] = sharding
        if sharding == "fully_reshardable":
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    return metadata


def _with_groups(metadata: dict[str, Any]) -> dict[str, Any]:
    from megatron.core import parallel_state

    return {**metadata,
            "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}


def sharded_state(trainee: Trainee, is_loading: bool,
                  metadata: dict[str, Any] | None = None, optimizer: bool = True,
                  rng: bool = True) -> dict[str, Any]:
    """Megatron-LM's state dict of ``trainee``: every model chunk (``model`` or
    ``model0..N``), the optimizer, and the common state (:mod:`.megatron_lm`)."""
    metadata = _with_groups(metadata if metadata is not None else content_metadata(trainee))
    state = megatron_lm.model_state(trainee.modules(), metadata)
    if optimizer:
        if trainee.distributed:
            patch_distributed_optimizer_checkpointing()
        state["optimizer"] = trainee.optimizer.sharded_state_dict(
            state, is_loading=is_loading, metadata=metadata)
    if rng:
        state["rng_state"] = megatron_lm.rng_sharded_object(
            None if is_loading else megatron_lm.rng_state())
    if not is_loading:
        state.update(
            args=megatron_lm.args_namespace(trainee),
            checkpoint_version=megatron_lm.CHECKPOINT_VERSION,
            iteration=trainee.iteration,
            opt_param_scheduler=(trainee.scheduler.state_dict()
                                 if trainee.scheduler is not None else None),
            num_floating_point_operations_so_far=0,
        )
    return state


class CheckpointMigrator:
    """Save → load-resharded with ``dist_checkpointing``; one per process, reused, so the
    persistent writer stays warm across saves.  ``close()`` stops the writer."""

    def __init__(self, thread_count: int = 2, async_writer: bool = True,
                 sharding: str = DISTOPT_SHARDING) -> None:
        """``async_writer=False`` writes in the calling process (megatron's synchronous
        path): no writer start-up, used by the small tests; benchmarks keep the default.
        ``sharding``: the distributed optimizer's format (:data:`DISTOPT_SHARDINGS`)."""
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        if sharding not in DISTOPT_SHARDINGS:
            raise ValueError(f"sharding {sharding!r}: use one of {', '.join(DISTOPT_SHARDINGS)}")
        route_writer_through_shim()
        self.thread_count = thread_count
        self.async_writer = async_writer
        self.sharding = sharding
        self._queue = AsyncCallsQueue(persistent=True)
        self._writer_started = False
        self._save_strategies: dict[tuple, Any] = {}

    def start_writer(self) -> None:
        """Start the persistent writer and its results queue now, outside any collective.

        Why: megatron starts both at a process's first asynchronous save, then waits for
        the fresh writer (a spawned interpreter importing torch and megatron-core) to stage
        the tensors.  A rank that joined since the last save waited there ~10 s on a loaded
        host while its peers, whose writers were warm, timed out in the next collective."""
        import logging
        import multiprocessing

        import torch
        from megatron.core.dist_checkpointing.strategies import async_utils

        results_queue_dying_with_us()
        caller = self._queue._get_async_caller()
        if caller.process is None:
            device = torch.cuda.current_device() if torch.cuda.is_available() else 0
            level = logging.getLogger(async_utils.__name__).getEffectiveLevel()
            caller.process = multiprocessing.get_context("spawn").Process(
                target=async_utils.PersistentAsyncCaller.async_loop,
                args=(device, caller.queue, caller.preload_q, caller.comp_q, level))
            caller.process.start()

    # ------------------------------------------------------------------ save
    def _save_strategy(self, trainee: Trainee) -> Any:
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelSaveStrategyWrapper,
        )
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        # cached plans/structure are valid only for one layout in one world
        key = (str(trainee.config), trainee.optimizer_kind, id(_world_marker()))
        if key not in self._save_strategies:
            base = TorchDistSaveShardedStrategy(
                "torch_dist", 1, thread_count=self.thread_count, cached_metadata=True
            )
            self._save_strategies.clear()
            self._save_strategies[key] = FullyParallelSaveStrategyWrapper(
                base,
                parallel_state.get_data_parallel_group(with_context_parallel=True),
                do_cache_distribution=True,
            )
        return self._save_strategies[key]

    def _wait_written(self, timeout_s: float) -> None:
        """Finalize the pending save; a dead writer or a timeout is an error, not a hang.

        Every rank polls in lockstep (each poll is a collective in megatron)."""
        deadline = time.monotonic() + timeout_s
        while self._queue.get_num_unfinalized_calls():
            self._queue.maybe_finalize_async_calls(blocking=False)
            if not self._queue.get_num_unfinalized_calls():
                break
            caller = self._queue.persistent_caller
            process = getattr(caller, "process", None)
            if process is not None and not process.is_alive():
                raise MigrationError(
                    f"the checkpoint writer process (pid {process.pid}) died with exit code "
                    f"{process.exitcode} before the save finished"
                )
            if time.monotonic() > deadline:
                raise WaitTimeout(f"checkpoint save not finished after {timeout_s:.0f} s")
            time.sleep(0.005)

    def save(
        self, trainee: Trainee, save_dir: str | os.PathLike[str], timeout_s: float = 600.0
    ) -> SaveReport:
        """Save model, optimizer and common state to ``save_dir/iter_NNNNNNN`` (the
        trainee's iteration) and point ``save_dir``'s tracker at it; blocks until every
        rank's files are written, fsynced and the metadata finalised.  All ranks call."""
        import torch.distributed as dist

        first = self.async_writer and not self._writer_started
        dist.barrier()
        t0 = time.perf_counter()
        target = self._start_save(trainee, Path(save_dir), self.async_writer)
        if self.async_writer:
            self._wait_written(timeout_s)
        dist.barrier()
        return SaveReport(time.perf_counter() - t0, first, str(target))

    def save_async(self, trainee: Trainee, save_dir: str | os.PathLike[str]) -> Path:
        """Start a save of ``trainee`` into ``save_dir`` (as :meth:`save`) and return its
        checkpoint directory once the state is staged (copied for the writer), so training
        goes on while the persistent writer writes; :meth:`poll` tells when it is complete
        (the tracker then names it).  All ranks call."""
        return self._start_save(trainee, Path(save_dir), True)

    def _start_save(self, trainee: Trainee, save_dir: Path, asynchronous: bool) -> Path:
        """A fresh ``iter_NNNNNNN`` (rank 0), then megatron's save; an asynchronous one is
        handed to the persistent writer.  Rank 0 moves the tracker once it is complete."""
        import torch.distributed as dist
        from megatron.core import dist_checkpointing

        results_queue_dying_with_us()  # where megatron would create it: inside the save
        target = megatron_lm.iteration_dir(save_dir, trainee.iteration)
        rank0 = dist.get_rank() == 0
        if rank0:
            if target.exists():
                shutil.rmtree(target)
            target.mkdir(parents=True)
        dist.barrier()
        metadata = content_metadata(trainee, self.sharding)
        request = dist_checkpointing.save(
            sharded_state(trainee, is_loading=False, metadata=metadata), str(target),
            sharded_strategy=self._save_strategy(trainee), async_sharded_save=asynchronous,
            content_metadata=metadata,
        )
        iteration = trainee.iteration

        def point_tracker() -> None:
            if rank0:
                megatron_lm.write_tracker(save_dir, iteration)

        if asynchronous:
            request.add_finalize_fn(point_tracker)
            self._align_call_index()
            self._queue.schedule_async_request(request)
            self._writer_started = True
        else:
            dist.barrier()  # every rank's files are complete
            point_tracker()
        return target

    def _align_call_index(self) -> None:
        """Number this save the same on every rank of the world that makes it.

        Why: megatron's queue counts its saves per process and, finalizing, checks that
        every rank finalizes the same index.  A process that sat out a save (a leaver, a
        rank outside a smaller world) counts fewer, and its next save in a world with the
        others failed with megatron's "Unmatched async calls"."""
        import torch
        import torch.distributed as dist

        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        index = torch.tensor([self._queue.call_idx], dtype=torch.int, device=device)
        dist.all_reduce(index, op=dist.ReduceOp.MAX)
        self._queue.call_idx = int(index.item())

    def poll(self, blocking: bool = False) -> bool:
        """Finalise what the writer has finished (``blocking``: wait for all of it);
        true when no save is pending.  All ranks call, in lockstep (a collective)."""
        if self._queue.get_num_unfinalized_calls():
            self._queue.maybe_finalize_async_calls(blocking=blocking)
        return not self._queue.get_num_unfinalized_calls()

    def abandon(self) -> None:
        """Drop a pending save whose peers are gone (no collective can finalise it): kill
        the writer process and keep megatron's caller from logging through a process
        group that no longer exists when it is collected."""
        caller = getattr(self._queue, "persistent_caller", None)
        if caller is not None:
            process = getattr(caller, "process", None)
            if process is not None and process.is_alive():
                process.kill()
            caller.close = lambda: None  # its __del__ calls close(), which asks for a rank
        self._queue.async_calls.clear()

    # ------------------------------------------------------------------ load
    def load(self, trainee: Trainee, path: str | os.PathLike[str]) -> LoadReport:
        """Load the checkpoint at ``path`` (a save directory: its tracker's iteration; or
        one checkpoint directory) resharded into ``trainee``, freshly built in any layout:
        model chunks, optimizer (Adam ``step`` one tensor per param), scheduler,
        iteration, consumed samples, and the RNG states when TP and PP are the saved
        ones (as Megatron-LM).  All ranks call."""
        import torch.distributed as dist
        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.dist_checkpointing import serialization
        from megatron.core.dist_checkpointing.serialization import (
            get_default_load_sharded_strategy,
        )
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelLoadStrategyWrapper,
        )

        target, _ = megatron_lm.resolve(path)
        if trainee.distributed:
            patch_distributed_optimizer_checkpointing()
        dist.barrier()
        t0 = time.perf_counter()
        common = dist_checkpointing.load_common_state_dict(str(target))
        metadata = dict(dist_checkpointing.load_content_metadata(str(target)) or {})
        saved = megatron_lm.saved_layout(common)
        found = serialization.load_sharded_metadata(str(target))
        sharding = metadata.get("distrib_optim_sharding_type")
        with_optimizer = any(k.startswith("optimizer.") for k in found)
        by_buckets = with_optimizer and sharding == "dp_reshardable"
        cfg = trainee.config
        same_mp = saved is not None and (saved.tp, saved.pp) == (cfg.tp, cfg.pp)
        request = sharded_state(
            trainee, is_loading=True,
            metadata={**content_metadata(trainee), **metadata},
            optimizer=with_optimizer and not by_buckets,
            rng=same_mp and "rng_state" in found)
        strategy = FullyParallelLoadStrategyWrapper(
            get_default_load_sharded_strategy(str(target)),
            parallel_state.get_data_parallel_group(with_context_parallel=True),
        )
        loaded = dist_checkpointing.load(request, str(target), sharded_strategy=strategy)
        megatron_lm.load_model_state(trainee.modules(), loaded)
        if by_buckets:
            self._load_by_buckets(trainee, target, saved, found)
        elif with_optimizer:
            trainee.optimizer.load_state_dict(loaded["optimizer"])
            fix_step_alias(trainee.optimizer)
        else:
            log.warning("%s holds no optimizer state: the optimizer starts afresh", target)
        _restore_common(trainee, loaded)
        for chunk in trainee.model:
            chunk.zero_grad_buffer()
        dist.barrier()
        return LoadReport(time.perf_counter() - t0, str(target))

    @staticmethod
    def _load_by_buckets(trainee: Trainee, target: Path, saved: Any, found: dict) -> None:
        """The ``dp_reshardable`` optimizer state, decoded by etcslurm for any layout."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        from etcslurm.baseline import dp_reshardable
        from etcslurm.errors import UsageError

        if saved is None:
            raise UsageError(f"{target}: a dp_reshardable optimizer state without the saved "
                             "layout (the checkpoint has no args)")
        tensors = {k: v for k, v in found.items() if isinstance(v, ShardedTensor)}
        dp_reshardable.load_optimizer_state(
            trainee, target, saved, {k: tuple(v.global_shape) for k, v in tensors.items()},
            {k: v.dtype for k, v in tensors.items()})
        step, groups = dp_reshardable.saved_step(target)
        if step is None:
            raise UsageError(f"{target}: the optimizer's param groups carry no single step")
        _set_adam_step(trainee, step, groups)

    def close(self) -> None:
        """Stop the persistent writer (waits for pending saves).  Call while the process
        group is still up: megatron's caller logs ``get_rank()`` when it is collected."""
        import gc

        self._queue.close()
        self._queue.persistent_caller = None
        gc.collect()


def _world_marker() -> Any:
    """An object that changes whenever the default process group is rebuilt."""
    import torch.distributed as dist

    return dist.group.WORLD


def _set_adam_step(trainee: Trainee, step: float, groups: list[dict[str, Any]]) -> None:
    """Adam's ``step``: one tensor per param state (torch Adam), and per param group where
    the saved groups have it (Transformer Engine's and Apex's Adam)."""
    import torch

    for mopt in trainee.inner_optimizers():
        for state in mopt.optimizer.state.values():
            if "exp_avg" in state:
                state["step"] = torch.tensor(step, dtype=torch.float32)
        target = mopt.optimizer.param_groups
        if len(groups) == len(target):
            for group, old in zip(target, groups, strict=True):
                if "step" in old and "step" in group:
                    group["step"] = old["step"]


def _restore_common(trainee: Trainee, loaded: dict[str, Any]) -> None:
    """Iteration, data position, scheduler and (when loaded) RNG from the common state;
    the seed too (etcslurm's data order is a function of seed and sample)."""
    trainee.iteration = int(loaded.get("iteration") or 0)
    trainee.consumed_samples = megatron_lm.consumed_samples(loaded)
    seed = getattr(loaded.get("args"), "seed", None)
    if seed is not None:
        trainee.seed = int(seed)
    scheduler = loaded.get("opt_param_scheduler")
    if trainee.scheduler is not None and scheduler is not None:
        trainee.scheduler.num_steps = 0  # load_state_dict steps forward by num_steps
        trainee.scheduler.load_state_dict(dict(scheduler))
    if loaded.get("rng_state") is not None:
        megatron_lm.set_rng_state(loaded["rng_state"])


_DEFAULT: CheckpointMigrator | None = None


def _default() -> CheckpointMigrator:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = CheckpointMigrator()
    return _DEFAULT


def save_checkpoint(trainee: Trainee, save_dir: str | os.PathLike[str]) -> SaveReport:
    """Fallback API for the runtime: save everything into ``save_dir`` (all ranks call)."""
    return _default().save(trainee, save_dir)


def load_checkpoint(trainee: Trainee, path: str | os.PathLike[str]) -> LoadReport:
    """Fallback API for the runtime: restore everything from the checkpoint at ``path``
    into a freshly built trainee of any layout (all ranks call)."""
    return _default().load(trainee, path)


def close_default() -> None:
    """Stop the default migrator's persistent writer (call before the process exits)."""
    global _DEFAULT
    if _DEFAULT is not None:
        _DEFAULT.close()
        _DEFAULT = None
