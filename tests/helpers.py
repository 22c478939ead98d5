"""Small helpers shared by the integration tests (processes, Slurm jobs, polling)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from typing import Any


def pids_alive(pids: list[int]) -> list[int]:
    """The PIDs of ``pids`` that still exist (a test asserts nothing outlives a run)."""
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def wait_for(pred: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> Any:
    """Poll ``pred`` until it returns something truthy (returned); fail naming ``what``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def redis_commands(client: Any) -> int:
    """Commands the client's Redis server has processed so far (scripts' inner calls
    included): tests that bound a waiter's cost compare two readings (on a server of
    their own, ``own_redis_client``)."""
    return int(client.redis.info("stats")["total_commands_processed"])


def sh(*cmd: str) -> str:
    """Run a command (30 s bound), return its stripped stdout; fail on a non-zero exit."""
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=30).stdout.strip()


def job_state(job_id: str) -> str:
    """The Slurm state of ``job_id`` (first line: an array's first task)."""
    return sh("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T").split("\n")[0]


def generation_record(
    n: int, layout: str, workers: list[str], nodes: dict[str, str] | None = None, *,
    from_layout: str | None = None, leaving: tuple[str, ...] = (),
    joining: tuple[str, ...] = (), reason: str = "test", kind: str | None = None,
) -> Any:
    """A :class:`GenerationRecord` of ``layout`` played by ``workers`` in rank order."""
    from etcslurm.coord.records import Assignment, GenerationRecord
    from etcslurm.core.layout import ParallelConfig

    cfg = ParallelConfig.parse(layout)
    nodes = nodes or {}
    assignment = tuple(
        Assignment(r, w, nodes.get(w, "?"), *cfg.coord(r)) for r, w in enumerate(workers))
    return GenerationRecord(
        generation=n, kind=kind or ("start" if from_layout is None else "resize"), step=0,
        from_layout=from_layout, to_layout=layout, world=cfg.world_size,
        assignment=assignment, old_world=None, union=tuple(workers) + tuple(leaving),
        leaving=tuple(leaving), joining=tuple(joining), dead=(), idle=(),
        nodes={w: nodes.get(w, "?") for w in workers}, planner_ids={}, scalars={},
        reason=reason)


def run_ranks(code: str, world: int, args: Callable[[int], list[str]],
              timeout: float) -> list[str]:
    """Run ``python -c code RANK PORT *args(RANK)`` as ``world`` gloo ranks (a fresh TCP
    port for their rendezvous); every rank must exit 0.  Returns each rank's output."""
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(port), *args(r)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for r in range(world)]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{outs[r][-3000:]}"
    return outs
