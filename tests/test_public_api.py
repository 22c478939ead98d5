"""The public API is what ``import etcslurm`` gives: every exported name exists, and the
pure part of it (the planner) works without torch."""

from __future__ import annotations

import doctest
import json
import subprocess
import sys

import etcslurm


def test_every_exported_name_exists() -> None:
    missing = [n for n in etcslurm.__all__ if not hasattr(etcslurm, n)]
    assert not missing


def test_plan_migration_is_pure_and_agrees_with_the_planner() -> None:
    from etcslurm.core.layout import ParallelConfig
    from etcslurm.core.models import GPTSpec
    from etcslurm.megatron_state import planning
    from etcslurm.megatron_state.planning import plan_for_gpt

    spec = GPTSpec.parse("llama-tiny")
    old, new = ParallelConfig.parse("tp2pp2dp2"), ParallelConfig.parse("tp2pp1dp2")
    got = etcslurm.plan_migration("llama-tiny", "tp2pp2dp2", new, leaving=[4, "5", 6, 7],
                                  optimizer="distributed")
    want = plan_for_gpt(spec, old, new, ["4", "5", "6", "7"], optimizer="distributed")
    assert got.dumps(with_time=False) == want.dumps(with_time=False)
    assert got.stats["moved_bytes"] == got.stats["lower_bound_moved_bytes"] > 0
    assert doctest.testmod(planning).failed == 0


def test_importing_and_planning_loads_neither_torch_nor_megatron() -> None:
    code = ("import sys, json, etcslurm;"
            "p = etcslurm.plan_migration('gpt-tiny', 'tp1pp1dp4', 'tp2pp1dp1', leaving=[1, 2]);"
            "print(json.dumps([p.stats['missing_bytes'], 'torch' in sys.modules,"
            " 'megatron' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert json.loads(out) == [0, False, False]
