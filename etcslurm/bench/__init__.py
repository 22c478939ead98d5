"""Benchmarks: the ``etcslurm bench migrate`` driver, its workers and the local launcher."""
