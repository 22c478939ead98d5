"""The run's checkpoints: where they go, their pointers, and the requeue that resumes one.

Every checkpoint is Megatron-LM's (:mod:`etcslurm.baseline.megatron_lm`): a save directory
with ``iter_NNNNNNN/`` and ``latest_checkpointed_iteration.txt``, so a plain megatron-core
or Megatron-LM loop loads it (``--load DIR``) in any layout.

When every worker of a run leaves at once (the whole run preempted), the ``checkpoint``
generation makes every rank save its state into the checkpoint directory; rank 0 moves its
tracker once every rank's files are complete and, under Slurm, the first task of each job
requeues its own job.  The restarted workers find the ``checkpoint`` record and resume
from the tracker's iteration at the same step.  Periodic checkpoints (and those asked for
with ``etcslurm checkpoint``) go to its ``periodic/`` directory.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from etcslurm.baseline import megatron_lm
from etcslurm.errors import EtcslurmError, UsageError
from etcslurm.runtime.config import WorkerOptions

log = logging.getLogger("etcslurm.runtime")

#: ``SAVE_DIR/iter_NNNNNNN``: where the save of a step goes
iteration_dir = megatron_lm.iteration_dir


def directory(options: WorkerOptions) -> Path:
    """The checkpoint directory (created); a user mistake there is a one-line error."""
    path = Path(options.checkpoint_dir or Path(options.run_dir) / "checkpoint")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file, a read-only mount, ...: the user's to fix
        raise UsageError(f"checkpoint directory {path} is not usable: {exc.strerror}") from None
    return path


def _pointer(save_dir: Path) -> dict[str, Any] | None:
    """``{path, step}`` of the checkpoint ``save_dir``'s tracker names, if any (an
    unreadable tracker: :class:`StateLostError`)."""
    iteration = megatron_lm.read_tracker(save_dir)
    if iteration is None:
        return None
    return {"path": str(megatron_lm.iteration_dir(save_dir, iteration)), "step": iteration}


def pointer(options: WorkerOptions) -> dict[str, Any] | None:
    """The run's whole-run checkpoint (path, step), if it has one."""
    return _pointer(directory(options))


def load_pointer(load: str) -> dict[str, Any]:
    """The checkpoint ``RunSettings.load`` names (path, step): a save directory's latest,
    or one checkpoint directory (its step from the checkpoint's ``iteration``)."""
    path, iteration = megatron_lm.resolve(load)
    if iteration is None:
        iteration = megatron_lm.saved_iteration(path)
    return {"path": str(path), "step": iteration}


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
    """The latest COMPLETE periodic checkpoint (path, step), if any: what a run rolls
    back to when a death leaves state with no holder."""
    try:
        return _pointer(periodic_directory(options))
    except EtcslurmError as exc:
        log.error("periodic checkpoint pointer unreadable: %s", exc)
        return None


class Periodic:
    """Checkpoints every ``every`` steps (and when asked: :meth:`begin` at any step),
    written by megatron-core's persistent async writer while training goes on; a save
    counts only once every rank finalised it (rank 0's writer then moves ``periodic/``'s
    tracker to it; rank 0 drops all but the last ``keep``).

    ``poll`` is a collective while a save is pending: every world member calls it at
    every step boundary (they do, in lockstep).  A change of world first waits for a
    pending save (``finish``); a failure abandons it (its files are never pointed at).
    """

    def __init__(self, options: WorkerOptions, every: int, keep: int) -> None:
        self.options = options
        self.every = every
        self.keep = max(1, keep)
        self.pending: dict[str, Any] | None = None
        self.last_step: int | None = None  # the step of the last save begun
        self.saves: list[float] = []  # seconds each save held the training loop

    def due(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    def begin(self, world: Any, trainee: Any, step: int, layout: str, rank: int) -> None:
        """Begin the save of ``step`` (after finishing a previous one still pending)."""
        import time

        self.finish(world, rank)
        t0 = time.perf_counter()
        where = periodic_directory(self.options)
        where.mkdir(parents=True, exist_ok=True)
        world.save_async(trainee, where)
        self.saves.append(time.perf_counter() - t0)
        self.pending = {"path": str(megatron_lm.iteration_dir(where, step)), "step": step,
                        "layout": layout}
        self.last_step = step

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
            world.prepare_checkpoints()  # the next save's writer, warm before it is due
        self.pending = None

    def _complete(self, rank: int) -> None:
        """The pending save is complete (its tracker moved): rank 0 drops the oldest."""
        assert self.pending is not None
        done, self.pending = self.pending, None
        if rank != 0:
            return
        import shutil

        saved = megatron_lm.saved_iterations(periodic_directory(self.options))
        for old in saved[: max(0, len(saved) - self.keep)]:
            if str(old) != done["path"]:
                shutil.rmtree(old, ignore_errors=True)
