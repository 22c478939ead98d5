"""Checkpoint-based migration with megatron-core ``dist_checkpointing`` (the baseline and
the fallback).

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

RNG states are not saved (they depend on the TP rank; the model uses no dropout); the
other scalars travel in the checkpoint's common part as a JSON string.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from etcslurm.errors import MigrationError, WaitTimeout
from etcslurm.megatron.model import Trainee, fix_step_alias, patch_distopt_step_keyerror
from etcslurm.megatron.scalars import extract_scalars, restore_scalars
from etcslurm.parent_death import die_with_parent, forked_children_die_with_us

DISTOPT_SHARDING = "fully_reshardable"


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


def _metadata(trainee: Trainee) -> dict[str, Any]:
    return {"distrib_optim_sharding_type": DISTOPT_SHARDING} if trainee.distributed else {}


def sharded_state(trainee: Trainee, is_loading: bool) -> dict[str, Any]:
    """megatron's sharded state dict of model + optimizer (+ scalars as a JSON string)."""
    if len(trainee.model) != 1:
        raise NotImplementedError(
            "virtual pipeline stages (several model chunks) are not supported"
        )
    model_sd = trainee.modules()[0].sharded_state_dict()
    opt_sd = trainee.optimizer.sharded_state_dict(
        model_sd, is_loading=is_loading, metadata=_metadata(trainee)
    )
    scalars = extract_scalars(trainee)
    scalars.pop("rng")
    return {"model": model_sd, "optimizer": opt_sd, "scalars": json.dumps(scalars, sort_keys=True)}


def _persistent_writer_loop(*args: Any, **kwargs: Any) -> None:
    """The persistent writer process's entry point, with the CPU shim when needed.

    Why: megatron spawns the writer as a fresh interpreter running
    ``PersistentAsyncCaller.async_loop``, which starts with
    ``torch.cuda.set_device(rank % torch.cuda.device_count())`` — on a CPU-only machine a
    ZeroDivisionError that leaves the trainer waiting forever.  This runs the shim (and a
    device count of 1) in the writer first, then megatron's own loop; and the writer exits
    when its trainer process dies.
    """
    import threading

    import torch

    from etcslurm.megatron import cpu_shim

    if cpu_shim.install_if_needed():
        torch.cuda.device_count = lambda: 1
    parent = os.getppid()
    die_with_parent(parent=parent)
    forked_children_die_with_us()  # the workers megatron's writer forks for each save

    def _exit_with_parent() -> None:
        # megatron's writer blocks on its queue forever when the trainer dies (a crashed
        # or killed run left 200+ MB writers behind): leave when the parent is gone
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=_exit_with_parent, name="etcslurm-writer-guard", daemon=True).start()
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    loop = PersistentAsyncCaller.__dict__["async_loop"]
    loop = getattr(loop, "__func__", loop)
    if loop is _persistent_writer_loop:
        loop = _ORIGINAL_LOOP
    loop(*args, **kwargs)


_ORIGINAL_LOOP: Any = None



_RESULTS_MANAGER: Any = None


def _results_queue_dying_with_us() -> None:
    """Give megatron's file writer a results queue whose server dies with this process.

    ``filesystem_async`` creates, on first use, ``multiprocessing.Manager().Queue()``: a
    spawned manager server (~270 MB) that is only shut down when this process exits
    cleanly.  A trainer that is killed (preemption, a failed peer, a test timeout) left it
    behind forever -- measured: 36 orphans, ~10 GB, after one test session.  Started here
    with :func:`~etcslurm.parent_death.die_with_parent` as its initializer instead.
    """
    global _RESULTS_MANAGER
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=die_with_parent)
    _RESULTS_MANAGER = manager
    filesystem_async._results_queue = manager.Queue()


def _route_writer_through_shim() -> None:
    """Make megatron's persistent writer start via :func:`_persistent_writer_loop` (the
    shim only applies without a GPU; the parent-death guard always)."""
    global _ORIGINAL_LOOP
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    current = PersistentAsyncCaller.__dict__["async_loop"]
    current = getattr(current, "__func__", current)
    if current is _persistent_writer_loop:
        return
    _ORIGINAL_LOOP = current
    PersistentAsyncCaller.async_loop = staticmethod(_persistent_writer_loop)


class CheckpointMigrator:
    """Save → load-resharded with ``dist_checkpointing``; one per process, reused, so the
    persistent writer stays warm across saves.  ``close()`` stops the writer."""

    def __init__(self, thread_count: int = 2, async_writer: bool = True) -> None:
        """``async_writer=False`` writes in the calling process (megatron's synchronous
        path): no writer start-up, used by the small tests; benchmarks keep the default."""
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        _route_writer_through_shim()
        self.thread_count = thread_count
        self.async_writer = async_writer
        self._queue = AsyncCallsQueue(persistent=True)
        self._writer_started = False
        self._save_strategies: dict[tuple, Any] = {}

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
        self, trainee: Trainee, path: str | os.PathLike[str], timeout_s: float = 600.0
    ) -> SaveReport:
        """Save model, optimizer and scalars to ``path`` (a fresh directory); blocks until
        every rank's files are written, fsynced and the metadata finalised.  All ranks call."""
        import torch.distributed as dist

        first = self.async_writer and not self._writer_started
        dist.barrier()
        t0 = time.perf_counter()
        self._start_save(trainee, Path(path), self.async_writer)
        if self.async_writer:
            self._wait_written(timeout_s)
        dist.barrier()
        return SaveReport(time.perf_counter() - t0, first, str(path))

    def save_async(self, trainee: Trainee, path: str | os.PathLike[str]) -> None:
        """Start a save of ``trainee`` to ``path`` and return once the state is staged
        (copied for the writer), so training goes on while the persistent writer writes;
        :meth:`poll` tells when it is complete.  All ranks call."""
        self._start_save(trainee, Path(path), True)

    def _start_save(self, trainee: Trainee, path: Path, asynchronous: bool) -> None:
        """A fresh ``path`` (rank 0), then megatron's save; an asynchronous one is handed
        to the persistent writer."""
        import torch.distributed as dist
        from megatron.core import dist_checkpointing

        _results_queue_dying_with_us()  # where megatron would create it: inside the save
        if dist.get_rank() == 0:
            if path.exists():
                shutil.rmtree(path)
            path.mkdir(parents=True)
        dist.barrier()
        request = dist_checkpointing.save(
            sharded_state(trainee, is_loading=False), str(path),
            sharded_strategy=self._save_strategy(trainee), async_sharded_save=asynchronous,
        )
        if asynchronous:
            self._queue.schedule_async_request(request)
            self._writer_started = True

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
        """Load ``path`` resharded into ``trainee`` (freshly built for the new layout):
        model, optimizer (Adam ``step`` one tensor per param) and scalars.  All ranks call."""
        import torch.distributed as dist
        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.dist_checkpointing.serialization import (
            get_default_load_sharded_strategy,
        )
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelLoadStrategyWrapper,
        )

        if trainee.distributed:
            patch_distopt_step_keyerror()
        dist.barrier()
        t0 = time.perf_counter()
        strategy = FullyParallelLoadStrategyWrapper(
            get_default_load_sharded_strategy(str(path)),
            parallel_state.get_data_parallel_group(with_context_parallel=True),
        )
        loaded = dist_checkpointing.load(
            sharded_state(trainee, is_loading=True), str(path), sharded_strategy=strategy
        )
        trainee.modules()[0].load_state_dict(loaded["model"])
        trainee.optimizer.load_state_dict(loaded["optimizer"])
        fix_step_alias(trainee.optimizer)
        restore_scalars(trainee, json.loads(loaded["scalars"]))
        for chunk in trainee.model:
            chunk.zero_grad_buffer()
        dist.barrier()
        return LoadReport(time.perf_counter() - t0, str(path))

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


_DEFAULT: CheckpointMigrator | None = None


def _default() -> CheckpointMigrator:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = CheckpointMigrator()
    return _DEFAULT


def save_checkpoint(trainee: Trainee, path: str | os.PathLike[str]) -> SaveReport:
    """Fallback API for the runtime: save everything to ``path`` (all ranks call)."""
    return _default().save(trainee, path)


def load_checkpoint(trainee: Trainee, path: str | os.PathLike[str]) -> LoadReport:
    """Fallback API for the runtime: restore model, optimizer and scalars from ``path``
    into a freshly built trainee of any layout (all ranks call)."""
    return _default().load(trainee, path)


def close_default() -> None:
    """Stop the default migrator's persistent writer (call before the process exits)."""
    global _DEFAULT
    if _DEFAULT is not None:
        _DEFAULT.close()
        _DEFAULT = None
