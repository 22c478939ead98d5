"""Llama-style models (GQA, SwiGLU, RMSNorm, RoPE, untied, bf16): the model description,
the analytic state and megatron-core's live state agree.

The slow test starts four gloo processes that build real megatron-core models and
optimizers (through ``etcslurm.megatron.model.build_gpt``) for every case below and report
the pieces each rank holds (``local_state(trainee).pieces``, ShardedTensorFactory entries
applied); each must equal :func:`etcslurm.megatron_state.rank_pieces` for that rank.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import PRESETS, GPTSpec
from etcslurm.core.state import Piece
from etcslurm.errors import UsageError
from etcslurm.megatron_state import (
    expand,
    padded_vocab,
    rank_pieces,
    split_vocab_fill,
    stage_params,
    vocab_padding,
    vocab_rows,
)
from tests.helpers import run_ranks

LLAMA = PRESETS["llama-tiny"]
GPT = PRESETS["gpt-tiny"]
#: gated MLP with biases (the factory splits linear_fc1.bias too), LayerNorm, tied
#: embeddings (shared across PP), RoPE, odd sizes
ODD = GPTSpec(layers=2, hidden=48, heads=4, query_groups=2, ffn=40, vocab=300, seq=8,
              gated=True, activation="silu", bias=True, tied_embeddings=True, position="rope")

#: (spec, layout, optimizer, params dtype, train one step before describing)
CASES: list[tuple[GPTSpec, str, str, str, bool]] = [
    (LLAMA, "tp2pp2dp1", "adam", "float32", False),
    (LLAMA, "tp2pp2dp1", "distributed", "bfloat16", True),
    (LLAMA, "tp1pp2dp2", "distributed", "bfloat16", False),
    (LLAMA, "tp2pp1dp2", "distributed", "float32", False),
    (LLAMA, "tp1pp1dp4", "adam", "bfloat16", False),
    (LLAMA, "tp1pp4dp1", "distributed", "bfloat16", False),
    (GPT, "tp2pp2dp1", "adam", "float32", False),
    (GPT, "tp1pp2dp2", "distributed", "bfloat16", False),
    (GPT, "tp2pp1dp2", "distributed", "float32", False),
    (GPT, "tp1pp1dp4", "adam", "bfloat16", False),
    (GPT, "tp4pp1dp1", "distributed", "float32", False),
    (ODD, "tp2pp2dp1", "distributed", "bfloat16", False),
]

WORKER = r"""
import json, sys, datetime, time
import torch.distributed as dist
from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import GPTSpec
from etcslurm.megatron.parallel import init_parallel, teardown
from etcslurm.megatron.model import build_gpt
from etcslurm.megatron.sharded_meta import check_describable, local_state
from etcslurm.megatron.train import train_step
rank, port, out, cases = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
store = dist.TCPStore("127.0.0.1", port, 4, rank == 0, timeout=datetime.timedelta(seconds=120))
result = []
for gen, (spec, layout, opt, dtype, train) in enumerate(cases):
    t0 = time.perf_counter()
    cfg = ParallelConfig.parse(layout)
    init_parallel(cfg, rank, 4, store, gen, backend="gloo", timeout_s=120)
    trainee = build_gpt(GPTSpec.from_json(spec), cfg, optimizer=opt, dtype=dtype)
    check_describable(trainee)
    loss = train_step(trainee) if train else None
    pieces = [p.to_json() for p in local_state(trainee).pieces]
    result.append({"pieces": pieces, "loss": loss, "seconds": time.perf_counter() - t0})
teardown()
json.dump(result, open(out, "w"))
"""


# ------------------------------------------------------------------ model description
def test_presets_have_published_shapes() -> None:
    eight, seventy = PRESETS["llama3-8b"], PRESETS["llama3-70b"]
    assert (eight.layers, eight.hidden, eight.heads, eight.groups, eight.ffn, eight.vocab) == (
        32, 4096, 32, 8, 14336, 128256)
    assert (seventy.layers, seventy.hidden, seventy.heads, seventy.groups, seventy.ffn) == (
        80, 8192, 64, 8, 28672)
    for spec in (eight, seventy, LLAMA):
        assert spec.gated and spec.activation == "silu" and spec.norm == "RMSNorm"
        assert spec.position == "rope" and not spec.tied_embeddings and not spec.bias
    assert eight.dtype == seventy.dtype == "bfloat16"
    assert round(eight.num_params() / 1e9, 2) == 8.03
    assert round(seventy.num_params() / 1e9, 1) == 70.6


@pytest.mark.parametrize("name,billions", [("llama3-8b", 8.03), ("llama3-70b", 70.55)])
def test_expand_gives_published_parameter_counts(name: str, billions: float) -> None:
    spec = PRESETS[name]
    # TP 1 and plain megatron padding: 128256 is a multiple of 128, so no padding rows
    state = expand(spec, ParallelConfig.parse("tp1pp8dp1"), "distributed", vocab_pad_tp=None)
    held = {(p.key, p.box): p for block in state.blocks for p in block
            if not p.key.startswith("optimizer.")}
    total = sum(p.numel for p in held.values())
    assert total == spec.num_params(1)
    assert round(total / 1e9, 2) == billions
    assert {p.dtype for p in held.values()} == {"bfloat16"}
    keys = {k for k, _ in held}
    assert "output_layer.weight" in keys and "embedding.position_embeddings.weight" not in keys
    assert not any(k.endswith("bias") for k in keys)
    # bf16 + distributed optimizer: fp32 main params and both moments, each element once
    # over the DP ranks of a (tp, pp)
    main = [p for block in state.blocks for p in block
            if p.key.startswith("optimizer.state.fp32_param.")]
    assert {p.dtype for p in main} == {"float32"} and sum(p.numel for p in main) == total


def test_text_and_json_forms_round_trip() -> None:
    old = GPTSpec.parse("layers=4,hidden=64,heads=4,vocab=1024,seq=64")
    assert old == GPT and str(old) == "layers=4,hidden=64,heads=4,ffn=256,vocab=1024,seq=64"
    assert str(GPTSpec.parse("layers=2,hidden=32,heads=4,vocab=9,seq=8,tied=0")).endswith(
        ",tied=0")
    # an old JSON document (no Llama fields) still loads
    legacy = {"layers": 4, "hidden": 64, "heads": 4, "ffn": 256, "vocab": 1024, "seq": 64,
              "tied_embeddings": True, "name": "gpt-tiny"}
    assert GPTSpec.from_json(legacy) == GPT
    for spec in (*PRESETS.values(), ODD):
        assert GPTSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
        text = str(GPTSpec(**{**spec.to_json(), "name": ""}))
        assert GPTSpec.parse(text) == spec, text
    swiglu = GPTSpec.parse("layers=2,hidden=32,heads=4,groups=2,vocab=100,seq=8,ffn=48,"
                           "swiglu=1,norm=rms,pos=rope,bias=0,tied=0,dtype=bf16")
    assert swiglu == GPTSpec(layers=2, hidden=32, heads=4, query_groups=2, ffn=48, vocab=100,
                             seq=8, gated=True, activation="silu", norm="RMSNorm",
                             position="rope", bias=False, tied_embeddings=False,
                             dtype="bfloat16")


@pytest.mark.parametrize("bad", [
    "layers=2,hidden=32,heads=4,groups=3,vocab=9,seq=8",
    "layers=2,hidden=32,heads=4,vocab=9,seq=8,norm=batchnorm",
    "layers=2,hidden=32,heads=4,vocab=9,seq=8,dtype=int8",
    "layers=2,hidden=32,heads=4,vocab=9,seq=8,glu=2",
    "layers=2,hidden=32,heads=4,vocab=9,seq=8,experts=4",
])
def test_bad_model_text_is_a_usage_error(bad: str) -> None:
    with pytest.raises(UsageError):
        GPTSpec.parse(bad)


def test_gqa_limits_tensor_parallelism() -> None:
    with pytest.raises(UsageError, match="query_groups=2 is not divisible by tp=4"):
        expand(LLAMA, ParallelConfig.parse("tp4pp1dp1"))


def test_swiglu_fc1_is_two_factory_halves() -> None:
    cfg = ParallelConfig.parse("tp2pp1dp1")
    f, h = LLAMA.ffn, LLAMA.hidden
    for tp_rank in range(2):
        fc1 = next(p for p in stage_params(LLAMA, cfg, tp_rank, 0)
                   if p.key == "decoder.layers.mlp.linear_fc1.weight")
        lo = tp_rank * f // 2
        assert fc1.boxes == (((0, 1), (lo, lo + f // 2), (0, h)),
                             ((0, 1), (f + lo, f + lo + f // 2), (0, h)))
        assert fc1.numel == f * h
        qkv = next(p for p in stage_params(LLAMA, cfg, tp_rank, 0)
                   if p.key == "decoder.layers.self_attention.linear_qkv.weight")
        rows = (4 + 2 * 2) * 16 // 2  # (heads + 2 groups) * kv_channels / tp
        assert qkv.box[1] == (tp_rank * rows, (tp_rank + 1) * rows)


# ------------------------------------------------------------------ vocabulary padding
def test_vocab_padding_rows_are_filled_not_lost() -> None:
    from etcslurm.megatron_state.planning import plan_for_gpt

    spec = PRESETS["gpt-125m"]
    old, new = ParallelConfig.parse("tp2pp1dp3"), ParallelConfig.parse("tp3pp1dp2")
    assert padded_vocab(spec, 2) == 51200 and padded_vocab(spec, 3) == 51456
    for optimizer in ("adam", "distributed"):
        p = plan_for_gpt(spec, old, new, optimizer=optimizer)
        missing = [s for slices in p.missing.values() for s in slices]
        assert missing  # the planner alone reports the new padding rows as missing
        held = vocab_rows(q for b in expand(spec, old, optimizer).blocks for q in b)
        assert set(held.values()) == {51200}
        fill, lost = split_vocab_fill(missing, held)
        assert lost == [] and sum(q.nbytes for q in fill) == p.stats["missing_bytes"]
        assert all(q.box[0][0] >= 51200 for q in fill)
        assert split_vocab_fill(missing, 51200) == (fill, lost)
    # real state whose holders are gone stays lost
    gone = Piece("decoder.layers.mlp.linear_fc2.bias", ((0, 1), (0, 768)), "float32")
    assert split_vocab_fill([gone], 51200) == ([], [gone])
    part = Piece("output_layer.weight", ((51000, 51456), (0, 8)), "float32")
    fill, lost = split_vocab_fill([part], {"output_layer.weight": 51200})
    assert [q.box[0] for q in fill] == [(51200, 51456)] and [q.box[0] for q in lost] == [
        (51000, 51200)]
    pad = vocab_padding(rank_pieces(LLAMA, ParallelConfig.parse("tp1pp1dp1"), 0), LLAMA.vocab)
    assert {q.key for q in pad} == {
        "embedding.word_embeddings.weight", "output_layer.weight",
        "optimizer.state.exp_avg.embedding.word_embeddings.weight",
        "optimizer.state.exp_avg.output_layer.weight",
        "optimizer.state.exp_avg_sq.embedding.word_embeddings.weight",
        "optimizer.state.exp_avg_sq.output_layer.weight"}
    assert {q.box[0] for q in pad} == {(1000, 1024)}


# ------------------------------------------------------------------ analytic == live
@pytest.mark.slow
def test_analytic_pieces_equal_live_megatron_state(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    cases = json.dumps([[s.to_json(), lay, opt, dt, tr] for s, lay, opt, dt, tr in CASES])
    t0 = time.perf_counter()
    run_ranks(WORKER, 4, lambda r: [str(tmp_path / f"r{r}.json"), cases], timeout=600)
    results = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(4)]
    for r in range(4):
        for (spec, layout, opt, dtype, train), res in zip(CASES, results[r], strict=True):
            got = sorted(Piece.from_json(p) for p in res["pieces"])
            want = sorted(rank_pieces(spec, ParallelConfig.parse(layout), r, opt, dtype,
                                      vocab_pad_tp=8))
            assert got == want, (str(spec), layout, opt, dtype, r,
                                 sorted(set(got) ^ set(want))[:4])
            if train:
                assert res["loss"] is not None and 0 < res["loss"] < 20
    timings = {f"{s}/{lay}/{opt}/{dt}": round(results[0][i]["seconds"], 2)
               for i, (s, lay, opt, dt, _) in enumerate(CASES)}
    print(f"built+described in {time.perf_counter() - t0:.1f} s: {timings}")


# ------------------------------------------------------------------ what cannot be described
class _Fake:
    """A trainee-like object with one model chunk (no parallel_state needed)."""

    def __init__(self, module: object) -> None:
        self._module = module

    def modules(self) -> list:
        return [self._module]


def test_undescribable_tensors_fail_with_one_line() -> None:
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from etcslurm.errors import MigrationError
    from etcslurm.megatron.sharded_meta import param_metas

    class Listed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4, 3))
            self.hidden = torch.nn.Parameter(torch.zeros(2))

        def sharded_state_dict(self) -> dict:
            return {"w": ShardedTensor.from_rank_offsets("w", self.w)}

    with pytest.raises(MigrationError, match=r"^cannot describe tensor hidden: .*$"):
        param_metas(_Fake(Listed()))

    class Copies(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4, 3))

        def sharded_state_dict(self) -> dict:
            def build(key, t, replica_id, flattened_range):
                return [ShardedTensor.from_rank_offsets(key, t.clone())]

            return {"w": ShardedTensorFactory("fc.w", self.w, build, torch.cat)}

    with pytest.raises(MigrationError, match=r"^cannot describe tensor fc.w: "):
        param_metas(_Fake(Copies()))

    class Halves(torch.nn.Module):  # a SwiGLU-like factory: two halves, fine
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.arange(12.0).view(4, 3))

        def sharded_state_dict(self) -> dict:
            def build(key, t, replica_id, flattened_range):
                a, b = torch.chunk(t, 2)
                return [ShardedTensor.from_rank_offsets(key, b, (0, 1, 2)),
                        ShardedTensor.from_rank_offsets(key, a, (0, 0, 2))]

            return {"w": ShardedTensorFactory("fc.w", self.w, build, torch.cat)}

    module = Halves()
    (meta,) = param_metas(_Fake(module)).values()
    assert meta.parts == (("fc.w", ((0, 2), (0, 3)), 0), ("fc.w", ((2, 4), (0, 3)), 6))
    assert meta.ranges(4, 9) == [("fc.w", ((1, 2), (1, 3)), 0), ("fc.w", ((2, 3), (0, 3)), 2)]


# ------------------------------------------------------------------ vocab padding oracle
#: TP 3 pads the vocabulary to 1152 rows where TP 1 has 1024 (heads/groups/ffn split by 3)
TP3 = GPTSpec(layers=2, hidden=48, heads=6, query_groups=3, ffn=48, vocab=1000, seq=16,
              gated=True, activation="silu", norm="RMSNorm", position="rope", bias=False,
              tied_embeddings=False, dtype="bfloat16")

ORACLE = r"""
import json, sys, datetime
import torch, torch.distributed as dist
from etcslurm.baseline.checkpoint import CheckpointMigrator
from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import GPTSpec
from etcslurm.megatron.parallel import init_parallel, teardown
from etcslurm.megatron.model import TrainHyper, build_gpt
from etcslurm.megatron.sharded_meta import gather_global
from etcslurm.megatron.train import train_step
rank, port, out, spec, opt, ckpt = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                    GPTSpec.from_json(json.loads(sys.argv[4])), sys.argv[5],
                                    sys.argv[6])
store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timeout=datetime.timedelta(seconds=120))
old, new = ParallelConfig.parse("tp1pp1dp3"), ParallelConfig.parse("tp3pp1dp1")
init_parallel(old, rank, 3, store, 0, backend="gloo", timeout_s=120)
hyper = TrainHyper(global_batch=6)
t = build_gpt(spec, old, optimizer=opt, hyper=hyper)
train_step(t)
before = gather_global(t)
ck = CheckpointMigrator(async_writer=False)
ck.save(t, ckpt)
init_parallel(new, rank, 3, store, 1, backend="gloo", timeout_s=120)
fresh = build_gpt(spec, new, optimizer=opt, seed=99, hyper=hyper)
ck.load(fresh, ckpt)
after = gather_global(fresh)
ck.close()
teardown()
if rank == 0:
    torch.save({"before": before, "after": after}, out)
"""


@pytest.mark.slow
def test_vocab_fill_matches_megatron_resharded_load(tmp_path: Path) -> None:
    """megatron-core's own resharded checkpoint load (TP 1 → TP 3, padded vocabulary 1024 →
    1152; bf16, distributed optimizer) leaves exactly the rows ``split_vocab_fill`` calls
    ``fill`` at zero, for the params, the fp32 main params and both Adam moments, and keeps
    everything else."""
    optimizer = "distributed"
    pytest.importorskip("megatron.core")
    import torch

    from etcslurm.megatron_state.planning import plan_for_gpt

    old, new = ParallelConfig.parse("tp1pp1dp3"), ParallelConfig.parse("tp3pp1dp1")
    run_ranks(ORACLE, 3, lambda r: [str(tmp_path / "out.pt"), json.dumps(TP3.to_json()),
                                     optimizer, str(tmp_path / "ckpt")], timeout=600)
    got = torch.load(tmp_path / "out.pt")
    before, after = got["before"], got["after"]
    plan = plan_for_gpt(TP3, old, new, optimizer=optimizer, params_dtype=TP3.dtype)
    missing = [s for slices in plan.missing.values() for s in slices]
    held = vocab_rows(q for b in expand(TP3, old, optimizer).blocks for q in b)
    fill, lost = split_vocab_fill(missing, held)
    assert lost == [] and fill and set(held.values()) == {1024}
    assert set(after) == set(before)
    assert "optimizer.state.fp32_param.output_layer.weight" in after
    zeroed = {q.key for q in fill}
    assert {k for k in after if k.endswith(("word_embeddings.weight", "output_layer.weight"))
            } == zeroed
    for key, tensor in after.items():
        old_t = before[key]
        rows = old_t.shape[0]
        if key in zeroed:
            assert tensor.shape[0] == 1152 and rows == 1024
            assert torch.equal(tensor[:rows], old_t), key
            assert not bool(tensor[rows:].any()), f"{key}: padding rows are not zeros"
            assert bool(old_t[1000:].any()) or "exp_avg" in key  # padding rows are state
        else:
            assert torch.equal(tensor, old_t), key


@pytest.mark.slow
def test_plan_cli_answers_for_llama3_70b() -> None:
    """Two pipeline stages of 8k devices leave (≈1 minute with today's planner)."""
    out = subprocess.run(
        [sys.executable, "-m", "etcslurm", "plan", "--model", "llama3-70b", "--from",
         "tp8pp8dp128", "--to", "tp8pp8dp96", "--leave", "6144-8191", "--optimizer",
         "distributed", "--json"], capture_output=True, text=True, timeout=900, check=True)
    stats = json.loads(out.stdout)
    assert stats["model"] == "llama3-70b" and stats["missing_bytes"] == 0
    assert stats["moved_bytes"] == stats["lower_bound_moved_bytes"] > 0


def test_zero_fill_writes_into_live_views() -> None:
    import torch

    from etcslurm.megatron.sharded_meta import LocalState, zero_fill

    weight = torch.ones(8, 3)
    piece = Piece("output_layer.weight", ((4, 12), (0, 3)), "float32")
    state = LocalState([piece], [weight])
    fill, lost = split_vocab_fill([Piece("output_layer.weight", ((8, 12), (0, 3)), "float32")],
                                  {"output_layer.weight": 10})
    assert zero_fill(state, fill) == 2 * 3 * 4
    assert weight[:6].eq(1).all() and not weight[6:].any() and len(lost) == 1
