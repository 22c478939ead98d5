"""GPT model specifications: the shapes that decide what every rank holds.

A :class:`GPTSpec` is all the planner needs to know about a model: from it
:mod:`etcslurm.core.gpt_state` expands, analytically, the exact sharded tensors megatron-core
creates for any TP/PP/DP layout -- so a plan for 10k GPUs needs no GPU and no model.

All presets are plain multi-head attention with a non-gated GELU MLP and learned absolute
position embeddings (megatron-core's local GPT spec), so ``linear_fc1`` is an ordinary
column-parallel tensor of shape ``[ffn, hidden]``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from etcslurm.errors import UsageError

#: megatron's default ``make_vocab_size_divisible_by``; the padded vocabulary is a
#: multiple of this times the tensor-parallel size.
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128


@dataclass(frozen=True)
class GPTSpec:
    """Shapes of a megatron-core GPT model (local spec, LayerNorm, GELU, MHA)."""

    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    tied_embeddings: bool = True
    #: preset name, for display only (not part of equality)
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "ffn", "vocab", "seq"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UsageError(f"model spec: {name} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise UsageError(
                f"model spec: hidden={self.hidden} is not divisible by heads={self.heads}"
            )

    # ------------------------------------------------------------------ text forms
    @classmethod
    def parse(cls, text: str) -> GPTSpec:
        """A preset name (``gpt-1.3b``) or ``layers=..,hidden=..,heads=..,vocab=..,seq=..``.

        ``ffn`` defaults to ``4*hidden``; ``tied=0`` unties the output layer.
        """
        text = text.strip()
        if text in PRESETS:
            return PRESETS[text]
        if "=" not in text:
            raise UsageError(
                f"unknown model {text!r}; use one of {', '.join(PRESETS)} or "
                "'layers=..,hidden=..,heads=..,vocab=..,seq=..[,ffn=..][,tied=0|1]'"
            )
        fields: dict[str, int] = {}
        for part in text.split(","):
            if not part.strip():
                continue
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in {"layers", "hidden", "heads", "ffn", "vocab", "seq", "tied"}:
                raise UsageError(f"model spec: unknown field {part.strip()!r} in {text!r}")
            try:
                fields[key] = int(value)
            except ValueError:
                raise UsageError(f"model spec: {key}={value.strip()!r} is not an integer") from None
        missing = [k for k in ("layers", "hidden", "heads", "vocab", "seq") if k not in fields]
        if missing:
            raise UsageError(f"model spec {text!r} lacks {', '.join(missing)}")
        tied = bool(fields.pop("tied", 1))
        fields.setdefault("ffn", 4 * fields["hidden"])
        return cls(tied_embeddings=tied, **fields)

    def __str__(self) -> str:
        if self.name:
            return self.name
        text = (
            f"layers={self.layers},hidden={self.hidden},heads={self.heads},ffn={self.ffn},"
            f"vocab={self.vocab},seq={self.seq}"
        )
        return text if self.tied_embeddings else text + ",tied=0"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> GPTSpec:
        return cls(**data)

    # ------------------------------------------------------------------ sizes
    def padded_vocab(self, tp: int) -> int:
        """Vocabulary padded as megatron pads it (``make_vocab_size_divisible_by * tp``)."""
        multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp
        return -(-self.vocab // multiple) * multiple

    @property
    def kv_channels(self) -> int:
        return self.hidden // self.heads

    def layer_params(self) -> int:
        """Parameters of one transformer layer (LayerNorms, QKV, proj, MLP, all biases)."""
        h, f = self.hidden, self.ffn
        return 2 * h * 2 + (3 * h * h + 3 * h) + (h * h + h) + (f * h + f) + (h * f + h)

    def num_params(self, tp: int = 1) -> int:
        """Total parameters (with the vocabulary padded for ``tp``), counting a tied
        output layer once."""
        v = self.padded_vocab(tp)
        total = v * self.hidden + self.seq * self.hidden
        total += self.layers * self.layer_params() + 2 * self.hidden
        if not self.tied_embeddings:
            total += v * self.hidden
        return total


def _preset(name: str, **kw: int) -> GPTSpec:
    return GPTSpec(name=name, **kw)


PRESETS: dict[str, GPTSpec] = {
    s.name: s
    for s in (
        _preset("gpt-tiny", layers=4, hidden=64, heads=4, ffn=256, vocab=1024, seq=64),
        _preset("gpt-125m", layers=12, hidden=768, heads=12, ffn=3072, vocab=50257, seq=2048),
        _preset("gpt-1.3b", layers=24, hidden=2048, heads=16, ffn=8192, vocab=50257, seq=2048),
        _preset("gpt-7b", layers=32, hidden=4096, heads=32, ffn=16384, vocab=32000, seq=4096),
        _preset("gpt-70b", layers=80, hidden=8192, heads=64, ffn=28672, vocab=32000, seq=4096),
    )
}
