"""Fault injection on real elastic runs: SIGKILL of a worker and of the leader, a
preemption signal during a migration (two resizes back to back), state with no surviving
holder, a corrupted message (the coordinator's outages: ``test_faults_coordinator.py``).

The scenarios live in ``etcslurm/testing/fault_scenarios.py`` (``benchmarks/fault_matrix.py``
runs them all and prints the measured table); these tests run them small (gpt-tiny, 8
steps, 2–4 workers, lowered ``dead_after`` / ``collective_timeout``) and assert: the fault is detected within its bound, an event says
what happened, the next generation is rebuilt from replicas (nothing missing), the run
completes with the same losses as a run that never resized, and nothing hangs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from etcslurm.core.models import GPTSpec
from etcslurm.local.launcher import LOSS_TOLERANCE
from etcslurm.runtime.generation import LayoutSettings, first_generation, next_generation
from etcslurm.testing import fault_scenarios as fm
from tests.helpers import pids_alive

#: mostly waiting on detection timers (dead_after, collective timeouts): sbin/test runs
#: these beside the CPU-bound tests
pytestmark = pytest.mark.waits

STEPS = 6
#: the shared reference (tests/conftest.py) covers the longest scenario (12 steps)


def _measured(row: Any, reference: Any | None = None) -> Any:
    """Fill the loss column once the reference is there; with ``FAULT_MATRIX_ROWS`` set,
    append the measured row (JSON line) for ``benchmarks/fault_matrix.py --rows``."""
    if reference is not None and row.result is not None:
        ref = reference.get()
        common = sorted(set(row.result.losses) & set(ref))
        if common:
            row.max_loss_diff = max(abs(row.result.losses[s] - ref[s]) for s in common)
            if row.outcome.startswith("completed") and row.max_loss_diff > LOSS_TOLERANCE:
                row.outcome = "completed (LOSS MISMATCH)"
    out = os.environ.get("FAULT_MATRIX_ROWS")
    if out:
        with open(out, "a") as fh:
            fh.write(json.dumps(row.to_json()) + "\n")
    return row




def _types(row) -> list[str]:
    return [e["type"] for e in row.events]


def _assert_recovered_from_replicas(row) -> None:
    res = row.result
    assert row.error is None, row.error
    assert res is not None and sorted(res.losses) == list(range(1, STEPS + 1))
    assert row.max_loss_diff is not None and row.max_loss_diff <= LOSS_TOLERANCE, row.max_loss_diff
    assert row.bytes_lost == 0
    gens = [row.records[g] for g in sorted(row.records)]
    assert [g["kind"] for g in gens][:2] == ["start", "resize"]
    recovery = gens[1]
    assert len(recovery["dead"]) == 1 and recovery["world"] == 2, recovery
    killed = recovery["dead"][0]
    assert res.exit_codes[killed] == -9
    assert all(code == 0 for w, code in res.exit_codes.items() if w != killed), res.exit_codes
    # the events say what happened: a failed collective, the dead worker marked gone
    gone = [e for e in row.events if e["type"] == "worker.gone"]
    assert gone and gone[0]["data"]["worker"] == killed
    assert "error" in _types(row)
    # detected and rebuilt within the bounds (dead_after / collective_timeout + rebuild)
    bound = fm.DEAD_AFTER * 2 + fm.COLLECTIVE_TIMEOUT + 60
    assert row.recover_s is not None and 0 < row.recover_s < bound, row.recover_s
    assert pids_alive(res.pids) == []


@pytest.mark.slow
@pytest.mark.redis
def test_sigkill_of_a_worker_rebuilds_from_replicas(redis_url: str, reference: Any,
                                                    tmp_path: Path) -> None:
    row = _measured(fm.kill_worker(redis_url, None, tmp_path, STEPS, None), reference)
    _assert_recovered_from_replicas(row)
    # the killed rank was the highest one, not the leader
    gens = [row.records[g] for g in sorted(row.records)]
    assert gens[1]["dead"] == [gens[0]["assignment"][-1]["worker"]]


@pytest.mark.slow
@pytest.mark.redis
def test_sigkill_of_the_leader_rebuilds_from_replicas(redis_url: str, reference: Any,
                                                      tmp_path: Path) -> None:
    row = _measured(fm.kill_leader(redis_url, None, tmp_path, STEPS, None), reference)
    _assert_recovered_from_replicas(row)
    gens = [row.records[g] for g in sorted(row.records)]
    assert gens[1]["dead"] == [gens[0]["assignment"][0]["worker"]]
    # a survivor took over: the new rank 0 is another worker and steps go on
    assert gens[1]["assignment"][0]["worker"] != gens[0]["assignment"][0]["worker"]


@pytest.mark.slow
@pytest.mark.redis
def test_preemption_during_a_migration_gives_two_resizes_back_to_back(
        redis_url: str, reference: Any, tmp_path: Path) -> None:
    row = _measured(fm.preempt_during_migration(redis_url, None, tmp_path, STEPS, None), reference)
    res = row.result
    assert row.error is None, row.error
    assert res is not None and sorted(res.losses) == list(range(1, STEPS + 1))
    assert row.max_loss_diff is not None and row.max_loss_diff <= LOSS_TOLERANCE
    gens = [row.records[g] for g in sorted(row.records)]
    assert [(g["kind"], g["to"]) for g in gens] == [
        ("start", "tp1pp1dp4"), ("resize", "tp1pp1dp3"), ("resize", "tp1pp1dp2")]
    # the second resize follows the first at the next step boundary
    assert gens[2]["step"] <= gens[1]["step"] + 2, (gens[1]["step"], gens[2]["step"])
    assert len(gens[2]["leaving"]) == 1 and gens[2]["dead"] == []
    assert [e["type"] for e in row.events].count("worker.signal") == 2
    assert all(code == 0 for code in res.exit_codes.values()), res.exit_codes
    assert row.bytes_lost == 0


@pytest.mark.slow
@pytest.mark.redis
def test_sigkill_of_a_receiver_mid_migration_falls_back_to_the_old_state(
        redis_url: str, reference: Any, tmp_path: Path) -> None:
    row = _measured(fm.kill_receiver_mid_migration(redis_url, None, tmp_path, STEPS, None),
                    reference)
    res = row.result
    assert row.error is None, row.error
    assert res is not None and sorted(res.losses) == list(range(1, max(STEPS, 12) + 1))
    assert row.max_loss_diff is not None and row.max_loss_diff <= LOSS_TOLERANCE
    gens = [row.records[g] for g in sorted(row.records)]
    kinds = [(g["kind"], g["from"], g["to"]) for g in gens]
    # the failed generation (the joiner taken in) and the one planned again without it
    assert kinds[:3] == [("start", None, "tp1pp1dp3"), ("resize", "tp1pp1dp3", "tp1pp1dp4"),
                         ("resize", "tp1pp1dp3", "tp1pp1dp3")], kinds
    joiner = gens[1]["joining"][0]
    assert res.exit_codes[joiner] == -9
    assert all(code == 0 for w, code in res.exit_codes.items() if w != joiner), res.exit_codes
    errors = [e["data"].get("message", "") for e in row.events if e["type"] == "error"]
    assert any("migration to generation 1 failed" in m for m in errors), errors
    assert row.bytes_lost == 0
    assert pids_alive(res.pids) == []


def _kinds(row) -> list[tuple[str, str | None, str]]:
    return [(g["kind"], g["from"], g["to"]) for _, g in sorted(row.records.items())]


def _errors(row) -> list[str]:
    return [e["data"].get("message", "") for e in row.events if e["type"] == "error"]


def _assert_completed(row, steps: int) -> None:
    res = row.result
    assert row.error is None, row.error
    assert res is not None and sorted(res.losses) == list(range(1, steps + 1))
    assert row.max_loss_diff is not None and row.max_loss_diff <= LOSS_TOLERANCE, row.max_loss_diff
    assert row.bytes_lost == 0
    assert pids_alive(res.pids) == []


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.parametrize("who", ["sender", "leader"])
def test_sigkill_of_a_sender_mid_transfer_replans_from_the_old_state(
        who: str, redis_url: str, reference: Any, tmp_path: Path) -> None:
    """A joiner is receiving its replica in several rounds; a rank that has already sent
    part of its share is killed (rank 2, or rank 0, the one that publishes): the
    exchange fails everywhere, nothing was applied, the change is planned again from the
    old state without the dead and the joiner is taken in by that plan."""
    scenario = fm.kill_sender_mid_migration if who == "sender" else fm.kill_leader_mid_migration
    row = _measured(scenario(redis_url, None, tmp_path, STEPS, None), reference)
    _assert_completed(row, 12)
    gens = [row.records[g] for g in sorted(row.records)]
    assert _kinds(row)[:3] == [("start", None, "tp1pp1dp3"), ("resize", "tp1pp1dp3", "tp1pp1dp4"),
                               ("resize", "tp1pp1dp3", "tp1pp1dp3")], _kinds(row)
    victim = row.detail["worker"]
    ranks = {a["rank"]: a["worker"] for a in gens[0]["assignment"]}
    assert victim == ranks[0 if who == "leader" else 2]
    assert row.detail["sent"] > 0, row.detail  # it had sent bytes when it died
    assert gens[1]["plan_stats"]["rounds"] > 1  # ... in a transfer of several rounds
    assert gens[2]["dead"] == [victim] and gens[2]["joining"] == gens[1]["joining"]
    assert row.result.exit_codes[victim] == -9
    assert all(c == 0 for w, c in row.result.exit_codes.items() if w != victim)
    assert any("migration to generation 1 failed" in m for m in _errors(row)), _errors(row)
    if who == "leader":  # another rank took over publishing
        assert {a["rank"]: a["worker"] for a in gens[2]["assignment"]}[0] != victim


@pytest.mark.slow
@pytest.mark.redis
def test_sigkill_while_the_new_world_forms_falls_back_to_the_old_state(
        redis_url: str, reference: Any, tmp_path: Path) -> None:
    """While the new world forms (before the exchange; nobody has committed the new
    generation and the leaver is still there): a new member dies; everyone returns to
    the old generation's state and the change is planned again from it."""
    row = _measured(fm.kill_during_rebuild(redis_url, None, tmp_path, STEPS, None), reference)
    _assert_completed(row, 8)
    gens = [row.records[g] for g in sorted(row.records)]
    assert _kinds(row) == [("start", None, "tp1pp1dp4"), ("resize", "tp1pp1dp4", "tp1pp1dp3"),
                           ("resize", "tp1pp1dp4", "tp1pp1dp2")], _kinds(row)
    leaver = gens[1]["leaving"][0]
    victim = gens[2]["dead"][0]
    assert gens[2]["leaving"] == [leaver] and victim != leaver
    assert row.result.exit_codes[victim] == -9
    assert all(c == 0 for w, c in row.result.exit_codes.items() if w != victim)
    # the error names the phase: the new world failed while it formed (before the exchange)
    assert any(f"migration to generation 1 failed in {phase}:" in m
               for m in _errors(row) for phase in ("build", "group")), _errors(row)


@pytest.mark.slow
@pytest.mark.redis
def test_a_joiner_that_never_arrives_is_dropped_and_the_change_replanned(
        redis_url: str, reference: Any, tmp_path: Path) -> None:
    row = _measured(fm.joiner_never_arrives(redis_url, None, tmp_path, STEPS, None), reference)
    _assert_completed(row, 12)
    gens = [row.records[g] for g in sorted(row.records)]
    stalled = row.detail["stalled"][0]
    assert gens[1]["joining"] == [stalled]
    assert stalled not in gens[2]["union"] and gens[2]["world"] == 3
    gone = [e["data"]["worker"] for e in row.events if e["type"] == "worker.gone"]
    assert gone == [stalled]
    # let go afterwards, it found itself out of the run and exited cleanly
    assert all(c == 0 for c in row.result.exit_codes.values()), row.result.exit_codes
    assert row.recover_s is not None
    assert row.recover_s < fm.DEAD_AFTER * 2 + fm.COLLECTIVE_TIMEOUT + 60


def _logs(tmp_path: Path) -> dict[str, str]:
    return {p.name: p.read_text(errors="replace") for p in sorted(tmp_path.glob("worker-*.log"))}


@pytest.mark.slow
@pytest.mark.redis
def test_a_bug_in_the_step_ends_every_worker_with_its_traceback(redis_url: str,
                                                                 tmp_path: Path) -> None:
    """Not a peer failure: no recovery, no retry, every worker exits 1 with the user's
    traceback and one etcslurm line, within the collective timeout of the error."""
    row = fm.step_error_everywhere(redis_url, None, tmp_path, STEPS, None)
    res = row.result
    assert row.error is not None and "exited with code 1" in row.error, row.error
    logs = _logs(tmp_path)
    assert len(logs) == 3
    for name, text in logs.items():
        assert "ValueError: injected: a bug in the training step at step 3" in text, name
        ours = [ln for ln in text.splitlines() if ln.startswith("etcslurm worker")]
        assert len(ours) == 1 and "raised ValueError (not a failure of a peer)" in ours[0], name
        assert "recovering" not in text, name
    assert not [e for e in row.events if e["type"] == "error"
                and "collective failed" in e["data"].get("message", "")]
    assert [r["kind"] for r in row.records.values()] == ["start"]
    errors = [e["ts"] for e in row.events if e["type"] == "step" and e["data"]["step"] == 3]
    gone = [e["ts"] for e in row.events if e["type"] == "worker.state"
            and e["data"].get("state") == "gone"]
    if errors and gone:  # every worker left within the collective timeout of the step
        assert max(gone) - errors[0] < fm.COLLECTIVE_TIMEOUT, (errors, gone)
    assert res is None or pids_alive(res.pids) == []


@pytest.mark.slow
@pytest.mark.redis
def test_out_of_memory_on_one_rank_ends_that_worker_and_the_run_goes_on(
        redis_url: str, reference: Any, tmp_path: Path) -> None:
    row = _measured(fm.oom_on_one_rank(redis_url, None, tmp_path, STEPS, None), reference)
    res = row.result
    assert res is not None and sorted(res.losses) == list(range(1, STEPS + 1)), row.error
    assert row.max_loss_diff is not None and row.max_loss_diff <= LOSS_TOLERANCE
    failed = [w for w, code in res.exit_codes.items() if code != 0]
    assert len(failed) == 1 and res.exit_codes[failed[0]] == 1, res.exit_codes
    gens = [row.records[g] for g in sorted(row.records)]
    assert gens[-1]["world"] == 2 and failed[0] not in gens[-1]["union"], gens[-1]
    oom = [t for t in _logs(tmp_path).values() if "OutOfMemoryError: injected" in t]
    assert len(oom) == 1 and "raised OutOfMemoryError (not a failure of a peer)" in oom[0]
    assert pids_alive(res.pids) == []


@pytest.mark.slow
@pytest.mark.redis
def test_pieces_without_a_surviving_holder_stop_with_exit_5(redis_url: str, tmp_path: Path) -> None:
    row = _measured(fm.lost_pieces(redis_url, None, tmp_path, STEPS, None))
    assert row.error is not None and "exited with code 5" in row.error, row.error
    stop = [r for r in row.records.values() if r.get("kind") == "stop"]
    assert stop and "no replica survives" in stop[0]["reason"]
    assert row.bytes_lost and row.bytes_lost > 0
    assert row.recover_s is not None and row.recover_s < fm.DEAD_AFTER * 2 + fm.COLLECTIVE_TIMEOUT + 60


def test_stop_decision_names_the_dead_workers() -> None:
    """The pure decision: a dead rank of dp2 with a sharded optimizer → ``stop``."""
    spec = GPTSpec.parse("gpt-tiny")
    settings = LayoutSettings(spec, "distributed", 12, 1, 2, 2**26)
    start = first_generation(settings, ["w1", "w2"], {"w1": "n0", "w2": "n0"})
    assert start.to_layout == "tp1pp1dp2"
    record, migration = next_generation(
        settings, start, leaving=[], dead=["w2"], ready=[], nodes={}, step=3, scalars={},
        reason="recover")
    assert record.kind == "stop" and "w2" in record.reason
    assert migration is not None and migration.stats.get("missing_bytes", 0) > 0
    # with Adam every piece has a replica on w1: a resize, nothing missing
    adam = LayoutSettings(spec, "adam", 12, 1, 2, 2**26)
    record, migration = next_generation(
        adam, first_generation(adam, ["w1", "w2"], {}), leaving=[], dead=["w2"], ready=[],
        nodes={}, step=3, scalars={}, reason="recover")
    assert record.kind == "resize" and record.world == 1
    assert not migration.missing


@pytest.mark.slow
def test_corrupted_message_is_caught_and_names_the_piece() -> None:
    row = _measured(fm.corrupt_message())
    assert row.error.startswith("MigrationError: checksum mismatch"), row.error
    assert "first piece" in row.error and "0 -> 1" in row.error


@pytest.mark.slow
@pytest.mark.redis
def test_lost_pieces_roll_back_to_the_last_periodic_checkpoint(redis_url: str,
                                                              reference: Any,
                                                              tmp_path: Path) -> None:
    """With periodic checkpoints, a death that leaves state with no holder rolls the run
    back to the latest complete checkpoint on the survivor (not exit 5): the steps since
    are repeated, the run completes, and the losses equal the never-failed reference."""
    row = _measured(fm.rollback(redis_url, None, tmp_path, STEPS, None), reference)
    assert row.error is None, row.error
    back = row.detail.get("rollback")
    assert back is not None, [e["type"] for e in row.events]
    assert back["step"] in (2, 4) and back["lost_steps"] >= 1
    assert row.outcome.startswith("rolled back") and "completed" in row.outcome, row.outcome
    assert row.max_loss_diff is not None and row.max_loss_diff <= LOSS_TOLERANCE
    kinds = [r.get("kind") for _, r in sorted(row.records.items())]
    assert kinds[0] == "start" and kinds[-1] == "start" and "stop" not in kinds, kinds
    assert pids_alive(row.result.pids) == []


def test_rollback_decision_resumes_the_checkpoint_on_the_survivors() -> None:
    """The pure decision: state lost with a dead worker and a complete periodic
    checkpoint → a ``start`` record on the survivors that resumes it (not ``stop``)."""
    spec = GPTSpec.parse("gpt-tiny")
    settings = LayoutSettings(spec, "distributed", 12, 1, 2, 2**26)
    start = first_generation(settings, ["w1", "w2"], {"w1": "n0", "w2": "n0"})
    record, _ = next_generation(
        settings, start, leaving=[], dead=["w2"], ready=[], nodes={}, step=7, scalars={},
        reason="recover", rollback={"path": "/ckpt/periodic/iter_0000006", "step": 6})
    assert record.kind == "start" and record.resume == "/ckpt/periodic/iter_0000006"
    assert record.step == 6 and record.union == ("w1",) and record.dead == ("w2",)
    assert record.generation == start.generation + 1 and "1 steps lost" in record.reason
