"""Everything besides tensor values that shapes a rank's next optimizer update, and a
per-element comparison of two ranks' states.

Why: equal tensors right after a migration do not make equal training.  What else the
next step reads lives in attributes and structures no state dict holds: each param's
tensor-parallel marks (the gradient norm counts a weight that is not marked on TP rank 0
only), the DDP buffers' layout (which gradients are reduced together, in what order),
the optimizer's param groups (learning rate, weight decay, their multipliers), Adam's
step per param, the scheduler, the data position.  :func:`update_signature` is that, as
JSON, so two models can be compared field by field; :func:`compare_states` compares
their tensors element by element (after a step too: gradients included), so a
difference that only shows once the model trains cannot hide behind equal losses.
"""

from __future__ import annotations

from typing import Any

import torch

#: per-parameter attributes that are training state of their own, not marks
_RUNTIME_ATTRS = frozenset({"main_grad", "grad_added_to_main_grad", "_base", "grad"})


def _plain(value: Any) -> Any:
    """``value`` as JSON when it is a plain value (else ``None``: not compared)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple | list) and all(isinstance(x, bool | int | float | str)
                                               for x in value):
        return list(value)
    if isinstance(value, torch.dtype):
        return str(value)
    return None


def _marks(p: torch.Tensor) -> dict[str, Any]:
    """The plain attributes megatron set on ``p`` (tensor-parallel marks, sharing, ...)."""
    out = {}
    for name, value in sorted(vars(p).items()):
        if name in _RUNTIME_ATTRS or name.startswith("__"):
            continue
        plain = _plain(value)
        if plain is not None:
            out[name] = plain
    return out


def _counts_for_grad_norm(p: torch.Tensor) -> bool:
    """Whether megatron's gradient norm counts ``p`` on this rank (its own rule)."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.module import param_is_not_shared

    return bool(param_is_not_shared(p)
                and tensor_parallel.param_is_not_tensor_parallel_duplicate(p))


def _names(trainee: Any) -> dict[int, str]:
    out = {}
    for i, chunk in enumerate(trainee.model):
        for name, p in getattr(chunk, "module", chunk).named_parameters():
            out[id(p)] = f"{i}.{name}"
    return out


def _buffers(chunk: Any, names: dict[int, str]) -> list[dict[str, Any]]:
    """The DDP wrapper's gradient buffers: dtypes, size, buckets, where each param sits."""
    out = []
    for kind in ("buffers", "expert_parallel_buffers"):
        for buf in getattr(chunk, kind, None) or []:
            index = getattr(buf, "param_index_map", {})
            out.append({
                "kind": kind,
                "param_dtype": str(getattr(buf, "param_dtype", None)),
                "grad_dtype": str(getattr(buf, "grad_dtype", None)),
                "numel": int(getattr(buf, "numel", 0)),
                "buckets": [[int(b.offset), int(b.offset + b.grad_data.numel())]
                            for b in getattr(buf, "buckets", [])],
                "params": sorted([names.get(id(p), "?"), *map(int, where[:2]), int(where[2])]
                                 for p, where in index.items()),
            })
    return out


def update_signature(trainee: Any) -> dict[str, Any]:
    """This rank's update-shaping structure as JSON (see the module docstring)."""
    names = _names(trainee)
    params = {}
    for i, chunk in enumerate(trainee.model):
        for name, p in getattr(chunk, "module", chunk).named_parameters():
            params[f"{i}.{name}"] = {"shape": list(p.shape), "dtype": str(p.dtype),
                                     "requires_grad": bool(p.requires_grad),
                                     "grad_norm": _counts_for_grad_norm(p), **_marks(p)}
    optimizers = []
    for mopt in getattr(trainee.optimizer, "chained_optimizers", [trainee.optimizer]):
        inner = mopt.optimizer
        # torch's Adam counts steps per param (compared below) and ignores a group's
        # ``step``, which megatron's checkpoint loading sets for it; fused Adams count
        # them per group
        ignored = {"params", "step"} if isinstance(inner, torch.optim.Adam) else {"params"}
        groups = []
        for group in inner.param_groups:
            groups.append({
                "hyper": {k: _plain(v) for k, v in sorted(group.items())
                          if k not in ignored and _plain(v) is not None},
                "params": [[list(p.shape), str(p.dtype),
                            sorted(k for k in inner.state.get(p, {})),
                            float(inner.state.get(p, {}).get("step", -1))]
                           for p in group["params"]],
            })
        optimizers.append({
            "groups": groups,
            "grad_norm": [_counts_for_grad_norm(p) for p in mopt.get_parameters()],
        })
    scheduler = trainee.scheduler.state_dict() if trainee.scheduler is not None else None
    return {
        "params": params,
        "buffers": [_buffers(chunk, names) for chunk in trainee.model],
        "optimizers": optimizers,
        "scheduler": {k: _plain(v) for k, v in sorted((scheduler or {}).items())},
        "iteration": int(trainee.iteration),
        "consumed_samples": int(trainee.consumed_samples),
    }


def signature_differences(a: Any, b: Any, path: str = "", limit: int = 5) -> list[str]:
    """Where two signatures differ (at most ``limit`` paths, with both values)."""
    out: list[str] = []

    def walk(x: Any, y: Any, where: str) -> None:
        if len(out) >= limit:
            return
        if isinstance(x, dict) and isinstance(y, dict):
            for key in sorted(set(x) | set(y), key=str):
                walk(x.get(key, "<absent>"), y.get(key, "<absent>"), f"{where}.{key}")
        elif isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
            for i, (u, v) in enumerate(zip(x, y, strict=True)):
                walk(u, v, f"{where}[{i}]")
        elif x != y:
            out.append(f"{where.lstrip('.')}: {x!r} != {y!r}")

    walk(a, b, path)
    return out


def tensors(trainee: Any) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of this rank that the next step reads or the last one wrote: the
    migrated state (params, fp32 main params, Adam moments; by piece) and the gradient
    buffers (what the last backward left there)."""
    from etcslurm.megatron.sharded_meta import local_state

    out = [(f"{p.key}{list(p.box)}", v) for p, v in local_state(trainee).items()]
    for i, chunk in enumerate(trainee.model):
        for kind in ("buffers", "expert_parallel_buffers"):
            for j, buf in enumerate(getattr(chunk, kind, None) or []):
                out.append((f"grad.{i}.{kind}.{j}", buf.grad_data))
    return out


def _kind(name: str) -> str:
    if name.startswith("grad."):
        return "grad"
    for kind in ("exp_avg_sq", "exp_avg", "fp32_param"):
        if f".{kind}." in name or name.startswith(f"optimizer.state.{kind}"):
            return kind
    return "param"


def compare_states(a: list[tuple[str, torch.Tensor]],
                   b: list[tuple[str, torch.Tensor]]) -> dict[str, dict[str, Any]]:
    """Per kind (param, fp32_param, exp_avg, exp_avg_sq, grad): tensors, elements, how
    many differ bit for bit and the largest absolute difference."""
    by_name = dict(b)
    out: dict[str, dict[str, Any]] = {}
    for name, x in a:
        row = out.setdefault(_kind(name), {"tensors": 0, "elements": 0, "tensors_differ": 0,
                                           "elements_differ": 0, "max_abs_diff": 0.0})
        row["tensors"] += 1
        row["elements"] += x.numel()
        y = by_name.get(name)
        if y is None or y.shape != x.shape or y.dtype != x.dtype:
            row["tensors_differ"] += 1
            row["elements_differ"] += x.numel()
            row["max_abs_diff"] = float("inf")
            continue
        xb, yb = x.detach().contiguous(), y.detach().contiguous()
        differ = xb.view(torch.uint8).view(-1) != yb.view(torch.uint8).view(-1)
        if bool(differ.any()):
            row["tensors_differ"] += 1
            elements = int((xb.view(-1) != yb.view(-1)).sum())
            row["elements_differ"] += elements
            diff = float((xb.double() - yb.double()).abs().max())
            row["max_abs_diff"] = max(row["max_abs_diff"], diff)
    missing = set(by_name) - {name for name, _ in a}
    if missing:
        out.setdefault("absent", {"tensors": len(missing)})
    return out


def states_equal(table: dict[str, dict[str, Any]]) -> bool:
    """Whether :func:`compare_states` found nothing that differs."""
    return all(row.get("tensors_differ", 1) == 0 for kind, row in table.items()
               if kind != "absent") and "absent" not in table
