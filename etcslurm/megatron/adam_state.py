"""Adam state in megatron-core's optimizers, made explicit where torch's Adam leaves it
implicit: created at build time (migration and checkpoint loading write into it), one
``step`` tensor per param, and loadable on the torch-Adam fallback (no Apex or
Transformer Engine)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from etcslurm.megatron.model import Trainee


def init_optimizer_state(trainee: Trainee) -> None:
    """Create every Adam state tensor (zeros, ``step`` 0 — one tensor PER param).

    Why: torch Adam creates its state lazily at the first step, but migration and
    checkpoint loading write into the state of a freshly built optimizer.  Unlike
    megatron's ``_init_optimizer_states_with_dummy_values`` this runs no optimizer step,
    so weights stay untouched.
    """
    for mopt in trainee.inner_optimizers():
        inner = mopt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
    fix_step_alias(trainee.optimizer)


def fix_step_alias(optimizer: Any) -> int:
    """Give every param its own Adam ``step`` tensor; returns how many were shared.

    Why: DistributedOptimizer.load_state_dict (torch-Adam fallback, no Apex/TE) assigns
    ONE ``step`` tensor to every param; Adam then increments it once per param per step
    and bias correction goes silently wrong (loss off by ~1e-2 after one step).
    """
    shared = 0
    for mopt in getattr(optimizer, "chained_optimizers", [optimizer]):
        by_id: dict[int, list[dict]] = {}
        for state in mopt.optimizer.state.values():
            step = state.get("step")
            if torch.is_tensor(step):
                by_id.setdefault(id(step), []).append(state)
        for states in by_id.values():
            if len(states) > 1:
                shared += len(states)
                for state in states:
                    state["step"] = state["step"].clone()
    return shared
