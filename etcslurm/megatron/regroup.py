"""Keep a model across a data-parallel-only resize: new groups, same parameters.

Why: when only the data-parallel degree changes (same TP, PP and EP sizes, and this rank
keeps its TP/PP/expert coordinate) with the plain (replicated) optimizer, no parameter
and no Adam moment changes place.  Rebuilding the ``GPTModel`` then only re-creates what
the process already holds (and touches fresh memory, which dominated the build on the
CPU machines).  What does depend on the world is small: the process groups the modules
keep, megatron's DDP wrapper (its buckets, its gradient scaling ``1/dp``, its grad hooks)
and the megatron optimizer (which keeps the DDP buffers and the DP group for its
gradient-norm all-reduce).  So a kept model is

1. ``snapshot()`` of megatron's groups (by their ``parallel_state`` names) and of the
   default group, taken while the old world still exists;
2. the new world and megatron's groups formed as for a rebuild;
3. :func:`rewrap`: every process-group reference inside the ``GPTModel`` (attributes of
   its modules, their ``pg_collection``s, lists of groups) is pointed at the new group
   of the same name (a reference to a group the map does not know refuses the keep: a
   stale group would only fail at the next collective); the old DDP's gradient hooks are
   dropped (they would add every gradient a second time into the new buffers); a new
   DDP, optimizer and scheduler are built around the same module
   (:func:`etcslurm.megatron.model.wrap_gpt`), and each parameter's Adam state (and,
   with bf16, its fp32 main copy) is handed to the new optimizer.  Tensors stay valid
   after a teardown (only communicators go), so nothing is copied except the bf16 main
   copies.

The old trainee stays readable (its module *is* the new one's, its optimizer state is
shared, nothing is written to either) until the resize commits, so a change that fails
can still be planned again from it.  The distributed optimizer is not kept here: its
shards are cut along DP, so they change with every DP change and must be moved.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from etcslurm.core.layout import ParallelConfig
from etcslurm.errors import MigrationError


class RegroupError(MigrationError):
    """The model cannot be kept (its structure or its groups are not what a DP-only
    change allows); the caller builds a new one instead."""


@dataclass
class GroupSnapshot:
    """megatron-core's groups of one world by ``parallel_state`` name, plus its default
    group: what :func:`rewrap` maps the model's group references from."""

    named: dict[str, Any] = field(default_factory=dict)
    default: Any = None


def can_keep(old: tuple[ParallelConfig, int], new: tuple[ParallelConfig, int],
             optimizer_kind: str) -> bool:
    """Whether a rank of ``old`` that becomes ``new`` keeps every parameter in place.

    Same TP, PP, EP and expert TP sizes, the same TP and PP coordinate (and expert shard
    and slice), and the replicated optimizer (the distributed one's shards follow the DP
    rank).
    """
    (a, ra), (b, rb) = old, new
    if optimizer_kind != "adam":
        return False
    if (a.tp, a.pp, a.ep, a.expert_tp) != (b.tp, b.pp, b.ep, b.expert_tp):
        return False
    ca, cb = a.coord(ra), b.coord(rb)
    if (ca.tp, ca.pp) != (cb.tp, cb.pp):
        return False
    ea, eb = a.expert_coord(ra), b.expert_coord(rb)
    return a.ep == 1 or (ea.ep, ea.etp) == (eb.ep, eb.etp)


def _is_group(value: Any) -> bool:
    return isinstance(value, dist.ProcessGroup)


def snapshot() -> GroupSnapshot:
    """The current world's groups (call before its teardown)."""
    from megatron.core import parallel_state

    snap = GroupSnapshot()
    for name, value in vars(parallel_state).items():
        if not (name.startswith("_") and "GROUP" in name and value):
            continue
        if _is_group(value) or (isinstance(value, (list, tuple)) and all(map(_is_group, value))):
            snap.named[name] = value
    if dist.is_initialized():
        snap.default = dist.distributed_c10d._get_default_group()
    return snap


def group_map(old: GroupSnapshot, new: GroupSnapshot) -> dict[int, Any]:
    """id(old group) → the new world's group of the same ``parallel_state`` name.

    megatron may store one group object under several names (e.g. the data-parallel
    group with and without CP when CP is 1); the new groups of those names must then
    hold the same ranks, else the old reference is ambiguous and the keep is refused.
    """
    mapping: dict[int, Any] = {}
    if old.default is not None and new.default is not None:
        mapping[id(old.default)] = new.default
    for name, before in old.named.items():
        after = new.named.get(name)
        pairs: list[tuple[Any, Any]]
        if _is_group(before):
            if not _is_group(after):
                raise RegroupError(f"group {name} has no counterpart in the new world")
            pairs = [(before, after)]
        else:
            if not isinstance(after, (list, tuple)) or len(after) != len(before):
                raise RegroupError(f"group list {name} changed shape in the new world")
            pairs = list(zip(before, after, strict=True))
        for b, a in pairs:
            known = mapping.get(id(b))
            if known is not None and known is not a and _ranks(known) != _ranks(a):
                raise RegroupError(f"group {name}: one old group maps to two different new ones")
            mapping.setdefault(id(b), a)
    return mapping


def _ranks(group: Any) -> list[int]:
    try:
        return list(dist.get_process_group_ranks(group))
    except (ValueError, RuntimeError):
        return []


def _objects(module: torch.nn.Module) -> Iterator[tuple[Any, str, Any]]:
    """(owner, attribute, value) of every attribute of every submodule, and of the plain
    objects they keep (``pg_collection``, configs), one level down."""
    skip = {"_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks",
            "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
            "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
            "_state_dict_pre_hooks", "_non_persistent_buffers_set",
            "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
            "_forward_pre_hooks_with_kwargs"}
    seen: set[int] = set()
    for sub in module.modules():
        for name, value in list(vars(sub).items()):
            if name in skip:
                continue
            yield sub, name, value
            if (not _is_group(value) and hasattr(value, "__dict__")
                    and not isinstance(value, (torch.nn.Module, torch.Tensor, type))
                    and not callable(value) and id(value) not in seen):
                seen.add(id(value))
                for inner, ivalue in list(vars(value).items()):
                    yield value, inner, ivalue


def rebind_groups(module: torch.nn.Module, mapping: dict[int, Any],
                  live: set[int]) -> int:
    """Point every group reference in ``module`` at its new group; returns how many.

    ``live``: ids of the new world's groups.  A group reference that is neither mapped nor
    live (kept from a world the map does not describe) raises :class:`RegroupError`.
    """
    changed = 0

    def swap(value: Any, where: str) -> Any:
        if id(value) in mapping:
            return mapping[id(value)]
        if id(value) in live:
            return value
        raise RegroupError(f"{where} keeps a process group of an unknown world")

    for owner, name, value in _objects(module):
        where = f"{type(owner).__name__}.{name}"
        if _is_group(value):
            new = swap(value, where)
            if new is not value:
                setattr(owner, name, new)
                changed += 1
        elif isinstance(value, list) and value and all(map(_is_group, value)):
            for i, item in enumerate(value):
                new = swap(item, f"{where}[{i}]")
                if new is not item:
                    value[i] = new
                    changed += 1
        elif isinstance(value, tuple) and value and all(map(_is_group, value)):
            swapped = tuple(swap(item, f"{where}[{i}]") for i, item in enumerate(value))
            if any(a is not b for a, b in zip(swapped, value, strict=True)):
                setattr(owner, name, swapped)
                changed += 1
    return changed


def drop_grad_hooks(ddp: Any) -> None:
    """Release the old DDP wrapper's gradient-accumulation hooks.

    Why: megatron's DDP registers a hook on each parameter's ``AccumulateGrad`` node and
    keeps the nodes alive in ``grad_accs`` (no handle to remove them).  Once that list is
    dropped (and no autograd graph holds them) the nodes go, and the next backward
    creates fresh ones that carry only the new wrapper's hooks; else every gradient would
    be added twice into the new wrapper's buffers.
    """
    accs = getattr(ddp, "grad_accs", None)
    if accs is not None:
        accs.clear()
    for param in ddp.module.parameters():
        param.grad = None
        if hasattr(param, "main_grad"):
            param.main_grad = None


def live_groups(snap: GroupSnapshot) -> set[int]:
    """ids of every group of ``snap`` (the new world's)."""
    ids = {id(snap.default)} if snap.default is not None else set()
    for value in snap.named.values():
        for group in ([value] if _is_group(value) else value):
            ids.add(id(group))
    return ids


def hand_over_optimizer(old: Any, new: Any) -> None:
    """Give ``new`` (a freshly built megatron optimizer over the same params) the state
    of ``old``: each param's Adam state dict is shared, and an fp32 main copy (bf16/fp16
    params) is copied bit for bit.  The param groups must match one to one in count,
    shape and dtype, else :class:`RegroupError`."""
    olds = list(getattr(old, "chained_optimizers", [old]))
    news = list(getattr(new, "chained_optimizers", [new]))
    if len(olds) != len(news):
        raise RegroupError(f"{len(olds)} optimizers before, {len(news)} after")
    with torch.no_grad():
        for o, n in zip(olds, news, strict=True):
            oi, ni = o.optimizer, n.optimizer
            if len(oi.param_groups) != len(ni.param_groups):
                raise RegroupError("the optimizer's param groups changed")
            for og, ng in zip(oi.param_groups, ni.param_groups, strict=True):
                if len(og["params"]) != len(ng["params"]):
                    raise RegroupError("a param group changed its size")
                for op, np_ in zip(og["params"], ng["params"], strict=True):
                    if op.shape != np_.shape or op.dtype != np_.dtype:
                        raise RegroupError(
                            f"param {tuple(op.shape)} {op.dtype} became "
                            f"{tuple(np_.shape)} {np_.dtype}")
                    if op is not np_:
                        np_.copy_(op)
                    state = oi.state.get(op)
                    if state:
                        ni.state[np_] = dict(state)


def rewrap(old: Any, before: GroupSnapshot, layout: ParallelConfig) -> Any:
    """A trainee for ``layout`` around ``old``'s module, in the current (new) world.

    ``before``: :func:`snapshot` of the world ``old`` was built in.  Megatron's groups
    for ``layout`` must exist already.  Raises :class:`RegroupError` (nothing changed
    that a rebuild would not replace) when the model cannot be kept.
    """
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from etcslurm.megatron.model import wrap_gpt

    if len(old.model) != 1:
        raise RegroupError("more than one model chunk (virtual pipeline)")
    gpt = old.modules()[0]
    after = snapshot()
    mapping = group_map(before, after)
    rebind_groups(gpt, mapping, live_groups(after))
    drop_grad_hooks(old.model[0])
    # the same RNG seeding a build does, so a kept model and a rebuilt one are the same
    torch.manual_seed(old.seed)
    model_parallel_cuda_manual_seed(old.seed)
    trainee = wrap_gpt(gpt, gpt.config, old.spec, layout, old.optimizer_kind, old.seed,
                       old.dtype, old.hyper, init_state=False)
    hand_over_optimizer(old.optimizer, trainee.optimizer)
    from etcslurm.megatron.adam_state import init_optimizer_state

    init_optimizer_state(trainee)  # a param without state (none after a step) gets zeros
    trainee.iteration, trainee.consumed_samples = old.iteration, old.consumed_samples
    return trainee
