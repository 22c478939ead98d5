"""The layout policy under what a recipe fixes: context parallelism in every layout, an
interleaved pipeline (``vpp`` chunks per stage) wherever the layout has stages, and the
run settings that carry both."""

from __future__ import annotations

import random

import pytest

from etcslurm.core.layout import ParallelConfig
from etcslurm.core.layout_choice import LayoutRules, NoLayoutFits, choose, layout_options
from etcslurm.core.memory import TrainingSetup
from etcslurm.core.models import GPTSpec
from etcslurm.errors import UsageError
from etcslurm.runtime.config import RunSettings


def _random_rules(rng: random.Random) -> tuple[GPTSpec, LayoutRules, int]:
    layers = rng.choice([4, 6, 8, 12])
    spec = GPTSpec.parse(f"layers={layers},hidden=64,heads=4,vocab=128,seq=64")
    rules = LayoutRules(setup=TrainingSetup(global_batch=rng.choice([12, 16, 24, 48])),
                        gpus_per_node=rng.choice([None, 4, 8]), cp=rng.choice([1, 1, 2]),
                        vpp=rng.choice([1, 2, 3]))
    return spec, rules, rng.randint(1, 24)


def test_every_listed_layout_keeps_the_recipe_s_cp_and_vpp() -> None:
    rng = random.Random(31)
    for _ in range(300):
        spec, rules, n = _random_rules(rng)
        options = layout_options(n, spec, rules)
        if n % rules.cp:
            assert options == []
            continue
        assert options
        for option in options:
            cfg = option.config
            assert cfg.world_size == n and cfg.cp == rules.cp
            assert cfg.vpp == (rules.vpp if cfg.pp > 1 else 1)
            if option.fits and cfg.vpp > 1:  # megatron's interleaved schedule runs
                micro = rules.setup.global_batch // cfg.dp  # a multiple of pp micro-batches
                assert micro % cfg.pp == 0


def test_the_policy_prefers_the_recipe_s_interleaving_on_the_same_devices() -> None:
    rng = random.Random(7)
    for _ in range(300):
        spec, rules, n = _random_rules(rng)
        try:
            decision = choose(n, spec, rules)
        except NoLayoutFits:
            continue
        used = decision.config.world_size
        interleaved = [o for o in layout_options(used, spec, rules)
                       if o.fits and o.config.pp > 1]
        if rules.vpp > 1 and interleaved:
            assert decision.config.pp > 1 and decision.config.vpp == rules.vpp, decision


def test_a_shrink_and_grow_crosses_pipeline_sizes_with_the_chunks_kept() -> None:
    """The demo's ``--vpp 2`` run: 4 → 3 → 5 devices of llama-tiny (4 layers)."""
    spec = GPTSpec.parse("llama-tiny")
    rules = LayoutRules(setup=TrainingSetup(global_batch=12), gpus_per_node=2, vpp=2)
    picks, previous = [], None
    for n in (4, 3, 5):
        previous = choose(n, spec, rules, previous=previous).config
        picks.append(str(previous))
    assert picks == ["tp1pp2vpp2dp2", "tp1pp1dp3", "tp1pp2vpp2dp2"]


def test_the_interleaved_micro_batch_rule_names_itself() -> None:
    from etcslurm.core.layout_choice import assess

    spec = GPTSpec.parse("llama-tiny")
    option = assess(ParallelConfig(1, 2, 2, vpp=2), spec,
                    LayoutRules(setup=TrainingSetup(global_batch=6), gpus_per_node=None))
    assert option.why == ("an interleaved pipeline runs a multiple of pp=2 micro-batches per "
                          "DP rank; global batch 6 gives 3")


def test_run_settings_carry_cp_and_vpp_and_refuse_what_cannot_run() -> None:
    settings = RunSettings(model=GPTSpec.parse("llama-tiny"), vpp=2)
    assert RunSettings.from_json(settings.to_json()) == settings
    assert RunSettings.from_json(RunSettings(model=None, cp=2).to_json()).cp == 2
    with pytest.raises(UsageError, match="vpp must be a positive integer"):
        RunSettings(vpp=0)
    with pytest.raises(UsageError, match="Transformer Engine"):
        RunSettings(model=GPTSpec.parse("gpt-tiny"), cp=2)
    with pytest.raises(UsageError, match="the run fixes cp=1, vpp=2"):
        RunSettings(model=GPTSpec.parse("llama-tiny"), vpp=2, first_layout="tp1pp2dp2")
