"""The analytic expansion (megatron_state) equals the live megatron-core metadata.

Four gloo processes build real megatron-core GPT models + optimizers (through the
etcslurm.megatron adapter: DDP buffers, DistributedOptimizer shards) for several layouts and
report the pieces each rank holds (``local_state(trainee).pieces``); the test compares them
with :func:`etcslurm.megatron_state.rank_pieces` for the same rank, piece for piece.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import GPTSpec
from etcslurm.core.state import Piece
from etcslurm.megatron_state import rank_pieces
from tests.helpers import run_ranks

pytest.importorskip("megatron.core")

SPEC = GPTSpec(layers=4, hidden=64, heads=4, ffn=128, vocab=1000, seq=16, tied_embeddings=True)
UNTIED = GPTSpec(layers=2, hidden=40, heads=2, ffn=72, vocab=300, seq=8, tied_embeddings=False)
MOE = GPTSpec.parse("moe-tiny")
MOE_BF16 = GPTSpec(**{**MOE.to_json(), "name": "", "dtype": "bfloat16"})
MOE_GELU = GPTSpec(layers=2, hidden=64, heads=4, ffn=96, vocab=1000, seq=16, experts=4, topk=2,
                   bias=False, expert_ffn=48)
LLAMA = GPTSpec(**{**GPTSpec.parse("llama-tiny").to_json(), "name": "", "dtype": "bfloat16"})
UNEVEN = GPTSpec(layers=6, hidden=64, heads=4, ffn=128, vocab=1000, seq=16,
                 first_stage_layers=1, last_stage_layers=1)
UNEVEN_V = GPTSpec(layers=8, hidden=64, heads=4, ffn=128, vocab=1000, seq=16,
                   first_stage_layers=2, last_stage_layers=2)
CASES = [
    (SPEC, "tp2pp2dp1", "adam"),
    (SPEC, "tp2pp2dp1", "distributed"),
    (SPEC, "tp1pp2dp2", "distributed"),
    (UNTIED, "tp1pp1dp4", "distributed"),  # odd sizes: 64-element param padding, lcm(4,128)
    (UNTIED, "tp2pp1dp2", "adam"),
    # mixture of experts: experts split over EP, replicated and ZeRO-sharded over expert DP
    (MOE, "tp1pp1dp4ep2", "adam"),
    (MOE, "tp1pp1dp4ep4", "distributed"),
    (MOE_BF16, "tp1pp2dp2ep2", "distributed"),
    (MOE_BF16, "tp1pp2dp2", "distributed"),  # EP 1: experts in the dense DDP buffer
    # ungated experts, expert_ffn != ffn; TP stays 1 for MoE on CPU (sequence parallelism
    # needs Apex norms: megatron.model.moe_layout_problem), benchmarks/gpu_check.sh has TP 2
    (MOE_GELU, "tp1pp1dp4ep2", "distributed"),
    # expert tensor parallelism apart from TP: each expert's MLP split over etp ranks of
    # megatron's expert grid (etp-ep-edp), which crosses DP (etp > tp) or TP (etp < tp)
    (MOE, "tp1pp1dp4ep2etp2", "distributed"),
    (MOE_BF16, "tp1pp1dp4ep2etp2", "adam"),
    (MOE_GELU, "tp2pp1dp2ep2etp1", "distributed"),  # state only: TP 2 MoE needs Apex
    (MOE, "tp2pp1dp2ep2etp1", "adam"),
    (MOE, "tp1pp2dp2ep2etp1", "distributed"),  # etp = tp written out: the default layout
    # an interleaved pipeline: two model chunks per rank, each with its own DDP buffer
    (SPEC, "tp1pp2vpp2dp2", "distributed"),
    (SPEC, "tp2pp2vpp2dp1", "adam"),
    (LLAMA, "tp1pp2vpp2dp2", "distributed"),
    # context parallel: weights replicated over CP, the optimizer sharded over DP x CP
    (SPEC, "tp1cp2pp1dp2", "distributed"),
    (SPEC, "tp2cp2pp1dp1", "distributed"),
    (UNTIED, "tp1cp2pp2dp1", "distributed"),
    # uneven stages (1, 2, 2, 1 layers), and with two chunks per stage (1+1, 1+1, ...)
    (UNEVEN, "tp1pp4dp1", "distributed"),
    (UNEVEN_V, "tp1pp4vpp2dp1", "adam"),
]
VOCAB_TP = 8  # the adapter pads the vocabulary for TP 8 in every layout

WORKER = r"""
import json, sys, datetime
import torch.distributed as dist
from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import GPTSpec
from etcslurm.megatron.parallel import init_parallel, teardown
from etcslurm.megatron.model import build_gpt
from etcslurm.megatron.sharded_meta import local_state
rank, port, out, cases = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
store = dist.TCPStore("127.0.0.1", port, 4, rank == 0, timeout=datetime.timedelta(seconds=120))
result = []
for gen, (spec, layout, opt) in enumerate(cases):
    cfg = ParallelConfig.parse(layout)
    init_parallel(cfg, rank, 4, store, gen, backend="gloo", timeout_s=120)
    trainee = build_gpt(GPTSpec.from_json(spec), cfg, optimizer=opt,
                        state_only=cfg.cp > 1 or cfg.tp > 1)
    result.append([p.to_json() for p in local_state(trainee).pieces])
teardown()
json.dump(result, open(out, "w"))
"""


@pytest.mark.slow
def test_analytic_pieces_equal_live_megatron_metadata(tmp_path: Path) -> None:
    pytest.importorskip("etcslurm.megatron.sharded_meta")
    cases = json.dumps([[s.to_json(), layout, opt] for s, layout, opt in CASES])
    run_ranks(WORKER, 4, lambda r: [str(tmp_path / f"r{r}.json"), cases], timeout=400)
    for r in range(4):
        live = json.loads((tmp_path / f"r{r}.json").read_text())
        for (spec, layout, opt), pieces in zip(CASES, live, strict=True):
            got = sorted(Piece.from_json(p) for p in pieces)
            want = sorted(rank_pieces(spec, ParallelConfig.parse(layout), r, opt,
                                      vocab_pad_tp=VOCAB_TP))
            assert got == want, (layout, opt, r, sorted(set(got) ^ set(want))[:4])
