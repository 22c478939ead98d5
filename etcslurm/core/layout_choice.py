"""Which layout a run takes on the devices at hand.

The policy (:func:`choose`) judges every layout against :class:`LayoutRules` -- the
model's divisibility, TP inside a node, the global batch, the per-rank memory of
:mod:`etcslurm.core.memory` against the device's with a margin, the user's allowed
layouts and world limits -- and :func:`layout_options` lists that judgement for every
layout of a device count (``etcslurm layouts``).  Pure: no torch, no clock.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from etcslurm.core.layout import ParallelConfig, divisors
from etcslurm.core.memory import (
    DEFAULT_MARGIN,
    MemoryBreakdown,
    TrainingSetup,
    format_bytes,
    rank_memory,
    usable_bytes,
)
from etcslurm.core.models import GPTSpec
from etcslurm.errors import LayoutError, UsageError


class NoLayoutFits(LayoutError):
    """No allowed layout of the devices at hand can train the model: the run waits as
    standby until one does (the message says why, in one line)."""


_FILTER = re.compile(r"^(tp|pp|dp|ep)=(\d+)$")


@dataclass(frozen=True)
class LayoutFilter:
    """One entry of a run's allowed layouts: a layout (``tp8pp2dp4``: exactly that one)
    or fixed sizes (``tp=8``, ``tp=8,pp=2``: any layout with those sizes)."""

    sizes: tuple[tuple[str, int], ...]
    text: str

    @classmethod
    def parse(cls, text: str) -> LayoutFilter:
        text = text.strip().lower()
        if "=" not in text:
            cfg = ParallelConfig.parse(text)
            return cls((("tp", cfg.tp), ("pp", cfg.pp), ("dp", cfg.dp), ("ep", cfg.ep)),
                       str(cfg))
        sizes = []
        for part in text.split(","):
            match = _FILTER.match(part.strip())
            if not match or int(match.group(2)) < 1:
                raise LayoutError(f"allowed layout {text!r}: {part.strip()!r} is not of the "
                                  "form tp=N, pp=N, dp=N or ep=N (N >= 1)")
            sizes.append((match.group(1), int(match.group(2))))
        return cls(tuple(sizes), ",".join(f"{k}={v}" for k, v in sizes))

    def allows(self, cfg: ParallelConfig) -> bool:
        return all(getattr(cfg, key) == value for key, value in self.sizes)

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class LayoutRules:
    """What a layout must satisfy besides the model's divisibility: TP inside a node
    (``gpus_per_node`` None: no rule), the global batch (``setup.global_batch``), device
    memory with a margin (``device_memory_bytes`` None: no limit), and the user's limits
    (``allowed``: empty allows all; world sizes from ``min_world`` to ``max_world``).

    ``cp`` and ``vpp``: what the user's recipe fixes (context-parallel size; model chunks
    per pipeline stage), kept by every layout the policy lists: ``cp`` in all of them,
    ``vpp`` in those with pp > 1, which the policy then prefers on the same devices (a
    single stage has one chunk: it stays a fallback where no pipeline fits)."""

    setup: TrainingSetup = field(default_factory=TrainingSetup)
    gpus_per_node: int | None = 8
    device_memory_bytes: int | None = None
    memory_margin: float = DEFAULT_MARGIN
    allowed: tuple[LayoutFilter, ...] = ()
    min_world: int = 1
    max_world: int | None = None
    cp: int = 1
    vpp: int = 1

    def __post_init__(self) -> None:
        for name in ("cp", "vpp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UsageError(f"{name} must be a positive integer, got {value!r}")
        if not 0 <= self.memory_margin < 1:
            raise UsageError(f"memory margin must be in [0, 1), got {self.memory_margin}")
        if self.device_memory_bytes is not None and self.device_memory_bytes <= 0:
            raise UsageError(f"device memory must be positive, got {self.device_memory_bytes}")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise UsageError(f"gpus per node must be at least 1, got {self.gpus_per_node}")
        if self.min_world < 1:
            raise UsageError(f"min_world must be at least 1, got {self.min_world}")
        if self.max_world is not None and self.max_world < self.min_world:
            raise UsageError(f"max_world={self.max_world} is below min_world={self.min_world}")

    @property
    def usable_bytes(self) -> int | None:
        """Bytes a rank may use (None: no limit)."""
        if self.device_memory_bytes is None:
            return None
        return usable_bytes(self.device_memory_bytes, self.memory_margin)


@dataclass(frozen=True)
class LayoutOption:
    """One layout judged against the rules: its busiest rank's memory (None when the
    model cannot be split this way) and everything that rules it out (empty: it fits)."""

    config: ParallelConfig
    memory: MemoryBreakdown | None
    problems: tuple[str, ...]

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def why(self) -> str | None:
        """The first reason it does not fit (None: it fits)."""
        return self.problems[0] if self.problems else None

    @property
    def memory_only(self) -> bool:
        """Ruled out by device memory alone."""
        return len(self.problems) == 1 and self.problems[0].startswith(_MEMORY)

    def to_json(self) -> dict:
        return {"layout": str(self.config),
                "per_rank_bytes": None if self.memory is None else self.memory.total,
                "breakdown": None if self.memory is None else self.memory.to_json(),
                "fits": self.fits, "why": self.why}


_MEMORY = "state+activations"


def assess(cfg: ParallelConfig, spec: GPTSpec, rules: LayoutRules) -> LayoutOption:
    """``cfg`` judged against the model and ``rules``; problems in this order: the model's
    divisibility, TP inside a node, the allowed layouts, the world limits, the global
    batch, device memory."""
    problems = cfg.problems(spec)
    memory = None if problems else rank_memory(spec, cfg, rules.setup)
    gpn = rules.gpus_per_node
    if gpn is not None and gpn % cfg.tp:
        problems.append(f"tp={cfg.tp} does not fit a {gpn}-GPU node (spans "
                        f"{-(-cfg.tp // gpn)} nodes)" if cfg.tp > gpn else
                        f"tp={cfg.tp} does not fit a {gpn}-GPU node (does not divide it)")
    if rules.allowed and not any(f.allows(cfg) for f in rules.allowed):
        problems.append(f"not among the allowed layouts "
                        f"({'; '.join(str(f) for f in rules.allowed)})")
    if cfg.world_size < rules.min_world:
        problems.append(f"{cfg.world_size} devices is below min_world={rules.min_world}")
    if rules.max_world is not None and cfg.world_size > rules.max_world:
        problems.append(f"{cfg.world_size} devices is above max_world={rules.max_world}")
    gb = rules.setup.global_batch
    batch = None if gb is None else cfg.batch_problem(gb, rules.setup.micro_batch)
    if batch is not None:
        problems.append(batch)
    usable = rules.usable_bytes
    if memory is not None and usable is not None and memory.total > usable:
        problems.append(f"{_MEMORY} {format_bytes(memory.total)} > {format_bytes(usable)} "
                        "usable")
    return LayoutOption(cfg, memory, tuple(problems))


def _interleaves_as_asked(cfg: ParallelConfig, rules: LayoutRules) -> bool:
    """Whether ``cfg`` runs the chunks per stage the recipe asks for (``rules.vpp``)."""
    return rules.vpp == 1 or cfg.vpp == rules.vpp


def _preference(cfg: ParallelConfig) -> tuple:
    """Smallest model-parallel size first (more DP, less communication), then the
    smaller PP, then for a MoE model the largest EP (fewest expert bytes per rank)."""
    return (cfg.tp * cfg.pp, cfg.pp, cfg.tp, -cfg.ep)


def layout_options(n_devices: int, spec: GPTSpec, rules: LayoutRules) -> list[LayoutOption]:
    """Every layout of exactly ``n_devices`` (every TP × PP × DP with the rules' CP and,
    where pp > 1, their VPP, and every EP dividing DP for a MoE model), judged
    (:func:`assess`), in the policy's order of preference.  None when CP does not divide
    ``n_devices``."""
    out = []
    if n_devices % rules.cp:
        return out
    per_cp = n_devices // rules.cp
    for tp in divisors(per_cp):
        for pp in divisors(per_cp // tp):
            dp = per_cp // (tp * pp)
            vpp = rules.vpp if pp > 1 else 1
            for ep in divisors(dp) if spec.moe else [1]:
                cfg = ParallelConfig(tp, pp, dp, ep, cp=rules.cp, vpp=vpp)
                out.append(assess(cfg, spec, rules))
    return sorted(out, key=lambda o: (not _interleaves_as_asked(o.config, rules),
                                      _preference(o.config)))


def usable_layouts(n_devices: int, spec: GPTSpec, rules: LayoutRules) -> list[ParallelConfig]:
    """The layouts of ``n_devices`` that fit ``rules``, in the policy's order."""
    return [o.config for o in layout_options(n_devices, spec, rules) if o.fits]


@dataclass(frozen=True)
class LayoutDecision:
    """The layout picked for a device count, and why."""

    config: ParallelConfig
    used_devices: int
    idle_devices: tuple[int, ...]
    reason: str
    micro_batches_per_rank: int
    notes: tuple[str, ...] = field(default=())
    #: the busiest rank's memory under this layout
    memory: MemoryBreakdown | None = None

    def to_json(self) -> dict:
        return {
            "config": str(self.config),
            "used_devices": self.used_devices,
            "idle_devices": list(self.idle_devices),
            "reason": self.reason,
            "micro_batches_per_rank": self.micro_batches_per_rank,
        }


def choose(
    n_devices: int,
    spec: GPTSpec,
    rules: LayoutRules,
    previous: ParallelConfig | None = None,
    first: ParallelConfig | None = None,
) -> LayoutDecision:
    """Pick the layout for ``n_devices`` under ``rules``.

    Preference order: use as many devices as possible (up to ``max_world``); the chunks
    per stage the recipe fixes (``rules.vpp``: a pipeline over a single stage); keep the
    previous TP and PP (then every surviving DP replica already holds its state); then
    :func:`_preference`; for a MoE model the previous EP if it still divides DP.  When no
    layout uses all devices (a prime count, a batch that does not divide, memory), the
    highest device indices idle and the reason says why.  ``first``: the user's first
    layout, used as it is.  Raises :class:`NoLayoutFits` when nothing fits.
    """
    if n_devices < 1:
        raise LayoutError(f"need at least one device, got {n_devices}")
    if n_devices < rules.min_world:
        raise NoLayoutFits(f"{n_devices} devices: fewer than min_world={rules.min_world}")
    top = min(n_devices, rules.max_world or n_devices)
    if first is not None:
        option = assess(first, spec, rules)
        if first.world_size > n_devices:
            raise NoLayoutFits(f"{n_devices} devices: the first layout {first} needs "
                               f"{first.world_size}")
        if not option.fits:
            raise NoLayoutFits(f"{n_devices} devices: the first layout {first} cannot be "
                               f"used: {option.why}")
        return _decision(option, n_devices, top, spec, rules, previous, "the first layout set")
    best: tuple | None = None
    rejected: list[LayoutOption] = []
    for used in range(top, rules.min_world - 1, -1):
        if best is not None and used < -best[0][0]:
            break  # every layout on fewer devices ranks below the best one found
        for option in layout_options(used, spec, rules):
            cfg = option.config
            if not option.fits:
                rejected.append(option)
                continue
            keeps = previous is not None and (cfg.tp, cfg.pp) == (previous.tp, previous.pp)
            keeps_ep = previous is not None and cfg.ep == previous.ep
            key = (-used, not _interleaves_as_asked(cfg, rules), not keeps,
                   *_preference(cfg)[:3], not keeps_ep, -cfg.ep)
            if best is None or key < best[0]:
                best = (key, option)
    if best is None:
        raise NoLayoutFits(_nothing_fits(n_devices, spec, rules, rejected))
    return _decision(best[1], n_devices, top, spec, rules, previous, None)


def _nothing_fits(n: int, spec: GPTSpec, rules: LayoutRules,
                  rejected: list[LayoutOption]) -> str:
    """One line: why no layout of at most ``n`` devices fits."""
    by_memory = [o for o in rejected if o.memory_only and o.memory is not None]
    if by_memory:
        small = min(by_memory, key=lambda o: (o.memory.total, _preference(o.config)))
        assert small.memory is not None and rules.device_memory_bytes is not None
        return (f"{n} devices: no layout of {spec} fits the memory of a device "
                f"({format_bytes(rules.device_memory_bytes)}, "
                f"{format_bytes(rules.usable_bytes or 0)} usable; smallest: {small.config} "
                f"needs {format_bytes(small.memory.total)})")
    example = next((o for o in rejected if o.memory is not None), rejected[0] if rejected
                   else None)
    tail = f"; e.g. {example.config}: {example.why}" if example is not None else ""
    return f"{n} devices: no layout of {spec} fits{tail}"


def _decision(option: LayoutOption, n_devices: int, top: int, spec: GPTSpec,
              rules: LayoutRules, previous: ParallelConfig | None,
              why: str | None) -> LayoutDecision:
    cfg = option.config
    used = cfg.world_size
    idle = tuple(range(used, n_devices))
    parts = [f"{cfg} on {used} of {n_devices} devices"]
    if why:
        parts.append(why)
    if previous is not None and (cfg.tp, cfg.pp) == (previous.tp, previous.pp):
        parts.append("keeps TP and PP of the previous layout so replicas keep their state")
    if option.memory is not None and rules.usable_bytes is not None:
        parts.append(f"{format_bytes(option.memory.total)} per rank of "
                     f"{format_bytes(rules.usable_bytes)} usable")
    if idle:
        if why is not None:
            parts.append(f"devices {_ranges(idle)} idle: {why} uses {used}")
        elif used == top < n_devices:
            parts.append(f"devices {_ranges(idle)} idle: max_world={top}")
        else:
            first_no = next((o for o in layout_options(top, spec, rules) if not o.fits), None)
            detail = f" ({first_no.config}: {first_no.why})" if first_no is not None else ""
            parts.append(f"devices {_ranges(idle)} idle: no allowed layout of "
                         f"{used + 1}..{n_devices} devices fits{detail}")
    gb, mb = rules.setup.global_batch, rules.setup.micro_batch
    micro = 1 if gb is None else gb // (cfg.dp * mb)
    parts.append(f"{micro} micro-batches of {mb} per rank per step")
    return LayoutDecision(cfg, used, idle, "; ".join(parts), micro, memory=option.memory)


def choose_config(
    n_devices: int,
    spec: GPTSpec,
    gpus_per_node: int = 8,
    device_memory_bytes: int | None = None,
    global_batch: int = 1,
    micro_batch: int = 1,
    optimizer: str = "adam",
    previous: ParallelConfig | None = None,
    *,
    memory_margin: float = DEFAULT_MARGIN,
    recompute: str = "selective",
    sequence_parallel: bool = True,
    params_dtype: str | None = None,
    allowed: tuple[str, ...] = (),
    min_world: int = 1,
    max_world: int | None = None,
    first: ParallelConfig | None = None,
) -> LayoutDecision:
    """:func:`choose` with the rules spelled out (see :class:`LayoutRules`,
    :class:`~etcslurm.core.memory.TrainingSetup`)."""
    if global_batch % micro_batch:
        raise LayoutError(
            f"global batch {global_batch} is not a multiple of micro batch {micro_batch}"
        )
    setup = TrainingSetup(optimizer=optimizer, micro_batch=micro_batch,
                          global_batch=global_batch, recompute=recompute,
                          sequence_parallel=sequence_parallel, params_dtype=params_dtype)
    rules = LayoutRules(setup=setup, gpus_per_node=gpus_per_node,
                        device_memory_bytes=device_memory_bytes, memory_margin=memory_margin,
                        allowed=tuple(LayoutFilter.parse(a) for a in allowed),
                        min_world=min_world, max_world=max_world)
    return choose(n_devices, spec, rules, previous, first)


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
