"""Small helpers shared by the integration tests (processes, Slurm jobs, polling)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from typing import Any

#: results computed once per pytest process and shared by the test modules that need
#: them: pytest imports a test module under its own name, and a module importing it as
#: ``tests.<name>`` gets a second copy with module globals of its own; this module is
#: imported once, under one name
SHARED: dict[str, Any] = {}


class Background:
    """A value ``compute()`` makes in a thread, started now, so that it is made while the
    test that needs it does its own waiting (a reference run trains while the run it
    judges starts); :meth:`get` waits for it, bounded, and re-raises its error."""

    def __init__(self, compute: Callable[[], Any], what: str) -> None:
        import threading

        self.what = what
        self.value: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(compute,), daemon=True)
        self.thread.start()

    def _run(self, compute: Callable[[], Any]) -> None:
        try:
            self.value = compute()
        except BaseException as exc:  # reported by get()
            self.error = exc

    def get(self, timeout: float = 900) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"{self.what} not done within {timeout:.0f} s"
        if self.error is not None:
            raise AssertionError(f"{self.what} failed: {self.error!r}") from self.error
        return self.value


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
    """The Slurm state of ``job_id`` (first line: an array's first task); "" once squeue
    has forgotten the job (MinJobAge after its end), which it reports as an invalid id."""
    done = subprocess.run(("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"),
                          capture_output=True, text=True, timeout=30)
    if done.returncode and "Invalid job id" in done.stderr:
        return ""
    done.check_returncode()
    return done.stdout.strip().split("\n")[0]


def cluster_state() -> str:
    """squeue and sinfo as one text, for a failure message: which jobs hold or wait for
    which nodes, and why a node takes no job (down, drained and the reason)."""
    parts = []
    for cmd in (("squeue", "-h", "-t", "all", "-o", "%i %P %j %T %R"),
                ("sinfo", "-h", "-N", "-o", "%N %P %t %E")):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
        parts.append(f"$ {' '.join(cmd)}\n{(done.stdout + done.stderr).strip()}")
    return "\n".join(parts)


def settle_jobs(job_ids: list[str], timeout: float = 120.0) -> None:
    """Cancel ``job_ids`` and wait (bounded) until none holds a node any more, so the next
    test starts on free nodes: a cancelled job's processes may take a while to end on a
    loaded host, and its node takes no job until they have."""
    if not job_ids:
        return
    subprocess.run(["scancel", *job_ids], capture_output=True, timeout=30, check=False)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done = subprocess.run(["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i"],
                              capture_output=True, text=True, timeout=30, check=False)
        if done.returncode or not done.stdout.strip():  # ended, or forgotten already
            return
        time.sleep(1)


#: node states (sinfo's compact ones) that take a job at once
_FREE = {"idle"}
#: why a lab node may be out of service after a loaded test (a job's processes took longer
#: to die than UnkillableStepTimeout, or slurmd was too busy to answer): not a lasting
#: fault on this one-host cluster, so the node is put back into service
_TRANSIENT = ("Kill task failed", "Not responding", "Node unexpectedly rebooted")


def free_nodes(partition: str, count: int | None = None, timeout: float = 300.0) -> list[str]:
    """Wait until ``count`` nodes of ``partition`` (default: all of them) are idle (the
    jobs of earlier tests ended); a node a loaded earlier test took out of service is
    resumed.  Fails with the cluster's state, which names what holds the nodes."""
    end = time.monotonic() + timeout
    while True:
        done = subprocess.run(["sinfo", "-h", "-N", "-p", partition, "-o", "%N|%t|%E"],
                              capture_output=True, text=True, timeout=30, check=True)
        rows = [ln.split("|", 2) for ln in done.stdout.split("\n") if ln.strip()]
        idle = sorted({n for n, state, _ in rows if state in _FREE})
        if len(idle) >= (len({n for n, _, _ in rows}) if count is None else count):
            return idle
        for node, state, reason in rows:
            if state.startswith(("drain", "drng", "down")) and reason.startswith(_TRANSIENT):
                subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"],
                               capture_output=True, timeout=30, check=False)
        if time.monotonic() > end:
            raise AssertionError(f"{count or 'all'} idle nodes of {partition} not there after "
                                 f"{timeout:.0f} s (idle: {idle})\n{cluster_state()}")
        time.sleep(1)


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


def random_holdings(rng: Any) -> tuple[Any, bool]:
    """Planner inputs that no GPT layout gives, drawn from ``rng``: a few tensors
    (scalars included) tiled into random boxes per layout, each box held by random
    classes, sometimes an extra old piece overlapping others (``overlapping``), dead
    devices, leavers and joiners.  The planner's property test and its golden hashes
    draw the same cases from the same seed."""
    from etcslurm.core.plan import PlanInputs
    from etcslurm.core.state import Piece

    tensors = {f"t{k}": tuple(rng.randint(1, 6) for _ in range(rng.randint(0, 3)))
               for k in range(rng.randint(1, 4))}

    def tiling(shape: tuple[int, ...]) -> list[tuple[tuple[int, int], ...]]:
        boxes = [tuple((0, n) for n in shape)]
        for _ in range(rng.randint(0, 3)):
            b = boxes.pop(rng.randrange(len(boxes)))
            axes = [a for a, (lo, hi) in enumerate(b) if hi - lo > 1]
            if not axes:
                boxes.append(b)
                continue
            a = rng.choice(axes)
            lo, hi = b[a]
            cut = rng.randrange(lo + 1, hi)
            boxes += [(*b[:a], (lo, cut), *b[a + 1:]), (*b[:a], (cut, hi), *b[a + 1:])]
        return boxes

    def layout(n_cls: int) -> tuple[list[list[Any]], list[list[int]]]:
        blocks: list[list[Any]] = []
        class_blocks: list[list[int]] = [[] for _ in range(n_cls)]
        for key, shape in tensors.items():
            for box in tiling(shape):
                blocks.append([Piece(key, box, "float32")])
                for c in rng.sample(range(n_cls), rng.randint(1, n_cls)):
                    class_blocks[c].append(len(blocks) - 1)
        return blocks, class_blocks

    n_oc, n_nc = rng.randint(1, 4), rng.randint(1, 4)
    old_blocks, old_class_blocks = layout(n_oc)
    new_blocks, new_class_blocks = layout(n_nc)
    overlapping = rng.random() < 0.3
    if overlapping:
        key = rng.choice(list(tensors))
        box = tuple((lo, rng.randint(lo + 1, n)) for n in tensors[key]
                    for lo in [rng.randrange(n)])
        old_blocks.append([Piece(key, box, "float32")])
        old_class_blocks[rng.randrange(n_oc)].append(len(old_blocks) - 1)
    old_dev = {str(d): rng.randrange(n_oc) for d in range(rng.randint(1, 6))}
    leave = [d for d in old_dev if rng.random() < 0.3][: len(old_dev) - 1]
    joiners = [f"join:{k}" for k in range(rng.randint(0, 3))]
    n_new = rng.randint(1, len(old_dev) - len(leave) + len(joiners))
    inputs = PlanInputs(
        old_device_class=old_dev, new_rank_class=[rng.randrange(n_nc) for _ in range(n_new)],
        nodes={d: f"n{rng.randrange(3)}" for d in [*old_dev, *joiners]}, leaving=leave,
        joiners=joiners, staging_bytes=rng.choice([4, 16, 10**6]), old_blocks=old_blocks,
        old_class_blocks=old_class_blocks, new_blocks=new_blocks,
        new_class_blocks=new_class_blocks)
    alive = [d for d in old_dev if d not in leave]
    if rng.random() < 0.3 and len(alive) - 1 + len(joiners) >= n_new:
        del inputs.old_device_class[rng.choice(alive)]  # dead: its pieces may be missing
    return inputs, overlapping
