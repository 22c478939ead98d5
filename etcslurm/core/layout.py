"""Hybrid-parallel layouts (TP x PP x DP, with expert parallelism for MoE models) in
megatron-core's rank order, and the policy that picks the next layout when devices leave
or join.

Rank order is megatron-core's default ``tp-cp-ep-dp-pp`` with cp = 1, i.e.
``rank = tp + TP * (dp + DP * pp)``: TP neighbours are adjacent ranks (so a TP group sits
inside a node when ``TP`` divides the GPUs per node), and DP replicas of one pipeline stage
follow each other.

Expert parallelism (``tp1pp1dp4ep2``) is megatron-core's: the dense parts are laid out as
above; the experts of every MoE layer are split over ``ep`` ranks, which are consecutive
data-parallel ranks (expert tensor parallelism = TP), and each expert shard is replicated
over the expert-data-parallel size ``dp / ep``: a rank's expert coordinate is
``ep_rank = dp % EP``, ``edp_rank = dp // EP`` (megatron's expert rank generator,
``tp-cp-ep-dp-pp`` over (TP, EP, DP/EP, PP)).  ``ep`` must divide ``dp`` and the experts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NamedTuple

from etcslurm.core.models import GPTSpec
from etcslurm.errors import LayoutError

_TEXT = re.compile(r"^tp(\d+)pp(\d+)dp(\d+)(?:ep(\d+))?$")


class RankCoord(NamedTuple):
    """A rank's coordinate in the layout."""

    tp: int
    pp: int
    dp: int


class ExpertCoord(NamedTuple):
    """A rank's coordinate among the experts: which expert shard, which replica of it."""

    ep: int
    edp: int


@dataclass(frozen=True, order=True)
class ParallelConfig:
    """Tensor-, pipeline-, data- and expert-parallel sizes; text form ``tp2pp2dp4`` (and
    ``tp1pp1dp4ep2`` when ``ep`` > 1).  ``ep`` splits a MoE model's experts over
    consecutive DP ranks; it must divide ``dp``."""

    tp: int
    pp: int
    dp: int
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"layout: {name} must be a positive integer, got {value!r}")

    @classmethod
    def parse(cls, text: str) -> ParallelConfig:
        match = _TEXT.match(text.strip().lower())
        if not match:
            raise LayoutError(
                f"layout {text!r} is not of the form tp<N>pp<N>dp<N>[ep<N>] (e.g. tp2pp2dp4, "
                "tp1pp1dp4ep2)"
            )
        tp, pp, dp, ep = (int(g) if g is not None else 1 for g in match.groups())
        if min(tp, pp, dp, ep) < 1:
            raise LayoutError(f"layout {text!r}: every size must be at least 1")
        return cls(tp, pp, dp, ep)

    def __str__(self) -> str:
        text = f"tp{self.tp}pp{self.pp}dp{self.dp}"
        return f"{text}ep{self.ep}" if self.ep > 1 else text

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the replicas of each expert shard (``dp / ep``)."""
        return self.dp // self.ep

    def expert_coord(self, rank: int) -> ExpertCoord:
        """Which expert shard (``ep``) and which replica of it (``edp``) a rank holds."""
        dp = self.coord(rank).dp
        return ExpertCoord(dp % self.ep, dp // self.ep)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coord(self, rank: int) -> RankCoord:
        """The (tp, pp, dp) coordinate of a global rank."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside {self} (world size {self.world_size})")
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        pp = rank // (self.tp * self.dp)
        return RankCoord(tp, pp, dp)

    def rank_of(self, tp: int, pp: int, dp: int) -> int:
        """The global rank of a coordinate (inverse of :meth:`coord`)."""
        if not (0 <= tp < self.tp and 0 <= pp < self.pp and 0 <= dp < self.dp):
            raise LayoutError(f"coordinate tp={tp} pp={pp} dp={dp} is outside {self}")
        return tp + self.tp * (dp + self.dp * pp)

    def problems(self, spec: GPTSpec | None = None, world_size: int | None = None) -> list[str]:
        """Everything that makes this layout unusable (empty when valid)."""
        out: list[str] = []
        if world_size is not None and self.world_size != world_size:
            out.append(f"{self} needs {self.world_size} devices, not {world_size}")
        if self.dp % self.ep:
            out.append(f"ep={self.ep} does not divide dp={self.dp}")
        if spec is not None:
            out.extend(spec.tp_problems(self.tp))  # heads, query groups, ffn
            if spec.layers % self.pp:
                out.append(f"layers={spec.layers} is not divisible by pp={self.pp}")
            out.extend(spec.ep_problems(self.ep))  # a MoE model, experts divisible
        return out

    def validate(self, spec: GPTSpec | None = None, world_size: int | None = None) -> None:
        """Raise :class:`LayoutError` naming what is wrong and listing valid layouts."""
        problems = self.problems(spec, world_size)
        if not problems:
            return
        n = world_size if world_size is not None else self.world_size
        valid = valid_configs(n, spec)
        hint = ", ".join(str(c) for c in valid[:12]) + (" ..." if len(valid) > 12 else "")
        raise LayoutError(
            f"layout {self} is invalid: {'; '.join(problems)}; valid for {n} devices: "
            f"{hint or 'none'}"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_configs(
    world_size: int, spec: GPTSpec | None = None, gpus_per_node: int | None = None
) -> list[ParallelConfig]:
    """All layouts of exactly ``world_size`` devices that suit ``spec``; with
    ``gpus_per_node``, only those whose TP groups fit inside a node.  For a MoE ``spec``
    every expert-parallel size that divides DP and the experts is listed."""
    out = []
    for tp in _divisors(world_size):
        if gpus_per_node is not None and gpus_per_node % tp:
            continue
        for pp in _divisors(world_size // tp):
            dp = world_size // (tp * pp)
            eps = _divisors(dp) if spec is not None and spec.moe else [1]
            for ep in eps:
                cfg = ParallelConfig(tp, pp, dp, ep)
                if not cfg.problems(spec):
                    out.append(cfg)
    return out


#: bytes of training state per parameter: model param, gradient and the Adam state.
#: 'adam' (plain): fp32 param + fp32 grad + 2 fp32 moments, all replicated over DP.
#: 'distributed': bf16 param + fp32 main grad replicated; fp32 main param + 2 moments
#: sharded over DP (ZeRO-1).
def state_bytes_per_param(optimizer: str, dp: int) -> float:
    if optimizer == "adam":
        return 16.0
    if optimizer == "distributed":
        return 6.0 + 12.0 / dp
    raise LayoutError(f"unknown optimizer {optimizer!r}; use 'adam' or 'distributed'")


#: share of device memory the training state may use (the rest: activations, buffers).
MEMORY_FRACTION = 0.7


def rank_state_bytes(spec: GPTSpec, cfg: ParallelConfig, optimizer: str) -> float:
    """Estimated training-state bytes of the busiest rank (first stage holds embeddings)."""
    expert_part = spec.layers * spec.experts * spec.expert_params()
    per_layer = (spec.layer_params() - spec.experts * spec.expert_params()) / cfg.tp
    emb = (spec.padded_vocab(cfg.tp) * spec.hidden) / cfg.tp + spec.seq * spec.hidden
    params = per_layer * spec.layers / cfg.pp + emb + expert_part / (cfg.tp * cfg.pp * cfg.ep)
    if cfg.pp == 1 and not spec.tied_embeddings:
        params += emb
    return params * state_bytes_per_param(optimizer, cfg.dp)


@dataclass(frozen=True)
class LayoutDecision:
    """The layout picked for a device count, and why."""

    config: ParallelConfig
    used_devices: int
    idle_devices: tuple[int, ...]
    reason: str
    micro_batches_per_rank: int
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> dict:
        return {
            "config": str(self.config),
            "used_devices": self.used_devices,
            "idle_devices": list(self.idle_devices),
            "reason": self.reason,
            "micro_batches_per_rank": self.micro_batches_per_rank,
        }


def choose_config(
    n_devices: int,
    spec: GPTSpec,
    gpus_per_node: int = 8,
    device_memory_bytes: int | None = None,
    global_batch: int = 1,
    micro_batch: int = 1,
    optimizer: str = "adam",
    previous: ParallelConfig | None = None,
) -> LayoutDecision:
    """Pick the layout for ``n_devices``: TP inside a node, PP as memory requires, DP takes
    the rest, the global batch kept (``global_batch = dp * micro_batch * micro_batches``).

    Preference order: use as many devices as possible; keep the previous TP and PP (then
    every surviving DP replica already holds its state); the smallest model-parallel size
    ``tp*pp`` that fits memory (more DP, less communication); then the smaller PP; for a
    MoE model, the previous EP if it still divides DP, else the largest EP (fewest expert
    bytes per rank).  When no
    layout uses all devices (a prime count, a batch that does not divide), the highest
    device indices idle and the reason says why.
    """
    if n_devices < 1:
        raise LayoutError(f"need at least one device, got {n_devices}")
    if global_batch % micro_batch:
        raise LayoutError(
            f"global batch {global_batch} is not a multiple of micro batch {micro_batch}"
        )
    state_bytes_per_param(optimizer, 1)  # validates the name
    budget = None if device_memory_bytes is None else device_memory_bytes * MEMORY_FRACTION
    best: tuple | None = None
    rejected: dict[str, int] = {}
    for used in range(n_devices, 0, -1):
        if best is not None and used < -best[0][0]:
            break  # every layout on fewer devices ranks below the best one found
        for cfg in valid_configs(used, spec, gpus_per_node):
            if global_batch % (cfg.dp * micro_batch):
                rejected["global batch"] = rejected.get("global batch", 0) + 1
                continue
            if budget is not None and rank_state_bytes(spec, cfg, optimizer) > budget:
                rejected["memory"] = rejected.get("memory", 0) + 1
                continue
            keeps = previous is not None and (cfg.tp, cfg.pp) == (previous.tp, previous.pp)
            keeps_ep = previous is not None and cfg.ep == previous.ep
            key = (-used, not keeps, cfg.tp * cfg.pp, cfg.pp, cfg.tp, not keeps_ep, -cfg.ep)
            if best is None or key < best[0]:
                best = (key, cfg)
    if best is None:
        why = ", ".join(f"{k}: {v}" for k, v in sorted(rejected.items())) or "no valid layout"
        raise LayoutError(
            f"no layout of {spec} fits {n_devices} devices ({gpus_per_node} per node, "
            f"global batch {global_batch}, micro batch {micro_batch}); rejected by {why}"
        )
    cfg = best[1]
    used = cfg.world_size
    idle = tuple(range(used, n_devices))
    parts = [f"{cfg} on {used} of {n_devices} devices"]
    if previous is not None and (cfg.tp, cfg.pp) == (previous.tp, previous.pp):
        parts.append("keeps TP and PP of the previous layout so replicas keep their state")
    if idle:
        parts.append(
            f"devices {_ranges(idle)} idle: no layout of {used + 1}..{n_devices} devices "
            f"divides heads={spec.heads}, ffn={spec.ffn}, layers={spec.layers} with TP inside "
            f"a {gpus_per_node}-GPU node, keeps global batch {global_batch} with micro "
            f"batch {micro_batch}"
            + (" and fits device memory" if budget is not None else "")
        )
    micro = global_batch // (cfg.dp * micro_batch)
    parts.append(f"{micro} micro-batches of {micro_batch} per rank per step")
    return LayoutDecision(cfg, used, idle, "; ".join(parts), micro)


def _ranges(values: tuple[int, ...]) -> str:
    """``(4, 5, 6, 9)`` → ``4-6,9``."""
    out: list[str] = []
    start = prev = None
    for v in values:
        if start is None:
            start = prev = v
        elif v == prev + 1:
            prev = v
        else:
            out.append(f"{start}-{prev}" if start != prev else str(start))
            start = prev = v
    if start is not None:
        out.append(f"{start}-{prev}" if start != prev else str(start))
    return ",".join(out)


def parse_ranges(text: str) -> list[int]:
    """``"4-7,9"`` → ``[4, 5, 6, 7, 9]`` (the CLI's device lists)."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise LayoutError(f"bad device range {part!r} (use e.g. 4-7,9)") from None
        if a < 0 or b < a:
            raise LayoutError(f"bad device range {part!r} (use e.g. 4-7,9)")
        out.extend(range(a, b + 1))
    return sorted(set(out))
