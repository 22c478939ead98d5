"""Exchange live-state descriptions over the exchange group (before the plan).

Two all-gathers on the group the state then moves on: first every participant's header
(its planner id, new rank, node, and a digest of what it holds and needs), then each
distinct description once (sent by the lowest group rank that has it), so
data-parallel replicas with identical holdings cost one description, not one each.
JSON only (see :mod:`etcslurm.core.descriptions`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from etcslurm.core.descriptions import decode_pieces, digest, encode_pieces
from etcslurm.core.state import Piece
from etcslurm.errors import MigrationError
from etcslurm.transfer.wire import state_device


@dataclass(frozen=True)
class Descriptions:
    """What every participant holds and needs, as all of them described it."""

    held: dict[str, list[Piece]]  # old device id → pieces (participants with old state)
    needed: dict[int, list[Piece]]  # new rank → pieces of its new model
    devices: list[str]  # planner ids in group-rank order


def exchange_descriptions(group: Any, me: str, held: list[Piece] | None,
                          needed: list[Piece] | None, new_rank: int | None,
                          timeout: float) -> Descriptions:
    """All-gather the descriptions of every member of ``group`` (every member calls it)."""
    bodies: dict[str, bytes] = {}
    header: dict[str, Any] = {"me": me, "rank": new_rank, "held": None, "needed": None}
    for side, pieces in (("held", held), ("needed", needed)):
        if pieces is not None:
            body = encode_pieces(pieces)
            header[side] = digest(body)
            bodies[header[side]] = body
    headers = [json.loads(h) for h in _all_gather(group, json.dumps(header).encode(), timeout)]
    first_owner: dict[str, int] = {}
    for i, h in enumerate(headers):
        for side in ("held", "needed"):
            if h[side] is not None:
                first_owner.setdefault(h[side], i)
    mine = {d: b.decode() for d, b in bodies.items() if first_owner[d] == group.rank()}
    decoded: dict[str, list[Piece]] = {}
    for payload in _all_gather(group, json.dumps(mine).encode(), timeout):
        for d, body in json.loads(payload).items():
            decoded[d] = decode_pieces(body.encode())
    missing = sorted(set(first_owner) - set(decoded))
    if missing:
        raise MigrationError(f"state descriptions {missing[:3]} were announced but not sent")
    out_held = {h["me"]: decoded[h["held"]] for h in headers if h["held"] is not None}
    out_needed = {int(h["rank"]): decoded[h["needed"]] for h in headers
                  if h["needed"] is not None}
    return Descriptions(out_held, out_needed, [h["me"] for h in headers])


def _all_gather(group: Any, payload: bytes, timeout: float) -> list[bytes]:
    """Every member's ``payload``, in group-rank order (two all-gathers: sizes, bytes)."""
    device = state_device()
    wait = timedelta(seconds=timeout)
    n = group.size()
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    group.allgather([sizes], [size]).wait(wait)
    lengths = [int(s.item()) for s in sizes]
    width = max(1, *lengths)
    buf = torch.zeros(width, dtype=torch.uint8)
    if payload:
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    buf = buf.to(device)
    outs = [torch.empty(width, dtype=torch.uint8, device=device) for _ in range(n)]
    group.allgather([outs], [buf]).wait(wait)
    return [bytes(o[:k].cpu().numpy().tobytes()) for o, k in zip(outs, lengths, strict=True)]


def sum_over(group: Any, values: list[int], timeout: float) -> list[int]:
    """The element-wise sum of every member's ``values`` (one all-reduce): totals and
    verdicts every member of ``group`` must agree on, from facts each knows only in part."""
    t = torch.tensor(values, dtype=torch.int64, device=state_device())
    group.allreduce([t]).wait(timedelta(seconds=timeout))
    return [int(v) for v in t.tolist()]
