"""torch.distributed + megatron-core ``parallel_state`` for one layout, rebuilt in place.

Why this module: an elastic job changes its world and its TP/PP/DP layout many times in
the same processes.  ``parallel_state.destroy_model_parallel()`` only clears megatron's
globals and leaks every process group it created (~20 per rebuild; teardown slows to
over a second after ~100 rebuilds).  :func:`teardown` destroys every group megatron-core
created (its ``_global_process_group_list``), then the default group; :func:`init_parallel`
starts the next world on a fresh ``PrefixStore(f"gen{generation}", store)`` over ONE
long-lived store (e.g. the coordinator's Redis store or a ``TCPStore``), so keys of an
old generation can never be mistaken for the new one.  Subgroups are created with all
ranks participating (``use_local_synchronization=True`` can hang in gloo).

Worlds are started and torn down by ``etcslurm/groups/lifecycle.py`` (which also forms
the exchange group that moves the state); :func:`teardown` is registered there as a teardown hook,
so there is one lifecycle implementation.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from etcslurm.core.layout import ParallelConfig
from etcslurm.errors import LayoutError
from etcslurm.groups import lifecycle as groups
from etcslurm.megatron import cpu_shim
from etcslurm.megatron.stale_graphs import cut_watched

log = logging.getLogger(__name__)

#: default timeout of every collective of a generation (a lost peer surfaces as an error)
DEFAULT_TIMEOUT_S = 300.0


def default_backend() -> str:
    """``nccl`` when this process has a GPU, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() and not cpu_shim.installed() else "gloo"


def init_world(
    rank: int,
    world_size: int,
    store: dist.Store,
    generation: int | str,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> float:
    """Start the default process group of ``generation``; returns the seconds it took.

    The one lifecycle of :mod:`etcslurm.groups.lifecycle` (whose teardown runs
    :func:`teardown` below first, so megatron's groups of the old layout go too).
    """
    if not 0 <= rank < world_size:
        raise LayoutError(f"rank {rank} is outside a world of {world_size}")
    warm_up()
    t0 = time.perf_counter()
    groups.configure(store, generation, rank, world_size, backend or default_backend(),
                     timeout=timeout_s)
    return time.perf_counter() - t0


#: what a build imports: the model and optimizer stack, and the layer specs -- whose
#: import reaches ``fused_bias_dropout``'s ``torch.compile``, whose first call builds
#: dynamo's rule map: 0.22 s of a joiner's build inside a DP grow's pause (profiled),
#: while the old ranks waited for it in the optimizer's all-gather
WARM_MODULES = ("megatron.core.models.gpt", "megatron.core.models.gpt.gpt_layer_specs",
                "megatron.core.optimizer", "megatron.core.optimizer_param_scheduler",
                "megatron.core.distributed")


def warm_up() -> None:
    """Import megatron-core's model and optimizer stack (what every build imports anyway)
    and freeze what is alive (:func:`groups.freeze_long_lived`), so the collections of
    every later teardown skip it; once per process.

    A worker calls it before it registers (:meth:`ElasticSession.start`): a joiner taken
    in at a boundary would otherwise import the optimizer and walk ~400 000 objects
    (about a second) inside everyone's pause.  The first world calls it too, for
    processes that never register (benchmarks, tests)."""
    if groups.frozen():
        return
    cpu_shim.install_if_needed()
    for module in WARM_MODULES:
        importlib.import_module(module)

    groups.freeze_long_lived()


def init_model_parallel(config: ParallelConfig, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Create megatron-core's groups for ``config`` on the current default world."""
    from megatron.core import parallel_state

    world = dist.get_world_size()
    if config.world_size != world:
        raise LayoutError(f"layout {config} needs {config.world_size} ranks, the world has {world}")
    gloo = dist.get_backend() == "gloo"
    with _lazy_gloo(gloo):
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=config.tp,
            pipeline_model_parallel_size=config.pp,
            expert_model_parallel_size=config.ep,
            expert_tensor_parallel_size=config.expert_tp,
            context_parallel_size=config.cp,
            virtual_pipeline_model_parallel_size=config.vpp if config.vpp > 1 else None,
            distributed_timeout_minutes=max(1, int(timeout_s // 60)),
            # the default backend is gloo already: megatron's extra gloo groups would only
            # double the groups (and threads) per rebuild
            create_gloo_process_groups=not gloo,
        )
    # megatron's RNG tracker must exist before a model is built; seeded by build_gpt
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.initialize_rng_tracker(force_reset=True)


@contextlib.contextmanager
def _lazy_gloo(gloo: bool) -> Iterator[None]:
    """Inside: gloo groups connect their pairs at their first use, not when created
    (torch's ``TORCH_GLOO_LAZY_INIT``, read at each group's creation).

    Why: megatron-core creates every group of its layout on every rank -- 17 with this
    rank as a member for tp2pp1dp2 on 4 ranks, only 4 distinct rank sets among them --
    and most are never used by a training step; connected eagerly they took 0.19 s of
    each resize's pause over the Redis store, lazily 0.04 s (4 gloo ranks on a
    2-core machine).  The groups a step uses connect in the first step after the resize.  The
    default group and the exchange group stay eager: their first collective comes at
    once (a barrier, a probe), and an eager connection makes a peer that dies show at
    once, where a lazy connect to a dead peer retries up to five times the group's
    timeout.  A value the user exported is left as it is.
    """
    if not gloo or "TORCH_GLOO_LAZY_INIT" in os.environ:
        yield
        return
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    try:
        yield
    finally:
        os.environ.pop("TORCH_GLOO_LAZY_INIT", None)


def init_parallel(
    config: ParallelConfig,
    rank: int,
    world_size: int,
    store: dist.Store,
    generation: int | str,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> float:
    """Start the world of ``generation`` and megatron's groups for ``config``.

    Returns the seconds taken.  Call :func:`cpu_shim.install_if_needed` before (done here).
    """
    cpu_shim.install_if_needed()
    if config.world_size != world_size:
        raise LayoutError(f"layout {config} needs {config.world_size} ranks, not {world_size}")
    t0 = time.perf_counter()
    init_world(rank, world_size, store, generation, backend, timeout_s)
    init_model_parallel(config, timeout_s)
    return time.perf_counter() - t0


def megatron_groups() -> list[dist.ProcessGroup]:
    """The process groups megatron-core created in this process (not the default group)."""
    from megatron.core import parallel_state

    groups = parallel_state._global_process_group_list or []
    return [g for g in groups if g is not None and g is not dist.GroupMember.NON_GROUP_MEMBER]


def teardown() -> float:
    """Destroy megatron's groups, its globals and the default group; seconds taken.

    Safe to call when nothing is initialised.  Model tensors (and views of them) stay
    valid: only communicators go.
    """
    from megatron.core import parallel_state

    t0 = time.perf_counter()
    cut_watched()  # else an MoE model of this world would keep its groups alive
    if dist.is_initialized():
        for group in megatron_groups():
            try:
                dist.destroy_process_group(group)
            except (ValueError, RuntimeError) as exc:  # already gone
                log.debug("destroying a megatron group failed: %s", exc)
    parallel_state.destroy_model_parallel()
    # megatron's global memory buffer and RNG tracker belong to the old layout
    try:
        from megatron.core.tensor_parallel import random as mrandom

        mrandom.initialize_rng_tracker(force_reset=True)
    except Exception as exc:  # pragma: no cover - older megatron
        log.debug("rng tracker reset failed: %s", exc)
    if dist.is_initialized():
        dist.destroy_process_group()
    return time.perf_counter() - t0


groups.register_teardown_hook(teardown)
