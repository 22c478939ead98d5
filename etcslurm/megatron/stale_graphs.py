"""Cut the autograd graphs a model keeps from its last forward pass.

Why: megatron-core's MoE token dispatchers keep tensors of the last forward as plain
attributes (the all-gather dispatcher's ``local_probs``, the all-to-all one's ``probs``).
Their autograd graph leads to the parameters' ``AccumulateGrad`` nodes, whose hooks hold
the DDP wrapper, which holds the model and its dispatchers: a cycle through C++ objects
that Python's garbage collector cannot see.  A model given up at a resize then never goes,
and neither do the process groups its modules refer to (measured on CPU: 32 gloo groups,
about 90 OS threads, for every MoE model with EP > 1 built and dropped).

Detaching keeps every value (the next forward reassigns them anyway) and drops only the
graph, so it is safe on a model that trains on as well as on one about to be dropped.
Every model etcslurm builds is watched (weakly) and cut whenever the process groups are
torn down: a model of the old world is then either kept (and its next forward builds a
new graph) or about to be given up.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["cut_stale_graphs", "cut_watched", "watch"]

#: the model chunks built in this process and still alive (weakly: watching frees nothing)
_WATCHED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def watch(chunks: Iterable[torch.nn.Module]) -> None:
    """Have :func:`cut_watched` cut ``chunks``' graphs (for as long as they live)."""
    _WATCHED.update(chunks)


def cut_watched() -> int:
    """:func:`cut_stale_graphs` on every watched chunk still alive."""
    return cut_stale_graphs(list(_WATCHED))


def cut_stale_graphs(chunks: Iterable[torch.nn.Module]) -> int:
    """Detach every graph-carrying tensor held as an attribute of ``chunks``' modules (or
    of the megatron helper objects they own); how many were cut."""
    cut = 0
    for chunk in chunks:
        for module in chunk.modules():
            for owner in (module, *_helpers(module)):
                for name, value in list(vars(owner).items()):
                    if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                        object.__setattr__(owner, name, value.detach())
                        cut += 1
    return cut


def _helpers(module: torch.nn.Module) -> Iterator[Any]:
    """The plain (non-module) megatron objects ``module`` owns, such as a token dispatcher."""
    for value in vars(module).values():
        kind = type(value)
        if (kind.__module__.startswith("megatron.") and hasattr(value, "__dict__")
                and not isinstance(value, (torch.nn.Module, torch.Tensor))):
            yield value
