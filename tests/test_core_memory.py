"""The per-rank memory model against the analytic state model and Megatron's formula."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from etcslurm import megatron_state as gpt_state
from etcslurm.core.layout import ParallelConfig, valid_configs
from etcslurm.core.memory import (
    GRAD_BYTES,
    TrainingSetup,
    activation_bytes,
    format_bytes,
    padded_vocab,
    parse_bytes,
    rank_memory,
    stage_memory,
)
from etcslurm.core.models import PRESETS, GPTSpec
from etcslurm.errors import UsageError


def _exact(spec: GPTSpec, cfg: ParallelConfig, rank: int, optimizer: str) -> tuple[int, int, int]:
    """(param bytes, param elements, optimizer bytes) of ``rank`` as gpt_state lays them out."""
    pieces = gpt_state.rank_pieces(spec, cfg, rank, optimizer)
    params = [p for p in pieces if not p.key.startswith("optimizer.")]
    opt = sum(p.nbytes for p in pieces if p.key.startswith("optimizer."))
    return sum(p.nbytes for p in params), sum(p.numel for p in params), opt


def _check_state(spec: GPTSpec, cfg: ParallelConfig, optimizer: str) -> None:
    """Params and grads match gpt_state exactly on every rank; plain Adam's optimizer state
    too; the distributed optimizer's shards sum to exactly the state of a replica, and the
    busiest shard is above the estimate by at most megatron's padding (64 elements per
    tensor, ``lcm(dp, 128)`` per bucket) over the shard group."""
    setup = TrainingSetup(optimizer=optimizer)
    dtype_extra = 0 if spec.dtype == "float32" else 4
    per_element = 8 + dtype_extra
    for pp in range(cfg.pp):
        est = stage_memory(spec, cfg, pp, setup)
        ranks = [cfg.rank_of(0, pp, dp) for dp in range(cfg.dp)]
        exact = [_exact(spec, cfg, r, optimizer) for r in ranks]
        for params, elements, _ in exact:
            assert est.params == params and est.grads == GRAD_BYTES * elements
        if optimizer == "adam":
            assert all(opt == est.optimizer for *_, opt in exact)
            continue
        # every element's state lives on exactly one rank of its shard group
        # (with EP > 1, the ranks of one DP group hold different experts: each expert
        # shard's state sums to its replica over its expert-DP group)
        if cfg.ep == 1:
            assert sum(opt for *_, opt in exact) == exact[0][1] * per_element
        tensors = len(gpt_state.stage_params(spec, cfg, 0, pp))
        group = cfg.edp if cfg.ep > 1 else cfg.dp
        slack = per_element * (64 * tensors + 2 * math.lcm(cfg.dp, 128)) / group
        busiest = max(opt for *_, opt in exact)
        assert est.optimizer - 2 * per_element <= busiest <= est.optimizer + slack, (
            cfg, pp, est.optimizer, busiest)


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("optimizer", ["adam", "distributed"])
def test_state_matches_the_analytic_model_for_every_preset(name: str, optimizer: str) -> None:
    spec = PRESETS[name]
    layouts = [c for n in (1, 2, 4, 8) for c in valid_configs(n, spec) if c.tp <= 8]
    rng = random.Random(f"{name}-{optimizer}")
    for cfg in rng.sample(layouts, min(6, len(layouts))):
        _check_state(spec, cfg, optimizer)


def test_state_matches_on_seeded_random_layouts() -> None:
    rng = random.Random(20240607)
    small = [s for s in PRESETS.values() if s.num_params() < 2e9]
    for _ in range(40):
        spec = rng.choice(small)
        n = rng.choice([1, 2, 3, 4, 6, 8, 12, 16])
        layouts = [c for c in valid_configs(n, spec) if c.tp <= 8]
        if not layouts:
            continue
        _check_state(spec, rng.choice(layouts), rng.choice(["adam", "distributed"]))


def test_vocabulary_padding_is_gpt_state_s() -> None:
    assert gpt_state.DEFAULT_VOCAB_PAD_TP == 8
    for spec in PRESETS.values():
        for tp in (1, 2, 3, 4, 8, 16):
            assert padded_vocab(spec, tp) == gpt_state.padded_vocab(spec, tp)


def test_activations_by_hand() -> None:
    # s=32, b=2, h=64: s*b*h = 4096 bytes; tp2 with SP, selective: per layer
    # (10 + 8 + 4*256/64) / 2 = 17 units; 4 layers, 2 per stage; 4 microbatches
    spec = GPTSpec.parse("layers=4,hidden=64,heads=4,ffn=256,vocab=1024,seq=32,dtype=bf16")
    cfg = ParallelConfig.parse("tp2pp2dp1")
    setup = TrainingSetup(micro_batch=2, global_batch=8)
    # stage 0: 2 layers x 2 in flight x 17 x 4096, plus (8*64 token-id bytes + 4096
    # dropout mask) x 2 in flight / tp
    assert activation_bytes(spec, cfg, 0, setup) == 2 * 2 * 17 * 4096 + 2 * (8 * 64 + 4096) // 2
    # stage 1: 2 layers x 1 in flight, plus the final norm (4*4096/2) and fp32 logits
    # (4 * 64 tokens * 1024 vocab / 2)
    assert activation_bytes(spec, cfg, 1, setup) == 2 * 17 * 4096 + 8192 + 131072
    # one microbatch per step: the first stage holds one only
    one = TrainingSetup(micro_batch=2, global_batch=2)
    assert activation_bytes(spec, cfg, 0, one) == 2 * 17 * 4096 + (8 * 64 + 4096) // 2
    # no sequence parallelism: the 10 unsplit units and the embedding stay whole
    nosp = TrainingSetup(micro_batch=2, global_batch=8, sequence_parallel=False)
    assert activation_bytes(spec, cfg, 0, nosp) == 2 * 2 * (10 + 12) * 4096 + 2 * (512 + 4096)
    # no recompute: attention scores 5 * heads * s / h / tp = 5 * 4 * 32 / 64 / 2 = 5 units
    none = TrainingSetup(micro_batch=2, global_batch=8, recompute="none")
    assert activation_bytes(spec, cfg, 0, none) == 2 * 2 * 22 * 4096 + 4608
    # full recompute: each layer's input (2 / tp units) plus one layer's working set
    full = TrainingSetup(micro_batch=2, global_batch=8, recompute="full")
    assert activation_bytes(spec, cfg, 0, full) == 2 * 2 * 1 * 4096 + 17 * 4096 + 4608


def _megatron_activation_memory(args: SimpleNamespace, num_microbatches: int | None) -> float:
    """Megatron-LM ``theoretical_memory_usage.compute_activation_memory`` (its sequence-
    parallel + selective-recompute path, no virtual pipeline), transcribed."""
    mem = (args.seq_length * args.micro_batch_size * args.hidden_size) * (
        18 + (4 * (args.ffn_hidden_size / args.hidden_size)))
    mem *= args.num_layers
    mem += 8 * args.seq_length * args.micro_batch_size * args.pipeline_model_parallel_size
    mem += (args.seq_length * args.micro_batch_size * args.hidden_size
            * args.pipeline_model_parallel_size)
    if args.pipeline_model_parallel_size > 1 and num_microbatches is not None:
        mem *= min(1, num_microbatches / args.pipeline_model_parallel_size)
    if args.pipeline_model_parallel_size == 1:
        mem += (args.seq_length * args.micro_batch_size * args.hidden_size * 4
                * (1 + (args.padded_vocab_size / args.hidden_size)))
    return mem / args.tensor_model_parallel_size


def test_first_stage_activations_are_megatron_s_estimate() -> None:
    rng = random.Random(7)
    for _ in range(200):
        heads = rng.choice([4, 8, 16, 32])
        hidden = heads * rng.choice([16, 64, 128])
        pp = rng.choice([1, 2, 4])
        spec = GPTSpec(layers=pp * rng.randint(1, 6), hidden=hidden, heads=heads,
                       ffn=hidden * rng.choice([2, 4]), vocab=rng.randint(500, 60000),
                       seq=rng.choice([128, 2048, 8192]), dtype="bfloat16")
        tp, dp, mb = rng.choice([1, 2, 4]), rng.choice([1, 2, 3]), rng.choice([1, 2])
        micro = rng.choice([1, 2, 3, 8])
        cfg = ParallelConfig(tp, pp, dp)
        setup = TrainingSetup(micro_batch=mb, global_batch=dp * mb * micro)
        args = SimpleNamespace(
            seq_length=spec.seq, micro_batch_size=mb, hidden_size=hidden, ffn_hidden_size=spec.ffn,
            num_layers=spec.layers, pipeline_model_parallel_size=pp,
            tensor_model_parallel_size=tp, padded_vocab_size=padded_vocab(spec, tp))
        ours = activation_bytes(spec, cfg, 0, setup)
        assert ours == pytest.approx(_megatron_activation_memory(args, micro), abs=1)


def test_rank_memory_is_the_busiest_stage_and_recompute_orders_it() -> None:
    spec = PRESETS["llama3-70b"]
    cfg = ParallelConfig.parse("tp8pp4dp2")
    setups = [TrainingSetup("distributed", 1, 1024, recompute=r)
              for r in ("full", "selective", "none")]
    totals = [rank_memory(spec, cfg, s).total for s in setups]
    assert totals == sorted(totals) and len(set(totals)) == 3
    busiest = rank_memory(spec, cfg, setups[1])
    assert busiest.total == max(stage_memory(spec, cfg, pp, setups[1]).total for pp in range(4))
    # gated MLP: the fc1 output is twice as wide as ffn (6*ffn/h rather than 4*ffn/h)
    plain = GPTSpec.parse("layers=2,hidden=64,heads=4,ffn=128,vocab=1024,seq=32")
    gated = GPTSpec.parse("layers=2,hidden=64,heads=4,ffn=128,vocab=1024,seq=32,swiglu=1")
    one = ParallelConfig(1, 1, 1)
    assert activation_bytes(gated, one, 0, TrainingSetup()) > activation_bytes(
        plain, one, 0, TrainingSetup())


def test_moe_experts_shard_over_ep_and_their_state_over_expert_dp() -> None:
    spec = PRESETS["mixtral-8x7b"]
    setup = TrainingSetup("distributed", 1, 64)
    one, four = ParallelConfig(8, 1, 8, 1), ParallelConfig(8, 1, 8, 4)
    a, b = rank_memory(spec, one, setup), rank_memory(spec, four, setup)
    assert b.params < a.params / 2  # 2 experts of 8 per rank instead of 8
    _check_state(PRESETS["moe-tiny"], ParallelConfig(1, 1, 4, 2), "distributed")
    _check_state(PRESETS["moe-tiny"], ParallelConfig(2, 2, 2, 2), "adam")


@pytest.mark.parametrize(("text", "n"), [
    ("80GB", 80 * 10**9), ("80GiB", 80 * 2**30), ("80e9", 80 * 10**9), ("1.5 TiB", 3 * 2**39),
    ("85899345920", 85899345920), ("512mib", 512 * 2**20), (4096, 4096),
])
def test_sizes_parse(text: str | int, n: int) -> None:
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text", ["80G", "eighty", "-5GB", "0", "GB", ""])
def test_bad_sizes_are_one_line_usage_errors(text: str) -> None:
    with pytest.raises(UsageError, match="size"):
        parse_bytes(text)


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B" and format_bytes(80 * 10**9) == "74.5 GiB"
    assert format_bytes(3 * 2**40) == "3.0 TiB"
