"""Context parallelism, interleaved pipelines and uneven stages, against megatron-core's own
rules: the layer split (``get_transformer_layer_offset`` / ``get_num_layers_to_build``),
the validity rules (``TransformerConfig``), the rank order and the optimizer's DP x CP
groups (``RankGenerator``), on seeded random cases; and the planner on 70B layouts.

Pure: megatron-core's functions are called without a process group (``pp_rank`` given).
"""

from __future__ import annotations

import random

import pytest
import torch

from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import GPTSpec
from etcslurm.core.stages import chunk_layers, split_problems
from etcslurm.errors import LayoutError
from etcslurm.megatron_state.expand import expand
from etcslurm.megatron_state.planning import plan_migration

pytest.importorskip("megatron.core")

SEED = 31


def _random_split(rng: random.Random) -> tuple[GPTSpec, int, int]:
    pp, vpp = rng.choice([2, 3, 4, 6]), rng.choice([1, 1, 2, 3])
    layers = rng.choice([4, 6, 8, 12, 16, 24])
    first = rng.choice([None, 1, 2, 3, 4])
    last = rng.choice([None, 1, 2, 3, 4])
    if (first or 0) + (last or 0) > layers:
        first = last = None
    spec = GPTSpec(layers=layers, hidden=64, heads=4, ffn=128, vocab=256, seq=16,
                   first_stage_layers=first, last_stage_layers=last)
    return spec, pp, vpp


def _megatron_config(spec: GPTSpec, pp: int, vpp: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        num_layers_in_first_pipeline_stage=spec.first_stage_layers,
        num_layers_in_last_pipeline_stage=spec.last_stage_layers,
    )


def test_layer_split_is_megatrons_on_random_specs() -> None:
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    rng, checked, refused = random.Random(SEED), 0, 0
    for _ in range(400):
        spec, pp, vpp = _random_split(rng)
        problems = split_problems(spec, pp, vpp)
        try:
            config = _megatron_config(spec, pp, vpp)
            megatron_ok = True
        except (ValueError, AssertionError):
            megatron_ok = False
        if problems:
            # a split etcslurm refuses is one megatron refuses (at config or build time)
            refused += 1
            if megatron_ok:
                with pytest.raises(AssertionError):
                    for p in range(pp):
                        for v in range(vpp):
                            get_num_layers_to_build(config, vp_stage=v if vpp > 1 else None,
                                                    pp_rank=p)
            continue
        assert megatron_ok, (str(spec), pp, vpp)
        seen: list[int] = []
        for p in range(pp):
            for v in range(vpp):
                vp = v if vpp > 1 else None
                got = chunk_layers(spec, pp, vpp, p, v)
                assert got.start == get_transformer_layer_offset(config, vp_stage=vp, pp_rank=p)
                assert len(got) == get_num_layers_to_build(config, vp_stage=vp, pp_rank=p)
                seen.extend(got)
        assert sorted(seen) == list(range(spec.layers))  # every layer held exactly once
        checked += 1
    assert checked > 50 and refused > 50  # both halves of the class were exercised


def test_rank_order_and_optimizer_groups_are_megatrons() -> None:
    from megatron.core.parallel_state import RankGenerator

    rng = random.Random(SEED)
    for _ in range(60):
        cfg = ParallelConfig(rng.choice([1, 2, 4]), rng.choice([1, 2, 3]),
                             rng.choice([1, 2, 3]), cp=rng.choice([1, 2, 4]),
                             vpp=rng.choice([1, 2]))
        assert ParallelConfig.parse(str(cfg)) == cfg
        gen = RankGenerator(tp=cfg.tp, ep=1, dp=cfg.dp, pp=cfg.pp, cp=cfg.cp,
                            order="tp-cp-ep-dp-pp")
        for name in ("tp", "cp", "dp", "pp"):
            for group in gen.get_ranks(name):
                # a group varies in its own coordinate only
                others = {(cfg.coord(r).tp * (name != "tp"), cfg.cp_rank(r) * (name != "cp"),
                           cfg.coord(r).dp * (name != "dp"), cfg.coord(r).pp * (name != "pp"))
                          for r in group}
                assert len(others) == 1, (cfg, name, group)
        for group in gen.get_ranks("dp-cp"):  # the distributed optimizer's shard group
            assert [cfg.shard_rank(r) for r in group] == list(range(cfg.dp * cfg.cp))
        for r in range(cfg.world_size):
            c = cfg.coord(r)
            assert cfg.rank_of(c.tp, c.pp, c.dp, cfg.cp_rank(r)) == r


@pytest.mark.parametrize("text, problem", [
    ("tp8cp3pp4dp2", "seq=8192 is not divisible by 2*cp=6"),
    ("tp8pp1vpp2dp2", "vpp=2 needs pp > 1"),
    ("tp8pp4vpp3dp2", "layers=80 is not divisible by pp*vpp=12"),
])
def test_invalid_layouts_say_why(text: str, problem: str) -> None:
    with pytest.raises(LayoutError, match=problem.replace("*", r"\*")):
        ParallelConfig.parse(text).validate(GPTSpec.parse("llama3-70b"))


def _random_expert_layout(rng: random.Random) -> ParallelConfig:
    """A valid layout whose experts' TP differs from TP (etp x ep fills a stage)."""
    while True:
        cfg = ParallelConfig(rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 3]),
                             rng.choice([1, 2, 4, 6, 8]), ep=rng.choice([2, 4, 8]),
                             etp=rng.choice([1, 2, 4, 8]))
        if cfg.etp and not cfg.problems():
            return cfg


def test_expert_grid_is_megatron_s_on_random_layouts() -> None:
    """A rank's (etp, ep, edp) coordinate is the one megatron's expert rank generator
    (``tp=etp, ep, dp=edp, pp``, order tp-cp-ep-dp-pp) gives it, and the text round-trips."""
    from megatron.core.parallel_state import RankGenerator

    rng = random.Random(SEED)
    for _ in range(60):
        cfg = _random_expert_layout(rng)
        assert ParallelConfig.parse(str(cfg)) == cfg and "etp" in str(cfg)
        gen = RankGenerator(tp=cfg.expert_tp, ep=cfg.ep, dp=cfg.edp, pp=cfg.pp, cp=1,
                            order="tp-cp-ep-dp-pp")
        for name, field in (("tp", "etp"), ("ep", "ep"), ("dp", "edp")):
            for group in gen.get_ranks(name):
                coords = [cfg.expert_coord(r) for r in group]
                assert [getattr(c, field) for c in coords] == list(range(len(group))), cfg
                rest = {tuple(v for f, v in c._asdict().items() if f != field) for c in coords}
                assert len(rest) == 1 and len({cfg.coord(r).pp for r in group}) == 1, cfg


def test_expert_shards_tile_each_expert_once_per_replica_on_random_layouts() -> None:
    """Analytic state of random etp layouts: per expert-DP replica, every expert weight
    element is held exactly once; the distributed optimizer's expert shards tile the expert
    state once over the whole layout."""
    from etcslurm.megatron_state.params import EXPERT_FC1_KEY, EXPERT_FC2_KEY

    rng = random.Random(SEED + 1)
    for _ in range(12):
        cfg = _random_expert_layout(rng)
        if cfg.world_size > 96:
            continue
        f = 16 * cfg.expert_tp
        spec = GPTSpec.parse(f"layers={2 * cfg.pp},hidden=16,heads={cfg.tp},query_groups="
                             f"{cfg.tp},ffn={8 * cfg.tp},vocab=64,seq=8,bias=0,swiglu=1,"
                             f"experts={cfg.ep * 2},expert_ffn={f}")
        per_layer = spec.experts * (2 * f * 16 + 16 * f)
        for opt in ("adam", "distributed"):
            st = expand(spec, cfg, opt)
            for edp in range(cfg.edp):
                held = [p for r in range(cfg.world_size) if cfg.expert_coord(r).edp == edp
                        for p in st.pieces(r) if p.key in (EXPERT_FC1_KEY, EXPERT_FC2_KEY)]
                assert len(set(held)) * cfg.pp <= len(held) * cfg.pp  # no piece twice
                assert sum(p.numel for p in set(held)) == spec.layers * per_layer, (cfg, opt)
            if opt == "distributed":
                state = {p for r in range(cfg.world_size) for p in st.pieces(r)
                         if p.key.startswith("optimizer.state.exp_avg.decoder.layers.mlp."
                                             "experts")}
                assert sum(p.numel for p in state) == spec.layers * per_layer, cfg


def test_expert_tp_layouts_say_why_they_are_invalid() -> None:
    moe = GPTSpec.parse("moe-tiny")
    for text, problem in [
        ("tp1pp1dp4etp2", "etp=2 differs from tp=1, which megatron-core supports only with "
                          "ep > 1"),
        ("tp1pp1dp4ep4etp2", "etp×ep = 8 does not divide the 4 ranks of a stage"),
    ]:
        with pytest.raises(LayoutError, match=problem):
            ParallelConfig.parse(text).validate(moe)
    odd = GPTSpec.parse("layers=2,hidden=64,heads=4,vocab=100,seq=16,experts=4,bias=0,"
                        "expert_ffn=36")
    with pytest.raises(LayoutError, match="expert_ffn=36 is not divisible by etp=8"):
        ParallelConfig.parse("tp1pp1dp16ep2etp8").validate(odd)
    with pytest.raises(LayoutError, match="etp=2 needs a mixture-of-experts model"):
        ParallelConfig.parse("tp1pp1dp4ep2etp2").validate(GPTSpec.parse("gpt-tiny"))


def test_layout_text_refuses_what_it_cannot_hold() -> None:
    # etp equal to tp is the default layout, however it is written
    assert ParallelConfig.parse("tp2pp1dp4ep2etp2") == ParallelConfig(2, 1, 4, 2)
    assert str(ParallelConfig.parse("tp2pp1dp4ep2etp2")) == "tp2pp1dp4ep2"
    assert ParallelConfig(2, 1, 4, 2, etp=1).expert_tp == 1
    assert str(ParallelConfig.parse("tp2pp1dp4ep2etp1")) == "tp2pp1dp4ep2etp1"
    with pytest.raises(LayoutError, match="not of the form"):
        ParallelConfig.parse("tp2vpp2pp2dp1")


def test_uneven_stages_refuse_a_pp_they_cannot_fill() -> None:
    spec = GPTSpec.parse("layers=6,hidden=64,heads=4,vocab=1000,seq=64,"
                         "first_stage_layers=1,last_stage_layers=1")
    assert ParallelConfig.parse("tp1pp1dp3").problems(spec) == []  # one stage: all layers
    assert ParallelConfig.parse("tp1pp3dp1").problems(spec) == []  # 1, 4, 1
    assert "middle stages" in " ".join(ParallelConfig.parse("tp1pp2dp1").problems(spec))
    assert GPTSpec.parse(str(spec)) == spec


def test_context_parallel_shards_optimizer_state_not_weights() -> None:
    spec = GPTSpec.parse("llama-tiny")
    a = expand(spec, ParallelConfig.parse("tp1cp2pp2dp2"), "distributed")
    # CP peers hold the same params and different optimizer shards
    r0, r1 = a.pieces(0), a.pieces(1)
    weights = [{p for p in r if not p.key.startswith("optimizer.")} for r in (r0, r1)]
    assert weights[0] == weights[1]
    assert {p for p in r0 if p.key.startswith("optimizer.")} != {
        p for p in r1 if p.key.startswith("optimizer.")}
    # dp x cp constant: the same shards, nothing moves (gloo-free: the plan alone)
    plan = plan_migration(spec, "tp1cp2pp2dp2", "tp1pp2dp4", optimizer="distributed")
    assert plan.stats["moved_bytes"] == 0


@pytest.mark.parametrize("old, new, leave", [
    ("tp8pp4vpp5dp32", "tp8pp4vpp5dp24", range(768, 1024)),
    ("tp8cp2pp4dp8", "tp8cp2pp4dp6", range(384, 512)),
    ("tp8pp4vpp5dp8", "tp8pp2vpp10dp16", ()),
])
def test_70b_plans_move_only_what_must_move(old: str, new: str, leave: range) -> None:
    plan = plan_migration("llama3-70b", old, new, optimizer="distributed", leaving=list(leave))
    s = plan.stats
    assert s["missing_bytes"] == 0
    assert s["moved_bytes"] == s["lower_bound_moved_bytes"] > 0
