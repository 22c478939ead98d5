"""`etcslurm plan`: JSON fields, human output, bad input → one line + exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from etcslurm.cli import main

FIELDS = ("state_bytes", "moved_bytes", "local_bytes", "inter_node_bytes",
          "lower_bound_moved_bytes", "naive_moved_bytes", "missing_bytes", "messages", "rounds",
          "max_send_bytes", "max_recv_bytes", "peak_staging_bytes", "plan_seconds", "assignment")


def test_json_output(capsys):
    rc = main(["plan", "--model", "gpt-tiny", "--from", "tp2pp2dp4", "--to", "tp2pp2dp3",
               "--leave", "12-15", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for f in FIELDS:
        assert f in out
    assert len(out["assignment"]) == 12 and "12" not in out["assignment"].values()
    assert out["moved_bytes"] == out["lower_bound_moved_bytes"] > 0


def test_part_of_a_device_reports_its_own_share(capsys):
    # untied, distributed optimizer, the last of 4 stages leaves: device 0 (stage 0, which
    # stays stage 0) plans only stage 0's share of the move
    model = "layers=8,hidden=32,heads=4,vocab=200,seq=16,ffn=64,tied=0"
    rc = main(["plan", "--model", model, "--from", "tp2pp4dp8", "--to", "tp2pp4dp6",
               "--leave", "48-63", "--optimizer", "distributed", "--part-of", "0", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    part = out["part_of"]
    assert part["device"] == "0" and part["plan_seconds"] > 0
    assert 0 < part["own_messages"] <= part["messages"] < out["messages"] / 2


def test_join_and_human_output(capsys):
    rc = main(["plan", "--model", "layers=2,hidden=32,heads=4,vocab=100,seq=8", "--from",
               "tp1pp1dp2", "--to", "tp2pp1dp2", "--join", "2", "--optimizer", "distributed"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "moved_bytes" in out and "join:" in out


@pytest.mark.parametrize("args,needle", [
    (["--model", "gpt-x", "--from", "tp1pp1dp2", "--to", "tp1pp1dp2"], "unknown model"),
    (["--model", "gpt-tiny", "--from", "tp3pp1dp2", "--to", "tp1pp1dp6"], "not divisible"),
    (["--model", "gpt-tiny", "--from", "tp1pp1dp4", "--to", "tp1pp1dp2", "--leave", "3"],
     "do not add up"),
    (["--model", "gpt-tiny", "--from", "tp1pp1dp4", "--to", "tp1pp1dp3", "--leave", "7"],
     "out of range"),
    (["--model", "gpt-tiny", "--from", "tp1pp1dp4", "--to", "tp1pp1dp4", "--optimizer", "sgd"],
     "unknown optimizer"),
    (["--model", "gpt-tiny", "--from", "tp1pp1dp4", "--to", "tp1pp1dp3", "--leave", "3",
      "--part-of", "9"], "--part-of: '9' is not a device of this plan"),
])
def test_bad_input_one_line_exit_2(args, needle):
    r = subprocess.run([sys.executable, "-m", "etcslurm", "plan", *args], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert needle in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
