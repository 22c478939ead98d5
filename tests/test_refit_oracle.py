"""megatron-core's own weight resharding ("refit") as an external oracle in ``bench migrate``.

Where refit applies (one world: the same world size, nobody leaves or joins) the benchmark
reshards the exact pre-migration weights with ``megatron.core.resharding.refit.
swap_model_weights`` over gloo into a NaN-filled target model of the new layout and checks
the target's weights equal the P2P-migrated model's bit for bit (weights only: refit does
not move optimizer state).  Elsewhere the report says why it did not run.  The multi-process cases run in
``tests/test_migrate_gpt.py``'s launch (``test_refit_weights_equal_p2p``).
"""

from __future__ import annotations

import pytest

from etcslurm.bench.refit import out_of_scope, rank_enum
from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import GPTSpec


@pytest.mark.parametrize("layout", ["tp2pp2dp2", "tp1pp2dp4", "tp4pp1dp2", "tp2pp4dp1"])
def test_rank_enum_groups_match_the_layout_rank_order(layout: str) -> None:
    """The einops-free grid enumeration gives the groups of ParallelConfig's rank order."""
    cfg = ParallelConfig.parse(layout)
    shape, names = [cfg.tp, 1, 1, cfg.dp, cfg.pp], ["tp", "cp", "ep", "dp", "pp"]
    coords = [cfg.coord(r) for r in range(cfg.world_size)]
    for dim in ("tp", "dp", "pp"):
        groups = rank_enum(shape, names, [dim])
        assert sorted(r for g in groups for r in g) == list(range(cfg.world_size))
        for g in groups:
            # members differ in ``dim`` only, in increasing order of it
            others = {tuple(v for k, v in coords[r]._asdict().items() if k != dim) for r in g}
            assert len(others) == 1
            assert [getattr(coords[r], dim) for r in g] == list(range(getattr(cfg, dim)))
    # megatron's own example (HyperCommGrid docstring grid [2, 2, 2]): groups over a, b
    assert rank_enum([2, 2, 2], ["a", "b", "c"], ["b", "a"]) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_out_of_scope_cases_say_why() -> None:
    gpt, llama = GPTSpec.parse("gpt-tiny"), GPTSpec.parse("llama-tiny")
    p = ParallelConfig.parse
    assert out_of_scope(gpt, p("tp2pp2dp1"), p("tp1pp2dp2"), [], 0) is None
    assert out_of_scope(llama, p("tp2pp1dp2"), p("tp1pp2dp2"), [], 0) is None
    assert "one world" in out_of_scope(gpt, p("tp1pp2dp2"), p("tp1pp2dp3"), [], 1)
    assert "one world" in out_of_scope(gpt, p("tp1pp2dp2"), p("tp1pp2dp2"), [1], 1)
    assert "tied" in out_of_scope(gpt, p("tp2pp1dp2"), p("tp1pp2dp2"), [], 0)
    assert "dump" in out_of_scope(gpt, p("tp2pp2dp1"), p("tp1pp2dp2"), [], 0, have_dump=False)
