"""megatron-core's asynchronous checkpoint writer, made safe to leave running: its
persistent writer process starts with the CPU shim where there is no GPU, and it and the
results queue's manager server die with the trainer that started them."""

from __future__ import annotations

import os
import time
from typing import Any

from etcslurm.parent_death import die_with_parent, forked_children_die_with_us


def persistent_writer_loop(*args: Any, **kwargs: Any) -> None:
    """The persistent writer process's entry point, with the CPU shim when needed.

    Why: megatron spawns the writer as a fresh interpreter running
    ``PersistentAsyncCaller.async_loop``, which starts with
    ``torch.cuda.set_device(rank % torch.cuda.device_count())`` — on a CPU-only machine a
    ZeroDivisionError that leaves the trainer waiting forever.  This runs the shim (and a
    device count of 1) in the writer first, then megatron's own loop; and the writer exits
    when its trainer process dies.
    """
    import multiprocessing
    import threading

    # the trainer's PID as it started this process (not read after the imports below: a
    # trainer killed while they ran would leave an orphan that takes init for its parent)
    started_by = multiprocessing.parent_process()
    parent = started_by.pid if started_by is not None and started_by.pid else os.getppid()
    die_with_parent(parent=parent)
    import torch

    from etcslurm.megatron import cpu_shim

    if cpu_shim.install_if_needed():
        torch.cuda.device_count = lambda: 1
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
    if loop is persistent_writer_loop:
        loop = _ORIGINAL_LOOP
    loop(*args, **kwargs)


_ORIGINAL_LOOP: Any = None



_RESULTS_MANAGER: Any = None


def results_queue_dying_with_us() -> None:
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


def route_writer_through_shim() -> None:
    """Make megatron's persistent writer start via :func:`persistent_writer_loop` (the
    shim only applies without a GPU; the parent-death guard always)."""
    global _ORIGINAL_LOOP
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    current = PersistentAsyncCaller.__dict__["async_loop"]
    current = getattr(current, "__func__", current)
    if current is persistent_writer_loop:
        return
    _ORIGINAL_LOOP = current
    PersistentAsyncCaller.async_loop = staticmethod(persistent_writer_loop)
