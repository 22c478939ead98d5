"""The fault hooks of ``etcslurm.testing`` (pure, no processes)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from etcslurm.errors import UsageError
from etcslurm.hooks import NO_HOOKS
from etcslurm.testing import faults as faults_module
from etcslurm.testing.faults import (
    CorruptOnce,
    HoldAfterStep,
    MigrationDelay,
    RebuildDelay,
    Several,
    StepPacing,
    hooks_from_json,
)


def test_no_faults_are_the_no_op_hooks() -> None:
    assert hooks_from_json({}) is NO_HOOKS
    assert hooks_from_json(None) is NO_HOOKS
    assert hooks_from_json({"migration_delay": 0, "rebuild_delay": 0}) is NO_HOOKS


def test_json_builds_each_hook() -> None:
    h = hooks_from_json({"migration_delay": 3, "rebuild_delay": 0})
    assert isinstance(h, MigrationDelay) and h.seconds == 3
    h = hooks_from_json({"rebuild_delay": 2, "min_step_seconds": 1.5,
                         "corrupt": {"src": "0", "dst": "1"}})
    assert isinstance(h, Several)
    assert [type(p) for p in h.parts] == [RebuildDelay, StepPacing, CorruptOnce]


@pytest.mark.parametrize("spec", [{"migration_dely": 1}, {"corrupt": {"byte": 3}}, [1],
                                  {"rebuild_delay": "soon"}, {"hold": {"step": 2}},
                                  {"hold": {"step": "two", "file": "/x"}}])
def test_bad_fault_specs_are_refused(spec: object) -> None:
    with pytest.raises(UsageError):
        hooks_from_json(spec)  # type: ignore[arg-type]


def test_migration_delay_only_after_round_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    h = MigrationDelay(2.5)
    h.after_round(1, 1)
    h.before_new_world(1)
    h.after_round(1, 0)
    assert slept == [2.5]
    RebuildDelay(1.0).before_new_world(3)
    assert slept == [2.5, 1.0]


def test_step_pacing_sleeps_the_rest_of_the_minimum(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    pace = StepPacing(3.0)
    pace.after_step(1, 1.0)
    pace.after_step(2, 4.0)
    assert slept == [2.0]


class _Clock:
    """A clock that moves only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, 0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.sleeps += 1


def test_hold_waits_after_its_step_until_the_file_exists(tmp_path, monkeypatch) -> None:
    go = tmp_path / "go"
    h = hooks_from_json({"hold": {"step": 2, "file": str(go), "timeout": 0.3}})
    assert isinstance(h, HoldAfterStep)
    clock = _Clock()
    monkeypatch.setattr(faults_module, "time", clock)
    h.after_step(1, 0.0)  # not its step: no wait
    assert clock.sleeps == 0
    h.after_step(2, 0.0)  # no file: waits out its timeout, then goes on
    assert 0.3 <= clock.now < 0.4 and clock.sleeps > 1
    go.touch()
    before = clock.sleeps
    h.after_step(2, 0.0)  # the file exists: no wait
    assert clock.sleeps == before


def test_corrupt_once_flips_one_byte_of_the_first_matching_message() -> None:
    h = CorruptOnce(src="0", dst="1", offset=3, mask=0x10)
    other = SimpleNamespace(src="2", dst="1")
    msg = SimpleNamespace(src="0", dst="1")
    packed, segment = torch.zeros(16, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    h.message_received(other, [packed, segment])
    assert not segment.any() and not h.fired
    h.message_received(msg, [packed, segment])
    assert int(segment[3]) == 0x10 and not packed.any()  # the last buffer, once
    h.message_received(msg, [packed, segment])
    assert int(segment[3]) == 0x10


def test_the_test_worker_hands_its_hooks_to_the_runtime_worker(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import etcslurm.runtime.worker as runtime_worker
    from etcslurm.testing import worker

    seen: dict[str, object] = {}

    def fake_main(argv: list[str] | None = None, hooks: object = None,
                  train_step: object = None) -> int:
        seen.update(argv=argv, hooks=hooks, train_step=train_step)
        return 0

    monkeypatch.setattr(runtime_worker, "main", fake_main)
    args = ["--run", "r1", "--faults", '{"migration_delay": 3}', "--min-step-seconds", "2"]
    assert worker.main(args) == 0
    assert seen["argv"] == ["--run", "r1", "--min-step-seconds", "2"]
    assert isinstance(seen["hooks"], MigrationDelay)
    assert seen["train_step"] is None  # no "raise" key: the runtime's own step
    assert worker.main(["--faults", "{not json"]) == 2
    assert worker.main(["--faults", '{"nope": 1}']) == 2
