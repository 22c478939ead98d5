"""A ``torch.distributed.Store`` on the coordinator's Redis, one namespace per generation.

Why: ``init_process_group`` needs a rendezvous store, and the usual ``TCPStore`` lives in
one rank — if that rank leaves or is killed, the store dies with it and the survivors
cannot rebuild.  Redis outlives every worker, so each generation's process group meets at
``etcslurm:{run}:store:{generation}`` (a hash) and no rank is special.  Values are the raw bytes
torch.distributed puts there (addresses, counters), never pickled objects.

``add`` uses ``HINCRBY`` and ``compare_set`` a Lua script, so both are atomic across ranks.
Waiting blocks instead of polling: every write also appends a notice to the store's
``...:news`` stream, and ``get``/``wait`` check their keys (one command, which also
returns the stream's newest id) and, while some are missing, block in ``XREAD`` from
that id, so a write after the check wakes them at once and nothing is lost between the
two.  A rank that waits W seconds costs a handful of commands, not W / 20 ms polls
(polling, 1023 ranks waiting for rank 0's NCCL id send Redis tens of thousands of
commands in one resize at 1024 workers: ``benchmarks/resize_coordinator.py``).  At the store
timeout they raise the ``DistStoreError`` that torch expects, naming the missing keys.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from etcslurm.coord.client import CoordClient
from etcslurm.coord.schema import Keys

# KEYS[1] hash, KEYS[2] its news stream; ARGV[1] field; ARGV[2] expected; ARGV[3]
# desired; ARGV[4] ttl ms.  torch semantics: a missing key with an empty ``expected`` is
# created; on mismatch the current value is returned unchanged.
_COMPARE_SET = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
local out = cur
if not cur then
  if ARGV[2] == '' then redis.call('HSET', KEYS[1], ARGV[1], ARGV[3]); out = ARGV[3]
  else out = ARGV[2] end
elseif cur == ARGV[2] then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3]); out = ARGV[3]
end
if out == ARGV[3] then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', 64, '*', 'k', ARGV[1])
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return out
"""

# the id of the newest notice on KEYS[2] (a store's news stream), '0-0' when it has none:
# the id a waiter blocks from
_NEWEST = """
local top = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
local newest = top[1] and top[1][1] or '0-0'
"""

# KEYS[1] hash, KEYS[2] its news stream; ARGV: fields.  Returns {newest news id or '0-0',
# the 1-based indexes of the fields not in the hash...}: one command whatever the number
# of keys waited for, and the id to block from.
_MISSING = _NEWEST + """
local out = {newest}
for i = 1, #ARGV do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 then out[#out + 1] = i end
end
return out
"""

# KEYS[1] hash, KEYS[2] its news stream; ARGV[1] field.  {newest news id or '0-0', value}
_GET = _NEWEST + """
return {newest, redis.call('HGET', KEYS[1], ARGV[1])}
"""

_DEFAULT_TIMEOUT = timedelta(seconds=300)
#: the longest single block in ``XREAD`` (seconds; under the client's socket timeout,
#: and how often a waiter checks again even without news)
_BLOCK_S = 1.0


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
        self.news = keys.store_news(generation)
        self._ttl_ms = int(ttl * 1000)
        self._cas = client.redis.register_script(_COMPARE_SET)
        self._missing = client.redis.register_script(_MISSING)
        self._get = client.redis.register_script(_GET)
        self.set_timeout(timeout)
        client.call("store register", lambda r: r.sadd(keys.stores, self.generation))

    # torch calls these from its own threads (gloo), with the GIL taken by the binding.
    def _write(self, what: str, key: str, fn: Callable[[Any], Any]) -> Any:
        def _tx(r: Any) -> Any:
            p = r.pipeline(transaction=True)
            fn(p)
            p.pexpire(self.hash, self._ttl_ms)
            p.xadd(self.news, {"k": key}, maxlen=64, approximate=True)
            p.pexpire(self.news, self._ttl_ms)
            return p.execute()[0]

        return self.client.call(what, _tx)

    def _block(self, since: bytes | str, end: float) -> None:
        """Wait in ``XREAD`` for a write after news id ``since`` (at most :data:`_BLOCK_S`
        and never past ``end``)."""
        ms = int(max(0.001, min(_BLOCK_S, end - time.monotonic())) * 1000)
        self.client.call("store wait", lambda r: r.xread({self.news: since}, count=1, block=ms))

    def set(self, key: str, value: str | bytes) -> None:
        v = _bytes(value)
        self._write(f"store set {key}", key, lambda p: p.hset(self.hash, key, v))

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting (up to the store timeout) until a rank sets it.

        Each try is one command that returns the value when present (and else the news
        id to block from): the common case, an NCCL unique id every rank fetches, costs
        each rank two or three commands however long it waits."""
        limit = self.timeout.total_seconds()
        end = time.monotonic() + limit
        while True:
            since, value = self.client.call(
                f"store get {key}", lambda r: self._get(keys=[self.hash, self.news], args=[key]))
            if value is not None:
                return bytes(value)
            if end - time.monotonic() <= 0:
                raise dist.DistStoreError(
                    f"Timed out after {limit:g} s waiting for store key {key!r} in "
                    f"{self.hash} (a rank of generation {self.generation} never arrived)")
            self._block(since, end)

    def add(self, key: str, value: int) -> int:
        return int(self._write(f"store add {key}", key,
                               lambda p: p.hincrby(self.hash, key, int(value))))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        out = self.client.call(
            f"store compare_set {key}",
            lambda r: self._cas(
                keys=[self.hash, self.news],
                args=[key, _bytes(expected), _bytes(desired), self._ttl_ms],
            ),
        )
        return bytes(out)

    def _absent(self, keys: list[str]) -> tuple[bytes, list[str]]:
        """(the newest news id, the keys not (yet) in the store): one command for any
        number of keys."""
        out = self.client.call("store check", lambda r: self._missing(
            keys=[self.hash, self.news], args=keys))
        return out[0], [keys[int(i) - 1] for i in out[1:]]

    def check(self, keys: list[str]) -> bool:
        return not self._absent(list(keys))[1] if keys else True

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        keys = list(keys)
        if not keys:
            return
        limit = (timeout if timeout is not None else self.timeout).total_seconds()
        end = time.monotonic() + limit
        while True:
            since, missing = self._absent(keys)
            if not missing:
                return
            keys = missing  # the others are there; stores only grow while ranks meet
            if end - time.monotonic() <= 0:
                raise dist.DistStoreError(
                    f"Timed out after {limit:g} s waiting for store keys {missing} in "
                    f"{self.hash} (a rank of generation {self.generation} never arrived)"
                )
            self._block(since, end)

    def delete_key(self, key: str) -> bool:
        return int(self.client.call("store delete", lambda r: r.hdel(self.hash, key))) > 0

    def num_keys(self) -> int:
        return int(self.client.call("store num_keys", lambda r: r.hlen(self.hash)))

    def clear(self) -> None:
        """Delete this generation's store (once every rank has joined the group)."""
        self.client.call("store clear", lambda r: r.unlink(self.hash, self.news))
