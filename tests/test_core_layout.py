"""Layouts, model specs and the state model's box arithmetic."""

from __future__ import annotations

import itertools

import pytest

from etcslurm.core.layout import ParallelConfig, parse_ranges, valid_configs
from etcslurm.core.layout_choice import choose_config
from etcslurm.core.models import PRESETS, GPTSpec
from etcslurm.core.state import Piece, box_numel, flat_range_boxes
from etcslurm.errors import LayoutError, UsageError
from etcslurm.megatron_state import (
    buffer_layout,
    expand,
    padded_vocab,
    rank_pieces,
    stage_params,
)


def test_rank_order_is_megatron_tp_dp_pp():
    cfg = ParallelConfig.parse("tp2pp2dp4")
    assert str(cfg) == "tp2pp2dp4" and cfg.world_size == 16
    assert cfg.coord(5) == (1, 0, 2)
    assert cfg.rank_of(1, 1, 3) == 1 + 2 * (3 + 4 * 1)
    assert all(cfg.rank_of(*cfg.coord(r)) == r for r in range(16))


def test_invalid_layouts_name_the_problem_and_alternatives():
    with pytest.raises(LayoutError, match=r"heads=4 is not divisible by tp=3.*valid for 3"):
        ParallelConfig(3, 1, 1).validate(PRESETS["gpt-tiny"], 3)
    with pytest.raises(LayoutError, match="not of the form"):
        ParallelConfig.parse("tp2dp4")
    with pytest.raises(LayoutError, match="needs 8 devices, not 6"):
        ParallelConfig(2, 2, 2).validate(None, 6)


def test_choose_config_prime_count_idles_and_keeps_previous():
    spec = PRESETS["gpt-1.3b"]
    d = choose_config(13, spec, 8, 80 * 2**30, 1024, 1, "adam")
    assert d.used_devices == 12 and d.idle_devices == (12,) and "idle" in d.reason
    assert 1024 % (d.config.dp * 1) == 0
    assert d.micro_batches_per_rank * d.config.dp == 1024
    d2 = choose_config(12, spec, 8, None, 1536, 1, "adam", previous=ParallelConfig(2, 2, 4))
    assert (d2.config.tp, d2.config.pp) == (2, 2)
    with pytest.raises(LayoutError, match="memory"):
        choose_config(1, PRESETS["gpt-70b"], 8, 16 * 2**30, 8, 1, "adam")


def test_valid_configs_keep_tp_inside_node():
    for c in valid_configs(16, PRESETS["gpt-tiny"], gpus_per_node=2):
        assert c.tp <= 2 and c.world_size == 16


def test_model_spec_parse_and_presets():
    s = GPTSpec.parse("layers=4,hidden=64,heads=4,vocab=1024,seq=64")
    assert s.ffn == 256 and s == PRESETS["gpt-tiny"]
    assert s.padded_vocab(2) == 1024 and GPTSpec.parse("gpt-tiny").padded_vocab(3) == 1152
    assert 5.5e10 < PRESETS["gpt-70b"].num_params() < 7.5e10
    assert 1.2e9 < PRESETS["gpt-1.3b"].num_params() < 1.5e9
    for bad in ("gpt-nope", "layers=4,hidden=64", "layers=x,hidden=64,heads=4,vocab=1,seq=1",
                "layers=4,hidden=65,heads=4,vocab=10,seq=8"):
        with pytest.raises(UsageError):
            GPTSpec.parse(bad)


def test_flat_range_boxes_cover_exactly():
    box = ((2, 5), (0, 4), (1, 4))
    n = box_numel(box)
    for s, e in itertools.combinations(range(n + 1), 2):
        boxes = flat_range_boxes(box, s, e)
        assert len(boxes) <= 2 * len(box) - 1
        assert sum(box_numel(b) for b in boxes) == e - s


def test_piece_intersection_and_json():
    a = Piece("w", ((0, 4), (0, 4)), "float32")
    b = Piece("w", ((2, 6), (1, 3)), "float32")
    assert a.intersect(b) == Piece("w", ((2, 4), (1, 3)), "float32")
    assert a.nbytes == 64 and Piece.from_json(a.to_json()) == a
    assert a.intersect(Piece("v", a.box, "float32")) is None


def test_gpt_state_tp_shards_tile_the_tensors():
    spec = GPTSpec(layers=4, hidden=32, heads=4, ffn=64, vocab=200, seq=16,
                   tied_embeddings=False)
    for opt in ("adam", "distributed"):
        cfg = ParallelConfig(2, 2, 2)
        st = expand(spec, cfg, opt)
        per_dp0 = [p for r in range(cfg.world_size) if cfg.coord(r).dp == 0
                   for p in st.pieces(r) if not p.key.startswith("optimizer")]
        total = sum(p.numel for p in per_dp0 if "position" not in p.key
                    and "layer_norm" not in p.key and "final" not in p.key
                    and not p.key.endswith("proj.bias") and not p.key.endswith("fc2.bias"))
        h, f, v = 32, 64, padded_vocab(spec, 2)
        assert total == 4 * (3 * h * h + 3 * h + h * h + 2 * f * h + f) + 2 * v * h
        if opt == "distributed":  # ZeRO-1 shards over dp tile each (tp, pp) buffer once
            for tp, pp in itertools.product(range(2), range(2)):
                n = sum(p.numel for d in range(2)
                        for p in rank_pieces(spec, cfg, cfg.rank_of(tp, pp, d), opt)
                        if p.key.startswith("optimizer.state.exp_avg."))
                assert n == sum(q.numel for q in stage_params(spec, cfg, tp, pp))


def test_buffer_layout_pads_like_megatron():
    spec = GPTSpec(layers=2, hidden=24, heads=2, ffn=40, vocab=100, seq=8)
    params = stage_params(spec, ParallelConfig(1, 2, 3), 0, 0)
    buckets, index = buffer_layout(params, 3, None)
    assert all(s % 64 == 0 for s, _, _ in index)
    assert all((e - s) % 384 == 0 for s, e in buckets)  # lcm(3, 128)
    # shared embedding (tied, PP > 1) sits alone in the last bucket
    assert len(buckets) == 2 and index[0][2] == 1


def test_vocab_padding_matches_megatron_and_the_adapter():
    spec = GPTSpec(layers=2, hidden=32, heads=4, ffn=64, vocab=50257, seq=8)
    assert padded_vocab(spec, 2, None) == 50432  # megatron: multiple of 128*2
    assert padded_vocab(spec, 2) == padded_vocab(spec, 8) == 51200  # pre-padded for TP 8
    assert padded_vocab(spec, 16) == 51200 and padded_vocab(spec, 3, None) == 50304


def test_parse_ranges():
    assert parse_ranges("4-6,9") == [4, 5, 6, 9]
    with pytest.raises(LayoutError):
        parse_ranges("7-4")


# ----------------------------------------------------------------------- expert parallelism
MOE = PRESETS["moe-tiny"]


def test_expert_layouts_parse_print_and_follow_megatron_order():
    cfg = ParallelConfig.parse("tp1pp1dp4ep2")
    assert (cfg.ep, cfg.edp, str(cfg)) == (2, 2, "tp1pp1dp4ep2")
    assert str(ParallelConfig.parse("tp2pp2dp4ep1")) == "tp2pp2dp4"  # ep 1: the dense form
    # megatron's expert rank generator: consecutive DP ranks hold different experts
    assert [cfg.expert_coord(r)[:2] for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    big = ParallelConfig.parse("tp2pp4dp64ep8")
    r = big.rank_of(1, 3, 13)
    assert big.expert_coord(r) == (13 % 8, 13 // 8, 1)  # its expert slice is its TP rank


def test_expert_layout_validation_names_the_problem():
    with pytest.raises(LayoutError, match=r"ep=2 does not divide dp=3.*valid for 3"):
        ParallelConfig.parse("tp1pp1dp3ep2").validate(MOE)
    with pytest.raises(LayoutError, match="experts=4 is not divisible by ep=3"):
        ParallelConfig.parse("tp1pp1dp3ep3").validate(MOE)
    with pytest.raises(LayoutError, match="needs a mixture-of-experts model"):
        ParallelConfig.parse("tp1pp1dp4ep2").validate(PRESETS["gpt-tiny"])
    with pytest.raises(LayoutError, match=r"not of the form tp<N>\[cp<N>\]pp<N>"):
        ParallelConfig.parse("tp1pp1dp4ep")
    with pytest.raises(UsageError, match="topk must be between 1 and experts=4"):
        GPTSpec.parse("layers=2,hidden=64,heads=4,vocab=100,seq=16,bias=0,experts=4,topk=5")
    with pytest.raises(UsageError, match="must have bias=0"):
        GPTSpec.parse("layers=2,hidden=64,heads=4,vocab=100,seq=16,experts=4")


def test_policy_picks_and_keeps_expert_parallelism():
    eps = {c.ep for c in valid_configs(4, MOE) if (c.tp, c.pp) == (1, 1)}
    assert eps == {1, 2, 4}
    assert all(c.ep == 1 for c in valid_configs(4, PRESETS["gpt-tiny"]))
    assert choose_config(4, MOE, global_batch=12).config == ParallelConfig(1, 1, 4, 4)
    kept = choose_config(4, MOE, global_batch=12, previous=ParallelConfig(1, 1, 2, 2))
    assert kept.config == ParallelConfig(1, 1, 4, 2)
    # 3 devices: no EP > 1 divides dp 3 → the experts gather on every rank
    assert choose_config(3, MOE, global_batch=12,
                         previous=ParallelConfig(1, 1, 4, 4)).config == ParallelConfig(1, 1, 3)


def test_expert_shards_tile_the_experts_once_per_expert_replica():
    cfg = ParallelConfig.parse("tp2pp1dp4ep2")
    spec = GPTSpec.parse("layers=2,hidden=32,heads=4,ffn=64,vocab=200,seq=16,bias=0,"
                         "swiglu=1,experts=4,expert_ffn=32")
    for opt in ("adam", "distributed"):
        st = expand(spec, cfg, opt)
        for edp in range(cfg.edp):
            ranks = [r for r in range(cfg.world_size) if cfg.expert_coord(r).edp == edp]
            fc1 = [p for r in ranks for p in st.pieces(r)
                   if p.key == "decoder.layers.mlp.experts.experts.linear_fc1.weight"]
            assert sum(p.numel for p in fc1) == 2 * 4 * (2 * 32) * 32  # layers·E·2f·h
            assert len(set(fc1)) == len(fc1)  # no expert slice twice in one replica
        if opt == "distributed":  # ZeRO-1 shards over expert DP tile each expert buffer
            n = sum(p.numel for r in range(cfg.world_size) for p in st.pieces(r)
                    if p.key.startswith("optimizer.state.exp_avg.decoder.layers.mlp.experts"))
            assert n == 2 * 4 * (2 * 32 * 32 + 32 * 32)


def test_allowed_layout_filters() -> None:
    from etcslurm.core.layout_choice import LayoutFilter

    exact = LayoutFilter.parse(" TP2PP2dp4 ")
    assert str(exact) == "tp2pp2dp4" and exact.allows(ParallelConfig(2, 2, 4))
    assert not exact.allows(ParallelConfig(2, 2, 2))
    sizes = LayoutFilter.parse("tp=2,pp=2")
    assert str(sizes) == "tp=2,pp=2" and sizes.allows(ParallelConfig(2, 2, 7))
    assert not sizes.allows(ParallelConfig(2, 1, 4))
    for bad in ("tp=0", "tq=2", "tp=2,", "tp2dp4"):
        with pytest.raises(LayoutError):
            LayoutFilter.parse(bad)


def test_choose_honours_the_limits_and_names_why() -> None:
    from etcslurm.core.layout_choice import LayoutFilter, LayoutRules, NoLayoutFits, choose
    from etcslurm.core.memory import TrainingSetup

    spec = PRESETS["gpt-tiny"]
    rules = LayoutRules(TrainingSetup(global_batch=12), gpus_per_node=2, max_world=4)
    d = choose(6, spec, rules)
    assert d.config == ParallelConfig(1, 1, 4) and d.idle_devices == (4, 5)
    assert "devices 4-5 idle: max_world=4" in d.reason
    pinned = LayoutRules(TrainingSetup(global_batch=12), gpus_per_node=2,
                         allowed=(LayoutFilter.parse("pp=2"),))
    assert choose(6, spec, pinned).config == ParallelConfig(1, 2, 3)
    with pytest.raises(NoLayoutFits, match="fewer than min_world=8"):
        choose(6, spec, LayoutRules(min_world=8))
    with pytest.raises(NoLayoutFits, match=r"first layout tp2pp1dp2 cannot be used: tp=2 "
                                           r"does not fit a 1-GPU node"):
        choose(4, spec, LayoutRules(gpus_per_node=1), first=ParallelConfig(2, 1, 2))
    with pytest.raises(NoLayoutFits, match=r"3 devices: no layout of gpt-tiny fits; e.g. "
                                           r"tp1pp1dp3: global batch 8 does not split"):
        choose(3, spec, LayoutRules(TrainingSetup(global_batch=8), min_world=3))
