"""Checkpoint-based migration with megatron-core dist_checkpointing (baseline + fallback)."""
