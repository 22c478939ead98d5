"""Process-group lifecycle: the layer below both ``megatron/`` and ``transfer/``.

:mod:`etcslurm.groups.lifecycle` starts and tears down torch.distributed worlds (one
``PrefixStore`` per generation on a long-lived store) and forms the exchange group that
moves state outside them.  It knows only configure/abort, never why a world changes.
"""
