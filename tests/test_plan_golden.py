"""Plans are byte-identical to the recorded ones (``tests/data/plan_golden.json``).

The planner is a pipeline of small stages tuned for speed; a change to any of them (or to
the analytic expansion that feeds them) that alters a single slice, round or statistic of
any plan shows up here as a different sha256 of the plan's canonical JSON.  The cases:
the layouts and scenarios the planner and state tests use, seeded random small scenarios
(gpt-tiny / llama-tiny / moe-tiny and small custom specs; leavers, joiners, both
optimizers, vanished holders, given assignments, one device's part), random holdings no
GPT layout gives, and 1k-device gpt-70b / llama3-70b moves.  The 8k-device moves are
``big``: slow, checked only when ``ETCSLURM_GOLDEN_BIG=1``.

A deliberate change of the plans re-records them:
``python -m tests.test_plan_golden --write`` (``--big`` for the 8k ones too), and the
commit says why every plan changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from etcslurm.core.layout import ParallelConfig, valid_configs
from etcslurm.core.models import PRESETS, GPTSpec
from etcslurm.core.plan import MigrationPlan, PlanInputs, plan
from etcslurm.megatron_state.planning import gpt_inputs
from tests.helpers import random_holdings

GOLDEN = Path(__file__).parent / "data" / "plan_golden.json"
P = ParallelConfig.parse

SPEC = GPTSpec(layers=4, hidden=32, heads=4, ffn=64, vocab=200, seq=16)
UNTIED = GPTSpec(layers=4, hidden=32, heads=4, ffn=64, vocab=200, seq=16,
                 tied_embeddings=False)
EQ_SPEC = GPTSpec(layers=4, hidden=64, heads=4, ffn=128, vocab=1000, seq=16,
                  tied_embeddings=True)
EQ_UNTIED = GPTSpec(layers=2, hidden=40, heads=2, ffn=72, vocab=300, seq=8,
                    tied_embeddings=False)
MOE = PRESETS["moe-tiny"]
MOE_BF16 = GPTSpec(**{**MOE.to_json(), "name": "", "dtype": "bfloat16"})
MOE_GELU = GPTSpec(layers=2, hidden=64, heads=4, ffn=96, vocab=1000, seq=16, experts=4, topk=2,
                   bias=False, expert_ffn=48)
TP3 = GPTSpec(layers=2, hidden=48, heads=6, ffn=96, vocab=1000, seq=16, dtype="bfloat16")


def digest(p: MigrationPlan) -> str:
    """sha256 of the plan's canonical JSON: assignment, messages, local copies, missing
    pieces, idle devices and every statistic but the clock.  Pieces and messages are
    named tuples, so they serialise as the arrays of their fields (in C: a 1k-device plan's
    ``to_json`` dicts would take most of this test's time)."""
    stats = {k: v for k, v in p.stats.items() if k != "plan_seconds"}
    doc = [p.assignment, p.messages, p.local, p.missing, p.idle, stats]
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


Case = Callable[[], Iterator[tuple[str, MigrationPlan]]]


def _whole(inputs_of: Callable[[], PlanInputs]) -> Case:
    def run() -> Iterator[tuple[str, MigrationPlan]]:
        yield "", plan(inputs_of())
    return run


def _with_parts(inputs_of: Callable[[], PlanInputs], devices: int | None = None) -> Case:
    """The whole plan, then each device's part, as a rank (with the assignment) and as the
    decider (without) plans it; ``devices``: only that many, spread over the devices."""
    def run() -> Iterator[tuple[str, MigrationPlan]]:
        inputs = inputs_of()
        whole = plan(inputs)
        yield "", whole
        every = [*inputs.old_device_class, *inputs.joiners]
        if devices is not None and len(every) > devices:
            every = [every[k * (len(every) - 1) // (devices - 1)] for k in range(devices)]
        for d in every:
            yield f"/rank:{d}", plan(inputs, whole.assignment, for_device=d)
            yield f"/decider:{d}", plan(inputs, for_device=d)
    return run


def _dead(inputs: PlanInputs, devices) -> PlanInputs:
    for d in devices:
        del inputs.old_device_class[d]
    return inputs


# ------------------------------------------------------------------ the tests' own cases
def own_cases() -> dict[str, Case]:
    cases: dict[str, Case] = {}
    g = gpt_inputs
    cases["planner/leaving_only_holders"] = _whole(
        lambda: g(SPEC, P("tp2pp2dp2"), P("tp2pp2dp1"), ["4", "5", "6", "7"], 2, 8, "adam",
                  10**9))
    old = P("tp2pp2dp4")
    cases["planner/dp_shrink_whole_replicas"] = _whole(
        lambda: g(SPEC, old, P("tp2pp2dp3"),
                  [str(old.rank_of(t, pp, 3)) for t in range(2) for pp in range(2)], 0, 8,
                  "adam", 10**6))
    cases["planner/dp_grow"] = _whole(
        lambda: g(SPEC, P("tp2pp2dp2"), P("tp2pp2dp3"), [], 4, 8, "adam", 10**6))
    cases["planner/identical_across_processes"] = _with_parts(
        lambda: g(SPEC, P("tp2pp1dp4"), P("tp4pp1dp2"), ["1", "6"], 2, 2, "distributed",
                  5000))
    cases["planner/locate"] = _whole(lambda: g(SPEC, P("tp1pp1dp2"), P("tp2pp1dp1"), [], 0))
    cases["planner/holders_gone"] = _with_parts(
        lambda: _dead(g(UNTIED, P("tp1pp2dp2"), P("tp1pp2dp1"), [], 0, 8, "distributed",
                        10**6), ["2", "3"]))
    stage_spec = GPTSpec(layers=8, hidden=32, heads=4, ffn=64, vocab=200, seq=16)
    for opt in ("adam", "distributed"):
        for staging in (10_000, 10**9):
            cases[f"planner/stage_leave/{opt}/{staging}"] = _whole(
                lambda opt=opt, staging=staging: g(
                    stage_spec, P("tp2pp4dp8"), P("tp2pp4dp6"),
                    [str(r) for r in range(48, 64)], 0, 4, opt, staging))
    runs_spec = GPTSpec(layers=8, hidden=64, heads=4, ffn=256, vocab=200, seq=16)
    for staging in (64 * 1024, 10**9):
        cases[f"planner/sources_in_runs/{staging}"] = _whole(
            lambda staging=staging: g(runs_spec, P("tp1pp2dp8"), P("tp1pp2dp4"),
                                      [str(r) for r in range(8, 16)], 0, 8, "adam", staging))
    for opt in ("adam", "distributed"):
        for old_s, new_s, dead, pad in [("tp1pp2dp2", "tp1pp2dp1", ("2", "3"), 8),
                                        ("tp2pp2dp2", "tp2pp2dp1", ("1", "3"), 8),
                                        ("tp1pp1dp4", "tp4pp1dp1", (), None)]:
            cases[f"planner/decider_totals/{opt}/{old_s}-{new_s}"] = _with_parts(
                lambda opt=opt, old_s=old_s, new_s=new_s, dead=dead, pad=pad: _dead(
                    g(UNTIED, P(old_s), P(new_s), [], 0, 8, opt, 10**6, vocab_pad_tp=pad),
                    dead))
    untied8 = GPTSpec(layers=8, hidden=32, heads=4, ffn=64, vocab=200, seq=16,
                      tied_embeddings=False)
    cases["planner/part_stages"] = _with_parts(
        lambda: g(untied8, P("tp2pp4dp8"), P("tp2pp4dp6"), [str(r) for r in range(48, 64)],
                  0, 4, "distributed", 10**6), devices=6)
    for opt in ("adam", "distributed"):
        cases[f"llama/vocab_padding/{opt}"] = _whole(
            lambda opt=opt: g(PRESETS["gpt-125m"], P("tp2pp1dp3"), P("tp3pp1dp2"),
                              optimizer=opt))
    cases["llama/vocab_fill_tp3"] = _whole(
        lambda: g(TP3, P("tp1pp1dp3"), P("tp3pp1dp1"), optimizer="distributed",
                  params_dtype=TP3.dtype))
    cases["executor/tp2pp2dp1"] = _whole(
        lambda: g(PRESETS["gpt-tiny"], P("tp2pp2dp1"), P("tp1pp2dp2"), [], 0, 2,
                  "distributed", 2**20))
    # the layouts the analytic == live test builds, each to the next one of its spec
    eq = [(EQ_SPEC, "tp2pp2dp1", "adam"), (EQ_SPEC, "tp2pp2dp1", "distributed"),
          (EQ_SPEC, "tp1pp2dp2", "distributed"), (EQ_UNTIED, "tp1pp1dp4", "distributed"),
          (EQ_UNTIED, "tp2pp1dp2", "adam"), (MOE, "tp1pp1dp4ep2", "adam"),
          (MOE, "tp1pp1dp4ep4", "distributed"), (MOE_BF16, "tp1pp2dp2ep2", "distributed"),
          (MOE_BF16, "tp1pp2dp2", "distributed"), (MOE_GELU, "tp1pp1dp4ep2", "distributed")]
    for k, (spec, layout, opt) in enumerate(eq):
        others = [c for c in valid_configs(4, spec) if str(c) != layout]
        for j, new in enumerate([others[0], others[-1]]):
            cases[f"equivalence/{k}/{layout}-{new}/{opt}"] = _whole(
                lambda spec=spec, layout=layout, new=new, opt=opt, j=j: g(
                    spec, P(layout), new, ["3"] if j else [], j, 2, opt, 10**5))
    return cases


# ------------------------------------------------------------------ seeded random cases
TINY = ("gpt-tiny", "llama-tiny", "moe-tiny")


def _random_spec(rng: random.Random) -> GPTSpec:
    if rng.random() < 0.7:
        return PRESETS[rng.choice(TINY)]
    heads = rng.choice([2, 4])
    return GPTSpec(layers=rng.choice([2, 4]), hidden=8 * heads, heads=heads,
                   ffn=rng.choice([16, 32]), vocab=rng.randint(50, 300), seq=8,
                   tied_embeddings=rng.random() < 0.5)


def random_case(seed: int) -> Case:
    """A random move of a small model: layouts, leavers, joiners, optimizer, staging cap,
    nodes, vocabulary padding, vanished holders, a given (not optimal) assignment, parts."""
    def run() -> Iterator[tuple[str, MigrationPlan]]:
        rng = random.Random(seed)
        spec = _random_spec(rng)
        n_old = rng.randint(1, 8)
        old = rng.choice(valid_configs(n_old, spec))
        leave = sorted(rng.sample(range(n_old), rng.randint(0, n_old - 1)))
        join = rng.randint(0, 4)
        new = rng.choice(valid_configs(n_old - len(leave) + join, spec))
        opt = rng.choice(["adam", "distributed"])
        staging = rng.choice([1000, 10_000, 10**6, 10**9])
        gpn = rng.choice([1, 2, 8])
        pad = rng.choice([8, 8, None])
        dtype = rng.choice([None, None, "bfloat16"])
        inputs = gpt_inputs(spec, old, new, [str(x) for x in leave], join, gpn, opt, staging,
                            params_dtype=dtype, vocab_pad_tp=pad)
        staying = [d for d in inputs.old_device_class if d not in inputs.leaving]
        spare = len(staying) + join - new.world_size
        if spare and rng.random() < 0.3:  # vanished holders: their pieces may be missing
            for d in rng.sample(staying, rng.randint(1, spare)):
                del inputs.old_device_class[d]
        whole = plan(inputs)
        yield "", whole
        available = [d for d in inputs.old_device_class if d not in inputs.leaving]
        available += inputs.joiners
        if rng.random() < 0.3:  # a given assignment (as the runtime plans with one)
            given = rng.sample(available, new.world_size)
            yield "/given", plan(inputs, given)
        if rng.random() < 0.3:
            for d in rng.sample(available, min(2, len(available))):
                yield f"/rank:{d}", plan(inputs, whole.assignment, for_device=d)
                yield f"/decider:{d}", plan(inputs, for_device=d)
    return run


def random_holdings_case(seed: int) -> Case:
    """Holdings no GPT layout gives: a few tensors (scalars included) tiled into random
    boxes per layout, each box held by random classes, sometimes an old piece overlapping
    others, dead devices, leavers and joiners."""
    def run() -> Iterator[tuple[str, MigrationPlan]]:
        inputs, _ = random_holdings(random.Random(seed))
        yield "", plan(inputs)
    return run


# ------------------------------------------------------------------ at scale
def _scale(model: str, old: str, new: str, pattern: str, opt: str, parts: bool) -> Case:
    def inputs_of() -> PlanInputs:
        o, n = P(old), P(new)
        if pattern == "stage":  # the last pipeline stages leave
            leave = [str(r) for r in range(n.world_size, o.world_size)]
        else:  # whole DP replicas leave
            leave = [str(r) for r in range(o.world_size) if o.coord(r).dp >= n.dp]
        return gpt_inputs(PRESETS[model], o, n, leave, 0, 8, opt)
    return _with_parts(inputs_of, devices=3) if parts else _whole(inputs_of)


def scale_cases() -> dict[str, Case]:
    out = {}
    for model in ("gpt-70b", "llama3-70b"):
        for pattern in ("stage", "dp"):
            for opt in ("adam", "distributed"):
                out[f"1k/{model}/{pattern}/{opt}"] = _scale(
                    model, "tp8pp8dp16", "tp8pp8dp12", pattern, opt, parts=opt == "adam")
    return out


def big_cases() -> dict[str, Case]:
    out = {}
    for model in ("gpt-70b", "llama3-70b"):
        for pattern in ("stage", "dp"):
            for opt in ("adam", "distributed"):
                out[f"8k/{model}/{pattern}/{opt}"] = _scale(
                    model, "tp8pp8dp128", "tp8pp8dp96", pattern, opt,
                    parts=(pattern, opt) == ("stage", "distributed"))
    return out


N_RANDOM, N_HOLDINGS = 120, 40


def all_cases(big: bool = False) -> dict[str, Case]:
    cases = dict(own_cases())
    cases.update({f"random/{s}": random_case(s) for s in range(N_RANDOM)})
    cases.update({f"holdings/{s}": random_holdings_case(s) for s in range(N_HOLDINGS)})
    cases.update(scale_cases())
    if big:
        cases.update(big_cases())
    return cases


def hashes(cases: dict[str, Case]) -> dict[str, str]:
    return {name + sub: digest(p) for name, run in cases.items() for sub, p in run()}


# ------------------------------------------------------------------ the tests
def _recorded() -> dict[str, str]:
    return json.loads(GOLDEN.read_text())


def test_plans_equal_the_recorded_ones() -> None:
    want = {k: v for k, v in _recorded().items() if not k.startswith("8k/")}
    got = hashes(all_cases())
    assert got.keys() == want.keys()
    differ = sorted(k for k in got if got[k] != want[k])
    assert not differ, f"{len(differ)} of {len(got)} plans changed: {differ[:10]}"


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ETCSLURM_GOLDEN_BIG") != "1",
                    reason="8k-device plans: set ETCSLURM_GOLDEN_BIG=1")
def test_8k_plans_equal_the_recorded_ones() -> None:
    want = {k: v for k, v in _recorded().items() if k.startswith("8k/")}
    assert want
    assert hashes(big_cases()) == want


if __name__ == "__main__":
    if "--write" not in sys.argv:
        sys.exit("usage: python -m tests.test_plan_golden --write [--big]")
    big = "--big" in sys.argv
    new = hashes(all_cases(big))
    if not big and GOLDEN.exists():  # keep the recorded 8k plans
        new.update({k: v for k, v in _recorded().items() if k.startswith("8k/")})
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(dict(sorted(new.items())), indent=1) + "\n")
    print(f"{len(new)} plans recorded in {GOLDEN}")
