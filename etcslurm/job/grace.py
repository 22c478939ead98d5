"""How long a preempted job may take to leave: the GraceTime that applies to it.

Slurm takes the preemption grace time from the job's partition with
``PreemptType=preempt/partition_prio`` and from the job's QOS with ``preempt/qos``.  The
partition's comes from ``scontrol show partition``; the QOS's from ``sacctmgr`` and so
only where accounting (slurmdbd) runs — without it the partition's is used.  The sbatch
templates run ``python -m etcslurm.job.grace`` once per job and export the seconds as
``ETCSLURM_GRACE_TIME``; the workers' signal budget reads that.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping


def parse_duration(text: str) -> int | None:
    """Slurm's ``D-HH:MM:SS`` / ``HH:MM:SS`` / ``MM:SS`` / seconds → seconds."""
    text = text.strip()
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not m:
        return None
    days, a, b, c = (int(x) if x else None for x in m.groups())
    if b is None:  # a bare number: seconds (with a day part: D-HH)
        return (days or 0) * 86400 + (a * 3600 if days is not None else a)
    hours, minutes, seconds = (a, b, c) if c is not None else (0, a, b)
    return (days or 0) * 86400 + hours * 3600 + minutes * 60 + seconds


def partition_grace(scontrol_partition: str) -> int | None:
    """``GraceTime=N`` of ``scontrol show partition P`` (seconds)."""
    m = re.search(r"\bGraceTime=(\d+)", scontrol_partition)
    return int(m.group(1)) if m else None


def qos_grace(sacctmgr_qos: str) -> int | None:
    """GraceTime from ``sacctmgr -nP show qos NAME format=GraceTime`` (first line)."""
    lines = [ln for ln in sacctmgr_qos.splitlines() if ln.strip()]
    return parse_duration(lines[0].split("|")[-1]) if lines else None


def preempt_type(scontrol_config: str) -> str:
    """``PreemptType`` of ``scontrol show config`` (``preempt/partition_prio``, ...)."""
    m = re.search(r"^PreemptType\s*=\s*(\S+)", scontrol_config, re.MULTILINE)
    return m.group(1) if m else ""


def applicable_grace(preempt: str, partition: int | None, qos: int | None) -> tuple[int, str]:
    """(seconds, where from): the QOS's under ``preempt/qos`` when known, else the partition's."""
    if preempt.endswith("/qos") and qos is not None:
        return qos, "qos"
    if partition is not None:
        return partition, "partition"
    return 0, "unknown"


def _out(cmd: list[str], timeout: float = 10.0) -> str:
    if not shutil.which(cmd[0]):
        return ""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return res.stdout if res.returncode == 0 else ""


def query(environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """The grace time of the job this process runs in (asks slurmctld and, under
    ``preempt/qos``, the accounting database)."""
    env = os.environ if environ is None else environ
    preempt = preempt_type(_out(["scontrol", "show", "config"]))
    part = env.get("SLURM_JOB_PARTITION", "")
    partition = partition_grace(_out(["scontrol", "show", "partition", part])) if part else None
    qos = None
    if preempt.endswith("/qos"):
        name = env.get("SLURM_JOB_QOS") or _out(
            ["squeue", "-h", "-j", env.get("SLURM_JOB_ID", ""), "-o", "%q"]).strip()
        if name:
            qos = qos_grace(_out(["sacctmgr", "-nP", "show", "qos", name, "format=GraceTime"]))
    return applicable_grace(preempt, partition, qos)


if __name__ == "__main__":
    seconds, source = query()
    print(seconds)
    if "-v" in sys.argv[1:]:
        print(f"grace time {seconds} s from the {source}", file=sys.stderr)
