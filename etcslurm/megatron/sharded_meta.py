"""Live megatron-core state → ``core.state.Piece`` + tensor views of the live storage.

Why: the planner reasons about pieces of global tensors; the transfer executor reads the
pieces it sends from, and writes the pieces it receives into, the *live* tensors of the
model and optimizer.  Each view returned here has the piece's box shape and aliases the
storage of a model parameter or of an Adam state tensor, so writing into it changes the
model/optimizer without any later "load" step.

Where the metadata comes from:
- model parameters: ``model.sharded_state_dict()`` (megatron's ``ShardedTensor``: key,
  global offset, prepended layer axis; tied output weights on the last stage come back as
  replicas of ``embedding.word_embeddings.weight``).  ``ShardedTensor.data`` is the
  ``Parameter`` itself (megatron's own optimizer mapping relies on that too).
- optimizer state: read from the optimizer's own structures, not from
  ``optimizer.sharded_state_dict()`` (which for the distributed optimizer gathers on DP
  rank 0 or, in ``fully_sharded_model_space``, fails on CPU).  Plain Adam holds full
  tensors shaped like the param; the distributed optimizer holds a flat shard
  ``[start, end)`` of every param (``_get_model_param_range_map(p)["param"]``), decomposed
  with :func:`etcslurm.core.state.flat_range_boxes` into boxes, each a contiguous slice of
  the flat shard.  Keys follow megatron's optimizer naming:
  ``optimizer.state.{exp_avg|exp_avg_sq|fp32_param}.{param key}``.  ``fp32_param`` exists
  only when params are not fp32 (with fp32 params the optimizer updates the model params
  themselves).  Adam's per-param ``step`` is a scalar (see ``scalars.py``).

Duplicates on one rank (the same key and box reached twice) keep the first one met in
megatron's deterministic traversal order; the result is sorted by piece.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from etcslurm.core.state import Box, Piece, flat_range_boxes, total_bytes
from etcslurm.errors import MigrationError
from etcslurm.megatron.model import Trainee

#: Adam state tensors migrated per param (``step`` is a scalar, restored separately)
ADAM_STATES = ("exp_avg", "exp_avg_sq")


#: the prefix of every optimizer-state key (``optimizer.state.exp_avg.<param key>``)
OPTIMIZER_PREFIX = "optimizer."


def is_weight(piece: Piece) -> bool:
    """Whether ``piece`` is part of a model parameter (not optimizer state)."""
    return not piece.key.startswith(OPTIMIZER_PREFIX)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ParamMeta:
    """Where one local model parameter sits in its global tensor(s).

    ``parts``: ``(key, box, offset)`` for every checkpointed piece of the local tensor,
    ``offset`` being the piece's first element in the tensor's flat (contiguous) storage.
    An ordinary tensor is one part at offset 0; a SwiGLU ``linear_fc1`` (megatron's
    ``ShardedTensorFactory``) is two: the gate half and the up half, each a contiguous half
    of the local rows, at different rows of the global tensor.
    """

    key: str
    box: Box
    param: torch.Tensor
    parts: tuple[tuple[str, Box, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.parts:
            object.__setattr__(self, "parts", ((self.key, self.box, 0),))

    def ranges(self, start: int, stop: int) -> list[tuple[str, Box, int]]:
        """``(key, box, offset)`` of the flat element range ``[start, stop)`` of the local
        tensor, ``offset`` counted from ``start``."""
        out: list[tuple[str, Box, int]] = []
        for key, box, off in self.parts:
            n = _numel(box)
            lo, hi = max(start, off), min(stop, off + n)
            if hi <= lo:
                continue
            pos = lo - start
            for sub in flat_range_boxes(box, lo - off, hi - off):
                out.append((key, sub, pos))
                pos += _numel(sub)
        return out


@dataclass
class LocalState:
    """Everything one rank holds: pieces and, index for index, views of live storage."""

    pieces: list[Piece]
    views: list[torch.Tensor]

    def __post_init__(self) -> None:
        self._index = {p: i for i, p in enumerate(self.pieces)}

    def __len__(self) -> int:
        return len(self.pieces)

    def items(self) -> list[tuple[Piece, torch.Tensor]]:
        return list(zip(self.pieces, self.views, strict=True))

    def view(self, piece: Piece) -> torch.Tensor:
        """The view of exactly this held piece (KeyError otherwise)."""
        return self.views[self._index[piece]]

    @property
    def nbytes(self) -> int:
        return total_bytes(self.pieces)

    def keys(self) -> list[str]:
        return sorted({p.key for p in self.pieces})


def _numel(box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def _box_of(sh: Any) -> Box:
    if sh.flattened_range is not None:
        raise MigrationError(
            f"cannot describe tensor {sh.key}: flattened ShardedTensor (model tensors are "
            "expected whole)"
        )
    shape = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    return tuple((int(o), int(o) + int(n)) for o, n in zip(sh.global_offset, shape, strict=True))


def _flat_offset(part: torch.Tensor, whole: torch.Tensor, key: str) -> int:
    """Element offset of ``part`` (a contiguous view) inside contiguous ``whole``."""
    size = whole.element_size()
    delta = part.data_ptr() - whole.data_ptr()
    if (not part.is_contiguous() or not whole.is_contiguous() or part.dtype != whole.dtype
            or delta % size or delta < 0 or delta // size + part.numel() > whole.numel()):
        raise MigrationError(
            f"cannot describe tensor {key}: a ShardedTensorFactory piece is not a contiguous "
            "slice of its tensor"
        )
    return delta // size


def _factory_parts(factory: Any) -> list[tuple[str, Box, int]]:
    """Apply a ``ShardedTensorFactory`` (megatron builds its checkpoint pieces from it) and
    locate every piece in the factory's tensor."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    built = factory.build_fn(factory.key, factory.data, factory.replica_id,
                             factory.flattened_range)
    parts = []
    for sub in nested_values(built):
        if not isinstance(sub, ShardedTensor):
            raise MigrationError(
                f"cannot describe tensor {factory.key}: its ShardedTensorFactory builds a "
                f"{type(sub).__name__}"
            )
        parts.append((sub.key, _box_of(sub), _flat_offset(sub.data, factory.data, sub.key)))
    parts.sort(key=lambda p: p[2])
    covered = 0
    for _key, box, off in parts:
        if off != covered:
            break
        covered += _numel(box)
    if covered != factory.data.numel():
        raise MigrationError(
            f"cannot describe tensor {factory.key}: its ShardedTensorFactory pieces do not "
            "tile the tensor"
        )
    return parts


def param_metas(trainee: Trainee) -> dict[int, ParamMeta]:
    """``id(param)`` → keys and global boxes of every local model parameter.

    Reads ``sharded_state_dict()`` of every unwrapped model chunk; ``ShardedTensorFactory``
    entries (SwiGLU ``linear_fc1``) are applied, never skipped.  Raises
    :class:`MigrationError` (one line, naming the first such tensor) when a trainable
    parameter has no checkpoint metadata or a factory cannot be located in its tensor.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    metas: dict[int, ParamMeta] = {}
    for chunk in trainee.modules():
        for value in nested_values(chunk.sharded_state_dict()):
            if isinstance(value, ShardedTensorFactory):
                data = value.data
                parts = tuple(_factory_parts(value))
                meta = ParamMeta(parts[0][0], parts[0][1], data, parts)
            elif isinstance(value, ShardedTensor):
                if value.data is None:
                    continue
                data = value.data
                meta = ParamMeta(value.key, _box_of(value), data)
            else:
                continue
            if id(data) not in metas:
                metas[id(data)] = meta
        for name, param in chunk.named_parameters():
            if param.requires_grad and id(param) not in metas:
                raise MigrationError(
                    f"cannot describe tensor {name}: it is not in the model's "
                    "sharded_state_dict()"
                )
    return metas


def check_describable(trainee: Trainee) -> None:
    """Raise :class:`MigrationError` naming the first tensor etcslurm cannot describe.

    The runtime calls this at session start (before the first step): it reads the model's
    ``sharded_state_dict()`` and the optimizer's structures exactly as a migration would.
    """
    local_state(trainee)


def _box_view(flat: torch.Tensor, box: Box, offset: int) -> torch.Tensor:
    """The slice of a contiguous 1-D tensor holding ``box`` (flattened) from ``offset``."""
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return flat[offset : offset + n].view(tuple(hi - lo for lo, hi in box))


def local_state(trainee: Trainee) -> LocalState:
    """All pieces this rank holds, with views aliasing the live model/optimizer storage.

    Needs the layout's ``parallel_state`` (call before tearing the layout down; the views
    stay valid afterwards).
    """
    metas = param_metas(trainee)
    found: dict[tuple[str, Box], tuple[Piece, torch.Tensor]] = {}

    def add(key: str, box: Box, view: torch.Tensor) -> None:
        piece = Piece(key, box, dtype_name(view.dtype))
        if (key, box) in found:
            return
        if tuple(view.shape) != piece.shape:
            raise AssertionError(f"{key} {box}: view shape {tuple(view.shape)} != box")
        found[(key, box)] = (piece, view)

    for meta in metas.values():
        flat = meta.param.data.view(-1)
        for key, box, off in meta.parts:
            add(key, box, _box_view(flat, box, off))
    for mopt in trainee.inner_optimizers():
        if trainee.distributed:
            _distributed_pieces(mopt, metas, add)
        else:
            _plain_pieces(mopt, metas, add)
    ordered = sorted(found.values(), key=lambda pv: pv[0])
    return LocalState([p for p, _ in ordered], [v for _, v in ordered])


def _plain_pieces(mopt: Any, metas: dict[int, ParamMeta], add: Any) -> None:
    """Plain Adam: full state tensors shaped like the local param."""
    state = mopt.optimizer.state
    if hasattr(mopt, "float16_groups"):  # Float16OptimizerWithFloat16Params (bf16/fp16)
        pairs = [
            (model_p, main_p)
            for mg, fg in zip(mopt.float16_groups, mopt.fp32_from_float16_groups, strict=True)
            for model_p, main_p in zip(mg, fg, strict=True)
        ]
        pairs += [(p, p) for group in mopt.fp32_from_fp32_groups for p in group]
    else:  # FP32Optimizer: the optimizer updates the model params directly
        pairs = [(p, p) for group in mopt.optimizer.param_groups for p in group["params"]]
    for model_p, main_p in pairs:
        meta = metas.get(id(model_p))
        if meta is None:
            raise MigrationError(
                f"cannot describe tensor of shape {tuple(model_p.shape)}: the optimizer "
                "updates it but the model's sharded_state_dict() does not list it"
            )
        tensors = {n: state[main_p][n] for n in ADAM_STATES}
        if main_p is not model_p:
            tensors = {"fp32_param": main_p.data, **tensors}
        for name, tensor in tensors.items():
            flat = tensor.view(-1)
            for key, box, off in meta.parts:
                add(f"optimizer.state.{name}.{key}", box, _box_view(flat, box, off))


def _distributed_pieces(mopt: Any, metas: dict[int, ParamMeta], add: Any) -> None:
    """Distributed optimizer: a flat shard ``[start, end)`` of every local param."""
    state = mopt.optimizer.state
    for model_p, (gi, go) in mopt.model_param_group_index_map.items():
        meta = metas.get(id(model_p))
        if meta is None:
            raise MigrationError(
                f"cannot describe tensor of shape {tuple(model_p.shape)}: the optimizer "
                "updates it but the model's sharded_state_dict() does not list it"
            )
        rng = mopt._get_model_param_range_map(model_p)["param"]
        start, end = int(rng.start), int(rng.end)
        if start == end:
            continue
        main_p = mopt.optimizer.param_groups[gi]["params"][go]
        tensors: dict[str, torch.Tensor] = {n: state[main_p][n] for n in ADAM_STATES}
        if main_p.dtype != model_p.dtype:
            tensors["fp32_param"] = main_p.data
        for key, box, offset in meta.ranges(start, end):
            for name, flat in tensors.items():
                add(f"optimizer.state.{name}.{key}", box, _box_view(flat.view(-1), box, offset))


def zero_fill(state: LocalState, slices: list[Piece]) -> int:
    """Zero ``slices`` of this rank's NEW state; returns the bytes written.

    For the vocabulary rows no old rank holds (``megatron_state.split_vocab_fill``'s
    ``fill``): megatron-core's resharded checkpoint load leaves them at zero in the params,
    the fp32 main params and both Adam moments, so a migration does the same.  Each slice
    must lie inside one piece of ``state`` (planned slices do).
    """
    from etcslurm.core.state import locate

    written = 0
    for piece in slices:
        holder, rel = locate(piece, state.pieces)
        state.view(holder)[tuple(slice(lo, hi) for lo, hi in rel)].zero_()
        written += piece.nbytes
    return written


def gather_global(trainee: Trainee, group: Any = None) -> dict[str, torch.Tensor]:
    """Every global tensor, assembled from all ranks' pieces (tests and bench only).

    All ranks call it; every rank gets the full dict.  No pickle: a JSON header and the raw
    bytes of every piece travel as uint8 tensors.  Replicas must agree bit for bit and
    every element must be held by some rank, else AssertionError names the key.
    """
    import json

    import torch.distributed as dist

    mine = local_state(trainee)
    header = json.dumps([p.to_json() for p in mine.pieces]).encode()
    blobs = [v.detach().contiguous().view(-1).view(torch.uint8) for v in mine.views]
    payload = torch.cat([torch.frombuffer(bytearray(header), dtype=torch.uint8), *blobs])
    world = dist.get_world_size(group)
    sizes = torch.tensor([len(header), payload.numel()], dtype=torch.int64)
    all_sizes = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(all_sizes, sizes, group=group)
    longest = int(max(int(s[1]) for s in all_sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    gathered = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    parts: list[tuple[Piece, torch.Tensor]] = []
    shapes: dict[str, list[int]] = {}
    for (hlen, _total), buf in zip(all_sizes, gathered, strict=True):
        hlen = int(hlen)
        pieces = [Piece.from_json(pj) for pj in json.loads(bytes(buf[:hlen].tolist()))]
        offset = hlen
        for piece in pieces:
            dtype = getattr(torch, piece.dtype)
            raw = buf[offset : offset + piece.nbytes].clone()
            offset += piece.nbytes
            parts.append((piece, raw.view(dtype).view(piece.shape)))
            hi = [b[1] for b in piece.box]
            old = shapes.get(piece.key, hi)
            shapes[piece.key] = [max(a, b) for a, b in zip(old, hi, strict=True)]
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, torch.Tensor] = {}
    for piece, tensor in parts:
        if piece.key not in out:
            out[piece.key] = torch.zeros(shapes[piece.key], dtype=tensor.dtype)
            filled[piece.key] = torch.zeros(shapes[piece.key], dtype=torch.bool)
        idx = tuple(slice(lo, hi) for lo, hi in piece.box)
        region, seen = out[piece.key][idx], filled[piece.key][idx]
        if bool(seen.any()) and not torch.equal(region[seen], tensor[seen]):
            raise AssertionError(f"replicas of {piece.key} {piece.box} differ")
        region.copy_(tensor)
        seen.fill_(True)
    for key, seen in filled.items():
        if not bool(seen.all()):
            raise AssertionError(f"{key}: {int((~seen).sum())} elements held by no rank")
    return out
