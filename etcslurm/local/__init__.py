"""Elastic runs on this machine: the launcher behind ``etcslurm demo`` (local worker
processes, a bundled Redis, a schedule of leaves and joins) and the schedule's grammar.

Not part of the runtime: it starts and signals worker processes from outside, as Slurm
does on a cluster, and the runtime never imports it.
"""
