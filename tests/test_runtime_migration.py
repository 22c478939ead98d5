"""The migration sequence's pure parts: what a live plan's missing pieces mean."""

from __future__ import annotations

from types import SimpleNamespace

from etcslurm.core.planner import MigrationPlan
from etcslurm.core.state import Piece
from etcslurm.runtime.migration import _split_fill

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
