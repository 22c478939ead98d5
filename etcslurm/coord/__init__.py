"""The coordinator protocol on Redis: client, membership, generations, records, events, Store.

Import the pieces from their modules; this package imports nothing heavy (``store.py`` is
the only module that imports torch).  Running a Redis for it (the bundled server,
Sentinel sites, failover, ACL users) is :mod:`etcslurm.redis_host`.

* :mod:`etcslurm.coord.client` — :func:`connect` (URL [+ password file] → :class:`CoordClient`)
  with bounded timeouts and retry-until-deadline.
* :mod:`etcslurm.coord.coordinator` — :class:`Coordinator`, the per-run API the runtime uses.
* :mod:`etcslurm.coord.records` — the typed, versioned records it stores: generation
  records, events, change requests (JSON only; malformed ones raise ``RecordError``).
* :mod:`etcslurm.coord.store` — :class:`RedisStore`, a ``torch.distributed.Store`` on Redis.
"""

from __future__ import annotations
