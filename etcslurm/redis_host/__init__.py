"""Running the Redis that hosts the coordinator: the servers, not the protocol.

The protocol (:mod:`etcslurm.coord`) talks to any Redis >= 6.2 through a URL; this
package starts and looks after one for a run.  Import the pieces from their modules:

* :mod:`etcslurm.redis_host.server` — :class:`BundledRedis`, a private password-protected
  ``redis-server`` for a run directory (``etcslurm coordinator start``).
* :mod:`etcslurm.redis_host.sentinel` — :class:`Site`: one node's part of a replicated
  coordinator (a Redis primary or replica + a Sentinel).
* :mod:`etcslurm.redis_host.failover` — :func:`topology`, :func:`hand_over` (move the
  primary off a node about to be preempted), :func:`hand_over_local`.
* :mod:`etcslurm.redis_host.acl` — per-run ACL users confined to one run's keys.
"""

from __future__ import annotations
