"""The whole-run checkpoint: where it goes, its pointer, and the requeue that resumes it.

When every worker of a run leaves at once (the whole run preempted), the ``checkpoint``
generation makes every rank save its state with megatron-core ``dist_checkpointing``;
rank 0 then writes ``latest.json`` and, under Slurm, the first task of each job requeues
its own job.  The restarted workers find the ``checkpoint`` record and resume from the
pointer at the same step.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from etcslurm.errors import EtcslurmError, StateLostError, UsageError
from etcslurm.runtime.config import WorkerOptions

log = logging.getLogger("etcslurm.runtime")


def directory(options: WorkerOptions) -> Path:
    """The checkpoint directory (created); a user mistake there is a one-line error."""
    path = Path(options.checkpoint_dir or Path(options.run_dir) / "checkpoint")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file, a read-only mount, ...: the user's to fix
        raise UsageError(f"checkpoint directory {path} is not usable: {exc.strerror}") from None
    return path


def write_pointer(where: Path, target: Path, step: int, layout: str | None) -> None:
    (where / "latest.json").write_text(json.dumps(
        {"path": str(target), "step": step, "layout": layout}))


def pointer(options: WorkerOptions) -> dict[str, Any] | None:
    """The pointer :func:`write_pointer` wrote (path, step, layout), if any."""
    latest = directory(options) / "latest.json"
    if not latest.exists():
        return None
    try:
        found = json.loads(latest.read_text())
        return {**found, "path": str(found["path"])}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StateLostError(f"cannot read checkpoint pointer {latest}: {exc}") from None


def requeue_own_job(coord: Any, worker: str) -> None:
    """Under Slurm, the first task of each job requeues its job.

    A job whose processes exit by themselves inside the preemption grace time ends
    COMPLETED and Slurm does not requeue it; so after the whole-run checkpoint each job
    of the run (one per array task / growth job) asks for its own requeue.
    """
    from etcslurm.job.environment import SlurmEnvironment, requeue

    env = SlurmEnvironment.from_env()
    if not env.is_slurm or env.proc_id != 0:
        return
    try:
        requeue(env.job_id)
    except EtcslurmError as exc:
        coord.emit("error", worker=worker, message=f"requeue failed: {exc}")
        log.error("requeue of job %s failed: %s", env.job_id, exc)
        return
    coord.emit("job.requeued", worker=worker, job=env.job_id)


# ---------------------------------------------------------------------- periodic checkpoints
def periodic_directory(options: WorkerOptions) -> Path:
    return directory(options) / "periodic"


def periodic_pointer(options: WorkerOptions) -> dict[str, Any] | None:
    """The latest COMPLETE periodic checkpoint (path, step, layout), if any: what a run
    rolls back to when a death leaves state with no holder."""
    latest = periodic_directory(options) / "latest.json"
    if not latest.exists():
        return None
    try:
        found = json.loads(latest.read_text())
        return {**found, "path": str(found["path"]), "step": int(found["step"])}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.error("periodic checkpoint pointer %s unreadable: %s", latest, exc)
        return None


class Periodic:
    """Checkpoints every ``every`` steps, written by megatron-core's persistent async
    writer while training goes on; a save counts only once every rank finalised it (rank
    0 then moves ``periodic/latest.json`` to it and drops all but the last ``keep``).

    ``poll`` is a collective while a save is pending: every world member calls it at
    every step boundary (they do, in lockstep).  A change of world first waits for a
    pending save (``finish``); a failure abandons it (its files are never pointed at).
    """

    def __init__(self, options: WorkerOptions, every: int, keep: int) -> None:
        self.options = options
        self.every = every
        self.keep = max(1, keep)
        self.pending: dict[str, Any] | None = None
        self.saves: list[float] = []  # seconds each save held the training loop

    def due(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    def begin(self, world: Any, trainee: Any, step: int, layout: str, rank: int) -> None:
        """Begin the save of ``step`` (after finishing a previous one still pending)."""
        import time

        self.finish(world, rank)
        t0 = time.perf_counter()
        target = periodic_directory(self.options) / f"step{step:08d}"
        world.save_async(trainee, target)
        self.saves.append(time.perf_counter() - t0)
        self.pending = {"path": str(target), "step": step, "layout": layout}

    def poll(self, world: Any, rank: int, blocking: bool = False) -> None:
        if self.pending is not None and world.checkpoint_poll(blocking):
            self._complete(rank)

    def finish(self, world: Any, rank: int) -> None:
        """Wait for a pending save (before the world changes)."""
        self.poll(world, rank, blocking=True)

    def abandon(self, world: Any) -> None:
        """A peer died: the pending save cannot be finalised (its files stay unreferenced)."""
        if self.pending is not None:
            log.warning("periodic checkpoint of step %s abandoned", self.pending["step"])
            world.abandon_checkpoint()
        self.pending = None

    def _complete(self, rank: int) -> None:
        assert self.pending is not None
        done, self.pending = self.pending, None
        if rank != 0:
            return
        where = periodic_directory(self.options)
        tmp = where / "latest.json.tmp"
        tmp.write_text(json.dumps(done))
        tmp.replace(where / "latest.json")  # atomic: a reader sees the old or the new one
        steps = sorted(p for p in where.glob("step*") if p.is_dir())
        import shutil

        for old in steps[: max(0, len(steps) - self.keep)]:
            if str(old) != done["path"]:
                shutil.rmtree(old, ignore_errors=True)
