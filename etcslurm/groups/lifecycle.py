"""Process-group lifecycle: configure a generation, tear it down completely.

Like torchft's ``process_group.py`` this module knows only *configure* and *teardown*:
every generation (a world of devices that exchanges state or trains) gets a fresh
``PrefixStore(f"gen{generation}", store)`` over **one long-lived store** (a TCPStore held by
the launcher or the coordinator's Redis store), so keys of a dead generation never collide
with the next one and no rank has to host the store.

Why teardown is more than ``destroy_model_parallel()``: megatron-core's teardown only
clears its globals and leaks every group it created (~20 per rebuild; teardown slows past
1 s after ~100).  ``teardown()`` runs the registered hooks (megatron's adapter registers
its ``destroy_model_parallel``-and-friends there, so there is one implementation), then
``destroy_process_group()`` which, for the WORLD group, shuts down *every* registered group
(torch >= 2.4), then collects garbage so sockets and threads are released now, not later.
:func:`resource_usage` measures threads, open fds and RSS so tests can prove ten
migrations in a row leak nothing.
"""

from __future__ import annotations

import atexit
import gc
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from etcslurm.errors import MigrationError, WaitTimeout
from etcslurm.groups.devices import local_device_index

_TEARDOWN_HOOKS: list[Callable[[], None]] = []
_CURRENT: dict[str, int | str] = {}
_FROZEN: list[bool] = []  # non-empty once freeze_long_lived() ran
_GPU: list[int] = []  # this process's CUDA device index, once chosen


def default_backend() -> str:
    """NCCL on a GPU machine, gloo on CPU -- the same code path otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def use_local_gpu(rank: int) -> torch.device:
    """Make this task's GPU the current CUDA device, once per process (see
    :mod:`etcslurm.groups.devices`: device 0 when Slurm shows the task one GPU, its
    node-local rank otherwise; ``rank`` only outside Slurm and torchrun)."""
    if not _GPU:
        _GPU.append(local_device_index(os.environ, torch.cuda.device_count(), rank))
        torch.cuda.set_device(_GPU[0])
    return torch.device("cuda", _GPU[0])


def register_teardown_hook(hook: Callable[[], None]) -> None:
    """Run ``hook`` at the start of every :func:`teardown` (before groups are destroyed).

    The megatron adapter registers the clearing of ``parallel_state``'s globals here so the
    groups megatron-core created are destroyed by the same single teardown.
    Registering the same callable twice has no effect.
    """
    if hook not in _TEARDOWN_HOOKS:
        _TEARDOWN_HOOKS.append(hook)


def freeze_long_lived() -> bool:
    """Move every object alive now into the garbage collector's permanent generation,
    once per process; returns whether this call did it.

    Why: :func:`teardown` collects garbage so that a dead world's sockets and threads go
    at once, and a full collection walks every tracked object -- after importing torch
    and megatron-core's model stack that is ~400 000, ~1 s per collection on a shared
    core (measured with 4 gloo ranks), most of a DP shrink's pause.  What is alive
    before the first world (modules, classes, the run's settings and store) lives as
    long as the process anyway; frozen, it is skipped, and each collection walks only
    what came later (models, groups, buffers: well under 10 ms).  Call it before the
    first model is built, so that models stay collectable (a frozen cycle is never
    freed).
    """
    if _FROZEN:
        return False
    gc.collect()
    gc.freeze()
    _FROZEN.append(True)
    return True


def frozen() -> bool:
    """Whether :func:`freeze_long_lived` ran in this process."""
    return bool(_FROZEN)


#: how long the reaper waits for the other references to a retired object to go
RETIRE_WAIT_S = 30.0
_RETIRED: queue.Queue[Any] = queue.Queue()
_REAPER: list[threading.Thread] = []


def retire(obj: Any) -> None:
    """Let a background thread drop ``obj`` (a dead world's groups, a replaced model) once
    nothing else refers to it.

    Why: a gloo group's destructor waits for its device's event loop to notice the stop
    (an ``epoll_wait`` of 10 ms), ~14 ms per group and ~0.24 s for megatron's 17 groups of
    a 4-rank world, and it runs wherever the last reference goes -- in
    the middle of a resize's pause.  The wait releases the GIL, so the reaper costs the
    training thread nothing.  The reaper holds ``obj`` until its own reference is the
    last (the caller's locals and the old model may still point at it) or
    :data:`RETIRE_WAIT_S` passed, then drops it.  With NCCL, groups are dropped here and
    now: destroying communicators beside a running collective is not something to risk
    for a few milliseconds.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return
    if not _REAPER or not _REAPER[0].is_alive():
        _REAPER[:] = [threading.Thread(target=_reap, name="etcslurm-reaper", daemon=True)]
        _REAPER[0].start()
        atexit.register(_let_the_reaper_finish)
    _RETIRED.put(obj)


#: how long a process that exits waits for the reaper to finish the groups it was handed
REAPER_EXIT_WAIT_S = 3.0


def _let_the_reaper_finish() -> None:
    """At exit, give the reaper :data:`REAPER_EXIT_WAIT_S` to finish what it holds.

    Why: the reaper is a daemon thread; an interpreter that ends while it is inside a gloo
    group's destructor (the GIL released) tears down what that destructor still uses, and
    the process aborts (``terminate called without an active exception``, exit -6) after
    work that ended well -- seen on a worker that left right after a resize."""
    deadline = time.monotonic() + REAPER_EXIT_WAIT_S
    while _RETIRED.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.005)


def _reap() -> None:
    while True:
        obj = _RETIRED.get()
        deadline = time.monotonic() + RETIRE_WAIT_S
        # 2: ``obj`` here and getrefcount's argument -- nobody else holds it
        while sys.getrefcount(obj) > 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        del obj
        # a model is full of reference cycles (modules, hooks): dropping the last
        # reference leaves it to the collector, and the next collection -- the teardown's,
        # inside the next resize's pause -- would run its groups' destructors there
        # (~0.09 s of every TP change after the first).  Collected here, they
        # wait in this thread.
        if _RETIRED.empty():
            gc.collect()
        _RETIRED.task_done()


def configure(
    store: dist.Store,
    generation: int | str,
    rank: int,
    world_size: int,
    backend: str | None = None,
    timeout: float = 60.0,
) -> None:
    """Join generation ``generation`` as ``rank`` of ``world_size``.

    Tears down whatever generation this process was in first.  The rendezvous uses
    ``PrefixStore(f"gen{generation}", store)``; the wait for all ranks and every later
    collective/P2P wait is bounded by ``timeout`` seconds.  A barrier at the end makes the
    first ``batch_isend_irecv`` safe (NCCL requires every rank to take part in a group's
    first collective) and proves every rank arrived.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise MigrationError(f"generation {generation}: rank {rank} outside world {world_size}")
    teardown()
    backend = backend or default_backend()
    prefix = dist.PrefixStore(f"gen{generation}", store)
    kwargs = {}
    if backend == "nccl":
        kwargs["device_id"] = use_local_gpu(rank)
    t0 = time.monotonic()
    try:
        dist.init_process_group(
            backend=backend,
            store=prefix,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
            **kwargs,
        )
        if backend == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()
    except (RuntimeError, dist.DistError) as exc:
        teardown()
        raise WaitTimeout(
            f"generation {generation}: rank {rank} of {world_size} could not form the "
            f"{backend} group (timeout {timeout:.0f} s, gave up after "
            f"{time.monotonic() - t0:.0f} s): {exc}"
        ) from exc
    _CURRENT.update(generation=generation, rank=rank, world_size=world_size, backend=backend)


def exchange_group(
    store: dist.Store,
    generation: int | str,
    rank: int,
    size: int,
    backend: str | None = None,
    timeout: float = 60.0,
) -> dist.Backend:
    """A process group of its own over the devices that exchange state, outside the
    default world.

    Why: megatron-core modules keep the groups of the world they were built in, and that
    world (the new layout) does not contain leaving devices.  With the exchange on a group
    of its own, the new world is formed and the new model built *before* the exchange,
    and the state is received straight into the new model's (already resident) memory
    instead of into fresh buffers copied afterwards.  The group is a bare
    ``ProcessGroupGloo``/``ProcessGroupNCCL`` backend on
    ``PrefixStore(f"exchange{generation}", store)``; :func:`~etcslurm.transfer.executor.execute`
    takes it as ``group``.  It ends with a one-element all-reduce that proves every member
    arrived (NCCL also needs every rank in a group's first collective).  Drop it with
    :func:`close_exchange_group`.
    """
    if size < 1 or not 0 <= rank < size:
        raise MigrationError(f"exchange {generation}: rank {rank} outside group of {size}")
    backend = backend or default_backend()
    prefix = dist.PrefixStore(f"exchange{generation}", store)
    wait = timedelta(seconds=timeout)
    pg: dist.Backend | None = None
    t0 = time.monotonic()
    try:
        if backend == "nccl":
            gpu = use_local_gpu(rank)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = wait
            pg = dist.ProcessGroupNCCL(prefix, rank, size, options)
            probe = torch.ones(1, device=gpu)
        else:
            pg = dist.ProcessGroupGloo(prefix, rank, size, wait)
            probe = torch.ones(1)
        group_max(pg, probe, timeout)
    except (RuntimeError, dist.DistError, WaitTimeout) as exc:
        close_exchange_group(pg, now=True)  # a half-formed group must not keep its sockets
        raise WaitTimeout(
            f"exchange {generation}: rank {rank} of {size} could not form the {backend} "
            f"exchange group (timeout {timeout:.0f} s, gave up after "
            f"{time.monotonic() - t0:.0f} s): {exc}"
        ) from exc
    if int(probe.item()) != 1:
        raise MigrationError(f"exchange {generation}: probe all-reduce returned {probe.item()}")
    return pg


def world_exchange(generation: int | str, timeout: float) -> dist.Backend:
    """The current (new) world's own gloo backend as the exchange group, when the devices
    that exchange state are exactly the world's members (nobody leaves or stays idle):
    the executor and :func:`group_max` take it like an :func:`exchange_group`, its ranks
    are the world's.

    Why: a second rendezvous over the same members (store round trips, a full mesh of
    connections) was 0.01-0.05 s of a DP grow's or a TP change's pause on gpt-tiny.
    It ends with the same probe all-reduce, bounded by ``timeout`` (gloo honours
    a per-operation timeout): members arrive once their model is built, which may take
    longer than the world's own collective timeout.  Never closed by the migration: it
    is the world's.  gloo only (:class:`MigrationError` otherwise): whether NCCL honours
    the probe's longer timeout is unverified, so NCCL keeps an exchange group.
    """
    if not dist.is_initialized() or dist.get_backend() != "gloo":
        raise MigrationError(f"exchange {generation}: the world is not a gloo world")
    pg = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    probe = torch.ones(1)
    try:
        group_max(pg, probe, timeout)
    except (RuntimeError, dist.DistError, WaitTimeout) as exc:
        raise WaitTimeout(
            f"exchange {generation}: rank {dist.get_rank()} of {dist.get_world_size()} "
            f"did not meet the new world's members within {timeout:.0f} s: {exc}"
        ) from exc
    if int(probe.item()) != 1:
        raise MigrationError(f"exchange {generation}: probe all-reduce returned {probe.item()}")
    return pg


def group_max(pg: dist.Backend, tensor: torch.Tensor, timeout: float) -> torch.Tensor:
    """In-place all-reduce (MAX) of ``tensor`` over a bare backend, bounded by ``timeout``
    (also inside gloo, whose own wait would otherwise be the group's timeout)."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    opts.timeout = timedelta(seconds=timeout)
    if not pg.allreduce([tensor], opts).wait(timedelta(seconds=timeout)):
        raise WaitTimeout(f"all-reduce on the exchange group did not finish in {timeout:.0f} s")
    return tensor


def close_exchange_group(pg: dist.Backend | None, now: bool = False) -> None:
    """Release an exchange group's connections (NCCL: abort its communicators now).

    A gloo group is handed to :func:`retire` unless ``now``: its shutdown waits for its
    device's event loop like any gloo group's destructor (10-30 ms of every resize's
    pause on gpt-tiny), and nothing needs its sockets gone at once -- the
    members that leave exit, the others never use it again.  ``now``: a half-formed
    group after a failure, whose sockets must not linger into the retry.
    """
    if pg is None:
        return
    nccl = isinstance(pg, getattr(dist, "ProcessGroupNCCL", ()))
    if not nccl and not now:
        retire(pg)
        return
    try:
        if nccl:
            pg.abort()
        else:
            pg.shutdown()
    except (RuntimeError, AttributeError):
        pass
    gc.collect()


def configure_local(timeout: float = 60.0) -> None:
    """A world of one (this process alone, gloo, in-memory store): for libraries that ask
    for a rank after the real world is gone (e.g. closing megatron's checkpoint writer)."""
    configure(dist.HashStore(), 0, 0, 1, "gloo", timeout)


def current() -> dict[str, int | str]:
    """The generation this process is in (empty after teardown)."""
    return dict(_CURRENT)


def teardown() -> None:
    """Destroy every process group this process holds (megatron's too) and forget them.

    Safe to call when nothing is initialised.  Hooks run first; an exception in a hook is
    re-raised only after the groups are destroyed, so a failing hook never leaks sockets.
    """
    error: BaseException | None = None
    for hook in list(_TEARDOWN_HOOKS):
        try:
            hook()
        except BaseException as exc:  # keep tearing down
            error = error or exc
    if dist.is_initialized():
        dist.destroy_process_group()
    else:
        _forget_failed_init()
    _CURRENT.clear()
    gc.collect()
    if error is not None:
        raise error


def _forget_failed_init() -> None:
    """Reset torch's process-group counter after an ``init_process_group`` that failed.

    torch names each new group after a per-process counter and uses that name in the
    rendezvous keys; ``destroy_process_group()`` resets it, but a failed rendezvous (a peer
    that never arrived) leaves it incremented with no group to destroy.  Processes that
    then meet again in a new world would look for each other under different keys
    (measured: the fallback generation after a failed rebuild timed out).
    """
    from torch.distributed import distributed_c10d

    distributed_c10d._world.group_count = 0


def abort() -> None:
    """Tear down after a failure (a peer died, a wait timed out): same as teardown, never
    raises -- the caller is already handling an error."""
    try:
        teardown()
    except Exception:
        pass


def resource_usage() -> dict[str, int]:
    """Threads, open file descriptors (sockets included) and RSS of this process."""
    try:
        fds = len(os.listdir("/proc/self/fd"))
    except OSError:
        fds = -1
    rss = 0
    try:
        with open("/proc/self/statm") as fh:
            rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pass
    return {
        "threads": threading.active_count(),
        "os_threads": len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else -1,
        "fds": fds,
        "rss_bytes": rss,
    }
