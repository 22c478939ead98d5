"""The job a worker runs in, as the runtime sees it: below the runtime, above nothing.

* :class:`~etcslurm.job.environment.SlurmEnvironment` — who am I in the job (``SLURM_*``
  variables → fields), the time budget, and :func:`~etcslurm.job.environment.requeue`.
* :class:`~etcslurm.job.signals.SignalTrap` — the warning / preemption signal turned into
  a flag and a :class:`~etcslurm.job.signals.SignalEvent` with a time budget;
  :func:`~etcslurm.job.signals.trap_for_job` picks the job's signals or the local ones.

Submission, templates and growth (what *starts* jobs) live in :mod:`etcslurm.slurm`, above
the runtime.
"""
