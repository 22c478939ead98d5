"""The Slurm job environment of one worker process, read from ``SLURM_*`` variables.

Like Submitit's ``JobEnvironment`` but covering what an elastic worker needs: the het-job
component and array task (each is a separately preemptable unit), the end time (the
deadline a leaving worker must beat), the restart count (a requeued run resumes from its
checkpoint), the expanded node list (to put TP groups inside a node) and per-task devices.
Outside Slurm every field falls back to a single local process, so the same worker code
runs under ``python`` directly, under Submitit's local executor, and under ``srun``.

The run-level contract (``ETCSLURM_RUN_ID``, ``ETCSLURM_REDIS_URL``, ...) that the sbatch
templates and :mod:`etcslurm.slurm.submission` export is read here too, so a worker has
one place to learn where its coordinator is.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from etcslurm.errors import EtcslurmError, UsageError
from etcslurm.groups.devices import local_device_index

# ---- the environment contract between the launchers (templates, submission) and workers
ENV_RUN = "ETCSLURM_RUN"  # run namespace in the coordinator (what the runtime's worker reads)
ENV_RUN_ID = "ETCSLURM_RUN_ID"  # the same, older name; both are exported
ENV_RUN_DIR = "ETCSLURM_RUN_DIR"  # shared run directory (logs, checkpoints, coordinator URL)
ENV_REDIS_URL = "ETCSLURM_REDIS_URL"  # redis://:password@host:port/db of the coordinator
ENV_ROLE = "ETCSLURM_ROLE"  # "start" (elastic.sbatch / submit) or "join" (grow)
ENV_SIGNALS = "ETCSLURM_SIGNALS"  # comma list of signal names to trap, e.g. "USR2,TERM"
ENV_SIGNAL_LEAD = "ETCSLURM_SIGNAL_LEAD"  # seconds: the --signal=SIG@LEAD lead time
ENV_GRACE = "ETCSLURM_GRACE_TIME"  # seconds: the partition's preemption GraceTime (0: none)
ENV_END_TIME = "SLURM_JOB_END_TIME"  # epoch seconds (Slurm ≥ 23.02; templates export it on 22.05)


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm host list (``n[1-3,5],gpu-[01-02]x``) into node names.

    A pure-Python parser, used when ``scontrol show hostnames`` is not at hand (outside the
    cluster, in unit tests); zero padding is kept (``[01-03]`` → ``01 02 03``).
    """
    names: list[str] = []
    for part in _split_top_level(hostlist.strip()):
        if not part:
            continue
        expanded = [""]
        for literal, bracket in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", part):
            choices = [literal]
            if bracket:
                choices = [literal + item for item in _expand_range(bracket, part)]
            expanded = [prefix + choice for prefix in expanded for choice in choices]
        names.extend(expanded)
    return names


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    if depth != 0:
        raise UsageError(f"bad Slurm host list {text!r}: unbalanced brackets")
    return parts


def _expand_range(spec: str, whole: str) -> list[str]:
    out: list[str] = []
    for item in spec.split(","):
        if "-" in item:
            lo, hi = item.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise UsageError(f"bad Slurm host list {whole!r}: range {item!r}")
            width = len(lo)
            out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
        elif item.isdigit():
            out.append(item)
        else:
            raise UsageError(f"bad Slurm host list {whole!r}: item {item!r}")
    return out


def _count_list(value: str | None) -> list[int]:
    """Expand Slurm's compressed counts (``2(x3),1`` → ``[2, 2, 2, 1]``)."""
    if not value:
        return []
    out: list[int] = []
    for item in value.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            continue
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def _het_component(env: Mapping[str, str]) -> tuple[int | None, str | None]:
    """(component, het job id) of this task in a heterogeneous job step.

    Slurm 22.05 exports no per-task component variable in a ``--het-group`` step; it is
    derived from ``SLURM_PROCID`` and the per-group task counts ``SLURM_NTASKS_HET_GROUP_k``
    (tasks are numbered group by group).  The het job id is the leader's (group 0's) id.
    """
    size = _int(env, "SLURM_HET_SIZE")
    leader = env.get("SLURM_HET_JOB_ID") or env.get("SLURM_JOB_ID_HET_GROUP_0")
    explicit = _int(env, "SLURM_HET_JOB_COMPONENT", "SLURM_HET_GROUP")
    if explicit is not None:
        return explicit, leader
    if not size:
        return None, None
    procid = _int(env, "SLURM_PROCID", default=0) or 0
    first = 0
    for k in range(size):
        count = _int(env, f"SLURM_NTASKS_HET_GROUP_{k}")
        if count is None:
            break
        if procid < first + count:
            return k, leader
        first += count
    return 0, leader


def _int(environ: Mapping[str, str], *names: str, default: int | None = None) -> int | None:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            m = re.match(r"\d+", value)  # SLURM_CPUS_PER_TASK may read "2(x2)" in het jobs
            if m:
                return int(m.group())
    return default


def _float(environ: Mapping[str, str], name: str) -> float | None:
    value = environ.get(name, "").strip()
    try:
        return float(value) if value else None
    except ValueError:
        return None


@dataclass(frozen=True)
class SlurmEnvironment:
    """One worker's view of its Slurm job (``from_env``), with derived rank/node/device."""

    job_id: str | None = None  # the allocation: SLURM_JOB_ID (array: the element's own id)
    array_job_id: str | None = None  # SLURM_ARRAY_JOB_ID
    array_task_id: int | None = None  # SLURM_ARRAY_TASK_ID
    het_job_id: str | None = None  # SLURM_HET_JOB_ID (het jobs only)
    het_component: int | None = None  # SLURM_HET_JOB_COMPONENT... / het group of the step
    step_id: str | None = None  # SLURM_STEP_ID (None in the batch shell)
    proc_id: int = 0  # SLURM_PROCID: global task rank inside the step
    local_id: int = 0  # SLURM_LOCALID: task rank on this node
    node_id: int = 0  # SLURM_NODEID: index of this node in the step's node list
    ntasks: int = 1  # SLURM_STEP_NUM_TASKS / SLURM_NTASKS
    nodes: tuple[str, ...] = ()  # expanded node list of the step (or job)
    node_name: str = ""  # SLURMD_NODENAME (the logical node, also with `slurmd -N`)
    tasks_per_node: tuple[int, ...] = ()  # per node of `nodes`
    cpus_per_task: int = 1
    gpus_per_task: int | None = None  # SLURM_GPUS_PER_TASK when asked for
    gpus_on_node: int | None = None  # SLURM_GPUS_ON_NODE
    partition: str | None = None
    end_time: float | None = None  # epoch seconds; SLURM_JOB_END_TIME
    restart_count: int = 0  # SLURM_RESTART_COUNT: times the job was requeued
    submit_dir: str | None = None
    # the etcslurm run contract
    run_id: str | None = None
    run_dir: str | None = None
    redis_url: str | None = None
    role: str | None = None
    signal_lead: float | None = None
    grace_time: float | None = None
    signals: tuple[str, ...] = ()
    raw: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SlurmEnvironment:
        """Read the environment (``os.environ`` by default); never raises on odd values."""
        env = dict(os.environ if environ is None else environ)
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get(
            "SLURM_NODELIST", ""
        )
        nodes = tuple(expand_hostlist(nodelist)) if nodelist else ()
        node_name = env.get("SLURMD_NODENAME") or (nodes[0] if nodes else "")
        het, het_job = _het_component(env)
        tasks = _count_list(
            env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        )
        ntasks = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
        signals = tuple(s.strip() for s in env.get(ENV_SIGNALS, "").split(",") if s.strip())
        return cls(
            job_id=env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"),
            array_job_id=env.get("SLURM_ARRAY_JOB_ID"),
            array_task_id=_int(env, "SLURM_ARRAY_TASK_ID"),
            het_job_id=het_job,
            het_component=het,
            step_id=env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID"),
            proc_id=_int(env, "SLURM_PROCID", default=0) or 0,
            local_id=_int(env, "SLURM_LOCALID", default=0) or 0,
            node_id=_int(env, "SLURM_NODEID", default=0) or 0,
            ntasks=ntasks if ntasks else max(1, sum(tasks)),
            nodes=nodes,
            node_name=node_name,
            tasks_per_node=tuple(tasks),
            cpus_per_task=_int(env, "SLURM_CPUS_PER_TASK", default=1) or 1,
            gpus_per_task=_int(env, "SLURM_GPUS_PER_TASK"),
            gpus_on_node=_int(env, "SLURM_GPUS_ON_NODE"),
            partition=env.get("SLURM_JOB_PARTITION"),
            end_time=_float(env, ENV_END_TIME),
            restart_count=_int(env, "SLURM_RESTART_COUNT", default=0) or 0,
            submit_dir=env.get("SLURM_SUBMIT_DIR"),
            run_id=env.get(ENV_RUN) or env.get(ENV_RUN_ID) or None,
            run_dir=env.get(ENV_RUN_DIR) or None,
            redis_url=env.get(ENV_REDIS_URL) or None,
            role=env.get(ENV_ROLE) or None,
            signal_lead=_float(env, ENV_SIGNAL_LEAD),
            grace_time=_float(env, ENV_GRACE),
            signals=signals,
            raw=env,
        )

    # ---- derived ------------------------------------------------------------------------
    @property
    def is_slurm(self) -> bool:
        """True inside a Slurm allocation (batch shell or step task)."""
        return self.job_id is not None

    @property
    def in_step(self) -> bool:
        """True in a task launched by ``srun`` (the batch shell is not in a step)."""
        return self.step_id is not None and self.step_id not in ("batch", "extern")

    @property
    def world_size(self) -> int:
        return self.ntasks

    @property
    def num_nodes(self) -> int:
        return max(1, len(self.nodes))

    @property
    def local_world_size(self) -> int:
        """Tasks on this node (for ``LOCAL_WORLD_SIZE`` and per-node device counts)."""
        if self.tasks_per_node and self.node_id < len(self.tasks_per_node):
            return self.tasks_per_node[self.node_id]
        return max(1, self.ntasks // self.num_nodes)

    @property
    def worker_id(self) -> str:
        """A stable, unique name for this task across jobs of one run.

        ``{job}.{procid}`` where job is the array element (``123_4``), the het job with its
        component (``123+1``) or the plain job id; ``local.{pid}`` outside Slurm.  Stable
        over a requeue (same job id), so a restarted worker is recognised as such.
        """
        if not self.is_slurm:
            return f"local.{os.getpid()}"
        if self.array_job_id and self.array_task_id is not None:
            job = f"{self.array_job_id}_{self.array_task_id}"
        elif self.het_job_id and self.het_component is not None:
            job = f"{self.het_job_id}+{self.het_component}"
        else:
            job = str(self.job_id)
        return f"{job}.{self.proc_id}"

    def device(self, num_devices: int | None = None) -> str:
        """The torch device string for this task: ``cuda:<index>`` or ``cpu``.

        ``num_devices`` is the number of GPUs this task sees (``torch.cuda.device_count()``;
        passing it keeps this module free of torch).  With ``--gpus-per-task=1`` Slurm shows
        each task only its own GPU (``cuda:0``); with ``--gpus-per-node`` / ``--gres`` all
        tasks of a node see all of them (``cuda:<local id mod N>``): see
        :func:`etcslurm.groups.devices.local_device_index`.
        """
        if not num_devices:
            return "cpu"
        return f"cuda:{local_device_index(self.raw, num_devices, self.proc_id)}"

    def seconds_left(self, now: float | None = None) -> float | None:
        """Seconds until the job's end time (None if unknown, e.g. no time limit)."""
        if self.end_time is None:
            return None
        return self.end_time - (time.time() if now is None else now)

    def torch_env(self, master_addr: str | None = None, master_port: int | None = None) -> dict[str, str]:
        """``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/... for torch tools that read them.

        The elastic runtime assigns its own ranks per generation; this is the Slurm-step
        view, useful for a first generation or for a non-elastic baseline.
        """
        out = {
            "RANK": str(self.proc_id),
            "WORLD_SIZE": str(self.ntasks),
            "LOCAL_RANK": str(self.local_id),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_id),
        }
        if master_addr or self.nodes:
            out["MASTER_ADDR"] = master_addr or self.nodes[0]
        if master_port:
            out["MASTER_PORT"] = str(master_port)
        return out

    # ---- queries that need Slurm's client tools (never in a signal handler) ------------
    def query_end_time(self, timeout: float = 10.0) -> float | None:
        """Ask slurmctld for the job's current end time (it moves on preemption/update)."""
        if not self.job_id:
            return None
        out = _run(["squeue", "-h", "-j", self.job_id, "-o", "%e"], timeout)
        return parse_slurm_time(out.strip().splitlines()[0]) if out and out.strip() else None


def parse_slurm_time(text: str) -> float | None:
    """``YYYY-MM-DDTHH:MM:SS`` (local time) → epoch seconds; None for N/A/Unknown."""
    text = text.strip()
    if not text or text in ("N/A", "Unknown", "None", "INVALID"):
        return None
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def _run(cmd: list[str], timeout: float) -> str | None:
    if not shutil.which(cmd[0]):
        return None
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout if res.returncode == 0 else None


@contextlib.contextmanager
def _children_ignore_sigterm() -> Iterator[None]:
    """Processes started inside ignore SIGTERM (an ignored signal stays ignored across
    ``exec``).

    Why: ``scontrol requeue`` runs inside the job's step, and the requeue it asks for
    makes Slurm end that step: SIGTERM to every process in it, SIGKILL after
    ``KillWait``.  A SIGTERM landing before scontrol has read the controller's answer
    killed it, and a requeue that took effect was reported as failed (no
    ``job.requeued``).  This process ignores SIGTERM only while it starts the child
    (``Popen`` returns once the child has exec'd), and only on the main thread, where
    signal handlers live (elsewhere nothing changes).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def requeue(job_id: str | None = None, timeout: float = 60.0) -> None:
    """Requeue this job (``scontrol requeue``): the fallback when nothing survives.

    A job whose processes exit by themselves during a preemption's grace time ends
    COMPLETED and is *not* requeued by Slurm; a worker that wrote a checkpoint for the
    whole run must therefore requeue its job explicitly before exiting (as Submitit does).
    The restarted job sees ``SLURM_RESTART_COUNT`` ≥ 1 and resumes from the checkpoint.
    """
    job_id = job_id or SlurmEnvironment.from_env().job_id
    if not job_id:
        raise UsageError("not inside a Slurm job: nothing to requeue")
    try:
        with _children_ignore_sigterm():
            proc = subprocess.Popen(["scontrol", "requeue", job_id], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EtcslurmError(f"scontrol requeue {job_id} failed: {exc}") from None
    if proc.returncode != 0:
        why = err.strip() or f"exit status {proc.returncode}"
        raise EtcslurmError(f"scontrol requeue {job_id} failed: {why}")
