"""The live monitor, fed only from the coordinator's keys and event stream.

* :mod:`etcslurm.monitor.model` — pure fold of events + keys (``RunModel``).
* :mod:`etcslurm.monitor.snapshot` — that fold at a time, as a ``RunView``
  (:mod:`etcslurm.monitor.views`); :mod:`etcslurm.monitor.text` prints its numbers.
* :mod:`etcslurm.monitor.render` — rich renderables; ``render_run(view) -> str``.
* :mod:`etcslurm.monitor.source` — reading a run through the coordinator API.
* :mod:`etcslurm.monitor.live` — the refresh loop (rich Live / plain lines).
"""
