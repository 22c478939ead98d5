"""A ``torch.distributed.Store`` on the coordinator's Redis, one namespace per generation.

Why: ``init_process_group`` needs a rendezvous store, and the usual ``TCPStore`` lives in
one rank — if that rank leaves or is killed, the store dies with it and the survivors
cannot rebuild.  Redis outlives every worker, so each generation's process group meets at
``etcslurm:{run}:store:{generation}`` (a hash) and no rank is special.  Values are the raw bytes
torch.distributed puts there (addresses, counters), never pickled objects.

``add`` uses ``HINCRBY`` and ``compare_set`` a Lua script, so both are atomic across ranks;
``get`` fetches the value as soon as it is there (one ``HGET`` per try, no separate
existence check) and ``wait`` asks for all its keys in one command; both retry with a
short backoff (1 ms doubling to 20 ms) until the store timeout, then raise the
``DistStoreError`` that torch expects, with the missing keys in the message.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from etcslurm.coord.client import CoordClient
from etcslurm.coord.schema import Keys

# KEYS[1] hash; ARGV[1] field; ARGV[2] expected; ARGV[3] desired; ARGV[4] ttl ms.  torch
# semantics: a missing key with an empty ``expected`` is created; on mismatch the current
# value is returned unchanged.
_COMPARE_SET = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
local out = cur
if not cur then
  if ARGV[2] == '' then redis.call('HSET', KEYS[1], ARGV[1], ARGV[3]); out = ARGV[3]
  else out = ARGV[2] end
elseif cur == ARGV[2] then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3]); out = ARGV[3]
end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return out
"""

# KEYS[1] hash; ARGV: fields.  Returns the 1-based indexes of the fields not in the hash:
# one command whatever the number of keys waited for.
_MISSING = """
local out = {}
for i = 1, #ARGV do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 then out[#out + 1] = i end
end
return out
"""

_DEFAULT_TIMEOUT = timedelta(seconds=300)
#: first and longest pause between two tries of a ``get``/``wait`` (seconds)
_FIRST_DELAY, _MAX_DELAY = 0.001, 0.02


def _bytes(value: str | bytes) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)


class RedisStore(dist.Store):
    """torch.distributed ``Store`` kept in the hash ``etcslurm:{run}:store:{gen}``.

    ``RedisStore(client, run_id, generation)``; pass it to
    ``init_process_group(backend, store=..., rank=..., world_size=...)``.  ``timeout`` bounds
    ``get``/``wait`` (torch's store timeout semantics).  One hash per generation (not a
    key per entry) so the run can find and delete it without ``SCAN``, which a per-run ACL
    user may not use; it expires ``ttl`` seconds after its last write.
    """

    def __init__(
        self,
        client: CoordClient,
        run_id: str,
        generation: int | str,
        timeout: timedelta = _DEFAULT_TIMEOUT,
        ttl: float = 24 * 3600,
    ) -> None:
        super().__init__()
        keys = Keys(run_id)
        self.client = client
        self.generation = str(generation)
        self.hash = keys.store(generation)
        self._ttl_ms = int(ttl * 1000)
        self._cas = client.redis.register_script(_COMPARE_SET)
        self._missing = client.redis.register_script(_MISSING)
        self.set_timeout(timeout)
        client.call("store register", lambda r: r.sadd(keys.stores, self.generation))

    # torch calls these from its own threads (gloo), with the GIL taken by the binding.
    def _write(self, what: str, fn: Callable[[Any], Any]) -> Any:
        def _tx(r: Any) -> Any:
            p = r.pipeline(transaction=True)
            fn(p)
            p.pexpire(self.hash, self._ttl_ms)
            return p.execute()[0]

        return self.client.call(what, _tx)

    def set(self, key: str, value: str | bytes) -> None:
        v = _bytes(value)
        self._write(f"store set {key}", lambda p: p.hset(self.hash, key, v))

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting (up to the store timeout) until a rank sets it.

        Each try is one ``HGET`` that returns the value when present: the common case
        (an NCCL unique id every rank fetches) costs each rank one or a few commands, not
        a wait loop and then a read."""
        limit = self.timeout.total_seconds()
        end = time.monotonic() + limit
        delay = _FIRST_DELAY
        while True:
            value = self.client.call(f"store get {key}", lambda r: r.hget(self.hash, key))
            if value is not None:
                return bytes(value)
            left = end - time.monotonic()
            if left <= 0:
                raise dist.DistStoreError(
                    f"Timed out after {limit:g} s waiting for store key {key!r} in "
                    f"{self.hash} (a rank of generation {self.generation} never arrived)")
            time.sleep(min(delay, left))
            delay = min(delay * 2, _MAX_DELAY)

    def add(self, key: str, value: int) -> int:
        return int(self._write(f"store add {key}", lambda p: p.hincrby(self.hash, key, int(value))))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        out = self.client.call(
            f"store compare_set {key}",
            lambda r: self._cas(
                keys=[self.hash], args=[key, _bytes(expected), _bytes(desired), self._ttl_ms]
            ),
        )
        return bytes(out)

    def _absent(self, keys: list[str]) -> list[str]:
        """The keys not (yet) in the store: one command for any number of keys."""
        idx = self.client.call("store check", lambda r: self._missing(keys=[self.hash],
                                                                      args=keys))
        return [keys[int(i) - 1] for i in idx]

    def check(self, keys: list[str]) -> bool:
        return not self._absent(list(keys)) if keys else True

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        keys = list(keys)
        if not keys:
            return
        limit = (timeout if timeout is not None else self.timeout).total_seconds()
        end = time.monotonic() + limit
        delay = _FIRST_DELAY
        while True:
            missing = self._absent(keys)
            if not missing:
                return
            keys = missing  # the others are there; stores only grow while ranks meet
            left = end - time.monotonic()
            if left <= 0:
                raise dist.DistStoreError(
                    f"Timed out after {limit:g} s waiting for store keys {missing} in "
                    f"{self.hash} (a rank of generation {self.generation} never arrived)"
                )
            time.sleep(min(delay, left))
            delay = min(delay * 2, _MAX_DELAY)

    def delete_key(self, key: str) -> bool:
        return int(self.client.call("store delete", lambda r: r.hdel(self.hash, key))) > 0

    def num_keys(self) -> int:
        return int(self.client.call("store num_keys", lambda r: r.hlen(self.hash)))

    def clear(self) -> None:
        """Delete this generation's store (once every rank has joined the group)."""
        self.client.call("store clear", lambda r: r.unlink(self.hash))
