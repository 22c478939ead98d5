"""The migration sequence's pure parts: what a live plan's missing pieces mean."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from etcslurm.core.plan import MigrationPlan
from etcslurm.core.state import Piece
from etcslurm.runtime.plans import _split_fill

EMB = "embedding.word_embeddings.weight"


def test_vocab_rows_no_old_rank_held_are_filled_and_the_rest_is_lost() -> None:
    """A TP change that grows the padded vocabulary from 1024 to 1152 rows: rows
    [1024, 1152) are filled (zeros, like megatron-core's resharded load); a layer piece
    nobody holds stays missing (lost state)."""
    old = [Piece(EMB, ((0, 512), (0, 8)), "float32"), Piece(EMB, ((512, 1024), (0, 8)), "float32")]
    lost_piece = Piece("decoder.layers.mlp.linear_fc2.weight", ((0, 1), (0, 8), (0, 8)), "float32")
    plan = MigrationPlan(
        assignment=["0", "1"], messages=[], local={}, idle=[], stats={},
        missing={"0": [Piece(EMB, ((1000, 1152), (0, 8)), "float32")], "1": [lost_piece]},
    )
    migration = SimpleNamespace(job=SimpleNamespace(me="0"), fill=[])
    _split_fill(migration, plan, old)  # type: ignore[arg-type]
    assert migration.fill == [Piece(EMB, ((1024, 1152), (0, 8)), "float32")]
    # rows 1000-1023 were held by an old rank: if no survivor has them now they are lost
    assert plan.missing == {"0": [Piece(EMB, ((1000, 1024), (0, 8)), "float32")],
                            "1": [lost_piece]}


def test_the_analytic_plan_fills_new_vocab_rows_and_refuses_a_lost_piece() -> None:
    """Planning from the analytic model: vocabulary rows no old layout had become this
    participant's zero-fill; a piece nobody holds contradicts the decider (who found
    nothing lost) and is refused, naming it; the totals reported are the decider's."""
    from etcslurm.core.plan import PlanInputs
    from etcslurm.errors import MigrationError
    from etcslurm.runtime.plans import analytic_plan

    held = [Piece(EMB, ((0, 1024), (0, 8)), "float32")]
    grown = [Piece(EMB, ((0, 1152), (0, 8)), "float32")]
    inputs = PlanInputs(old_classes=[held], old_device_class={"0": 0},
                        new_classes=[grown], new_rank_class=[0], nodes={"0": "n0"})
    migration = SimpleNamespace(job=SimpleNamespace(me="0", generation=3), fill=[])
    got = analytic_plan(migration, inputs, assignment=["0"], old_vocab_rows=1024,  # type: ignore[arg-type]
                        totals={"moved_bytes": 5, "local_bytes": 7})
    assert migration.fill == [Piece(EMB, ((1024, 1152), (0, 8)), "float32")]
    assert got.missing == {} and got.messages == []
    assert (got.stats["moved_bytes"], got.stats["local_bytes"], got.stats["lost_pieces"]) == (5, 7, 0)
    layer = Piece("decoder.layers.mlp.linear_fc2.weight", ((0, 1), (0, 8), (0, 8)), "float32")
    lost = PlanInputs(old_classes=[held], old_device_class={"0": 0},
                      new_classes=[[*held, layer]], new_rank_class=[0], nodes={"0": "n0"})
    with pytest.raises(MigrationError, match=r"generation 3: 0 needs .*linear_fc2.*decider"):
        analytic_plan(migration, lost, assignment=["0"], old_vocab_rows=1024)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- a kept model
def test_a_kept_piece_is_one_the_new_model_views_through_the_same_memory() -> None:
    """Local copies of a kept model onto itself are dropped; anything else is kept."""
    import torch

    from etcslurm.runtime.migration import _boxes_by_tensor, _kept_pieces, _within

    base = torch.arange(16.0)
    a, b = Piece("a", ((0, 8),), "float32"), Piece("b", ((0, 8),), "float32")
    held = [(a, base[:8]), (b, base[8:])]
    needed = [(a, base[:8]), (b, base[8:].clone())]  # b is new memory: still copied
    kept = _kept_pieces(held, needed)
    assert kept == [a]
    boxes = _boxes_by_tensor(kept)
    assert _within(Piece("a", ((2, 4),), "float32"), boxes)
    assert not _within(Piece("a", ((6, 10),), "float32"), boxes)  # sticks out
    assert not _within(Piece("a", ((2, 4),), "bfloat16"), boxes)  # another tensor
    assert not _within(Piece("b", ((2, 4),), "float32"), boxes)


def test_a_model_built_anew_where_nothing_moves_is_filled_from_its_own_old_tensors() -> None:
    """The fallback of a change in which nothing moves (a model that cannot be kept):
    each needed piece is copied from the same held piece, shared memory skipped; a
    piece this rank does not hold is refused, naming it."""
    import torch

    from etcslurm.errors import MigrationError
    from etcslurm.runtime.migration import _copy_own

    a, b = Piece("a", ((0, 4),), "float32"), Piece("b", ((0, 4),), "float32")
    old_a, old_b = torch.arange(4.0), torch.arange(4.0, 8.0)
    new_a = torch.zeros(4)
    assert _copy_own([(a, old_a), (b, old_b)], [(a, new_a), (b, old_b)], "here") == 16
    assert torch.equal(new_a, old_a)
    with pytest.raises(MigrationError, match=r"here: nothing was to move.*Piece\(key='b'"):
        _copy_own([(a, old_a)], [(b, torch.zeros(4))], "here")


def test_a_kept_model_is_checked_against_the_pieces_its_new_rank_needs() -> None:
    """A kept model is not described and copied onto itself: its held pieces must be
    every piece the new rank needs, else the change is refused naming the first."""
    import torch

    from etcslurm.errors import MigrationError
    from etcslurm.runtime.migration import _check_held

    a, b = Piece("a", ((0, 4),), "float32"), Piece("b", ((0, 4),), "float32")
    held = [(a, torch.zeros(4)), (b, torch.zeros(4))]
    _check_held(held, [b, a], "here")
    with pytest.raises(MigrationError, match=r"here: nothing was to move.*Piece\(key='c'"):
        _check_held(held, [a, Piece("c", ((0, 4),), "float32")], "here")


def test_only_a_dp_only_change_that_keeps_the_coordinate_keeps_the_model() -> None:
    from etcslurm.core.layout import ParallelConfig as P
    from etcslurm.megatron.regroup import can_keep

    assert can_keep((P(1, 1, 4), 3), (P(1, 1, 3), 0), "adam")
    assert can_keep((P(2, 2, 2), 5), (P(2, 2, 1), 3), "adam")  # tp 1, pp 1 both times
    assert not can_keep((P(2, 2, 2), 5), (P(2, 2, 1), 2), "adam")  # another pp stage
    assert not can_keep((P(1, 1, 4), 0), (P(1, 1, 2), 0), "distributed")  # shards move
    assert not can_keep((P(1, 1, 4), 0), (P(2, 1, 2), 0), "adam")  # TP changes


KEPT_SCRIPT = r"""
import sys, json, torch
from etcslurm.megatron.cpu_shim import install_if_needed
install_if_needed()
import torch.distributed as dist
from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import PRESETS
from etcslurm.groups import lifecycle as groups
from etcslurm.megatron import parallel, regroup
from etcslurm.megatron.adapter import finish_restore
from etcslurm.megatron.model import TrainHyper, build_gpt
from etcslurm.megatron.scalars import extract_scalars
from etcslurm.megatron.train import train_step

dtype, store = sys.argv[1], dist.HashStore()
spec, cfg, hyper = PRESETS["gpt-tiny"], ParallelConfig.parse("tp1pp1dp1"), TrainHyper(global_batch=4)

def fresh(gen):
    parallel.init_parallel(cfg, 0, 1, store, gen, timeout_s=60)
    return build_gpt(spec, cfg, dtype=dtype, hyper=hyper)

def state(tr):
    params = [p.detach().clone() for p in tr.modules()[0].parameters()]
    grads = [p.main_grad.clone() for p in tr.modules()[0].parameters()]
    return params, grads

tr = fresh("ref")
ref = [train_step(tr) for _ in range(3)]
ref_state = state(tr)
groups.teardown()
tr = fresh("old")
got = [train_step(tr)]
scalars, before = extract_scalars(tr), regroup.snapshot()
groups.teardown()  # only communicators go: the model's tensors stay valid
parallel.init_parallel(cfg, 0, 1, store, "new", timeout_s=60)
kept = regroup.rewrap(tr, before, cfg)
finish_restore(kept, scalars)
same_module = kept.modules()[0] is tr.modules()[0]
got += [train_step(kept) for _ in range(2)]
got_state = state(kept)
print(json.dumps(dict(
    losses=ref == got, same_module=same_module,
    params=all(torch.equal(a, b) for a, b in zip(ref_state[0], got_state[0])),
    grads=all(torch.equal(a, b) for a, b in zip(ref_state[1], got_state[1])))))
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_kept_model_trains_on_bit_for_bit_like_one_never_regrouped(dtype: str) -> None:
    """A model re-wrapped for a new world (new groups, DDP, optimizer; same module and
    Adam state) trains on exactly as if nothing happened: losses, params and gradients
    equal bit for bit (gradients would be doubled if the old DDP's hooks survived)."""
    out = subprocess.run([sys.executable, "-c", KEPT_SCRIPT, dtype], capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == dict(
        losses=True, same_module=True, params=True, grads=True)
