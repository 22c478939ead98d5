"""``etcslurm bench migrate`` rejects bad input with one line and exit code 2 (no processes)."""

from __future__ import annotations

import pytest

from etcslurm.cli import main


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--model", "gpt-tiny", "--from", "tp2pp2dp1", "--to", "tp1pp2dp3"], "needs 6 devices"),
        (["--model", "gpt-tiny", "--leave", "9"], "--leave 9"),
        (["--model", "nope"], "unknown model"),
        (["--model", "gpt-tiny", "--from", "tp2pp2dp2", "--to", "tp3pp2dp1"], "tp=3"),
        (["--model", "gpt-tiny", "--from", "tp1pp2dp2", "--to", "tp1pp2dp1", "--repeat", "0"],
         "--repeat"),
        (["--model", "gpt-tiny", "--steps-before", "0"], "Adam's state"),
        (["--model", "gpt-tiny", "--ckpt-dir", "/nonexistent/dir"], "not a directory"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv: list[str], needle: str, capsys) -> None:
    assert main(["bench", "migrate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
