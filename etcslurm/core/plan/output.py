"""What a plan is: :class:`MigrationPlan` and its coalesced :class:`Message` s.

Plain data with a JSON form: every rank computes the same plan, and the plan is what the
transfer executor runs, the monitor shows and the tests check.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import NamedTuple

from etcslurm.core.state import Piece

#: a piece in transit: inside exactly one held piece of the sender and one needed piece of
#: the receiver
Slice = Piece


class Message(NamedTuple):
    """One coalesced transfer ``src → dst`` in ``round``; slices in canonical order.

    A named tuple: a plan at 8k devices has tens of thousands of them."""

    round: int
    src: str
    dst: str
    slices: list[Slice]
    nbytes: int

    def to_json(self) -> dict:
        return {"round": self.round, "src": self.src, "dst": self.dst,
                "slices": [s.to_json() for s in self.slices], "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, d: dict) -> Message:
        return cls(d["round"], d["src"], d["dst"], [Piece.from_json(s) for s in d["slices"]],
                   d["nbytes"])


@dataclass
class MigrationPlan:
    """``assignment[new_rank] = device``; messages; local copies; missing pieces; stats."""

    assignment: list[str]
    messages: list[Message]
    local: dict[str, list[Slice]]
    missing: dict[str, list[Slice]]  # destination device → pieces nobody holds
    idle: list[str]
    stats: dict

    def to_json(self) -> dict:
        return {
            "assignment": self.assignment,
            "messages": [m.to_json() for m in self.messages],
            "local": {d: [s.to_json() for s in v] for d, v in self.local.items()},
            "missing": {d: [s.to_json() for s in v] for d, v in self.missing.items()},
            "idle": self.idle,
            "stats": self.stats,
        }

    def dumps(self, with_time: bool = True) -> str:
        d = self.to_json()
        if not with_time:
            d["stats"] = {k: v for k, v in d["stats"].items() if k != "plan_seconds"}
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, d: dict) -> MigrationPlan:
        return cls(
            assignment=list(d["assignment"]),
            messages=[Message.from_json(m) for m in d["messages"]],
            local={k: [Piece.from_json(s) for s in v] for k, v in d["local"].items()},
            missing={k: [Piece.from_json(s) for s in v] for k, v in d["missing"].items()},
            idle=list(d["idle"]),
            stats=dict(d["stats"]),
        )
