"""Start a run and grow it: sbatch with the templates, or Submitit from Python.

Two launch paths that give a worker the same environment contract (``ETCSLURM_RUN``,
``ETCSLURM_REDIS_URL``, ``ETCSLURM_ROLE``, ``ETCSLURM_SIGNALS``, ``ETCSLURM_SIGNAL_LEAD``,
``ETCSLURM_GRACE_TIME``, ``SLURM_JOB_END_TIME``; see :mod:`etcslurm.job.environment`):

* ``via="sbatch"`` renders ``templates/elastic.sbatch`` / ``grow.sbatch`` and submits it;
  the worker is a command line (``worker_cmd``).
* ``via="submitit"`` uses ``submitit.AutoExecutor`` (Slurm, or the local executor off a
  cluster); the worker is a Python callable wrapped in :class:`ElasticTask`, a Submitit
  ``Checkpointable``: our signal trap runs first (elastic leave), Submitit's own
  checkpoint-and-requeue stays behind it as the second line of defence
  (:meth:`SignalTrap.fallback`).

Growth is always a *further job* (Slurm cannot grow a running job): plain, an array of
independent single-node jobs (each preemptable alone), or a heterogeneous job for mixed
node shapes.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from etcslurm.errors import EtcslurmError, UsageError
from etcslurm.job import environment as E
from etcslurm.job.environment import SlurmEnvironment
from etcslurm.job.signals import DEFAULT_SIGNALS, SignalTrap, parse_signal
from etcslurm.slurm.templates import render, render_het

DEFAULT_WORKER_CMD = "python -m etcslurm.runtime.worker"  # the runtime's worker entry point


@dataclass
class Submitted:
    """What a submission produced: the run, the Slurm job id(s), the script or Submitit job."""

    run_id: str
    job_id: str
    via: str
    script: str | None = None  # rendered sbatch text (sbatch path)
    script_path: Path | None = None
    job: Any = None  # submitit.Job (submitit path)
    extra: dict[str, Any] = field(default_factory=dict)


def new_run_id() -> str:
    return f"run-{uuid.uuid4().hex[:8]}"


# ---- sbatch --------------------------------------------------------------------------------
def sbatch(script: str, workdir: str | os.PathLike[str] | None = None, name: str = "job",
           timeout: float = 60.0) -> tuple[str, Path]:
    """Write ``script`` under ``workdir`` and ``sbatch --parsable`` it; returns (job id, path)."""
    if not shutil.which("sbatch"):
        raise EtcslurmError("sbatch not found: run on a Slurm login node (or `sbin/slurm-cluster start`)")
    wd = Path(workdir or os.getcwd())
    wd.mkdir(parents=True, exist_ok=True)
    path = wd / f"{name}.sbatch"
    path.write_text(script)
    try:
        res = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True,
                             timeout=timeout, cwd=wd, check=False)
    except subprocess.TimeoutExpired:
        raise EtcslurmError(f"sbatch did not answer within {timeout:.0f} s") from None
    if res.returncode != 0:
        raise EtcslurmError(f"sbatch refused {path}: {res.stderr.strip().splitlines()[-1:] or res.returncode}")
    job_id = res.stdout.strip().split(";")[0]
    if not re.fullmatch(r"\d+", job_id):
        raise EtcslurmError(f"sbatch gave no job id: {res.stdout.strip()!r}")
    return job_id, path


def submit(
    worker: str | Callable[..., Any] = DEFAULT_WORKER_CMD,
    *args: Any,
    via: str = "sbatch",
    run_id: str | None = None,
    nodes: int = 2,
    tasks_per_node: int = 1,
    redis_url: str | None = None,
    partition: str | None = None,
    time_limit: str | int = "01:00:00",
    signal: str = "USR2",
    signal_lead: int = 90,
    folder: str | os.PathLike[str] | None = None,
    cluster: str | None = None,
    fields: Mapping[str, object] | None = None,
    dry_run: bool = False,
    split: bool = False,
    slurm_params: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> Submitted:
    """Start an elastic run.

    ``via="sbatch"``: ``worker`` is the command each task runs (one task per device),
    rendered into ``templates/elastic.sbatch`` (which starts a coordinator on the first
    node unless ``redis_url`` is given); ``fields`` sets any other template field.
    ``via="submitit"``: ``worker`` is a callable or ``"module:function"`` called with
    ``*args, **kwargs`` in every task; ``cluster`` is Submitit's (``None``: auto,
    ``"local"``, ``"slurm"``).  ``dry_run`` (sbatch only) renders without submitting.
    ``split`` (sbatch only): an array of ``nodes`` single-node jobs instead of one job, so
    Slurm can preempt one node's workers alone (it always preempts whole jobs); array task
    0 hosts the coordinator unless ``redis_url`` is given.
    ``slurm_params`` (submitit only): further Submitit Slurm parameters without the
    ``slurm_`` prefix, e.g. ``{"exclusive": True}`` so each job owns its nodes and a
    preemption takes exactly one job.
    """
    run_id = run_id or new_run_id()
    parse_signal(signal)
    if via == "sbatch":
        values = _template_values(run_id, worker, redis_url, nodes, tasks_per_node, split,
                                  partition, time_limit, signal, signal_lead, fields)
        script = render("elastic", values)
        if dry_run:
            return Submitted(run_id, "", via, script=script)
        job_id, path = sbatch(script, folder, name=f"elastic-{run_id}")
        return Submitted(run_id, job_id, via, script=script, script_path=path)
    if via == "submitit":
        if fields or split:
            raise UsageError("template fields and split apply to via='sbatch' only")
        task = ElasticTask(worker, *args, run_id=run_id, redis_url=redis_url, role="start",
                           signals=(signal, "TERM"), signal_lead=signal_lead, **kwargs)
        ex = _executor(folder, cluster, nodes, tasks_per_node, partition, time_limit, signal_lead,
                       slurm_params)
        job = ex.submit(task)
        return Submitted(run_id, str(job.job_id), via, job=job)
    raise UsageError(f"unknown via {via!r}; valid: sbatch, submitit")


def grow(
    run: str,
    nodes: int = 1,
    worker: str | Callable[..., Any] = DEFAULT_WORKER_CMD,
    *args: Any,
    redis_url: str | None = None,
    via: str = "sbatch",
    tasks_per_node: int = 1,
    split: bool = False,
    components: Sequence[Mapping[str, object]] | None = None,
    partition: str | None = None,
    time_limit: str | int = "01:00:00",
    signal: str = "USR2",
    signal_lead: int = 90,
    folder: str | os.PathLike[str] | None = None,
    cluster: str | None = None,
    fields: Mapping[str, object] | None = None,
    dry_run: bool = False,
    slurm_params: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> Submitted:
    """Submit a further job whose workers join run ``run`` at its next step boundary.

    ``split``: an array of ``nodes`` single-node jobs (Slurm can preempt each alone);
    ``components``: a heterogeneous job, one dict of fields per node shape (e.g.
    ``[{"nodes": 1, "tasks_per_node": 4}, {"nodes": 2, "tasks_per_node": 2}]``).
    ``redis_url`` defaults to ``$ETCSLURM_REDIS_URL`` (set inside a run's jobs).
    ``slurm_params``: as for :func:`submit` (submitit only).
    """
    if not run or not re.fullmatch(r"[A-Za-z0-9._:+-]+", run):
        raise UsageError(f"bad run id {run!r}")
    if nodes < 1:
        raise UsageError(f"--nodes must be ≥ 1, got {nodes}")
    redis_url = redis_url or os.environ.get(E.ENV_REDIS_URL)
    if not redis_url:
        raise UsageError("the run's coordinator is unknown: give --redis URL (or set ETCSLURM_REDIS_URL)")
    if split and components:
        raise UsageError("split (array) and components (het job) cannot be combined")
    if via == "sbatch":
        values = _template_values(run, worker, redis_url, nodes, tasks_per_node, split,
                                  partition, time_limit, signal, signal_lead, fields)
        script = render_het("grow", components, values) if components else render("grow", values)
        if dry_run:
            return Submitted(run, "", via, script=script)
        job_id, path = sbatch(script, folder, name=f"grow-{run}-{uuid.uuid4().hex[:6]}")
        return Submitted(run, job_id, via, script=script, script_path=path)
    if via == "submitit":
        if components or fields:
            raise UsageError("het components and template fields apply to via='sbatch' only")
        task = ElasticTask(worker, *args, run_id=run, redis_url=redis_url, role="join",
                           signals=(signal, "TERM"), signal_lead=signal_lead, **kwargs)
        ex = _executor(folder, cluster, 1 if split else nodes, tasks_per_node, partition,
                       time_limit, signal_lead, slurm_params)
        if split:
            with ex.batch():
                jobs = [ex.submit(task) for _ in range(nodes)]
            return Submitted(run, ",".join(str(j.job_id) for j in jobs), via, job=jobs)
        job = ex.submit(task)
        return Submitted(run, str(job.job_id), via, job=job)
    raise UsageError(f"unknown via {via!r}; valid: sbatch, submitit")


def _template_values(run_id: str, worker: str | Callable[..., Any], redis_url: str | None,
                     nodes: int, tasks_per_node: int, split: bool, partition: str | None,
                     time_limit: str | int, signal: str, signal_lead: int,
                     fields: Mapping[str, object] | None) -> dict[str, object]:
    """The fields ``elastic.sbatch`` and ``grow.sbatch`` share (``fields`` override)."""
    if not isinstance(worker, str):
        raise UsageError("via='sbatch' needs the worker as a command line (worker_cmd)")
    values: dict[str, object] = {
        "run_id": run_id, "worker_cmd": worker, "nodes": 1 if split else nodes,
        "tasks_per_node": tasks_per_node, "redis_url": redis_url or "",
        "array": f"0-{nodes - 1}" if split else "",
        "partition": partition or "", "time": time_limit, "signal": signal,
        "signal_lead": signal_lead,
    }
    values.update(fields or {})
    return values


# ---- Submitit --------------------------------------------------------------------------------
def _minutes(time_limit: str | int) -> int:
    """``90`` / ``"90"`` / ``"01:30:00"`` / ``"1-00:00:00"`` → minutes for Submitit."""
    text = str(time_limit).strip()
    if text.isdigit():
        return int(text)
    m = re.fullmatch(r"(?:(\d+)-)?(\d+):(\d+)(?::(\d+))?", text)
    if not m:
        raise UsageError(f"bad time limit {time_limit!r} (minutes, HH:MM:SS or D-HH:MM:SS)")
    days, a, b, c = (int(x) if x else 0 for x in m.groups())
    hours, minutes, seconds = (a, b, c) if m.group(4) else (0, a, b)
    return max(1, days * 1440 + hours * 60 + minutes + (1 if seconds else 0))


def _executor(folder: Any, cluster: str | None, nodes: int, tasks_per_node: int,
              partition: str | None, time_limit: str | int, signal_lead: int,
              slurm_params: Mapping[str, Any] | None = None) -> Any:
    import submitit

    ex = submitit.AutoExecutor(folder=str(folder or "submitit-logs"), cluster=cluster)
    params: dict[str, Any] = {
        "nodes": nodes, "tasks_per_node": tasks_per_node, "timeout_min": _minutes(time_limit),
        "slurm_signal_delay_s": signal_lead,
    }
    if ex.cluster == "slurm":
        params["slurm_additional_parameters"] = {"requeue": True}
        if partition:
            params["slurm_partition"] = partition
        params.update({f"slurm_{k}": v for k, v in (slurm_params or {}).items()})
    ex.update_parameters(**params)
    return ex


def _resolve(target: str | Callable[..., Any]) -> Callable[..., Any]:
    if callable(target):
        return target
    module, _, name = target.partition(":")
    if not module or not name:
        raise UsageError(f"worker must be a callable or 'module:function', got {target!r}")
    return getattr(importlib.import_module(module), name)


def _query_grace(partition: str | None) -> float:
    if not partition or not shutil.which("scontrol"):
        return 0.0
    try:
        out = subprocess.run(["scontrol", "show", "partition", partition], capture_output=True,
                             text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0.0
    m = re.search(r"GraceTime=(\d+)", out)
    return float(m.group(1)) if m else 0.0


class ElasticTask:
    """A Submitit-``Checkpointable`` callable that runs an elastic worker in every task.

    ``__call__`` exports the worker contract, installs a :class:`SignalTrap` *over*
    Submitit's handlers (so a warning or preemption first becomes an elastic leave) and
    calls the target.  Submitit's checkpoint-and-requeue handler stays reachable through
    ``installed().fallback()``; when used, Submitit calls :meth:`checkpoint` (rank 0),
    which returns this task with ``checkpoints`` incremented so the requeued job knows
    (``ETCSLURM_CHECKPOINTS``) that it resumes.  The target may define
    ``checkpoint()`` itself (write the state) — it is called first.
    """

    def __init__(self, target: str | Callable[..., Any], *args: Any, run_id: str,
                 redis_url: str | None = None, role: str = "start",
                 signals: Sequence[str] = DEFAULT_SIGNALS, signal_lead: int | None = 90,
                 **kwargs: Any) -> None:
        for s in signals:
            parse_signal(s)
        self.target = target
        self.args = args
        self.kwargs = kwargs
        self.run_id = run_id
        self.redis_url = redis_url
        self.role = role
        self.signals = tuple(signals)
        self.signal_lead = signal_lead
        self.checkpoints = 0

    def environment(self) -> dict[str, str]:
        """The ``ETCSLURM_*`` variables this task exports to the worker."""
        env = {E.ENV_RUN: self.run_id, E.ENV_RUN_ID: self.run_id, E.ENV_ROLE: self.role,
               E.ENV_SIGNALS: ",".join(self.signals), "ETCSLURM_CHECKPOINTS": str(self.checkpoints)}
        if self.redis_url:
            env[E.ENV_REDIS_URL] = self.redis_url
        if self.signal_lead is not None:
            env[E.ENV_SIGNAL_LEAD] = str(self.signal_lead)
        return env

    def __call__(self) -> Any:
        os.environ.update(self.environment())
        slurm = SlurmEnvironment.from_env()
        if slurm.is_slurm:
            if E.ENV_END_TIME not in os.environ:
                end = slurm.query_end_time()
                if end:
                    os.environ[E.ENV_END_TIME] = str(int(end))
            os.environ.setdefault(E.ENV_GRACE, str(int(_query_grace(slurm.partition))))
        with SignalTrap.from_env(SlurmEnvironment.from_env()):
            return _resolve(self.target)(*self.args, **self.kwargs)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Submitit's preemption path: let the target save, then resubmit this task."""
        from submitit.helpers import DelayedSubmission

        target = _resolve(self.target) if isinstance(self.target, str) else self.target
        if hasattr(target, "checkpoint"):
            target.checkpoint()
        self.checkpoints += 1
        return DelayedSubmission(self)
