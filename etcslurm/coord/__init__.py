"""Redis coordinator: server, client, membership, generations, typed records, events, Store.

Import the pieces from their modules; this package imports nothing heavy (``store.py`` is
the only module that imports torch).

* :mod:`etcslurm.coord.server` — :class:`BundledRedis`, a private password-protected
  ``redis-server`` for a run directory.
* :mod:`etcslurm.coord.client` — :func:`connect` (URL [+ password file] → :class:`CoordClient`)
  with bounded timeouts and retry-until-deadline.
* :mod:`etcslurm.coord.coordinator` — :class:`Coordinator`, the per-run API the runtime uses.
* :mod:`etcslurm.coord.records` — the typed, versioned records it stores: generation
  records, events, change requests (JSON only; malformed ones raise ``RecordError``).
* :mod:`etcslurm.coord.store` — :class:`RedisStore`, a ``torch.distributed.Store`` on Redis.
* :mod:`etcslurm.coord.sentinel` — :class:`Site`: one node's part of a replicated
  coordinator (a Redis primary or replica + a Sentinel).
* :mod:`etcslurm.coord.failover` — :func:`topology`, :func:`hand_over` (move the primary
  off a node about to be preempted), :func:`hand_over_local`.
"""

from __future__ import annotations
