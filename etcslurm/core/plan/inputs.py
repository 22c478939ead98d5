"""What a plan depends on: :class:`PlanInputs` (what the coordinator publishes and every
rank replays), its checks, and the one device order every later stage breaks ties by.

Why the order lives here: ties of the assignment, the sources and the rounds are broken
"to the lowest device", and each rank must break them the same way; old ranks come
numerically, then joiners numerically (:func:`device_key`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from etcslurm.core.state import Piece
from etcslurm.errors import UsageError


@dataclass
class PlanInputs:
    """Everything the plan depends on (what the coordinator publishes).

    Holdings come as *blocks* of pieces and classes made of blocks (devices of one class
    hold identical state), e.g. from :func:`etcslurm.megatron_state.expand.expand`.
    Passing ``old_classes``/``new_classes`` (lists of pieces) instead makes every class
    one block.
    """

    old_device_class: dict[str, int] = field(default_factory=dict)  # old device → class
    new_rank_class: list[int] = field(default_factory=list)  # new rank → class
    nodes: dict[str, str] = field(default_factory=dict)  # every device → node name
    leaving: list[str] = field(default_factory=list)
    joiners: list[str] = field(default_factory=list)
    staging_bytes: int = 512 * 2**20
    tp: int = 1  # new TP size (for the TP-groups-split statistic)
    old_blocks: list[list[Piece]] | None = None
    old_class_blocks: list[list[int]] | None = None
    new_blocks: list[list[Piece]] | None = None
    new_class_blocks: list[list[int]] | None = None
    old_classes: list[list[Piece]] | None = None
    new_classes: list[list[Piece]] | None = None

    def __post_init__(self) -> None:
        if self.old_blocks is None:
            if self.old_classes is None:
                raise UsageError("PlanInputs needs old_blocks+old_class_blocks or old_classes")
            self.old_blocks = [list(c) for c in self.old_classes]
            self.old_class_blocks = [[i] for i in range(len(self.old_blocks))]
        if self.new_blocks is None:
            if self.new_classes is None:
                raise UsageError("PlanInputs needs new_blocks+new_class_blocks or new_classes")
            self.new_blocks = [list(c) for c in self.new_classes]
            self.new_class_blocks = [[i] for i in range(len(self.new_blocks))]
        self.old_classes = self.new_classes = None  # blocks are the one representation

    def old_pieces(self, cls: int) -> list[Piece]:
        """Pieces of old class ``cls``."""
        return [p for b in self.old_class_blocks[cls] for p in self.old_blocks[b]]

    def new_pieces(self, cls: int) -> list[Piece]:
        """Pieces of new class ``cls``."""
        return [p for b in self.new_class_blocks[cls] for p in self.new_blocks[b]]

    def validate(self) -> None:
        for d in self.leaving:
            if d not in self.old_device_class:
                raise UsageError(f"leaving device {d!r} is not an old device")
        for d in self.joiners:
            if d in self.old_device_class:
                raise UsageError(f"joiner {d!r} is also an old device")
        avail = len(self.old_device_class) - len(set(self.leaving)) + len(self.joiners)
        if avail < len(self.new_rank_class):
            raise UsageError(
                f"the new layout needs {len(self.new_rank_class)} devices but only {avail} "
                f"remain ({len(self.old_device_class)} old - {len(set(self.leaving))} leaving "
                f"+ {len(self.joiners)} joining)"
            )
        if self.staging_bytes < 1:
            raise UsageError("staging cap must be positive")
        for d in (*self.old_device_class, *self.joiners):
            if d not in self.nodes:
                raise UsageError(f"no node given for device {d!r}")

    def to_json(self) -> dict:
        return {
            "old_blocks": [[p.to_json() for p in c] for c in self.old_blocks],
            "old_class_blocks": self.old_class_blocks,
            "old_device_class": self.old_device_class,
            "new_blocks": [[p.to_json() for p in c] for c in self.new_blocks],
            "new_class_blocks": self.new_class_blocks,
            "new_rank_class": list(self.new_rank_class),
            "nodes": self.nodes,
            "leaving": list(self.leaving),
            "joiners": list(self.joiners),
            "staging_bytes": self.staging_bytes,
            "tp": self.tp,
        }

    @classmethod
    def from_json(cls, d: dict) -> PlanInputs:
        def pieces(key: str) -> list[list[Piece]] | None:
            return None if key not in d else [[Piece.from_json(p) for p in c] for c in d[key]]

        def ints(key: str) -> list[list[int]] | None:
            return None if key not in d else [[int(x) for x in c] for c in d[key]]

        return cls(
            old_device_class={k: int(v) for k, v in d["old_device_class"].items()},
            new_rank_class=[int(x) for x in d["new_rank_class"]],
            nodes=dict(d["nodes"]),
            leaving=list(d["leaving"]),
            joiners=list(d["joiners"]),
            staging_bytes=int(d["staging_bytes"]),
            tp=int(d.get("tp", 1)),
            old_blocks=pieces("old_blocks"),
            old_class_blocks=ints("old_class_blocks"),
            new_blocks=pieces("new_blocks"),
            new_class_blocks=ints("new_class_blocks"),
            old_classes=pieces("old_classes"),
            new_classes=pieces("new_classes"),
        )


def check_assignment(inputs: PlanInputs, assignment: list[str]) -> None:
    """A given assignment must place every new rank on a distinct available device."""
    leaving = set(inputs.leaving)
    available = {d for d in inputs.old_device_class if d not in leaving} | set(inputs.joiners)
    if len(assignment) != len(inputs.new_rank_class):
        raise UsageError(f"assignment has {len(assignment)} devices, the new layout "
                         f"{len(inputs.new_rank_class)} ranks")
    bad = [d for d in assignment if d not in available]
    if bad or len(set(assignment)) != len(assignment):
        raise UsageError(f"assignment {assignment} uses unavailable or repeated devices {bad}")


def device_key(d: str) -> tuple[int, int]:
    """Old ranks numerically, then joiners numerically (deterministic device order)."""
    if d.startswith("join:"):
        return (1, int(d[5:]))
    return (0, int(d))


class Devices(NamedTuple):
    """The devices of a plan in :func:`device_key` order.

    From the sources on, devices are ints in this order: ties "to the lowest device key"
    become ties to the lowest int, and a (src, dst) pair is one int ``src * n + dst`` whose
    order is the (src, dst) device-key order.
    """

    names: list[str]  # every old device and joiner; its position is the device's int
    id: dict[str, int]  # name → int
    node_of: list[int]  # int → node (ints, in order of first appearance)
    old: list[str]  # the old devices
    available: list[str]  # the old devices that stay, then the joiners
    leaving: set[str]


def devices_of(inputs: PlanInputs) -> Devices:
    """:class:`Devices` of ``inputs``."""
    leaving = set(inputs.leaving)
    keys = {d: device_key(d) for d in (*inputs.old_device_class, *inputs.joiners)}
    old = sorted(inputs.old_device_class, key=keys.__getitem__)
    available = [d for d in old if d not in leaving] + sorted(inputs.joiners, key=device_key)
    names = sorted(keys, key=keys.__getitem__)
    node_id: dict[str, int] = {}
    node_of = [node_id.setdefault(inputs.nodes[d], len(node_id)) for d in names]
    return Devices(names, {d: k for k, d in enumerate(names)}, node_of, old, available,
                   leaving)
