"""Run megatron-core's CUDA-only code paths on a CPU-only torch build.

Why: megatron-core hard-codes CUDA in a few places that our CPU + gloo tests and
benchmarks reach (``torch.cuda.current_device()``, ``device='cuda'`` factories,
``p.type() == 'torch.cuda.FloatTensor'`` in the optimizers and grad clipping, CUDA RNG
helpers, streams and events).  This module patches exactly those and nothing else, and
only when no CUDA device is present and none was allocated: on a GPU machine
:func:`install_if_needed` does nothing, so the same adapter code runs unchanged with NCCL,
and a GPU job whose torch cannot use its GPUs is refused (:func:`needed`).

Two pieces:

1. ``torch.cuda`` functions: ``current_device() -> 0``; ``synchronize``/``empty_cache``/
   ``set_device`` no-ops; the CUDA RNG functions mapped onto the CPU generator (megatron's
   RNG tracker then tracks CPU generator states); null streams and events.  Not
   ``torch.cuda.manual_seed_all``: ``torch.manual_seed`` calls it (infinite recursion).
2. :class:`CudaToCpuMode`, a ``TorchFunctionMode`` that rewrites ``device='cuda'`` /
   integer devices to CPU, makes ``Tensor.cuda()`` a no-op and makes ``Tensor.type()``
   report ``torch.cuda.*`` (the optimizers branch on it).  A torch function mode is per
   thread: call :func:`install_if_needed` in the main thread of every worker before any
   megatron code runs.  Worker threads that run megatron code need :func:`thread_mode`.

Also, since a CPU machine has neither Apex nor Transformer Engine: the three fixes the
distributed optimizer needs to load checkpoints with torch's Adam
(:func:`_torch_adam_fallback`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from etcslurm.errors import UsageError
from etcslurm.groups.devices import cpu_torch_problem

_CPU = torch.device("cpu")
_MODE: CudaToCpuMode | None = None
#: what :func:`install` patched, for logs and tests
PATCHED: list[str] = []


def _fix_device(device: Any) -> Any:
    """Map a CUDA device (``'cuda'``, ``'cuda:1'``, ``torch.device('cuda')``, ``0``) to CPU."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return _CPU
    if isinstance(device, str):
        return _CPU if device.startswith("cuda") else device
    if isinstance(device, torch.device):
        return _CPU if device.type == "cuda" else device
    return device


class CudaToCpuMode(TorchFunctionMode):
    """Redirect CUDA devices of tensor factories and ``Tensor.to`` to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _fix_device(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if (
            func is torch.Tensor.to
            and len(args) > 1
            and isinstance(args[1], str | int | torch.device)
            and not isinstance(args[1], bool)
        ):
            args = (args[0], _fix_device(args[1]), *args[2:])
        return func(*args, **kwargs)


class _NullEvent:
    """Stands in for ``torch.cuda.Event``: CPU work is already complete when it returns."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _NullStream:
    """Stands in for ``torch.cuda.Stream`` (and the ``torch.cuda.stream`` context)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> _NullEvent:
        return _NullEvent()

    def __enter__(self) -> _NullStream:
        return self

    def __exit__(self, *exc: object) -> bool:
        return False


def needed() -> bool:
    """True when there is no usable CUDA device and none was allocated (then the shim
    must be installed); a job given GPUs that this torch cannot use is refused in one
    line instead of training on the CPU unnoticed (``ETCSLURM_DEVICE=cpu``: on purpose)."""
    if torch.cuda.is_available():
        return False
    problem = cpu_torch_problem(os.environ, False, torch.version.cuda, torch.__version__)
    if problem:
        raise UsageError(problem)
    return True


def installed() -> bool:
    return _MODE is not None


def install() -> list[str]:
    """Install the patches and push the mode in this thread (idempotent)."""
    global _MODE
    if _MODE is not None:
        return PATCHED
    cuda = torch.cuda

    def patch(name: str, value: Any) -> None:
        setattr(cuda, name, value)
        PATCHED.append(f"torch.cuda.{name}")

    patch("current_device", lambda: 0)
    patch("synchronize", lambda *a, **k: None)
    patch("empty_cache", lambda *a, **k: None)
    patch("set_device", lambda *a, **k: None)
    patch("get_rng_state", lambda *a, **k: torch.get_rng_state())
    patch("set_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    patch("manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed)))
    patch("current_stream", lambda *a, **k: _NullStream())
    patch("default_stream", lambda *a, **k: _NullStream())
    patch("stream", lambda *a, **k: _NullStream())
    patch("Stream", _NullStream)
    patch("Event", _NullEvent)
    torch.cuda.random.get_rng_state = cuda.get_rng_state  # megatron's random.py uses it
    PATCHED.append("torch.cuda.random.get_rng_state")

    from megatron.core.tensor_parallel import random as mrandom

    def _get_state(*args: Any, clone: bool = False, **kwargs: Any) -> torch.Tensor:
        state = torch.get_rng_state()
        return state.clone() if clone else state

    mrandom._get_cuda_rng_state = _get_state
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    PATCHED.append("megatron.core.tensor_parallel.random._get/_set_cuda_rng_state")

    _redirect_in_backward()
    _torch_adam_fallback()
    _MODE = CudaToCpuMode()
    _MODE.__enter__()
    PATCHED.append("TorchFunctionMode cuda->cpu (main thread)")
    return PATCHED


def _redirect_in_backward() -> None:
    """Run every custom autograd function's backward under the mode.

    Why: the mode is off while it handles ``torch.autograd.backward`` (torch pops a mode
    while its handler runs), so megatron's autograd functions -- e.g. the MoE
    dispatcher's all-gather, whose backward allocates on ``torch.cuda.current_device()``
    -- would ask for a CUDA device.  megatron-core on CPU must also run without
    Transformer Engine, whose ``te_general_gemm`` the MoE router names at import.
    """
    from torch.autograd import function

    original = function.BackwardCFunction.apply

    def apply(self: Any, *args: Any) -> Any:
        if torch._C._len_torch_function_stack():
            return original(self, *args)
        with CudaToCpuMode():
            return original(self, *args)

    function.BackwardCFunction.apply = apply  # type: ignore[method-assign]
    PATCHED.append("torch.autograd.function.BackwardCFunction.apply (under the mode)")
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        PATCHED.append("megatron.core.transformer.moe.moe_utils.te_general_gemm = None")


def _torch_adam_fallback() -> None:
    """Make megatron's DistributedOptimizer load checkpoints with torch's Adam (no Apex or
    Transformer Engine, so on every CPU machine), as a plain megatron-core loop needs:

    - a fresh optimizer has no state, and its ``state_dict()`` (called to build the
      loading state dict) asserts one ``step``: states are created first (zeros, ``step``
      0 per param, no optimizer step taken);
    - loading ``fully_reshardable`` state raises ``KeyError: 'step'`` (the live state has a
      ``step`` the loaded one lacks): keys missing from the loaded state keep their value;
    - ``load_state_dict`` gives every param ONE shared ``step`` tensor, which Adam then
      increments once per param per step, and a ``dp_reshardable`` load then copies the
      step of the request (the fresh optimizer's) back over it: each param gets its own,
      of the saved param groups' step.
    """
    from megatron.core.optimizer import distrib_optimizer as dopt

    from etcslurm.megatron.distopt_checkpoint import patch_step_keyerror

    cls = dopt.DistributedOptimizer
    if dopt.HAVE_APEX_OR_TE or getattr(cls, "_etcslurm_fallback", False):
        return
    sharded_state_dict, load_state_dict = cls.sharded_state_dict, cls.load_state_dict

    def with_states(self: Any, *args: Any, **kwargs: Any) -> Any:
        inner = self.optimizer
        if not inner.state:
            for group in inner.param_groups:
                for p in group["params"]:
                    inner.state[p].update(exp_avg=torch.zeros_like(p),
                                          exp_avg_sq=torch.zeros_like(p),
                                          step=torch.zeros((), dtype=torch.float32))
        return sharded_state_dict(self, *args, **kwargs)

    def own_steps(self: Any, state_dict: Any) -> Any:
        groups = (state_dict.get("optimizer") or {}).get("param_groups") or []
        steps = {float(g["step"]) for g in groups if "step" in g}
        out = load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if len(steps) == 1:  # the dp_reshardable load copied a stale step back
                state["step"] = torch.tensor(next(iter(steps)), dtype=torch.float32)
            elif torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
        return out

    cls.sharded_state_dict = with_states
    patch_step_keyerror(cls)
    cls.load_state_dict = own_steps
    cls._etcslurm_fallback = True
    PATCHED.append("megatron DistributedOptimizer: torch-Adam fallback load fixes")


def install_if_needed() -> bool:
    """Install the shim when no CUDA GPU is present; returns whether it is active."""
    if installed():
        return True
    if not needed():
        return False
    install()
    return True


@contextlib.contextmanager
def thread_mode() -> Iterator[None]:
    """The cuda→cpu mode for a thread other than the one that installed the shim."""
    if _MODE is None:
        yield
        return
    with CudaToCpuMode():
        yield


def device() -> torch.device:
    """The device training tensors live on: this process's GPU, else the CPU."""
    if installed() or not torch.cuda.is_available():
        return _CPU
    return torch.device("cuda", torch.cuda.current_device())
