"""`etcslurm layouts`: every layout with its memory, fits or why not, the policy's pick."""

from __future__ import annotations

import json
import random
import re

import pytest

from etcslurm.cli import main
from etcslurm.core.layout import ParallelConfig
from etcslurm.core.layout_choice import LayoutFilter, LayoutRules, NoLayoutFits, assess
from etcslurm.core.memory import TrainingSetup
from etcslurm.core.models import PRESETS

MUST_SHOW = ["layouts", "--model", "llama3-70b", "--devices", "64", "--gpus-per-node", "8",
             "--gpu-memory", "80GB", "--optimizer", "distributed", "--global-batch", "1024",
             "--json"]


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_llama3_70b_on_64_devices_of_80gb(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, MUST_SHOW)
    assert out["chosen"] == "tp8pp2dp4"
    assert out["per_rank_bytes"] <= out["usable_bytes"] <= 80 * 10**9
    b = out["breakdown"]
    assert b["total"] == out["per_rank_bytes"] == sum(
        b[k] for k in ("params", "grads", "optimizer", "activations")) and b["activations"] > 0
    rows = {r["layout"]: r for r in out["layouts"]}
    assert len(rows) == len(out["layouts"]) and all(
        ParallelConfig.parse(r).world_size == 64 for r in rows)
    chosen = rows["tp8pp2dp4"]
    assert chosen["fits"] and chosen["why"] is None and chosen["per_rank_bytes"] <= 80 * 10**9
    # the unlimited policy's old pick: 400+ GiB of state alone
    dp64 = rows["tp1pp1dp64"]
    assert not dp64["fits"] and dp64["per_rank_bytes"] > 400 * 2**30
    assert re.fullmatch(r"state\+activations [\d.]+ GiB > 67\.1 GiB usable", dp64["why"])
    assert rows["tp16pp1dp4"]["why"] == "query_groups=8 is not divisible by tp=16"
    assert rows["tp16pp1dp4"]["breakdown"] is None
    assert all(r["why"] for r in out["layouts"] if not r["fits"])


def test_why_names_node_batch_and_allowed(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, ["layouts", "--model", "gpt-7b", "--devices", "48", "--gpus-per-node",
                         "8", "--global-batch", "1024", "--allow", "tp=2", "--allow",
                         "tp4pp4dp3", "--json"])
    rows = {r["layout"]: r for r in out["layouts"]}
    assert rows["tp16pp1dp3"]["why"] == "tp=16 does not fit a 8-GPU node (spans 2 nodes)"
    assert rows["tp2pp1dp24"]["why"].startswith("global batch 1024 does not split over dp=24")
    assert "dp×mb = 24" in rows["tp2pp1dp24"]["why"]
    assert rows["tp1pp1dp48"]["why"].startswith("not among the allowed layouts (tp=2; tp4pp4dp3)")
    # dp=3 does not split 1024 either: no layout of 48 fits, 16 devices idle
    assert not any(v["fits"] for v in rows.values())
    assert out["chosen"] == "tp2pp1dp16" and out["idle_devices"] == list(range(32, 48))
    assert "devices 32-47 idle: no allowed layout of 33..48 devices fits" in out["reason"]


def test_human_output_marks_the_choice(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(MUST_SHOW[:-1]) == 0
    text = capsys.readouterr().out
    assert "chosen: tp8pp2dp4" in text and "tp1pp1dp64" in text


def test_nothing_fits_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, ["layouts", "--model", "llama3-70b", "--devices", "8", "--gpu-memory",
                         "80GiB", "--optimizer", "distributed", "--json"])
    assert out["chosen"] is None and out["per_rank_bytes"] is None
    assert re.match(r"8 devices: no layout of llama3-70b fits the memory of a device "
                    r"\(80\.0 GiB, 72\.0 GiB usable; smallest: tp8pp1dp1 needs", out["reason"])
    assert not any(r["fits"] for r in out["layouts"])


def test_the_plan_error_lists_the_same_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "gpt-tiny", "--from", "tp3pp1dp2", "--to", "tp1pp1dp6",
                 "--gpus-per-node", "2"]) == 2
    err = capsys.readouterr().err
    listed = err.split("valid for 6 devices: ", 1)[1].strip().split(", ")
    out = _json(capsys, ["layouts", "--model", "gpt-tiny", "--devices", "6",
                         "--gpus-per-node", "2", "--json"])
    assert listed == [r["layout"] for r in out["layouts"] if r["fits"]]


def test_seeded_random_choices_fit_and_obey_the_limits(capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(1207)
    for _ in range(30):
        name = rng.choice(sorted(PRESETS))
        spec = PRESETS[name]
        n = rng.choice([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128])
        gpn = rng.choice([1, 2, 4, 8])
        memory = rng.choice([None, 16 * 10**9, 40 * 2**30, 80 * 10**9, 141 * 10**9])
        mb = rng.choice([1, 2])
        gb = rng.choice([None, mb * 64, mb * 96, mb * 1024])
        optimizer = rng.choice(["adam", "distributed"])
        recompute = rng.choice(["none", "selective", "full"])
        allow = rng.choice([[], ["tp=1"], ["tp=2", "pp=2"]])
        argv = ["layouts", "--model", name, "--devices", str(n), "--gpus-per-node", str(gpn),
                "--micro-batch", str(mb), "--optimizer", optimizer, "--recompute", recompute,
                "--json"]
        argv += [] if memory is None else ["--gpu-memory", str(memory)]
        argv += [] if gb is None else ["--global-batch", str(gb)]
        for a in allow:
            argv += ["--allow", a]
        out = _json(capsys, argv)
        rules = LayoutRules(TrainingSetup(optimizer, mb, gb, recompute), gpn, memory,
                            allowed=tuple(LayoutFilter.parse(a) for a in allow))
        fitting = [r for r in out["layouts"] if r["fits"]]
        if out["chosen"] is None:
            assert not fitting and out["reason"].startswith(f"{n} devices: ")
            continue
        cfg = ParallelConfig.parse(out["chosen"])
        option = assess(cfg, spec, rules)  # the same judgement, on whatever count it uses
        assert option.fits, (argv, option.problems)
        assert cfg.world_size == out["used_devices"] <= n
        assert gpn % cfg.tp == 0 and (gb is None or gb % (cfg.dp * mb) == 0)
        if memory is not None:
            assert out["per_rank_bytes"] <= out["usable_bytes"] < memory
        if allow:
            assert any(LayoutFilter.parse(a).allows(cfg) for a in allow)
        # a layout of all devices fits: the policy uses all of them
        assert (cfg.world_size == n) == bool(fitting)


def test_no_layout_fits_is_a_layout_error() -> None:
    from etcslurm.core.layout_choice import choose

    rules = LayoutRules(TrainingSetup("adam", 1, 8), 8, 16 * 2**30)
    with pytest.raises(NoLayoutFits, match="memory of a device"):
        choose(1, PRESETS["gpt-70b"], rules)
