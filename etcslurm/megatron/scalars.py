"""The small replicated state as one JSON document (no pickle).

Why: iteration, consumed samples, Adam's step count, the LR scheduler and the RNG states
are a few hundred bytes: the planner does not plan them; the decider puts this document,
read from its own state, into the generation record (``scalars``), and every new rank
applies it with :func:`restore_scalars` at the commit.
Byte states (RNG) are base64 of the raw bytes.

RNG: the torch generator and megatron's tracker states depend on the TP rank (the
model-parallel tracker is seeded ``seed + 2718 + tp_rank``).  With dropout 0 they do not
affect losses; :func:`restore_scalars` applies them only with ``restore_rng=True`` (use it
when the source had the same TP rank).
"""

from __future__ import annotations

import base64
from typing import Any

import torch

from etcslurm.megatron.adam_state import fix_step_alias
from etcslurm.megatron.model import Trainee

SCALARS_VERSION = 1


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(
        t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    ).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def adam_steps(trainee: Trainee) -> list[float]:
    """Distinct Adam ``step`` values over this rank's params (one value normally)."""
    values = set()
    for mopt in trainee.inner_optimizers():
        for state in mopt.optimizer.state.values():
            step = state.get("step")
            if step is not None:
                values.add(float(step))
    return sorted(values)


def extract_scalars(trainee: Trainee) -> dict[str, Any]:
    """JSON-able replicated state of this rank."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    steps = adam_steps(trainee)
    tracker = get_cuda_rng_tracker()
    return {
        "version": SCALARS_VERSION,
        "iteration": trainee.iteration,
        "consumed_samples": trainee.consumed_samples,
        "seed": trainee.seed,
        "optimizer_kind": trainee.optimizer_kind,
        "adam_step": steps[-1] if steps else 0.0,
        "param_groups": [
            [
                {k: v for k, v in g.items() if k != "params" and _jsonable(v)}
                for g in m.optimizer.param_groups
            ]
            for m in trainee.inner_optimizers()
        ],
        "scheduler": trainee.scheduler.state_dict() if trainee.scheduler is not None else None,
        "rng": {
            "torch": _b64(torch.get_rng_state()),
            "tracker": {name: _b64(state) for name, state in sorted(tracker.get_states().items())},
        },
    }


def _jsonable(value: Any) -> bool:
    return (
        value is None
        or isinstance(value, bool | int | float | str)
        or (isinstance(value, tuple | list) and all(isinstance(x, int | float) for x in value))
    )


def _restore_group_steps(trainee: Trainee, groups: list[list[dict[str, Any]]]) -> None:
    """Each param group's own ``step``, where the source's had one.

    Why: Transformer Engine's and Apex's fused Adam count steps per param group (torch's
    Adam per param, restored above); a group that came without it would start its bias
    correction again at step 1.  The groups of one layout and another are the same list
    (megatron builds them from the same config), so they are matched by position.
    """
    inners = trainee.inner_optimizers()
    if len(groups) != len(inners):
        return
    for mopt, source in zip(inners, groups, strict=True):
        target = mopt.optimizer.param_groups
        if len(source) != len(target):
            raise ValueError(f"{len(source)} optimizer param groups in the source, "
                             f"{len(target)} here")
        for group, old in zip(target, source, strict=True):
            if "step" in old:
                group["step"] = old["step"]


def restore_scalars(trainee: Trainee, scalars: dict[str, Any], restore_rng: bool = False) -> None:
    """Apply :func:`extract_scalars`'s document to a (freshly built, filled) trainee.

    Sets iteration/consumed samples, one fresh ``step`` tensor per Adam state (never
    shared), and the scheduler (which sets lr/weight decay of every param group exactly as
    the old layout computed them).
    """
    if scalars.get("version") != SCALARS_VERSION:
        raise ValueError(f"scalars version {scalars.get('version')!r} is not {SCALARS_VERSION}")
    trainee.iteration = int(scalars["iteration"])
    trainee.consumed_samples = int(scalars["consumed_samples"])
    trainee.seed = int(scalars["seed"])  # the data order is a function of (seed, sample)
    step = float(scalars["adam_step"])
    for mopt in trainee.inner_optimizers():
        for state in mopt.optimizer.state.values():
            if "exp_avg" in state:
                state["step"] = torch.tensor(step, dtype=torch.float32)
    fix_step_alias(trainee.optimizer)
    _restore_group_steps(trainee, scalars.get("param_groups") or [])
    if trainee.scheduler is not None and scalars.get("scheduler") is not None:
        trainee.scheduler.num_steps = 0  # load_state_dict steps forward by num_steps
        trainee.scheduler.load_state_dict(dict(scalars["scheduler"]))
    if restore_rng:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        torch.set_rng_state(_unb64(scalars["rng"]["torch"]))
        get_cuda_rng_tracker().set_states(
            {name: _unb64(s) for name, s in scalars["rng"]["tracker"].items()}
        )
