"""Device memory of one rank of a layout: model state plus activations (pure arithmetic).

The state is what megatron-core allocates for a :class:`GPTSpec` under a layout:

* params: the rank's own elements in the model's dtype, counted exactly as
  :mod:`etcslurm.megatron_state` lays them out (TP splits, the pipeline stage's layers,
  the embedding on the first stage, the output layer -- or the tied embedding's copy --
  on the last, a MoE layer's experts split over EP);
* grads: megatron's DDP gradient buffer, fp32 (``grad_reduce_in_fp32=True``), one element
  per param element;
* optimizer: Adam's two fp32 moments, plus an fp32 main copy of every param when the
  params are not fp32.  Plain Adam keeps all of it on every DP replica; the distributed
  optimizer (ZeRO-1) keeps ``1/dp`` of the dense params' state and ``1/edp`` of the
  experts' (their own DDP buffer, sharded over expert DP, when ``ep`` > 1).  megatron pads
  every param to 64 elements and each buffer to ``lcm(dp, 128)``; the shards here are the
  unpadded ``elements / dp``, so a rank's exact state (``megatron_state``) is at most that
  padding's share above them.

Activations follow Megatron-LM's ``report_theoretical_memory`` (Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models", Table 2), per microbatch
and layer, in units of ``s*b*h`` bytes of 16-bit activations: 10 that TP does not split
(norm inputs, attention and MLP inputs, dropout masks; split too with sequence
parallelism), 8 of attention that it splits, the MLP's (``4*ffn/h``: fc1 output and its
activation; a gated unit's fc1 output is twice as wide, ``6*ffn/h``; a MoE layer's
``topk`` experts each), and, with ``recompute='none'`` only, the attention scores
``5*heads*s/h`` (a fused/flash attention keeps none: use ``'selective'``).
``recompute='full'`` keeps the ``2*s*b*h`` input of every layer plus one layer's working
set.  A stage holds its layers for the microbatches in flight under 1F1B: stage ``i`` of
``pp`` runs ``min(pp - i, microbatches)``; the first stage adds the embedding's input and
dropout mask, the last the fp32 logits.  With fp32 activations the 16-bit terms double.

Per rank of a layout: the stage with the largest total (every rank of a stage holds the
same amounts).  Extending to more dimensions: context parallel divides ``s`` (the tokens
a rank holds) and widens the optimizer's shard group to ``dp * cp``; an interleaved
pipeline gives a stage ``vpp`` chunks and Megatron's in-flight penalty
``1 + (pp - 1) / (pp * vpp)``; expert tensor parallel divides expert params by ``etp``
instead of ``tp``.  Each of those lives in one helper below.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from etcslurm.core.models import MAKE_VOCAB_SIZE_DIVISIBLE_BY, GPTSpec
from etcslurm.core.stages import stage_layer_count
from etcslurm.core.state import dtype_bytes
from etcslurm.errors import UsageError

if TYPE_CHECKING:
    from etcslurm.core.layout import ParallelConfig

RECOMPUTE = ("none", "selective", "full")
OPTIMIZERS = ("adam", "distributed")
#: megatron's DDP gradient buffer dtype here (``grad_reduce_in_fp32=True``)
GRAD_BYTES = 4
#: etcslurm's adapter pre-pads the vocabulary for TP 8 (``gpt_state.DEFAULT_VOCAB_PAD_TP``)
VOCAB_PAD_TP = 8
#: share of device memory kept free by default (allocator fragmentation, NCCL buffers,
#: workspaces the estimate does not see)
DEFAULT_MARGIN = 0.1


@dataclass(frozen=True)
class TrainingSetup:
    """How the model is trained, as far as memory goes.

    ``global_batch`` None: the microbatches per step are unknown and a stage is assumed
    to run as many as 1F1B allows.  ``params_dtype`` None: the spec's ``dtype``.
    """

    optimizer: str = "adam"
    micro_batch: int = 1
    global_batch: int | None = None
    recompute: str = "selective"
    sequence_parallel: bool = True
    params_dtype: str | None = None
    vocab_pad_tp: int | None = VOCAB_PAD_TP

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise UsageError(f"unknown optimizer {self.optimizer!r}; use one of "
                             f"{', '.join(OPTIMIZERS)}")
        if self.recompute not in RECOMPUTE:
            raise UsageError(f"unknown recompute {self.recompute!r}; use one of "
                             f"{', '.join(RECOMPUTE)}")
        if self.micro_batch < 1:
            raise UsageError(f"micro batch must be at least 1, got {self.micro_batch}")
        if self.global_batch is not None and self.global_batch < 1:
            raise UsageError(f"global batch must be at least 1, got {self.global_batch}")

    def micro_batches(self, dp: int) -> int | None:
        """Microbatches per rank per step (None: unknown, or the batch does not split)."""
        if self.global_batch is None or self.global_batch % (dp * self.micro_batch):
            return None
        return self.global_batch // (dp * self.micro_batch)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one rank holds (``stage``: its pipeline stage, the busiest of the layout)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    stage: int = 0

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.state + self.activations

    def to_json(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "total": self.total, "stage": self.stage}


# --------------------------------------------------------------------------- state
def padded_vocab(spec: GPTSpec, tp: int, vocab_pad_tp: int | None = VOCAB_PAD_TP) -> int:
    """Embedding rows under TP ``tp`` (the same rule as ``gpt_state.padded_vocab``)."""
    vocab = spec.vocab
    if vocab_pad_tp:
        vocab = _pad(vocab, MAKE_VOCAB_SIZE_DIVISIBLE_BY * vocab_pad_tp)
    return _pad(vocab, MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp)


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def _stage_layers(spec: GPTSpec, cfg: ParallelConfig, pp_rank: int) -> int:
    """Transformer layers on pipeline stage ``pp_rank`` (uneven stages included)."""
    return stage_layer_count(spec, cfg.pp, pp_rank)


def _layer_elements(spec: GPTSpec, cfg: ParallelConfig) -> tuple[int, int]:
    """(dense, expert) param elements of one transformer layer on one rank."""
    h, tp, bias = spec.hidden, cfg.tp, int(spec.bias)
    norms = 2 * h * (2 if spec.norm_has_bias else 1)
    qkv = spec.qkv_rows // tp
    attn = h * (spec.heads * spec.kv_channels // tp) + bias * h + qkv * h + bias * qkv
    if spec.moe:
        f = int(spec.expert_ffn or 0) // cfg.expert_tp
        one = (2 if spec.gated else 1) * f * h + h * f
        return norms + attn + spec.experts * h, (spec.experts // cfg.ep) * one
    f = spec.ffn // tp
    fc1 = (2 if spec.gated else 1) * f
    return norms + attn + fc1 * h + bias * fc1 + h * f + bias * h, 0


def stage_elements(spec: GPTSpec, cfg: ParallelConfig, pp_rank: int,
                   vocab_pad_tp: int | None = VOCAB_PAD_TP) -> tuple[int, int]:
    """(dense, expert) param elements one rank of stage ``pp_rank`` holds; expert params
    count as expert only where megatron's DDP keeps them apart (``ep`` > 1)."""
    dense, expert = _layer_elements(spec, cfg)
    layers = _stage_layers(spec, cfg, pp_rank)
    dense, expert = dense * layers, expert * layers
    h = spec.hidden
    vocab_rows = padded_vocab(spec, cfg.tp, vocab_pad_tp) // cfg.tp
    first, last = pp_rank == 0, pp_rank == cfg.pp - 1
    if first:
        dense += vocab_rows * h + (spec.seq * h if spec.position == "learned" else 0)
    if last:
        dense += h * (2 if spec.norm_has_bias else 1)
        if not spec.tied_embeddings or not first:  # output layer, or the tied copy
            dense += vocab_rows * h
    if cfg.ep == 1:
        return dense + expert, 0
    return dense, expert


def _shard_groups(cfg: ParallelConfig) -> tuple[int, int]:
    """Ranks the distributed optimizer shards (dense, expert) state over."""
    return cfg.dp, cfg.edp


def state_bytes(spec: GPTSpec, cfg: ParallelConfig, pp_rank: int,
                setup: TrainingSetup) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes of one rank of stage ``pp_rank``."""
    dtype = setup.params_dtype or spec.dtype
    dense, expert = stage_elements(spec, cfg, pp_rank, setup.vocab_pad_tp)
    elements = dense + expert
    per_element = 8 + (0 if dtype == "float32" else 4)  # moments (+ fp32 main param)
    if setup.optimizer == "distributed":
        dense_group, expert_group = _shard_groups(cfg)
        held = -(-dense // dense_group) + -(-expert // expert_group)
    else:
        held = elements
    return elements * dtype_bytes(dtype), elements * GRAD_BYTES, held * per_element


# --------------------------------------------------------------------------- activations
def _in_flight(cfg: ParallelConfig, pp_rank: int, micro_batches: int | None) -> int:
    """Microbatches whose activations stage ``pp_rank`` holds at once under 1F1B."""
    n = cfg.pp - pp_rank
    return n if micro_batches is None else max(1, min(n, micro_batches))


def layer_activation_units(spec: GPTSpec, cfg: ParallelConfig, setup: TrainingSetup,
                           recompute: str | None = None) -> float:
    """Activation bytes of one layer and microbatch on one rank, in units of ``s*b*h``
    (16-bit activations), as stored between forward and backward."""
    recompute = recompute or setup.recompute
    tp, h = cfg.tp, spec.hidden
    split = tp if setup.sequence_parallel else 1
    if recompute == "full":
        return 2 / split
    if spec.moe:
        mlp = spec.topk * (6 if spec.gated else 4) * int(spec.expert_ffn or 0) / h
    else:
        mlp = (6 if spec.gated else 4) * spec.ffn / h
    units = 10 / split + (8 + mlp) / tp
    if recompute == "none":
        units += 5 * spec.heads * spec.seq / h / tp
    return units


def activation_bytes(spec: GPTSpec, cfg: ParallelConfig, pp_rank: int,
                     setup: TrainingSetup) -> int:
    """Peak activation bytes of one rank of stage ``pp_rank``."""
    tp, h = cfg.tp, spec.hidden
    tokens = spec.seq * setup.micro_batch  # a rank's tokens per microbatch
    sbh = tokens * h
    split = tp if setup.sequence_parallel else 1
    scale = 2 if (setup.params_dtype or spec.dtype) == "float32" else 1
    flight = _in_flight(cfg, pp_rank, setup.micro_batches(cfg.dp))
    layers = _stage_layers(spec, cfg, pp_rank)
    total = layers * flight * layer_activation_units(spec, cfg, setup) * sbh * scale
    if setup.recompute == "full":  # one layer is recomputed, for one microbatch, at a time
        total += layer_activation_units(spec, cfg, setup, "selective") * sbh * scale
    if pp_rank == 0:  # token ids (int64) and the embedding's dropout mask
        total += flight * (8 * tokens + sbh) / split
    if pp_rank == cfg.pp - 1:  # final norm output and fp32 logits, one microbatch
        vocab = padded_vocab(spec, tp, setup.vocab_pad_tp)
        total += 4 * sbh / split + 4 * tokens * vocab / tp
    return math.ceil(total)


# --------------------------------------------------------------------------- per rank
def stage_memory(spec: GPTSpec, cfg: ParallelConfig, pp_rank: int,
                 setup: TrainingSetup) -> MemoryBreakdown:
    params, grads, optimizer = state_bytes(spec, cfg, pp_rank, setup)
    return MemoryBreakdown(params, grads, optimizer,
                           activation_bytes(spec, cfg, pp_rank, setup), pp_rank)


def rank_memory(spec: GPTSpec, cfg: ParallelConfig, setup: TrainingSetup) -> MemoryBreakdown:
    """The busiest rank of ``cfg``: the stage with the largest total."""
    return max((stage_memory(spec, cfg, pp, setup) for pp in range(cfg.pp)),
               key=lambda m: (m.total, -m.stage))


def usable_bytes(device_memory_bytes: int, margin: float = DEFAULT_MARGIN) -> int:
    """What a rank may use of a device's memory."""
    return int(device_memory_bytes * (1 - margin))


# --------------------------------------------------------------------------- sizes
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """``"80GB"`` (10^9), ``"80GiB"`` (2^30), ``"80e9"`` or ``85899345920`` → bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        match = _SIZE.match(str(text))
        if not match or match.group(2).lower() not in _UNITS:
            raise UsageError(f"size {text!r} is not a number of bytes with an optional unit "
                             "(e.g. 80GB, 80GiB, 80e9)")
        value, unit = float(match.group(1)), match.group(2).lower()
    n = int(value * _UNITS[unit])
    if n <= 0:
        raise UsageError(f"size {text!r} must be positive")
    return n


def format_bytes(n: float) -> str:
    """``99857989632`` → ``93.0 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
