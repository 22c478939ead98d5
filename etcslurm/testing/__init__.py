"""Test scaffolding: fault hooks, the fault-injecting worker, self-tests and stand-ins.

Nothing in the product imports this package (an import-linter contract in
``pyproject.toml`` enforces it); tests, benchmarks and ``python -m`` runs do.

* :mod:`etcslurm.testing.faults` — :class:`~etcslurm.hooks.Hooks` that delay, corrupt
  or pace, and :func:`~etcslurm.testing.faults.hooks_from_json`.
* :mod:`etcslurm.testing.worker` — ``python -m etcslurm.testing.worker --faults JSON ...``:
  the runtime worker with those hooks.
* :mod:`etcslurm.testing.fault_scenarios` — the fault runs ``tests/test_faults.py`` asserts
  on and ``benchmarks/fault_matrix.py`` measures, on :mod:`etcslurm.testing.fault_harness`
  (a run's options, tracker and measured row).
* :mod:`etcslurm.testing.synthetic` — executor self-test on synthetic tensors.
* :mod:`etcslurm.testing.megatron_selftest` — multi-process adapter/baseline checks.
* :mod:`etcslurm.testing.scenario` — a scripted resize for the monitor.
* :mod:`etcslurm.testing.probe` — a stand-in worker that reports what Slurm gives it.
"""
