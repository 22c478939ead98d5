"""One run's handle on the coordinator: what every part of the protocol shares.

The parts (:mod:`~etcslurm.coord.membership`, :mod:`~etcslurm.coord.generations`,
:mod:`~etcslurm.coord.changes`, :mod:`~etcslurm.coord.events`) each do one job on the
run's keys; they share this handle: the client, the key names, the bounds on what is
read, the bounded JSON read, the deciding write (acknowledged by a replica when the
coordinator is replicated), and who this handle is (``worker_id``, set once by
registration) and whether the run has ended.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from etcslurm.coord import schema, scripts
from etcslurm.coord.client import CoordClient
from etcslurm.coord.schema import Keys, loads_dict
from etcslurm.errors import UsageError

T = TypeVar("T")


class RunHandle:
    """``client`` on run ``run_id``: keys, bounded reads, deciding writes, identity."""

    def __init__(self, client: CoordClient, run_id: str, *,
                 max_value_bytes: int = schema.MAX_VALUE_BYTES) -> None:
        self.client = client
        self.run_id = schema.check_run_id(run_id)
        self.keys = Keys(run_id)
        #: the marker written after a deciding write, for WAIT (a few bytes, TTL 60 s)
        self.ack_key = schema.run_prefix(self.run_id) + "ack"
        self.max_value_bytes = max_value_bytes
        #: this handle's worker id once registered (``None``: the operator)
        self.worker_id: str | None = None
        #: set when a write finds the run ended (``end_run``): nothing more is written
        self.ended = False
        self._get = client.redis.register_script(scripts.GET_BOUNDED)

    def read_raw(self, key: str, deadline: float | None = None) -> bytes | None:
        """The string at ``key`` (``None``: none), refused server-side when oversized."""
        return self.client.call(
            f"read {key}", lambda r: self._get(keys=[key], args=[self.max_value_bytes]),
            deadline)

    def read(self, key: str, deadline: float | None = None) -> dict | None:
        """The JSON object at ``key`` (``None``: none)."""
        return loads_dict(self.read_raw(key, deadline), key, self.max_value_bytes)

    def confirmed_raw(self, key: str, what: str) -> bytes | None:
        """The string at ``key``, read again and acknowledged by a replica."""
        return self.client.decided(
            what,
            lambda r: self._get(keys=[key], args=[self.max_value_bytes]), self.ack_key)

    def decided(self, what: str, fn: Callable[[Any], T]) -> T:
        """A write that decides the run: returns once a replica has it (when replicated)."""
        return self.client.decided(what, fn, self.ack_key)

    def dumps(self, value: Any, what: str) -> bytes:
        """Canonical JSON of ``value``, within this run's value bound."""
        return schema.dumps(value, what, self.max_value_bytes)

    def socket_timeout(self) -> float:
        """The client's socket timeout: no single blocking read may last longer."""
        kwargs = self.client.redis.connection_pool.connection_kwargs
        return float(kwargs.get("socket_timeout") or 5)

    @property
    def who(self) -> str:
        """What writes name as their author: the worker id, else ``operator``."""
        return self.worker_id or "operator"

    def require_worker(self) -> str:
        if self.worker_id is None:
            raise UsageError("register() this worker with the coordinator first")
        return self.worker_id
