"""The coordinator protocol on Redis: membership, generations, changes, events, records, Store.

Import the pieces from their modules; this package imports nothing heavy (``store.py`` is
the only module that imports torch).  Running a Redis for it (the bundled server,
Sentinel sites, failover, ACL users) is :mod:`etcslurm.redis_host`.

* :mod:`etcslurm.coord.client` — :func:`connect` (URL [+ password file] → :class:`CoordClient`)
  with bounded timeouts and retry-until-deadline, following a Sentinel failover.
* :mod:`etcslurm.coord.coordinator` — :class:`Coordinator`, the per-run API the runtime
  uses: a façade over the parts below, which share one
  :class:`~etcslurm.coord.run.RunHandle` (:mod:`etcslurm.coord.run`).
* :mod:`etcslurm.coord.membership` — run spec, registration, heartbeats, worker states,
  liveness, the leader.
* :mod:`etcslurm.coord.generations` — publish (compare-and-set), wait, commit.
* :mod:`etcslurm.coord.changes` — the change queue for the next step boundary.
* :mod:`etcslurm.coord.events` — the event stream.
* :mod:`etcslurm.coord.records` — the typed records it stores: generation records,
  events, change requests (JSON only, one codec; malformed ones raise ``RecordError``).
* :mod:`etcslurm.coord.store` — :class:`RedisStore`, a ``torch.distributed.Store`` on Redis.
* :mod:`etcslurm.coord.schema`, :mod:`etcslurm.coord.scripts` — key names and JSON rules;
  the server-side Lua.
"""

from __future__ import annotations
