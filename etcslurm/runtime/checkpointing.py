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
