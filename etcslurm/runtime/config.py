"""What a worker needs to take part in a run: run-wide settings apart from its own options.

:class:`RunSettings` is the same on every worker of a run: the first worker stores it in
the coordinator and a joiner whose settings differ is refused (``SpecMismatch``), because
every rank replays the same layout decisions and plans from them.  :class:`WorkerOptions`
are this worker's own (where the coordinator is, timeouts, its node, its run directory)
and may differ from worker to worker.
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from etcslurm.core.layout import ParallelConfig
from etcslurm.core.layout_choice import LayoutFilter, LayoutRules
from etcslurm.core.memory import DEFAULT_MARGIN, TrainingSetup
from etcslurm.core.models import GPTSpec
from etcslurm.errors import UsageError


@dataclass(frozen=True)
class RunSettings:
    """Run-wide settings: model, optimizer, batch, seed, steps, how layouts are chosen
    and which are allowed.

    ``model``: etcslurm's own GPT of these shapes, trained by the session's default
    builder; or ``None`` with a builder of your own, whose model's shapes are read from
    it at its first build (until then the first layout is ``first_layout``, else pure
    data parallel).  ``optimizer`` is etcslurm's model's; yours is read from it.
    ``staging_bytes`` bounds a round's send + receive staging memory; it shapes the plan
    (message sizes, rounds), so it is run-wide too.
    """

    model: GPTSpec | None = None
    optimizer: str = "adam"
    global_batch: int = 12
    micro_batch: int = 1
    seed: int = 1234
    steps: int = 60
    lr: float = 1e-3
    initial_workers: int = 1
    gpus_per_node: int = 8
    staging_bytes: int = 512 * 2**20
    #: a megatron-core checkpoint every this many steps, written off the training thread
    #: (0: none); when a death leaves state with no holder, the run rolls back to the
    #: latest complete one instead of stopping
    checkpoint_every: int = 0
    checkpoint_keep: int = 2  # complete periodic checkpoints kept
    #: the user's limits on layouts: no world below ``min_world`` devices (fewer wait as
    #: standby) nor above ``max_world`` (the extra ones idle as standbys); ``layouts``:
    #: the allowed ones, each a layout (``tp8pp2dp4``) or fixed sizes (``tp=8``,
    #: ``tp=8,pp=2``), empty: all; ``first_layout``: generation 0's layout
    min_world: int = 1
    max_world: int | None = None
    layouts: tuple[str, ...] = ()
    first_layout: str | None = None
    #: what the recipe fixes and the policy keeps in every layout it picks: ``cp``, the
    #: context-parallel size (sequence split over ``cp`` ranks; needs Transformer
    #: Engine's attention to train), and ``vpp``, the model chunks per pipeline stage
    #: (an interleaved pipeline wherever the layout has pp > 1)
    cp: int = 1
    vpp: int = 1
    #: how activations are recomputed ('none', 'selective', 'full'): the memory estimate
    recompute: str = "selective"
    #: device memory per rank (None: ``torch.cuda.mem_get_info`` on a GPU, no limit on CPU)
    gpu_memory_bytes: int | None = None
    memory_margin: float = DEFAULT_MARGIN  # share of device memory kept free
    #: TensorBoard scalars of the run, written by its rank 0 (None: none; the
    #: ``tensorboard`` extra)
    tensorboard_dir: str | None = None
    #: a megatron-core / Megatron-LM checkpoint to start from (a save directory with
    #: ``latest_checkpointed_iteration.txt``, or one ``iter_NNNNNNN``), saved in any
    #: layout, the distributed optimizer's ``dp_reshardable`` format included; a run that
    #: has a checkpoint of its own (a requeued one) resumes that instead
    load: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layouts", tuple(str(x) for x in self.layouts))
        # every limit checked as the policy reads it (one line each)
        allowed = tuple(LayoutFilter.parse(x) for x in self.layouts)
        LayoutRules(setup=TrainingSetup(optimizer=self.optimizer, micro_batch=self.micro_batch,
                                        global_batch=self.global_batch,
                                        recompute=self.recompute),
                    gpus_per_node=self.gpus_per_node, device_memory_bytes=self.gpu_memory_bytes,
                    memory_margin=self.memory_margin, allowed=allowed,
                    min_world=self.min_world, max_world=self.max_world,
                    cp=self.cp, vpp=self.vpp)
        if self.cp > 1 and self.model is not None:
            raise UsageError(
                f"cp={self.cp}: context parallelism trains only with Transformer Engine's "
                "attention; etcslurm's own model uses megatron-core's local layer spec, "
                "whose attention has none (build a model of your own with a TE spec)")
        if self.load is not None:
            object.__setattr__(self, "load", str(self.load))
        if self.first_layout is not None:
            first = ParallelConfig.parse(self.first_layout)
            object.__setattr__(self, "first_layout", str(first))
            if self.max_world is not None and first.world_size > self.max_world:
                raise UsageError(f"first_layout {first} needs {first.world_size} devices, "
                                 f"above max_world={self.max_world}")
            if allowed and not any(f.allows(first) for f in allowed):
                raise UsageError(f"first_layout {first} is not among the allowed layouts")
            if first.cp != self.cp or (first.pp > 1 and first.vpp != self.vpp):
                raise UsageError(f"first_layout {first} has cp={first.cp}, vpp={first.vpp}; "
                                 f"the run fixes cp={self.cp}, vpp={self.vpp}")

    def to_json(self) -> dict[str, Any]:
        """The run spec stored in the coordinator (JSON)."""
        return {
            "model": self.model.to_json() if self.model is not None else None,
            "optimizer": self.optimizer,
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
            "seed": self.seed,
            "steps": self.steps,
            "lr": self.lr,
            "initial_workers": self.initial_workers,
            "gpus_per_node": self.gpus_per_node,
            "staging_bytes": self.staging_bytes,
            "checkpoint_every": self.checkpoint_every,
            "checkpoint_keep": self.checkpoint_keep,
            "min_world": self.min_world,
            "max_world": self.max_world,
            "layouts": list(self.layouts),
            "first_layout": self.first_layout,
            "cp": self.cp,
            "vpp": self.vpp,
            "recompute": self.recompute,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "memory_margin": self.memory_margin,
            "tensorboard_dir": self.tensorboard_dir,
            "load": self.load,
        }

    @classmethod
    def from_json(cls, spec: dict[str, Any]) -> RunSettings:
        """The settings a run spec read from the coordinator describes."""
        try:
            return cls(
                model=GPTSpec.from_json(spec["model"]) if spec.get("model") else None,
                optimizer=str(spec["optimizer"]),
                global_batch=int(spec["global_batch"]),
                micro_batch=int(spec["micro_batch"]),
                seed=int(spec["seed"]),
                steps=int(spec["steps"]),
                lr=float(spec["lr"]),
                initial_workers=int(spec["initial_workers"]),
                gpus_per_node=int(spec["gpus_per_node"]),
                staging_bytes=int(spec.get("staging_bytes", 512 * 2**20)),
                checkpoint_every=int(spec.get("checkpoint_every", 0)),
                checkpoint_keep=int(spec.get("checkpoint_keep", 2)),
                min_world=int(spec.get("min_world", 1)),
                max_world=_optional_int(spec.get("max_world")),
                layouts=tuple(str(x) for x in spec.get("layouts") or ()),
                first_layout=spec.get("first_layout"),
                cp=int(spec.get("cp", 1)),
                vpp=int(spec.get("vpp", 1)),
                recompute=str(spec.get("recompute", "selective")),
                gpu_memory_bytes=_optional_int(spec.get("gpu_memory_bytes")),
                memory_margin=float(spec.get("memory_margin", DEFAULT_MARGIN)),
                tensorboard_dir=spec.get("tensorboard_dir"),
                load=None if spec.get("load") is None else str(spec["load"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"the run spec in the coordinator is malformed: {exc!r}") from None


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


@functools.cache
def device_memory_bytes() -> int | None:
    """This worker's device memory (``torch.cuda.mem_get_info``'s total), read once per
    process; None without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.mem_get_info()[1])


@dataclass(frozen=True)
class WorkerOptions:
    """This worker's own options (may differ between workers of one run)."""

    run_id: str
    redis_url: str
    password_file: str | None = None
    node: str = field(default_factory=socket.gethostname)
    run_dir: str = "."
    heartbeat_interval: float = 1.0
    dead_after: float = 10.0  # heartbeat TTL: a SIGKILLed worker is noticed within this
    collective_timeout: float = 10.0  # a collective stuck on a dead peer fails after this
    join_timeout: float = 600.0  # how long a joiner waits for a generation to take it
    decide_timeout: float = 120.0  # how long the world waits for the next generation record
    checkpoint_dir: str | None = None  # where a whole-run preemption writes its checkpoint
    signals: tuple[str, ...] = ("USR2", "TERM")
    leave_budget: float = 60.0  # seconds a signalled worker assumes it has, when unknown
    #: one JSON line per step and DP rank: which samples it trained (etcslurm's own model
    #: and ``train_step`` only)
    log_data: bool = True
    min_step_seconds: float = 0.0  # pace steps (demos): joiners get time to arrive


def recovery_window(dead_after: float, collective_timeout: float, notice: float) -> float:
    """How long a survivor of a failure waits for the next generation.

    The one that publishes it may first need to notice the failure itself and then to
    wait for the others to come back from the failed rendezvous, each up to ``notice``
    (``World.notice_seconds``: 5x a group's timeout); it also waits for the dead's
    heartbeat to lapse (``dead_after``, twice for a beat in flight)."""
    return dead_after * 2 + collective_timeout + 2 * notice


def settled_within(dead_after: float, collective_timeout: float, notice: float) -> float:
    """How long a failed change takes to be planned again and entered: a leaver keeps its
    state that long waiting for the commit, the launcher gives the other workers that
    long after one failed."""
    return recovery_window(dead_after, collective_timeout, notice) + collective_timeout + 30


#: ``build(layout)`` → this rank's ``(model chunks, megatron optimizer, LR scheduler or
#: None)`` for a world whose ``parallel_state`` is ready for ``layout`` (your own
#: megatron-core objects; :data:`etcslurm.megatron.adopt.Built`)
Builder = Callable[[ParallelConfig], Any]
