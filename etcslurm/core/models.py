"""Model specifications: the shapes that decide what every rank holds.

A :class:`GPTSpec` is all the planner needs to know about a dense megatron-core GPT-family
model: from it :mod:`etcslurm.megatron_state` expands, analytically, the exact sharded
tensors megatron-core creates for any TP/PP/DP layout -- so a plan for 10k GPUs needs no
GPU and no model.

Two families are described by the same fields (defaults = the original GPT-2 style):

* GPT (``gpt-*`` presets): multi-head attention, GELU MLP, LayerNorm, learned absolute
  position embeddings, biases, tied embeddings;
* Llama (``llama-*`` presets): grouped-query attention (``query_groups`` < ``heads``),
  SwiGLU (``gated=True`` + ``activation="silu"``; ``ffn`` is the size of ONE branch, so
  ``linear_fc1`` has ``2*ffn`` rows, which megatron-core checkpoints through a
  ``ShardedTensorFactory`` as two halves), RMSNorm, RoPE (no position-embedding tensor),
  an untied output layer, no biases; usually bf16 params (``dtype``).

and a third family on either:

* mixture of experts (``moe-tiny``, ``mixtral-8x7b``): ``experts`` > 0 makes every
  layer's MLP megatron-core's ``MoELayer`` -- a router (``[experts, hidden]``, replicated)
  and ``experts`` expert MLPs of ``expert_ffn`` hidden units (``topk`` of them per token),
  sharded over the expert-parallel size of the layout (``tp1pp1dp4ep2``).

Text forms (``GPTSpec.parse``): a preset name, or comma-separated ``key=value`` with
``layers, hidden, heads, vocab, seq`` required and optional ``ffn`` (default 4*hidden),
``tied=0|1``, ``groups=N``, ``glu=0|1``, ``act=gelu|silu``, ``norm=layernorm|rmsnorm``,
``pos=learned|rope``, ``bias=0|1``, ``dtype=fp32|bf16``, ``rope_base=N``,
``experts=N``, ``topk=N``, ``expert_ffn=N`` (alias ``moe_ffn``), ``swiglu=1`` (shorthand
for ``glu=1,act=silu``), ``first_stage_layers=N``, ``last_stage_layers=N`` (uneven
pipeline stages, :mod:`etcslurm.core.stages`).  ``str(spec)`` writes the non-default fields only, so
the GPT forms of older versions read and print unchanged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from etcslurm.errors import UsageError

#: megatron's default ``make_vocab_size_divisible_by``; the padded vocabulary is a
#: multiple of this times the tensor-parallel size.
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128

ACTIVATIONS = ("gelu", "silu")
NORMS = ("LayerNorm", "RMSNorm")
POSITIONS = ("learned", "rope")
DTYPES = ("float32", "bfloat16")
_ALIASES = {
    "layernorm": "LayerNorm", "ln": "LayerNorm", "rmsnorm": "RMSNorm", "rms": "RMSNorm",
    "learned_absolute": "learned", "fp32": "float32", "bf16": "bfloat16",
}
_INT_KEYS = ("layers", "hidden", "heads", "ffn", "vocab", "seq")


@dataclass(frozen=True)
class GPTSpec:
    """Shapes of a dense megatron-core GPT-family model (local layer spec)."""

    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    tied_embeddings: bool = True
    #: preset name, for display only (not part of equality)
    name: str = field(default="", compare=False)
    #: key/value head groups (grouped-query attention); ``None`` → ``heads`` (MHA)
    query_groups: int | None = None
    #: gated linear unit (SwiGLU with ``activation="silu"``); ``ffn`` is one branch
    gated: bool = False
    activation: str = "gelu"
    norm: str = "LayerNorm"
    #: ``"learned"`` (absolute position-embedding tensor) or ``"rope"`` (no tensor)
    position: str = "learned"
    #: biases on the linear layers (``add_bias_linear``)
    bias: bool = True
    #: model params dtype (``float32`` or ``bfloat16``; with bf16 the optimizer keeps fp32
    #: main params)
    dtype: str = "float32"
    rope_base: int = 10000
    #: mixture of experts: routed experts per MoE layer (0: a dense model).  Every layer's
    #: MLP is then megatron-core's ``MoELayer`` (router + ``SequentialMLP`` experts)
    experts: int = 0
    #: experts each token is routed to
    topk: int = 2
    #: hidden size of one expert's MLP (``moe_ffn_hidden_size``); ``None`` → ``ffn``
    expert_ffn: int | None = None
    #: uneven pipeline stages (megatron's ``num_layers_in_first_pipeline_stage`` /
    #: ``..._last_...``): the layers of the first / last stage whenever pp > 1 (the
    #: embedding and output stages carry fewer); ``None``: even stages
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def __post_init__(self) -> None:
        for name in (*_INT_KEYS, "rope_base"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UsageError(f"model spec: {name} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise UsageError(
                f"model spec: hidden={self.hidden} is not divisible by heads={self.heads}"
            )
        if self.query_groups is None:
            object.__setattr__(self, "query_groups", self.heads)
        g = self.query_groups
        if not isinstance(g, int) or isinstance(g, bool) or g <= 0 or self.heads % g:
            raise UsageError(
                f"model spec: query_groups must be a positive divisor of heads={self.heads}, "
                f"got {g!r}"
            )
        for name, allowed in (("activation", ACTIVATIONS), ("norm", NORMS),
                              ("position", POSITIONS), ("dtype", DTYPES)):
            value = getattr(self, name)
            value = _ALIASES.get(str(value).lower(), value)
            object.__setattr__(self, name, value)
            if value not in allowed:
                raise UsageError(
                    f"model spec: {name} must be one of {', '.join(allowed)}, got {value!r}"
                )
        for name in ("tied_embeddings", "gated", "bias"):
            object.__setattr__(self, name, bool(getattr(self, name)))
        self._check_experts()
        self._check_stages()

    def _check_stages(self) -> None:
        sizes = [getattr(self, n) for n in ("first_stage_layers", "last_stage_layers")]
        for name, value in zip(("first_stage_layers", "last_stage_layers"), sizes, strict=True):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value <= 0):
                raise UsageError(f"model spec: {name} must be a positive integer, got {value!r}")
        if sum(v or 0 for v in sizes) > self.layers:
            raise UsageError(
                f"model spec: first_stage_layers + last_stage_layers exceed layers={self.layers}"
            )

    def _check_experts(self) -> None:
        for name in ("experts", "topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise UsageError(f"model spec: {name} must be a non-negative integer, got {value!r}")
        if not self.experts:
            if self.expert_ffn is not None:
                raise UsageError("model spec: expert_ffn is set but experts=0 (a dense model)")
            return
        if self.expert_ffn is None:
            object.__setattr__(self, "expert_ffn", self.ffn)
        e = self.expert_ffn
        if not isinstance(e, int) or isinstance(e, bool) or e <= 0:
            raise UsageError(f"model spec: expert_ffn must be a positive integer, got {e!r}")
        if not 1 <= self.topk <= self.experts:
            raise UsageError(
                f"model spec: topk must be between 1 and experts={self.experts}, got {self.topk}"
            )
        if self.bias:
            raise UsageError(
                "model spec: a mixture-of-experts model must have bias=0 (etcslurm describes "
                "megatron-core MoE layers without linear biases, as Mixtral/DeepSeek/Qwen-MoE)"
            )

    # ------------------------------------------------------------------ text forms
    @classmethod
    def parse(cls, text: str) -> GPTSpec:
        """A preset name (``gpt-1.3b``, ``llama-tiny``) or ``layers=..,hidden=..,...``
        (see the module docstring for every key)."""
        text = text.strip()
        if text in PRESETS:
            return PRESETS[text]
        if "=" not in text:
            raise UsageError(
                f"unknown model {text!r}; use one of {', '.join(PRESETS)} or "
                "'layers=..,hidden=..,heads=..,vocab=..,seq=..[,ffn=..][,tied=0|1][,groups=..]"
                "[,swiglu=1][,norm=rmsnorm][,pos=rope][,bias=0][,dtype=bf16][,experts=..,topk=..]'"
            )
        kw: dict[str, object] = {}
        for part in text.split(","):
            if not part.strip():
                continue
            key, sep, value = part.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or key not in _TEXT_KEYS:
                raise UsageError(f"model spec: unknown field {part.strip()!r} in {text!r}")
            attr, kind = _TEXT_KEYS[key]
            if kind in (int, bool):
                try:
                    number = int(value)
                except ValueError:
                    raise UsageError(f"model spec: {key}={value!r} is not an integer") from None
                if kind is bool and number not in (0, 1):
                    raise UsageError(f"model spec: {key}={value!r} must be 0 or 1")
                if key == "swiglu":
                    if number:
                        kw.update(gated=True, activation="silu")
                    continue
                kw[attr] = bool(number) if kind is bool else number
            else:
                kw[attr] = value
        missing = [k for k in ("layers", "hidden", "heads", "vocab", "seq") if k not in kw]
        if missing:
            raise UsageError(f"model spec {text!r} lacks {', '.join(missing)}")
        kw.setdefault("ffn", 4 * int(kw["hidden"]))  # type: ignore[arg-type]
        return cls(**kw)  # type: ignore[arg-type]

    def __str__(self) -> str:
        if self.name:
            return self.name
        text = (
            f"layers={self.layers},hidden={self.hidden},heads={self.heads},ffn={self.ffn},"
            f"vocab={self.vocab},seq={self.seq}"
        )
        extra = []
        if not self.tied_embeddings:
            extra.append("tied=0")
        if self.query_groups != self.heads:
            extra.append(f"groups={self.query_groups}")
        if self.gated:
            extra.append("glu=1")
        if self.activation != "gelu":
            extra.append(f"act={self.activation}")
        if self.norm != "LayerNorm":
            extra.append(f"norm={self.norm.lower()}")
        if self.position != "learned":
            extra.append(f"pos={self.position}")
        if not self.bias:
            extra.append("bias=0")
        if self.dtype != "float32":
            extra.append(f"dtype={self.dtype}")
        if self.rope_base != 10000:
            extra.append(f"rope_base={self.rope_base}")
        if self.experts:
            extra.append(f"experts={self.experts},topk={self.topk}")
            if self.expert_ffn != self.ffn:
                extra.append(f"expert_ffn={self.expert_ffn}")
        for name in ("first_stage_layers", "last_stage_layers"):
            if getattr(self, name) is not None:
                extra.append(f"{name}={getattr(self, name)}")
        return ",".join([text, *extra])

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> GPTSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UsageError(f"model spec JSON: unknown field {unknown[0]!r}")
        return cls(**data)

    # ------------------------------------------------------------------ sizes
    def padded_vocab(self, tp: int) -> int:
        """Vocabulary padded as megatron pads it (``make_vocab_size_divisible_by * tp``)."""
        multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp
        return -(-self.vocab // multiple) * multiple

    @property
    def kv_channels(self) -> int:
        return self.hidden // self.heads

    @property
    def groups(self) -> int:
        """Key/value head groups (``heads`` for multi-head attention)."""
        return int(self.query_groups or self.heads)

    @property
    def qkv_rows(self) -> int:
        """Rows of ``linear_qkv.weight``: queries plus one key and one value per group."""
        return (self.heads + 2 * self.groups) * self.kv_channels

    @property
    def fc1_rows(self) -> int:
        """Rows of ``linear_fc1.weight`` (both branches of a gated unit)."""
        return 2 * self.ffn if self.gated else self.ffn

    @property
    def moe(self) -> bool:
        """True for a mixture-of-experts model."""
        return self.experts > 0

    @property
    def expert_fc1_rows(self) -> int:
        """Rows of one expert's ``linear_fc1.weight`` (both branches when gated)."""
        return 2 * int(self.expert_ffn or 0) if self.gated else int(self.expert_ffn or 0)

    @property
    def norm_has_bias(self) -> bool:
        return self.norm == "LayerNorm"

    def tp_problems(self, tp: int, etp: int | None = None) -> list[str]:
        """What makes tensor-parallel size ``tp`` (and expert tensor-parallel size ``etp``;
        None: ``tp``) unusable for this model."""
        etp = tp if etp is None else etp
        out = []
        if self.heads % tp:
            out.append(f"heads={self.heads} is not divisible by tp={tp}")
        if self.groups % tp:
            out.append(f"query_groups={self.groups} is not divisible by tp={tp}")
        if self.ffn % tp and not self.moe:
            out.append(f"ffn={self.ffn} is not divisible by tp={tp}")
        name = "tp" if etp == tp else "etp"
        if self.moe and int(self.expert_ffn or 0) % etp:
            out.append(f"expert_ffn={self.expert_ffn} is not divisible by {name}={etp}")
        return out

    def ep_problems(self, ep: int) -> list[str]:
        """What makes expert-parallel size ``ep`` unusable for this model."""
        if ep == 1:
            return []
        if not self.moe:
            return [f"ep={ep} needs a mixture-of-experts model (this one has experts=0)"]
        if self.experts % ep:
            return [f"experts={self.experts} is not divisible by ep={ep}"]
        return []

    def layer_params(self) -> int:
        """Parameters of one transformer layer (norms, QKV, proj, MLP, biases if any)."""
        h, b = self.hidden, int(self.bias)
        q = self.heads * self.kv_channels
        norms = 2 * h * (2 if self.norm_has_bias else 1)
        attn = self.qkv_rows * h + b * self.qkv_rows + q * h + b * h
        return norms + attn + self.mlp_params()

    def mlp_params(self) -> int:
        """Parameters of one layer's MLP (dense), or of its router and every expert."""
        h, f, b = self.hidden, self.ffn, int(self.bias)
        if self.moe:
            return self.experts * h + self.experts * self.expert_params()
        return self.fc1_rows * h + b * self.fc1_rows + h * f + b * h

    def expert_params(self) -> int:
        """Parameters of one expert of one layer (0 for a dense model)."""
        return self.expert_fc1_rows * self.hidden + self.hidden * int(self.expert_ffn or 0)

    def num_params(self, tp: int = 1) -> int:
        """Total parameters (with the vocabulary padded for ``tp``), counting a tied
        output layer once."""
        v = self.padded_vocab(tp)
        total = v * self.hidden
        if self.position == "learned":
            total += self.seq * self.hidden
        total += self.layers * self.layer_params()
        total += self.hidden * (2 if self.norm_has_bias else 1)
        if not self.tied_embeddings:
            total += v * self.hidden
        return total


#: text key → (field, kind)
_TEXT_KEYS: dict[str, tuple[str, type]] = {
    **{k: (k, int) for k in _INT_KEYS},
    "tied": ("tied_embeddings", bool), "groups": ("query_groups", int),
    "query_groups": ("query_groups", int), "glu": ("gated", bool), "swiglu": ("gated", bool),
    "act": ("activation", str), "activation": ("activation", str), "norm": ("norm", str),
    "pos": ("position", str), "position": ("position", str), "bias": ("bias", bool),
    "dtype": ("dtype", str), "rope_base": ("rope_base", int),
    "experts": ("experts", int), "topk": ("topk", int), "expert_ffn": ("expert_ffn", int),
    "moe_ffn": ("expert_ffn", int),
    "first_stage_layers": ("first_stage_layers", int),
    "last_stage_layers": ("last_stage_layers", int),
}


def _preset(name: str, **kw: object) -> GPTSpec:
    return GPTSpec(name=name, **kw)  # type: ignore[arg-type]


#: what makes a model Llama-style (grouped-query attention set per preset)
LLAMA = dict(tied_embeddings=False, gated=True, activation="silu", norm="RMSNorm",
             position="rope", bias=False)


PRESETS: dict[str, GPTSpec] = {
    s.name: s
    for s in (
        _preset("gpt-tiny", layers=4, hidden=64, heads=4, ffn=256, vocab=1024, seq=64),
        _preset("gpt-125m", layers=12, hidden=768, heads=12, ffn=3072, vocab=50257, seq=2048),
        _preset("gpt-1.3b", layers=24, hidden=2048, heads=16, ffn=8192, vocab=50257, seq=2048),
        _preset("gpt-7b", layers=32, hidden=4096, heads=32, ffn=16384, vocab=32000, seq=4096),
        _preset("gpt-70b", layers=80, hidden=8192, heads=64, ffn=28672, vocab=32000, seq=4096),
        # CPU-sized: a few MB, fast on 4 gloo processes (query_groups=2: TP 1 or 2)
        _preset("llama-tiny", layers=4, hidden=64, heads=4, query_groups=2, ffn=128,
                vocab=1000, seq=64, **LLAMA),
        # published shapes (Meta Llama 3): 8.03B and 70.6B parameters
        _preset("llama3-8b", layers=32, hidden=4096, heads=32, query_groups=8, ffn=14336,
                vocab=128256, seq=8192, dtype="bfloat16", rope_base=500000, **LLAMA),
        # mixture of experts, CPU-sized: 4 experts (EP 1, 2 or 4), top-2, Mixtral-style
        _preset("moe-tiny", layers=2, hidden=64, heads=4, query_groups=2, ffn=128,
                vocab=1000, seq=64, experts=4, topk=2, **LLAMA),
        # published shapes (Mistral AI Mixtral 8x7B): 46.7B parameters, 8 experts, top-2
        _preset("mixtral-8x7b", layers=32, hidden=4096, heads=32, query_groups=8,
                ffn=14336, vocab=32000, seq=4096, dtype="bfloat16", rope_base=1000000,
                experts=8, topk=2, **LLAMA),
        _preset("llama3-70b", layers=80, hidden=8192, heads=64, query_groups=8, ffn=28672,
                vocab=128256, seq=8192, dtype="bfloat16", rope_base=500000, **LLAMA),
    )
}
