"""The runtime: the step-boundary hook a training loop calls (``ElasticSession``).

``config`` (run settings, worker options) · ``session`` (the public hook) · ``machine``
(the protocol's phases and its one loop) · ``transitions`` / ``recovery`` (one small
function per phase) · ``boundary`` (signals, the coordinator's view, outages) ·
``world`` (torch.distributed, megatron-core, the model) · ``migration`` (the one
migration sequence, also run by ``etcslurm bench migrate``) · ``generation`` (what the
next generation is: pure decisions) · ``checkpointing`` (the whole-run checkpoint) ·
``worker`` / ``launcher`` / ``schedule`` (the worker process and the local demo).
"""
