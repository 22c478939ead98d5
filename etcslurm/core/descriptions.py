"""Descriptions of live state, and the planner inputs they make (pure).

At a resize every participant describes what it holds (the old model and optimizer) and,
if it has a rank in the new layout, what it needs (the new model, built before the
exchange); the descriptions travel as compact JSON (never pickle) and every participant
turns the same descriptions into the same :class:`~etcslurm.core.plan.PlanInputs`.
Participants with identical holdings (data-parallel replicas) share one class, so the
planner's work grows with distinct holdings, not with devices.

Encoding: ``{"keys": [...], "dtypes": [...], "pieces": [[key_index, dtype_index, lo0, hi0,
lo1, hi1, ...], ...]}``; a piece list encodes to the same bytes on every rank (sorted).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from etcslurm.core.plan import PlanInputs
from etcslurm.core.state import Piece
from etcslurm.errors import MigrationError


def encode_pieces(pieces: Iterable[Piece]) -> bytes:
    """Compact, canonical JSON of ``pieces`` (sorted: equal sets give equal bytes)."""
    ordered = sorted(set(pieces))
    keys = sorted({p.key for p in ordered})
    dtypes = sorted({p.dtype for p in ordered})
    ki = {k: i for i, k in enumerate(keys)}
    di = {d: i for i, d in enumerate(dtypes)}
    rows = [[ki[p.key], di[p.dtype], *(v for lo_hi in p.box for v in lo_hi)] for p in ordered]
    return json.dumps({"keys": keys, "dtypes": dtypes, "pieces": rows},
                      separators=(",", ":")).encode()


def decode_pieces(data: bytes) -> list[Piece]:
    """The pieces :func:`encode_pieces` encoded; a malformed description is refused."""
    try:
        doc = json.loads(data)
        keys, dtypes = doc["keys"], doc["dtypes"]
        out = []
        for row in doc["pieces"]:
            flat = row[2:]
            if len(flat) % 2:
                raise ValueError(f"odd box coordinates in {row!r}")
            box = tuple((int(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2))
            out.append(Piece(str(keys[row[0]]), box, str(dtypes[row[1]])))
        return out
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise MigrationError(f"a state description is malformed: {exc}") from None


def digest(data: bytes) -> str:
    """A short content hash: equal descriptions are sent and decoded once."""
    return hashlib.blake2b(data, digest_size=12).hexdigest()


def inputs_from_descriptions(
    held: Mapping[str, Sequence[Piece]],
    needed: Sequence[Sequence[Piece]],
    *,
    nodes: Mapping[str, str],
    leaving: Sequence[str],
    joiners: Sequence[str],
    staging_bytes: int,
    tp: int = 1,
) -> PlanInputs:
    """Planner inputs from live descriptions.

    ``held``: old device id → the pieces it holds (every old device that takes part);
    ``needed``: new rank → the pieces its freshly built model holds.  Devices (ranks) with
    identical pieces share one class, in first-seen order of sorted device ids (ranks),
    so every participant builds identical inputs.
    """
    def classes(sets: Sequence[Sequence[Piece]]) -> tuple[list[list[Piece]], list[int]]:
        index: dict[tuple[Piece, ...], int] = {}
        out: list[list[Piece]] = []
        of: list[int] = []
        for pieces in sets:
            canon = tuple(sorted(set(pieces)))
            if canon not in index:
                index[canon] = len(out)
                out.append(list(canon))
            of.append(index[canon])
        return out, of

    devices = sorted(held, key=_device_order)
    old_classes, old_of = classes([held[d] for d in devices])
    new_classes, new_of = classes(list(needed))
    return PlanInputs(
        old_classes=old_classes,
        old_device_class=dict(zip(devices, old_of, strict=True)),
        new_classes=new_classes,
        new_rank_class=new_of,
        nodes=dict(nodes),
        leaving=sorted(leaving, key=_device_order),
        joiners=list(joiners),
        staging_bytes=staging_bytes,
        tp=tp,
    )


def _device_order(device: str) -> tuple[int, int]:
    """Old devices (``"3"``) before joiners (``"join:0"``), numerically."""
    if device.startswith("join:"):
        return (1, int(device.split(":", 1)[1]))
    return (0, int(device))


def describe(pieces: Iterable[Piece]) -> dict[str, Any]:
    """A short summary for error messages and logs."""
    ps = list(pieces)
    return {"pieces": len(ps), "bytes": sum(p.nbytes for p in ps),
            "keys": len({p.key for p in ps})}
