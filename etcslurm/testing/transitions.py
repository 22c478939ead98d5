"""Migration cases for the suite and the benchmarks: a fixed matrix of transition classes
and seeded random transitions between valid layouts.

Why one module: ``tests/test_migrate_gpt.py`` runs the matrix plus a few seeds in one
launch of the same processes, ``benchmarks/random_transitions.py`` many seeds; both must
draw the same cases from the same seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Any

from etcslurm.core.layout import ParallelConfig, valid_configs
from etcslurm.core.models import GPTSpec


@dataclass(frozen=True)
class Case:
    """One transition: ``etcslurm bench migrate``'s arguments and why it is in the set."""

    name: str
    model: str
    source: str
    target: str
    leave: tuple[int, ...] = ()
    join: int = 0
    optimizer: str = "adam"
    dtype: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def request_args(self) -> dict[str, Any]:
        return dict(model=self.model, source=self.source, target=self.target,
                    leave=list(self.leave), join=self.join, optimizer=self.optimizer,
                    dtype=self.dtype, **self.extra)


#: every class of transition in both directions, both optimizers, fp32 and bf16; each
#: row names what it covers.  At most 4 processes (this machine's CI has 2 cores).
MATRIX = (
    # TP grows: one per optimizer and per dtype
    Case("tp-grow", "gpt-tiny", "tp1pp1dp2", "tp2pp1dp1"),
    Case("tp-grow-leave", "gpt-tiny", "tp1pp2dp2", "tp2pp1dp1", (1, 3), optimizer="distributed"),
    Case("tp-grow-bf16", "llama-tiny", "tp1pp2dp2", "tp2pp2dp1", dtype="bf16"),
    Case("tp-grow-2-4", "gpt-tiny", "tp2pp1dp2", "tp4pp1dp1", optimizer="distributed",
         dtype="bf16"),
    # TP shrinks
    Case("tp-shrink", "gpt-tiny", "tp2pp2dp1", "tp1pp2dp2", extra={"reference": True}),
    Case("tp-shrink-4-2", "gpt-tiny", "tp4pp1dp1", "tp2pp1dp2", optimizer="distributed"),
    # PP grows and shrinks
    Case("pp-grow", "gpt-tiny", "tp1pp2dp2", "tp1pp4dp1", optimizer="distributed"),
    Case("pp-shrink", "llama-tiny", "tp1pp4dp1", "tp1pp2dp2", dtype="bf16"),
    # PP <-> TP; the second sends every slice over 1 KiB as a segment of its own (in
    # place where contiguous, staged where not)
    Case("pp-to-tp", "gpt-tiny", "tp1pp2dp2", "tp2pp1dp2"),
    Case("tp-to-pp-segments", "llama-tiny", "tp2pp1dp2", "tp1pp2dp2", optimizer="distributed",
         dtype="bf16", extra={"direct_min_bytes": 1024}),
    # DP with leavers and joiners
    Case("dp-leave", "gpt-tiny", "tp1pp2dp2", "tp1pp2dp1", (1, 3), optimizer="distributed"),
    Case("dp-join-kept", "gpt-tiny", "tp1pp2dp1", "tp1pp2dp2", join=2),
    Case("dp-shrink-nothing-moves", "gpt-tiny", "tp1pp1dp4", "tp1pp1dp3", (3,)),
    Case("dp-grow-distributed", "llama-tiny", "tp1pp1dp2", "tp1pp1dp4", join=2,
         optimizer="distributed", dtype="bf16"),
    # combinations
    Case("mixed-leave-join", "gpt-tiny", "tp2pp2dp1", "tp1pp1dp4", (3,), join=1,
         optimizer="distributed"),
    Case("live-plan", "llama-tiny", "tp1pp2dp2", "tp2pp1dp2", extra={"live_plan": True}),
    # pipeline shapes: interleaved chunks to TP, then not interleaved or still so (twins:
    # from one state they must train the same function); uneven stages with a tied
    # embedding, whose stage pads its buckets (the distributed optimizer's checkpoint once
    # misread them)
    Case("vpp-to-tp", "llama-tiny", "tp1pp2vpp2dp2", "tp2pp2dp1", optimizer="distributed"),
    Case("vpp-tp-grow", "llama-tiny", "tp1pp2vpp2dp2", "tp2pp2vpp2dp1", optimizer="distributed"),
    Case("uneven-stages", "layers=6,hidden=64,heads=4,vocab=128,seq=32,first_stage_layers=1,"
         "last_stage_layers=1", "tp1pp3dp1", "tp1pp1dp3", optimizer="distributed"),
    # mixture of experts
    Case("ep-leave", "moe-tiny", "tp1pp1dp4ep2", "tp1pp1dp2ep2", (2, 3),
         optimizer="distributed"),
    Case("ep-shrink", "moe-tiny", "tp1pp1dp4ep4", "tp1pp1dp4ep2"),
    # megatron-core cannot load optimizer state saved with EP 1 into EP > 1 or back (one
    # optimizer against a chain of a dense and an expert one): the oracle is the
    # pre-migration dump loaded into the new layout
    Case("ep-grow-join", "moe-tiny", "tp1pp1dp2", "tp1pp1dp4ep4", join=2,
         extra={"checkpoint": False}),
    Case("ep-to-pp", "moe-tiny", "tp1pp1dp4ep2", "tp1pp2dp2", optimizer="distributed",
         dtype="bf16", extra={"checkpoint": False}),
    # expert tensor parallelism apart from TP: each expert's MLP split over two ranks that
    # are DP replicas of the dense parts, and back
    Case("etp-shrink", "moe-tiny", "tp1pp1dp4ep2etp2", "tp1pp1dp4ep2", optimizer="distributed"),
    Case("etp-grow-from-pp", "moe-tiny", "tp1pp2dp2ep2", "tp1pp1dp4ep2etp2", dtype="bf16"),
)

#: models of the random transitions (dense: a MoE layout with TP > 1 does not train on CPU)
RANDOM_MODELS = ("gpt-tiny", "llama-tiny")


def random_case(rng: random.Random, max_devices: int = 4) -> Case:
    """One transition between valid layouts of a random model: old layout, leavers and
    joiners drawn at random, then a new layout the remaining devices can form (not the old
    one unless someone leaves or joins), a random optimizer and dtype."""
    model = rng.choice(RANDOM_MODELS)
    spec = GPTSpec.parse(model)

    def layouts(n: int) -> list[ParallelConfig]:
        return [c for c in valid_configs(n, spec, gpus_per_node=8) if 8 % c.tp == 0]

    while True:
        n_old = rng.randint(1, max_devices)
        old = rng.choice(layouts(n_old))
        leave = sorted(rng.sample(range(n_old), rng.randint(0, n_old - 1)))
        join = rng.randint(0, max_devices - n_old)
        available = n_old - len(leave) + join
        n_new = rng.randint(1, available)
        choices = [c for c in layouts(n_new) if c != old or leave or join]
        if choices:
            new = rng.choice(choices)
            break
    return Case(f"random-{model}-{old}-{new}", model, str(old), str(new), tuple(leave), join,
                optimizer=rng.choice(("adam", "distributed")),
                dtype=rng.choice((None, "bf16")))


def random_cases(seed: int, count: int, max_devices: int = 4) -> list[Case]:
    """``count`` random transitions drawn from ``seed`` (the same list on every call)."""
    rng = random.Random(seed)
    cases = [random_case(rng, max_devices) for _ in range(count)]
    return [replace(c, name=f"random{seed}.{k}-{c.name.removeprefix('random-')}")
            for k, c in enumerate(cases)]


def random_pipeline_case(rng: random.Random, max_devices: int = 4) -> Case:
    """One transition of the pipeline-shape class: a small GPT of a random depth and width,
    tied or untied embeddings, uneven first/last stages and interleaved chunks where the
    depth allows them, from a pipelined layout to any other layout of the devices.

    Why a class of its own: what a stage holds (its layer count, a tied embedding's
    separate bucket, a chunk's padding) decides where the distributed optimizer's buckets
    pad, and the checkpoint path got that wrong where the random dense models never
    looked."""
    while True:
        layers = rng.randint(3, 8)
        first, last = rng.choice([(None, None), (1, None), (None, 1), (1, 1), (2, 1)])
        hidden = rng.choice((32, 64))
        text = (f"layers={layers},hidden={hidden},heads=4,vocab=128,seq=32,"
                f"tied={rng.choice((0, 1, 1))}")
        text += "".join(f",{name}={value}" for name, value in
                        (("first_stage_layers", first), ("last_stage_layers", last))
                        if value is not None)
        try:
            spec = GPTSpec.parse(text)
        except ValueError:
            continue
        n = rng.randint(2, max_devices)
        piped = [replace(c, vpp=v) for c in valid_configs(n, spec, gpus_per_node=8)
                 if c.pp > 1 for v in (1, 2) if not replace(c, vpp=v).problems(spec)]
        if not piped:
            continue
        old = rng.choice(piped)
        targets = [c for c in valid_configs(n, spec, gpus_per_node=8) if c != old]
        if targets:
            new = rng.choice(targets)
            break
    # tied embeddings and the distributed optimizer twice as often: a tied embedding's
    # bucket of its own and the optimizer's bucket padding are what this class is for
    return Case(f"pipeline-{old}-{new}", text, str(old), str(new),
                optimizer=rng.choice(("adam", "distributed", "distributed")),
                dtype=rng.choice((None, "bf16")))


def random_pipeline_cases(seed: int, count: int, max_devices: int = 4) -> list[Case]:
    """``count`` transitions of :func:`random_pipeline_case` drawn from ``seed``."""
    rng = random.Random(seed)
    return [replace(c, name=f"pipeline{seed}.{k}-{c.name.removeprefix('pipeline-')}")
            for k, c in enumerate(random_pipeline_case(rng, max_devices) for _ in range(count))]
