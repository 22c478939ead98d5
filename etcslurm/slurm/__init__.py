"""Slurm and Submitit: the job environment, preemption signals, sbatch templates,
submission and growth by further jobs.

The runtime uses three seams from here (see ``docs/slurm.md``):

* :class:`~etcslurm.job.environment.SlurmEnvironment` — who am I in the job
  (job id, rank, node, device, end time) from ``SLURM_*`` and ``ETCSLURM_*``;
* :class:`~etcslurm.job.signals.SignalTrap` — Slurm's warning / preemption signal
  turned into a flag + a :class:`~etcslurm.job.signals.SignalEvent` with a time budget;
* :func:`~etcslurm.slurm.submission.submit` / :func:`~etcslurm.slurm.submission.grow` —
  start a run, add capacity as a further job whose workers join.

Only the standard library (and Submitit, lazily) is imported here: no torch, no Redis.
"""

from __future__ import annotations
