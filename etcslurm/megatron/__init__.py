"""Adapter to megatron-core (see adapter.py and docs/megatron.md).

Importing this package imports nothing heavy; import ``etcslurm.megatron.adapter``.
"""
