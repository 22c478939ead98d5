"""The per-run coordinator API: one handle composed of the protocol's parts.

Why Redis and not a rank: the coordinator must outlive any worker (a leaving or killed
rank must never take the rendezvous down with it).  Everything of a run lives under
``etcslurm:{run}:`` (see "Coordinator keys" in docs/architecture.md); values are JSON
documents, read with a size bound; a bad entry raises :class:`CoordinatorError` naming
the key.  Every wait is bounded and its :class:`WaitTimeout` names what was missing.

:class:`Coordinator` is a façade over one part per job, each usable alone:

* :class:`~etcslurm.coord.membership.Membership` (``coord.membership``): run spec,
  registration, heartbeats, worker states, liveness, the leader;
* :class:`~etcslurm.coord.generations.Generations` (``coord.generations``): publish,
  wait for, commit generation records;
* :class:`~etcslurm.coord.changes.ChangeQueue` (``coord.changes``): change requests;
* :class:`~etcslurm.coord.events.EventLog` (``coord.events``): the event stream;

and ends the run, which touches them all.

Typical use by a worker::

    coord = Coordinator(connect(url, password_file), run_id, spec=run_spec)
    wid = coord.register({"device": "cpu:0", "address": "10.0.0.5"})  # starts heartbeats
    ...
    if coord.is_leader():
        rec = first_generation(settings, workers, nodes)  # runtime/generation.py
        coord.publish_generation(rec)  # a GenerationRecord (coord/records/)
    rec = coord.wait_generation(after=g - 1, timeout=60)
    coord.set_state("active", rank=rec.rank_of(wid), generation=rec.generation)
    coord.emit("step", gen=rec.generation, step=1, loss=5.2)  # checked against records

Generation records, events and change requests are the typed records of
:mod:`etcslurm.coord.records`: what is written is checked, what is read is parsed, and
an unknown or malformed one raises :class:`~etcslurm.errors.RecordError`.

With a replicated coordinator (``redis+sentinel://`` URL) the writes that decide the run
— registration and worker states, ``mark_gone``, the generation compare-and-set
(including ``checkpoint`` records), commits, change requests, ``end_run`` — return only
once a replica has them (:meth:`~etcslurm.coord.client.CoordClient.decided`, ``WAIT``),
and :meth:`Coordinator.wait_generation` hands out a record only once a replica has it:
a failover never forgets a decision anyone acted on.  Heartbeats, events and the
torch.distributed store are not waited for (see docs/coordinator.md, "Replicated
coordinator").
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from etcslurm.coord import schema
from etcslurm.coord.changes import ChangeQueue
from etcslurm.coord.client import CoordClient
from etcslurm.coord.events import EventLog
from etcslurm.coord.generations import NEWS_BLOCK_S, NEWS_CAP, GenerationHead, Generations
from etcslurm.coord.membership import (
    ACTIVE,
    GONE,
    JOINING,
    LEAVING,
    Membership,
    SpecMismatch,
)
from etcslurm.coord.records import ChangeRequest, CheckpointRequest, GenerationRecord
from etcslurm.coord.run import RunHandle
from etcslurm.coord.schema import Keys
from etcslurm.errors import CoordinatorError, UsageError

__all__ = ["ACTIVE", "GONE", "JOINING", "LEAVING", "NEWS_BLOCK_S", "NEWS_CAP", "Coordinator",
           "GenerationHead", "SpecMismatch"]


class Coordinator:
    """One worker's (or the operator's) handle on one run in the coordinator.

    ``client`` comes from :func:`etcslurm.coord.client.connect`.  ``spec`` is the run spec
    (model spec, seed, global batch, ...): the first to register stores it, a joiner whose
    spec differs is refused with :class:`SpecMismatch`.  ``heartbeat_interval`` and
    ``dead_after`` (seconds, default 1 and 10) decide how fast a dead worker is noticed;
    ``max_value_bytes`` bounds every JSON value read or written.
    """

    def __init__(
        self,
        client: CoordClient,
        run_id: str,
        *,
        spec: dict[str, Any] | None = None,
        heartbeat_interval: float = 1.0,
        dead_after: float = 10.0,
        max_value_bytes: int = schema.MAX_VALUE_BYTES,
        max_workers: int = 100_000,
        max_events: int = 10_000,
    ) -> None:
        if heartbeat_interval <= 0 or dead_after <= heartbeat_interval:
            raise UsageError(
                f"need 0 < heartbeat_interval ({heartbeat_interval}) < dead_after ({dead_after})"
            )
        self.run = RunHandle(client, run_id, max_value_bytes=max_value_bytes)
        self.events = EventLog(self.run, max_events)
        self.membership = Membership(self.run, self.events, spec=spec,
                                     heartbeat_interval=heartbeat_interval,
                                     dead_after=dead_after, max_workers=max_workers)
        self.generations = Generations(self.run, self.events, self.membership.leader)
        self.changes = ChangeQueue(self.run, self.events)

    # ------------------------------------------------------------------ who and where
    @property
    def client(self) -> CoordClient:
        return self.run.client

    @property
    def run_id(self) -> str:
        return self.run.run_id

    @property
    def keys(self) -> Keys:
        return self.run.keys

    @property
    def worker_id(self) -> str | None:
        """This handle's worker id once registered (``None``: the operator)."""
        return self.run.worker_id

    @property
    def ended(self) -> bool:
        """Whether a write or heartbeat found the run ended (:meth:`end_run`)."""
        return self.run.ended

    @property
    def spec(self) -> dict[str, Any] | None:
        return self.membership.spec

    @property
    def info(self) -> dict[str, Any]:
        """This worker's entry as last written."""
        return self.membership.info

    @property
    def heartbeat_interval(self) -> float:
        return self.membership.heartbeat_interval

    @property
    def dead_after(self) -> float:
        return self.membership.dead_after

    @property
    def last_beat_ok(self) -> float:
        """``time.monotonic()`` of the last successful heartbeat."""
        return self.membership.last_beat_ok

    @property
    def last_beat_error(self) -> str | None:
        """Why heartbeats fail now (``None``: they do not)."""
        return self.membership.last_beat_error

    # ------------------------------------------------------------------ membership
    def ensure_spec(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self.membership.ensure_spec(spec)

    def run_spec(self) -> dict[str, Any] | None:
        return self.membership.run_spec()

    @property
    def observers(self) -> list[Any]:
        """Called as ``observer(type, payload, ts)`` after each event this handle wrote
        (:attr:`etcslurm.coord.events.EventLog.observers`)."""
        return self.events.observers

    def record_shapes(self, shapes: dict[str, Any]) -> None:
        self.membership.record_shapes(shapes)

    def shapes(self) -> dict[str, Any] | None:
        return self.membership.shapes()

    def register(self, info: dict[str, Any] | None = None, *, heartbeat: bool = True) -> str:
        return self.membership.register(info, heartbeat=heartbeat)

    def beat(self, deadline: float | None = 0) -> str:
        return self.membership.beat(deadline)

    def start_heartbeat(self) -> None:
        self.membership.start_heartbeat()

    def stop_heartbeat(self) -> None:
        self.membership.stop_heartbeat()

    def set_state(self, state: str, *, rank: int | None = None, generation: int | None = None,
                  leave_within: float | None = None, **extra: Any) -> None:
        self.membership.set_state(state, rank=rank, generation=generation,
                                  leave_within=leave_within, **extra)

    def hold(self, generation: int) -> None:
        self.membership.hold(generation)

    def holding(self) -> dict[str, int]:
        return self.membership.holding()

    def mark_gone(self, worker_id: str, reason: str) -> None:
        self.membership.mark_gone(worker_id, reason)

    def members(self, deadline: float | None = None) -> dict[str, dict[str, Any]]:
        return self.membership.members(deadline)

    def live_members(self) -> dict[str, dict[str, Any]]:
        return self.membership.live_members()

    def dead_workers(self) -> list[str]:
        return self.membership.dead_workers()

    def alive(self, worker_id: str) -> bool:
        return self.membership.alive(worker_id)

    def leader(self) -> str | None:
        return self.membership.leader()

    def is_leader(self) -> bool:
        return self.membership.is_leader()

    def leave(self, within: float, reason: str = "signal") -> None:
        """Announce that this worker leaves within ``within`` seconds; asks for a resize
        (a change request draining this worker)."""
        wid = self.run.require_worker()
        self.membership.set_state(LEAVING, leave_within=within, leave_reason=reason)
        self.changes.request(ChangeRequest(to=None, drain=(wid,), by=wid, ts=time.time(),
                                           reason=f"{wid} leaving ({reason})"))

    # ------------------------------------------------------------------ generations
    def publish_generation(self, record: GenerationRecord) -> bool:
        return self.generations.publish(record)

    def commit_generation(self, generation: int) -> None:
        self.generations.commit(generation)

    def committed_generation(self) -> int:
        return self.generations.committed()

    def current_generation(self) -> GenerationRecord | None:
        return self.generations.current()

    def head(self) -> GenerationHead:
        return self.generations.head()

    def watch(self, generation: int, timeout: float,
              committed: int | None = None) -> GenerationHead:
        return self.generations.watch(generation, timeout, committed)

    def wait_generation(self, after: int, timeout: float) -> GenerationRecord:
        return self.generations.wait(after, timeout)

    # ------------------------------------------------------------------ changes, events
    def request_change(self, request: ChangeRequest) -> None:
        self.changes.request(request)

    def pending_changes(self, deadline: float | None = None) -> list[ChangeRequest]:
        return self.changes.pending(deadline)

    def take_changes(self, count: int) -> None:
        self.changes.take(count)

    def request_checkpoint(self, request: CheckpointRequest) -> None:
        self.changes.request_checkpoint(request)

    def checkpoint_request(self, deadline: float | None = None) -> CheckpointRequest | None:
        return self.changes.checkpoint_request(deadline)

    def take_checkpoint_request(self) -> None:
        self.changes.take_checkpoint_request()

    def emit(self, type: str, *, at_ts: float | None = None, retry_s: float | None = None,
             **data: Any) -> str:
        return self.events.emit(type, at_ts=at_ts, retry_s=retry_s, **data)

    def read_events(self, last_id: str = "0", block_ms: int | None = None,
                    count: int = 1000) -> list[dict[str, Any]]:
        return self.events.read(last_id, block_ms, count)

    # ------------------------------------------------------------------ end
    def run_keys(self) -> list[str]:
        """All existing keys of this run.

        Derived from what the run tracks (workers, store generations), not
        from ``SCAN``: a per-run ACL user may not list key names (see ``redis_host/acl.py``).
        The ``ended`` tombstone that :meth:`end_run` leaves (with a TTL) is not listed.
        """
        k = self.keys

        def _list(r: Any) -> list[str]:
            p = r.pipeline(transaction=False)
            p.hkeys(k.workers)
            p.smembers(k.stores)
            workers, stores = p.execute()
            names = list(k.fixed())
            names += [k.hb(schema.text(w)) for w in workers]
            names += [n for g in stores
                      for n in (k.store(schema.text(g)), k.store_news(schema.text(g)))]
            p = r.pipeline(transaction=False)
            for n in names:
                p.exists(n)
            return sorted(n for n, e in zip(names, p.execute(), strict=True) if e)

        return self.client.call("list keys", _list)

    def end_run(self, keep_s: float = 0.0, tombstone_s: float = 60.0) -> int:
        """End the run: emit ``run.end``; delete its keys, or let them expire in ``keep_s``.

        A tombstone ``ended`` (TTL ``max(keep_s, tombstone_s)``) stops the heartbeats of
        workers still alive from re-creating their entries, and refuses new
        registrations under this run id meanwhile.  Returns how many keys were deleted
        or given a TTL (the tombstone not counted).
        """
        self.emit("run.end", keep_s=keep_s)
        self.stop_heartbeat()
        ttl_ms = int(max(keep_s, tombstone_s, 1.0) * 1000)
        marker = schema.dumps({"ts": time.time(), "by": self.run.who}, self.keys.ended)
        self.run.decided("end run", lambda r: r.set(self.keys.ended, marker, px=ttl_ms))
        keys = self.run_keys()

        def _drop(r: Any) -> None:
            p = r.pipeline(transaction=False)
            for k in keys:
                if keep_s > 0:
                    p.pexpire(k, int(keep_s * 1000))
                else:
                    p.unlink(k)
            p.execute()

        if keys:
            self.client.call("end run", _drop)
        return len(keys)

    def close(self, state: str | None = GONE) -> None:
        """Stop heartbeats and (by default) record this worker as gone."""
        self.stop_heartbeat()
        if self.worker_id is not None and state and self.info.get("state") != state:
            with contextlib.suppress(CoordinatorError, UsageError):
                self.set_state(state)
        for observer in self.events.observers:
            with contextlib.suppress(Exception):
                getattr(observer, "close", lambda: None)()

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
