"""The pre-migration global state as raw bytes on local disk, for the bit-exact check.

Why: "bit-exact" means every tensor of the new layout equals the state *before* the
migration, checked independently of both migration paths.  Each old device writes the
pieces it is the first holder of (replicas are written once) as raw bytes plus a JSON
index -- no pickle -- and every new rank assembles its needed pieces from those files.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from etcslurm.core.state import Piece, box_intersect, box_relative


def dump(directory: Path, name: str, pairs: Iterable[tuple[Piece, torch.Tensor]]) -> int:
    """Write ``pairs`` to ``directory/name.bin`` + ``name.json``; returns bytes written."""
    directory.mkdir(parents=True, exist_ok=True)
    index = []
    offset = 0
    with open(directory / f"{name}.bin", "wb") as fh:
        for piece, tensor in pairs:
            data = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()
            fh.write(data.tobytes())
            index.append([piece.to_json(), offset])
            offset += data.nbytes
    (directory / f"{name}.json").write_text(json.dumps(index))
    return offset


class GlobalState:
    """All dumped pieces of a directory, readable by box."""

    def __init__(self, directory: Path) -> None:
        self._by_key: dict[str, list[tuple[Piece, np.memmap, int]]] = {}
        for idx in sorted(directory.glob("*.json")):
            data = np.memmap(idx.with_suffix(".bin"), dtype=np.uint8, mode="r") \
                if idx.with_suffix(".bin").stat().st_size else None
            for pj, off in json.loads(idx.read_text()):
                piece = Piece.from_json(pj)
                self._by_key.setdefault(piece.key, []).append((piece, data, off))

    def expected(self, piece: Piece) -> torch.Tensor:
        """The pre-migration values of ``piece`` (AssertionError if some were not held)."""
        dtype = getattr(torch, piece.dtype)
        out = torch.empty(piece.shape, dtype=dtype)
        covered = torch.zeros(piece.shape, dtype=torch.bool)
        for held, data, off in self._by_key.get(piece.key, []):
            inter = box_intersect(held.box, piece.box)
            if inter is None:
                continue
            size = out.element_size()
            shape = (*held.shape[:-1], held.shape[-1] * size) if held.shape else (size,)
            raw = data[off : off + held.nbytes].reshape(shape)
            rel = box_relative(held.box, inter)
            s = [slice(lo, hi) for lo, hi in rel]
            if s:
                s[-1] = slice(rel[-1][0] * size, rel[-1][1] * size)
            sub = torch.from_numpy(np.ascontiguousarray(raw[tuple(s)]))
            d = tuple(slice(lo, hi) for lo, hi in box_relative(piece.box, inter))
            out[d] = sub.view(dtype).view(tuple(hi - lo for lo, hi in inter))
            covered[d] = True
        if not bool(covered.all()):
            raise AssertionError(f"{piece.key} {piece.box}: not in the pre-migration state")
        return out
