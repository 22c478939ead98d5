"""Executor and process-group lifecycle on real gloo with synthetic tensors (4 processes)."""

from __future__ import annotations

import pytest
import torch

from etcslurm.bench.launch import launch
from etcslurm.core.state import Piece
from etcslurm.errors import MigrationError
from etcslurm.testing.synthetic import SynthMessage, global_tensor, needed_pieces, synthetic_plan
from etcslurm.transfer.executor import check_fills, execute
from etcslurm.transfer.wire import (
    DIRECT_MIN_BYTES,
    ViewIndex,
    checksum,
    message_layout,
    staging_bytes_per_round,
)

N = 4


@pytest.fixture(scope="module")
def selftest() -> list[dict]:
    return launch("etcslurm.testing.synthetic:executor_selftest", N, {"repeats": 10, "wait": 3},
                  timeout=240)


def test_every_migration_is_exact(selftest: list[dict]) -> None:
    for r in selftest:
        assert r["exact"] == [True] * 10
        assert r["exact_after_abort"] is True


def test_staging_peak_is_measured_and_under_cap(selftest: list[dict]) -> None:
    for r in selftest:
        stats = r["stats"]
        assert 0 < stats["peak_staging_bytes"] <= r["cap"]
        assert stats["rounds"] == 2
        assert stats["messages_sent"] == N - 1 and stats["messages_received"] == N - 1
        assert max(e["staging_bytes"] for e in stats["per_round"]) <= stats["peak_staging_bytes"]
        assert stats["bytes_local"] > 0


def test_progress_callback_reports_each_round(selftest: list[dict]) -> None:
    for r in selftest:
        events = r["progress_events"]
        assert [e["round_index"] for e in events] == [0, 1]
        assert sum(e["bytes_received"] for e in events) == r["stats"]["bytes_received"] > 0


def test_checksum_mismatch_is_detected_and_named(selftest: list[dict]) -> None:
    err = selftest[1]["corrupt_error"]
    assert err is not None and err.startswith("MigrationError: checksum mismatch")
    assert "0 -> 1" in err and "first piece t0" in err
    assert selftest[0]["corrupt_error"] is None


def test_large_slices_travel_as_segments_in_place_or_staged_and_arrive_exact(
        selftest: list[dict]) -> None:
    for r in selftest:
        assert r["segments_exact"] is True
        # every message's t and u slices were segments: the same bytes as the packed run
        assert r["segments_stats"]["bytes_received"] >= r["stats"]["bytes_received"] - 64


def test_checksum_mismatch_in_a_segment_names_its_piece(selftest: list[dict]) -> None:
    err = selftest[1]["corrupt_segment_error"]
    assert err is not None and err.startswith("MigrationError: checksum mismatch")
    assert "0 -> 1" in err and "segment 2" in err and "piece u0" in err
    assert selftest[0]["corrupt_segment_error"] is None


def test_wait_is_bounded_and_named(selftest: list[dict]) -> None:
    err = selftest[1]["timeout_error"]
    assert err is not None and err.startswith("WaitTimeout") and "peers 0" in err
    assert selftest[1]["timeout_seconds"] < 20


def test_ten_migrations_leak_nothing(selftest: list[dict]) -> None:
    for r in selftest:
        usage = r["usage"]
        assert len(usage) == 10
        # after the first two generations (lazy imports, allocator warm-up) nothing grows
        assert usage[-1]["os_threads"] <= usage[1]["os_threads"]
        assert usage[-1]["fds"] <= usage[1]["fds"]
        assert usage[-1]["rss_bytes"] - usage[1]["rss_bytes"] < 16 << 20


def test_exchange_group_outside_the_world_is_exact_and_leaks_nothing(selftest: list[dict]) -> None:
    """The benchmark's path: a bare gloo group of its own (no default world), the
    caller's staging arena packed into (not a fresh one), closed after each migration."""
    for r in selftest:
        assert r["exchange_exact"] == [True] * 5
        assert r["exchange_arena_used"] == [True] * 5
        usage = r["exchange_usage"]
        assert usage[-1]["os_threads"] <= usage[1]["os_threads"]
        assert usage[-1]["fds"] <= usage[1]["fds"]
        assert usage[-1]["rss_bytes"] - usage[1]["rss_bytes"] < 16 << 20


def test_staging_cap_is_enforced_before_anything_moves() -> None:
    messages, local = synthetic_plan(N)
    need = staging_bytes_per_round(messages, "0")
    with pytest.raises(MigrationError, match="over the cap"):
        execute(messages, local["0"], "0", {str(i): i for i in range(N)}, [], [],
                staging_cap=max(need.values()) - 1)


def test_layout_aligns_each_dtype_and_ends_with_checksum_word() -> None:
    slices = [Piece("a", ((0, 3),), "bfloat16"), Piece("b", ((0, 2),), "int64"),
              Piece("c", ((0, 1),), "uint8")]
    layout = message_layout(slices)
    assert layout.offsets == (0, 8, 24) and layout.direct == ()
    assert layout.payload == 32 and layout.size == 40


def test_layout_sends_large_slices_as_segments_with_a_checksum_word_each() -> None:
    slices = [Piece("a", ((0, 3),), "bfloat16"), Piece("b", ((0, 4),), "int64"),
              Piece("c", ((0, 5),), "float32"), Piece("d", ((0, 2),), "float32")]
    # b (32 bytes) qualifies; c (20 bytes) is large enough but not a multiple of 8; d small
    layout = message_layout(slices, direct_min=16)
    assert layout.direct == (1,) and layout.direct_bytes == (32,)
    assert layout.packed == (0, 2, 3) and layout.offsets == (0, 8, 28)
    assert layout.payload == 40 and layout.size == 40 + 2 * 8
    assert layout.wire_bytes == 72


def test_checksum_detects_a_single_bit_flip() -> None:
    buf = torch.arange(64, dtype=torch.uint8)
    before = int(checksum(buf))
    buf[5] ^= 1
    assert int(checksum(buf)) != before


def test_plan_mismatch_is_named() -> None:
    piece = needed_pieces(0, 1, N)[0]
    msg = SynthMessage(0, "1", "0", (piece,))
    held = [(Piece("t0", ((0, 2), (0, 2)), "float32"), global_tensor("t0")[:2, :2])]
    with pytest.raises(MigrationError, match=r"no held \(1\) piece contains t0"):
        execute([msg], [], "1", {"0": 0, "1": 1}, held, [])


def test_exchange_group_whose_peer_never_arrives_fails_bounded_and_named() -> None:
    import time

    import torch.distributed as dist

    from etcslurm.errors import WaitTimeout
    from etcslurm.groups import lifecycle as groups

    before = groups.resource_usage()
    t0 = time.perf_counter()
    with pytest.raises(WaitTimeout, match=r"exchange g7: rank 0 of 2 could not form the gloo"):
        groups.exchange_group(dist.HashStore(), "g7", 0, 2, "gloo", timeout=2)
    assert time.perf_counter() - t0 < 15
    after = groups.resource_usage()
    assert after["fds"] <= before["fds"] + 1


def test_check_fills_refuses_a_plan_that_leaves_part_of_the_new_model_unwritten() -> None:
    dest = [(Piece("w", ((0, 4),), "float32"), torch.zeros(4))]
    local = [Piece("w", ((0, 2),), "float32")]
    msg = SynthMessage(0, "1", "0", (Piece("w", ((2, 4),), "float32"),))
    assert check_fills(dest, local, [msg], "0") == 16
    with pytest.raises(MigrationError, match="fills 8 of the 16 bytes"):
        check_fills(dest, local, [], "0")
    other = SynthMessage(0, "1", "2", (Piece("w", ((2, 4),), "float32"),))  # not for "0"
    with pytest.raises(MigrationError, match="fills 8 of the 16 bytes"):
        check_fills(dest, local, [other], "0")


@pytest.mark.parametrize("direct_min", [DIRECT_MIN_BYTES, 4096, 256])
def test_plans_made_for_a_staging_cap_fit_it_in_the_executor(direct_min: int) -> None:
    """The planner caps messages at message_cap(cap); the executor's rounds (one send and
    one receive per device, plus layout and checksum words) must then stay under cap."""
    from etcslurm.core.layout import ParallelConfig
    from etcslurm.core.models import PRESETS
    from etcslurm.core.plan import message_cap
    from etcslurm.megatron_state.planning import plan_for_gpt

    spec = PRESETS["gpt-tiny"]
    for cap in (64 << 10, 1 << 20):
        plan = plan_for_gpt(spec, ParallelConfig.parse("tp2pp2dp1"),
                            ParallelConfig.parse("tp1pp2dp2"), optimizer="distributed",
                            staging_bytes=message_cap(cap))
        devices = {m.src for m in plan.messages} | {m.dst for m in plan.messages}
        assert len(plan.messages) > 4
        for dev in devices:
            assert max(staging_bytes_per_round(plan.messages, dev, direct_min).values()) <= cap


def test_arena_is_sized_for_the_segments_that_must_be_staged() -> None:
    w = torch.arange(64, dtype=torch.float32).view(8, 8)
    whole = Piece("w", ((0, 8), (0, 8)), "float32")
    rows = Piece("w", ((0, 4), (0, 8)), "float32")  # contiguous inside w: sent in place
    cols = Piece("w", ((0, 8), (0, 4)), "float32")  # strided inside w: staged
    msgs = [SynthMessage(0, "0", "1", (rows,)), SynthMessage(1, "0", "1", (cols,))]
    views = (ViewIndex([(whole, w)], "held"), ViewIndex([], "needed"))
    exact = staging_bytes_per_round(msgs, "0", 64, views)
    worst = staging_bytes_per_round(msgs, "0", 64)
    # the packed buffer (no payload, two checksum words) takes one 64-byte line
    assert exact == {0: 64, 1: 64 + 128} and worst == {0: 64 + 128, 1: 64 + 128}


_WORLD_EXCHANGE = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from etcslurm.errors import WaitTimeout
from etcslurm.groups import lifecycle as groups
rank, store_path, late, arrive = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4]
store = dist.FileStore(store_path, 2)
store.set(f"ready{rank}", "1")  # both past their imports: the short world timeout is fair
store.wait(["ready0", "ready1"], timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                        timeout=timedelta(seconds=2))
if rank == 1:
    time.sleep(late)
    if arrive == "never":  # stays connected, never joins, until rank 0 has its answer
        store.wait(["answered"], timedelta(seconds=90))
        sys.exit(0)
t0 = time.perf_counter()
try:
    pg = groups.world_exchange(5, timeout=8.0)
    print("ok", pg.rank(), pg.size(), flush=True)
except WaitTimeout as exc:
    print("timeout", round(time.perf_counter() - t0, 1), exc, flush=True)
finally:
    store.set("answered", "1")
"""


@pytest.mark.parametrize("arrive", ["late", "never"])
def test_world_exchange_waits_for_late_members_bounded_and_named(tmp_path, arrive: str) -> None:
    """The exchange on the new world's own backend (nobody leaves): members arrive once
    their model is built, later than the world's own collective timeout (2 s here) --
    the probe waits for them up to its own bound (8 s); one that never comes fails it
    within that bound, with a message naming the exchange and the rank."""
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", _WORLD_EXCHANGE, str(r),
                               str(tmp_path / "store"), "4", arrive],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    out = [p.communicate(timeout=120)[0] for p in procs]
    if arrive == "late":
        assert "ok 0 2" in out[0] and "ok 1 2" in out[1], out
    else:
        line = next(ln for ln in out[0].splitlines() if ln.startswith("timeout"))
        assert "exchange 5: rank 0 of 2 did not meet the new world's members within 8 s" in line
        assert 7.0 <= float(line.split()[1]) < 20.0, line
