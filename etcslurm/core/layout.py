"""Hybrid-parallel layouts (TP x CP x PP x DP, with an interleaved pipeline and expert
parallelism for MoE models) in megatron-core's rank order: their text form, rank
coordinates and validity.

Text: ``tp{T}[cp{C}]pp{P}[vpp{V}]dp{D}[ep{E}][etp{X}]``; an omitted size is 1 (``etp``:
equal to ``tp``, megatron-core's default).  Rank order is megatron-core's default
``tp-cp-ep-dp-pp``, i.e. ``rank = tp + TP * (cp + CP * (dp + DP * pp))``: TP neighbours are
adjacent ranks (so a TP group sits inside a node when ``TP`` divides the GPUs per node),
then the context-parallel ranks of a sequence, and DP replicas of one pipeline stage
follow each other.

Context parallelism (``cp``) splits each sequence over ``cp`` ranks: the weights are
replicated over them, and megatron's distributed optimizer shards its buffers over the
``dp * cp`` ranks of a stage (index ``cp + CP * dp``), so a CP change moves optimizer
shards though no weight moves.  An interleaved pipeline (``vpp`` > 1) gives each stage
``vpp`` non-contiguous chunks of layers (:mod:`etcslurm.core.stages`).

Expert parallelism (``tp1pp1dp4ep2``) is megatron-core's: the dense parts are laid out as
above; the ``tp * dp`` ranks of a stage form a second grid for the experts, megatron's
expert rank generator ``etp-ep-edp`` (expert tensor parallel first): a rank's index ``r``
in its stage gives ``etp_rank = r % ETP``, ``ep_rank = (r // ETP) % EP``, ``edp_rank = r //
(ETP * EP)``.  The experts of every MoE layer are split over ``ep`` ranks, each expert's
MLP over ``etp`` ranks, and each expert shard is replicated over the expert-data-parallel
size ``tp * dp / (etp * ep)``.  With ``etp = tp`` (the default) that is ``ep_rank = dp %
EP`` and ``edp_rank = dp // EP``: consecutive DP ranks share out the experts.  ``etp *
ep`` must divide ``tp * dp``.

Which layout a run takes on the devices it has is :mod:`etcslurm.core.layout_choice`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from etcslurm.core.models import GPTSpec
from etcslurm.core.stages import split_problems
from etcslurm.errors import LayoutError

if TYPE_CHECKING:
    from etcslurm.core.layout_choice import LayoutRules

_TEXT = re.compile(
    r"^tp(\d+)(?:cp(\d+))?pp(\d+)(?:vpp(\d+))?dp(\d+)(?:ep(\d+))?(?:etp(\d+))?$")
_FORM = "tp<N>[cp<N>]pp<N>[vpp<N>]dp<N>[ep<N>][etp<N>] (e.g. tp2pp2dp4, tp8cp2pp4vpp5dp8)"


class RankCoord(NamedTuple):
    """A rank's coordinate in the layout."""

    tp: int
    pp: int
    dp: int


class ExpertCoord(NamedTuple):
    """A rank's coordinate among the experts: which experts (``ep``), which replica of
    them (``edp``), which tensor-parallel slice of each expert (``etp``)."""

    ep: int
    edp: int
    etp: int = 0


@dataclass(frozen=True, order=True)
class ParallelConfig:
    """Tensor-, pipeline-, data-, expert- and context-parallel sizes, the virtual
    pipeline size and the expert tensor-parallel size; text form ``tp2pp2dp4``
    (``tp1pp1dp4ep2`` when ``ep`` > 1, ``tp1pp1dp4ep2etp2`` when the experts' TP differs
    from ``tp``, ``tp8cp2pp4vpp5dp8`` with context parallelism and an interleaved
    pipeline).  ``ep`` splits a MoE model's experts, ``etp`` each expert's MLP.

    ``etp`` 0 means "equal to ``tp``" and is what an ``etp`` equal to ``tp`` is stored as,
    so a layout has one value whichever way it was written, and ``replace(cfg, tp=…)``
    keeps the experts' TP following the dense TP (read the size as :attr:`expert_tp`)."""

    tp: int
    pp: int
    dp: int
    ep: int = 1
    cp: int = 1
    vpp: int = 1
    etp: int = 0

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "ep", "cp", "vpp", "etp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (name != "etp"):
                raise LayoutError(f"layout: {name} must be a positive integer, got {value!r}")
        if self.etp == self.tp:
            object.__setattr__(self, "etp", 0)

    @property
    def expert_tp(self) -> int:
        """The tensor-parallel size of each expert's MLP (megatron's ETP)."""
        return self.etp or self.tp

    @classmethod
    def parse(cls, text: str) -> ParallelConfig:
        match = _TEXT.match(text.strip().lower())
        if not match:
            raise LayoutError(f"layout {text!r} is not of the form {_FORM}")
        tp, cp, pp, vpp, dp, ep = (int(g) if g is not None else 1 for g in match.groups()[:6])
        etp = int(match.group(7)) if match.group(7) is not None else tp
        # checked here, not only by the constructor: there etp 0 means "equal to tp"
        if min(tp, cp, pp, vpp, dp, ep, etp) < 1:
            raise LayoutError(f"layout {text!r}: every size must be at least 1")
        return cls(tp, pp, dp, ep, cp, vpp, etp)

    def __str__(self) -> str:
        cp = f"cp{self.cp}" if self.cp > 1 else ""
        vpp = f"vpp{self.vpp}" if self.vpp > 1 else ""
        ep = f"ep{self.ep}" if self.ep > 1 else ""
        etp = f"etp{self.etp}" if self.etp else ""
        return f"tp{self.tp}{cp}pp{self.pp}{vpp}dp{self.dp}{ep}{etp}"

    def batch_problem(self, global_batch: int, micro_batch: int = 1) -> str | None:
        """Why this layout cannot train ``global_batch`` samples per step in micro-batches
        of ``micro_batch``, or None: the batch must split evenly over the DP ranks, and
        megatron-core's interleaved schedule runs micro-batches in groups of pp."""
        if global_batch % (self.dp * micro_batch):
            return (f"global batch {global_batch} does not split over dp={self.dp} with "
                    f"micro batch {micro_batch} (dp×mb = {self.dp * micro_batch})")
        per_rank = global_batch // (self.dp * micro_batch)
        if self.vpp > 1 and per_rank % self.pp:
            return (f"an interleaved pipeline runs a multiple of pp={self.pp} micro-batches "
                    f"per DP rank; global batch {global_batch} gives {per_rank}")
        return None

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the replicas of each expert shard (``tp * cp * dp /
        (etp * ep)``; ``dp / ep`` when ``etp = tp`` without CP)."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    def expert_coord(self, rank: int) -> ExpertCoord:
        """Which experts (``ep``), which replica of them (``edp``) and which slice of each
        (``etp``) a rank holds: megatron's expert grid over the ranks of its stage."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside {self} (world size {self.world_size})")
        r, etp = rank % (self.tp * self.cp * self.dp), self.expert_tp
        return ExpertCoord((r // etp) % self.ep, r // (etp * self.ep), r % etp)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def coord(self, rank: int) -> RankCoord:
        """The (tp, pp, dp) coordinate of a global rank (its CP rank: :meth:`cp_rank`)."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside {self} (world size {self.world_size})")
        tp = rank % self.tp
        dp = (rank // (self.tp * self.cp)) % self.dp
        pp = rank // (self.tp * self.cp * self.dp)
        return RankCoord(tp, pp, dp)

    def cp_rank(self, rank: int) -> int:
        """Which part of each sequence a global rank holds (0 without CP)."""
        return (rank // self.tp) % self.cp

    def shard_rank(self, rank: int) -> int:
        """A rank's index among the ``dp * cp`` ranks of its (tp, pp) that megatron's
        distributed optimizer shards over (``cp + CP * dp``, rank order)."""
        return self.cp_rank(rank) + self.cp * self.coord(rank).dp

    def rank_of(self, tp: int, pp: int, dp: int, cp: int = 0) -> int:
        """The global rank of a coordinate (inverse of :meth:`coord` and :meth:`cp_rank`)."""
        if not (0 <= tp < self.tp and 0 <= pp < self.pp and 0 <= dp < self.dp
                and 0 <= cp < self.cp):
            raise LayoutError(f"coordinate tp={tp} cp={cp} pp={pp} dp={dp} is outside {self}")
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def problems(self, spec: GPTSpec | None = None, world_size: int | None = None) -> list[str]:
        """Everything that makes this layout unusable (empty when valid)."""
        out: list[str] = []
        if world_size is not None and self.world_size != world_size:
            out.append(f"{self} needs {self.world_size} devices, not {world_size}")
        if not self.etp and self.dp % self.ep:
            out.append(f"ep={self.ep} does not divide dp={self.dp}")
        if self.etp:
            out.extend(self._etp_problems(spec))
        if self.cp > 1 and self.ep > 1:
            out.append("context parallelism with expert parallelism is not supported")
        if spec is not None:
            out.extend(spec.tp_problems(self.tp, self.expert_tp))  # heads, groups, ffn
            out.extend(split_problems(spec, self.pp, self.vpp))  # layers over pp x vpp
            if spec.seq % (2 * self.cp) and self.cp > 1:
                out.append(f"seq={spec.seq} is not divisible by 2*cp={2 * self.cp}")
            out.extend(spec.ep_problems(self.ep))  # a MoE model, experts divisible
        return out

    def _etp_problems(self, spec: GPTSpec | None) -> list[str]:
        """Why this layout's expert TP (apart from TP) is unusable: the experts' grid must
        fill a stage, megatron keeps experts apart from the dense gradients only with EP >
        1 (with EP 1 they would be reduced over the dense DP group, which holds other
        slices of them), and only a MoE model has experts."""
        out = []
        stage = self.tp * self.cp * self.dp
        if stage % (self.etp * self.ep):
            out.append(f"etp×ep = {self.etp * self.ep} does not divide the {stage} ranks "
                       f"of a stage (tp×cp×dp)")
        if self.ep == 1:
            out.append(f"etp={self.etp} differs from tp={self.tp}, which megatron-core "
                       "supports only with ep > 1")
        if spec is not None and not spec.moe:
            out.append(f"etp={self.etp} needs a mixture-of-experts model (this one has "
                       "experts=0)")
        return out

    def validate(self, spec: GPTSpec | None = None, world_size: int | None = None,
                 rules: LayoutRules | None = None) -> None:
        """Raise :class:`LayoutError` naming what is wrong and listing valid layouts (with
        ``spec`` and ``rules``: the ones :func:`usable_layouts` lists, which ``etcslurm
        layouts`` shows too)."""
        problems = self.problems(spec, world_size)
        if not problems:
            return
        from etcslurm.core.layout_choice import LayoutRules, usable_layouts  # it builds on this

        n = world_size if world_size is not None else self.world_size
        if spec is not None:
            valid = usable_layouts(n, spec, rules or LayoutRules(gpus_per_node=None))
        else:
            valid = valid_configs(n, spec)
        hint = ", ".join(str(c) for c in valid[:12]) + (" ..." if len(valid) > 12 else "")
        raise LayoutError(
            f"layout {self} is invalid: {'; '.join(problems)}; valid for {n} devices: "
            f"{hint or 'none'}"
        )


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_configs(
    world_size: int, spec: GPTSpec | None = None, gpus_per_node: int | None = None
) -> list[ParallelConfig]:
    """All layouts of exactly ``world_size`` devices that suit ``spec``; with
    ``gpus_per_node``, only those whose TP groups fit inside a node.  For a MoE ``spec``
    every expert-parallel size that divides DP and the experts is listed."""
    out = []
    for tp in divisors(world_size):
        if gpus_per_node is not None and gpus_per_node % tp:
            continue
        for pp in divisors(world_size // tp):
            dp = world_size // (tp * pp)
            eps = divisors(dp) if spec is not None and spec.moe else [1]
            for ep in eps:
                cfg = ParallelConfig(tp, pp, dp, ep)
                if not cfg.problems(spec):
                    out.append(cfg)
    return out


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
