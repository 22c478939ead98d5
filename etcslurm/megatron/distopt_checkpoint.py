"""Two corrections to megatron-core's distributed optimizer on the ``fully_reshardable``
checkpoint path, applied once per process before a save or load.

- **Saved state read from the wrong offsets.**  ``sharded_param_state_fully_reshardable``
  slices each param's state out of ``get_parameter_state_dp_zero``'s world tensors with
  ``param_index_map`` offsets, which count the padding at the end of every bucket, while
  the world tensors have that padding stripped.  With more than one bucket whose end is
  padded (a pipeline stage with a tied embedding always has a bucket of its own; a
  1-layer stage of gpt-tiny pads its first bucket by 64 elements) every param past the
  first bucket is saved shifted: the embedding's main params and Adam moments silently
  wrong, while the model weights (saved apart) stay right.  Fixed upstream (``cumulative_padding_stripped``,
  megatron-core 0.20); for earlier versions the world tensors are handed to that function
  with the padding put back, so its offsets land where they point.
- **``KeyError: 'step'`` on the torch-Adam fallback.**  ``_set_main_param_and_optimizer_states``
  iterates the live Adam state (which has ``step``) while the loaded dict has none; keys
  missing from the source keep their live value (the scalars restore ``step`` afterwards).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

#: the first megatron-core release whose fully_reshardable save rebases the offsets itself
_OFFSETS_FIXED_IN = (0, 20)

_PATCHED = False


def patch_distributed_optimizer_checkpointing() -> None:
    """Apply both corrections (idempotent)."""
    global _PATCHED
    if _PATCHED:
        return
    from megatron.core.optimizer import distrib_optimizer as dopt

    patch_step_keyerror(dopt.DistributedOptimizer)
    if _megatron_version() < _OFFSETS_FIXED_IN:
        _patch_bucket_padding(dopt.DistributedOptimizer)
    _PATCHED = True


def _megatron_version() -> tuple[int, int]:
    from megatron.core import package_info

    return int(package_info.MAJOR), int(package_info.MINOR)


def patch_step_keyerror(cls: Any) -> None:
    """Keys missing from a loaded state keep their live value (once per class: the CPU
    shim's torch-Adam fallback applies it too)."""
    if getattr(cls, "_etcslurm_keeps_missing_keys", False):
        return
    original = cls._set_main_param_and_optimizer_states

    def patched(self: Any, model_param: Any, tensors: dict) -> Any:
        gi, go = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[gi]["params"][go]
        merged = dict(tensors)
        for key, value in self.optimizer.state.get(main_param, {}).items():
            if key not in merged and torch.is_tensor(value):
                merged[key] = value.clone()
        return original(self, model_param, merged)

    cls._set_main_param_and_optimizer_states = patched
    cls._etcslurm_keeps_missing_keys = True


def _patch_bucket_padding(cls: Any) -> None:
    original = cls.sharded_param_state_fully_reshardable

    def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _world_tensors_in_buffer_layout(self):
            return original(self, *args, **kwargs)

    cls.sharded_param_state_fully_reshardable = patched


@contextmanager
def _world_tensors_in_buffer_layout(optimizer: Any) -> Iterator[None]:
    """While the body runs, ``optimizer.get_parameter_state_dp_zero`` returns each world
    tensor laid out as the grad buffer is (bucket ``b`` at ``bucket.offset``, zeros in
    the padding), the layout ``param_index_map`` offsets index."""
    gather = optimizer.get_parameter_state_dp_zero

    def in_buffer_layout(*args: Any, **kwargs: Any) -> Any:
        state = gather(*args, **kwargs)
        if state is None:
            return None
        for gbuf_idx, buffer in enumerate(optimizer.buffers):
            for world_tensors in state[gbuf_idx].values():
                for key, flat in list(world_tensors.items()):
                    if torch.is_tensor(flat):
                        world_tensors[key] = _with_padding(flat, buffer)
        return state

    own = optimizer.__dict__.get("get_parameter_state_dp_zero")
    optimizer.get_parameter_state_dp_zero = in_buffer_layout
    try:
        yield
    finally:
        if own is None:
            del optimizer.get_parameter_state_dp_zero  # back to the class's method
        else:
            optimizer.get_parameter_state_dp_zero = own


def _with_padding(flat: torch.Tensor, buffer: Any) -> torch.Tensor:
    """``flat`` (the buckets back to back, end padding stripped) spread out to the buffer's
    layout."""
    out = torch.zeros(buffer.numel, dtype=flat.dtype, device=flat.device)
    start = 0
    for bucket in buffer.buckets:
        n = bucket.numel_unpadded
        out[bucket.offset:bucket.offset + n].copy_(flat[start:start + n])
        start += n
    return out
