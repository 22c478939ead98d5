"""The per-run coordinator API: membership, leader, generations, change requests, events.

Why Redis and not a rank: the coordinator must outlive any worker (a leaving or killed
rank must never take the rendezvous down with it).  Everything of a run lives under
``etcslurm:{run}:`` (see "Coordinator keys" in docs/architecture.md); values are JSON
documents, read with a size bound; a bad entry raises :class:`CoordinatorError` naming
the key.  Every wait is bounded and its :class:`WaitTimeout` names what was missing.

Typical use by a worker::

    coord = Coordinator(connect(url, password_file), run_id, spec=run_spec)
    wid = coord.register({"device": "cpu:0", "address": "10.0.0.5"})  # starts heartbeats
    ...
    if coord.is_leader():
        rec = first_generation(settings, workers, nodes)  # runtime/generation.py
        coord.publish_generation(rec)  # a GenerationRecord (coord/records.py)
    rec = coord.wait_generation(after=g - 1, timeout=60)
    coord.set_state("active", rank=rec.rank_of(wid), generation=rec.generation)
    coord.emit("step", gen=rec.generation, step=1, loss=5.2)  # checked against records.py

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
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from etcslurm.coord import schema, scripts
from etcslurm.coord.client import CoordClient
from etcslurm.coord.records import (
    ChangeRequest,
    ChangeRequested,
    CheckpointRequest,
    CheckpointRequested,
    GenerationRecord,
    GenerationStart,
    event_data,
)
from etcslurm.coord.schema import Keys, dumps, loads, loads_dict
from etcslurm.errors import CoordinatorError, RecordError, UsageError, WaitTimeout

log = logging.getLogger(__name__)

#: Worker states, in lifecycle order: ``gone`` is final.
JOINING, ACTIVE, LEAVING, GONE = schema.WORKER_STATES
_ALLOWED = {
    JOINING: {JOINING, ACTIVE, LEAVING, GONE},
    ACTIVE: {ACTIVE, LEAVING, GONE},
    LEAVING: {LEAVING, GONE},
    GONE: {GONE},
}


class SpecMismatch(CoordinatorError):
    """A worker's run spec (model, seed, global batch, ...) differs from the run's."""


#: notices kept on the ``news`` stream (waiters only need the newest)
NEWS_CAP = 100
#: longest single XREAD BLOCK of a wait: a wait re-reads the head this often, so a record
#: written behind the scripts' back (a hand-edited key) is still seen within this time
NEWS_BLOCK_S = 2.0


@dataclass(frozen=True)
class GenerationHead:
    """What a waiting worker needs, read in one O(1) call (:meth:`Coordinator.head`):
    the current generation's number (``-1``: none), the last committed one (``-1``:
    none) and ``cursor``, the id of the newest notice on the ``news`` stream (block after
    it to hear of the next publish or commit)."""

    generation: int
    committed: int
    cursor: str


def _seq(worker_id: str) -> int:
    """The registration number inside a worker id ``w<n>`` (others sort last)."""
    try:
        return int(worker_id[1:]) if worker_id.startswith("w") else 1 << 62
    except ValueError:
        return 1 << 62


def _slurm_env() -> dict[str, Any]:
    env = os.environ
    out: dict[str, Any] = {}
    for field, var in (
        ("slurm_job", "SLURM_JOB_ID"),
        ("slurm_step", "SLURM_STEP_ID"),
        ("slurm_proc", "SLURM_PROCID"),
        ("slurm_array_task", "SLURM_ARRAY_TASK_ID"),
        ("node", "SLURMD_NODENAME"),
    ):
        if env.get(var):
            out[field] = env[var]
    return out


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
        self.client = client
        self.run_id = schema.check_run_id(run_id)
        self.keys = Keys(run_id)
        #: the marker written after a deciding write, for WAIT (a few bytes, TTL 60 s)
        self._ack_key = schema.run_prefix(self.run_id) + "ack"
        self.spec = spec
        self.heartbeat_interval = heartbeat_interval
        self.dead_after = dead_after
        self.max_value_bytes = max_value_bytes
        self.max_workers = max_workers
        self.max_events = max_events
        self.worker_id: str | None = None
        self.info: dict[str, Any] = {}
        self.evicted = False  # set when the others marked this live worker gone
        self.ended = False  # set when a heartbeat finds the run ended (end_run)
        self.last_beat_ok = 0.0  # time.monotonic() of the last successful heartbeat
        self.last_beat_error: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        r = client.redis
        self._get = r.register_script(scripts.GET_BOUNDED)
        self._hgetall = r.register_script(scripts.HGETALL_BOUNDED)
        self._gen_cas = r.register_script(scripts.GEN_CAS)
        self._gen_head = r.register_script(scripts.GEN_HEAD)
        self._commit = r.register_script(scripts.COMMIT)
        self._beat = r.register_script(scripts.HEARTBEAT)
        self._hset_live = r.register_script(scripts.HSET_UNLESS_ENDED)
        self._xadd_live = r.register_script(scripts.XADD_UNLESS_ENDED)

    # ------------------------------------------------------------------ JSON I/O
    def _read(self, key: str, deadline: float | None = None) -> dict | None:
        raw = self.client.call(
            f"read {key}", lambda r: self._get(keys=[key], args=[self.max_value_bytes]), deadline
        )
        return loads_dict(raw, key, self.max_value_bytes)

    def _workers_raw(self, deadline: float | None = None) -> dict[str, dict]:
        key = self.keys.workers
        flat = self.client.call(
            f"read {key}",
            lambda r: self._hgetall(keys=[key], args=[self.max_value_bytes, self.max_workers]),
            deadline,
        )
        out: dict[str, dict] = {}
        for i in range(0, len(flat), 2):
            wid = schema.text(flat[i])
            info = loads_dict(flat[i + 1], f"{key}[{wid}]", self.max_value_bytes)
            assert info is not None
            if info.get("run_id") != self.run_id:
                raise CoordinatorError(
                    f"coordinator entry {key}[{wid}] belongs to run {info.get('run_id')!r}, "
                    f"not {self.run_id!r}"
                )
            out[wid] = info
        return out

    # ------------------------------------------------------------------ run spec
    def ensure_spec(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Store ``spec`` as the run's spec if none is set; else require it to be equal.

        Raises :class:`SpecMismatch` listing the fields that differ.
        """
        key = self.keys.spec
        raw = dumps(spec, key, self.max_value_bytes)
        self.client.call(f"write {key}", lambda r: r.set(key, raw, nx=True))
        stored = self._read(key)
        if stored is None:  # deleted in between (end_run): store ours
            self.client.call(f"write {key}", lambda r: r.set(key, raw, nx=True))
            return spec
        canon = schema.loads(raw, key)
        if stored != canon:
            diffs = [
                f"{k}: run has {stored.get(k)!r}, this worker {canon.get(k)!r}"
                for k in sorted(set(stored) | set(canon))
                if stored.get(k) != canon.get(k)
            ]
            raise SpecMismatch(
                f"refused to join run {self.run_id}: spec differs ({'; '.join(diffs[:5])})"
            )
        return stored

    def run_spec(self) -> dict[str, Any] | None:
        """The run's stored spec, or ``None``."""
        return self._read(self.keys.spec)

    # ------------------------------------------------------------------ membership
    def register(self, info: dict[str, Any] | None = None, *, heartbeat: bool = True) -> str:
        """Join the run as a new worker in state ``joining``; returns its worker id ``w<n>``.

        ``info`` adds/overrides fields (``device``, ``address``, ...); host, pid and the
        Slurm job/step/node come from the environment.  Starts the heartbeat thread unless
        ``heartbeat=False`` (then call :meth:`beat` yourself, e.g. for 1000 simulated
        workers).  Emits ``worker.registered``.
        """
        if self.worker_id is not None:
            raise UsageError(f"this coordinator handle is already worker {self.worker_id}")
        ended = self._read(self.keys.ended)
        if ended is not None:
            raise CoordinatorError(
                f"run {self.run_id} has ended (end_run at {ended.get('ts', 0):.0f}); "
                "use a new run id"
            )
        if self.spec is not None:
            self.ensure_spec(self.spec)
        n = int(self.client.call("register", lambda r: r.incr(self.keys.worker_seq)))
        wid = f"w{n}"
        now = time.time()
        base: dict[str, Any] = {
            "worker_id": wid,
            "run_id": self.run_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "device": None,
            "address": None,
            **_slurm_env(),
        }
        base.update(info or {})
        base.update(
            worker_id=wid,
            run_id=self.run_id,
            state=JOINING,
            rank=None,
            generation=None,
            leave_deadline=None,
            registered_at=now,
            updated_at=now,
        )
        raw = dumps(base, f"{self.keys.workers}[{wid}]", self.max_value_bytes)
        with self._lock:
            self.worker_id, self.info = wid, base
        self.client.decided("register", lambda r: r.hset(self.keys.workers, wid, raw),
                            self._ack_key)
        self.beat(deadline=None)
        self.emit("worker.registered", **{k: base.get(k) for k in (
            "host", "node", "pid", "device", "address", "slurm_job", "slurm_step")})
        if heartbeat:
            self.start_heartbeat()
        return wid

    def beat(self, deadline: float | None = 0) -> str:
        """One heartbeat: refresh ``hb:{worker}`` (TTL ``dead_after``), heal a lost entry.

        ``deadline``: seconds to retry an outage (default 0: one try, the heartbeat
        thread just tries again next interval).  Returns the state stored for this
        worker; if others marked it ``gone`` while it was alive, :attr:`evicted` is set so
        the runtime can stop cleanly; after :meth:`end_run` it returns ``"ended"``, sets
        :attr:`ended` and stops the heartbeat thread (nothing is re-created).
        """
        wid = self._require_worker()
        with self._lock:
            info_raw = dumps(self.info, f"{self.keys.workers}[{wid}]", self.max_value_bytes)
        spec_raw = dumps(self.spec, self.keys.spec) if self.spec is not None else b""
        k = self.keys
        state = self.client.call(
            "heartbeat",
            lambda r: self._beat(
                keys=[k.hb(wid), k.workers, k.worker_seq, k.spec, k.ended],
                args=[wid, int(self.dead_after * 1000), f"{time.time():.3f}", info_raw,
                      _seq(wid), spec_raw],
            ),
            deadline=deadline,
        )
        state = schema.text(state)
        self.last_beat_ok = time.monotonic()
        self.last_beat_error = None
        if state == "ended":
            self.ended = True
            self._stop.set()  # the run is over: the heartbeat thread ends by itself
        elif state == GONE and self.info.get("state") != GONE:
            self.evicted = True
        return state

    def start_heartbeat(self) -> None:
        """Start the daemon thread that calls :meth:`beat` every ``heartbeat_interval``."""
        self._require_worker()
        if self._thread and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._heartbeat_loop, name=f"etcslurm-hb-{self.worker_id}", daemon=True
        )
        self._thread.start()

    def stop_heartbeat(self) -> None:
        """Stop the heartbeat thread (the key then expires after ``dead_after``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.client.redis.connection_pool.connection_kwargs.get(
                "socket_timeout", 5) or 5)
            self._thread = None

    def _heartbeat_loop(self) -> None:
        # Redis may be unreachable for a while (restart, network): keep trying at the same
        # cadence and never let the thread die; others judge liveness by the TTL key.
        while not self._stop.wait(self.heartbeat_interval):
            try:
                self.beat()
            except Exception as exc:  # the thread must survive anything
                if self.last_beat_error is None:
                    log.warning("heartbeat of %s failed (will retry): %s", self.worker_id, exc)
                self.last_beat_error = str(exc)

    def set_state(
        self,
        state: str,
        *,
        rank: int | None = None,
        generation: int | None = None,
        leave_within: float | None = None,
        **extra: Any,
    ) -> None:
        """Move this worker to ``state`` (joining → active → leaving → gone).

        ``rank``/``generation`` record the worker's place in the current generation;
        ``leave_within`` (seconds) sets the leaving deadline.  Emits ``worker.state``.
        After :meth:`end_run` only the local copy changes.
        """
        wid = self._require_worker()
        if state not in _ALLOWED:
            raise UsageError(f"unknown worker state {state!r} (use one of {schema.WORKER_STATES})")
        with self._lock:
            old = self.info.get("state", JOINING)
            if state not in _ALLOWED[old]:
                raise UsageError(f"worker {wid} cannot go from {old} to {state}")
            self.info["state"] = state
            if rank is not None:
                self.info["rank"] = rank
            if generation is not None:
                self.info["generation"] = generation
            if leave_within is not None:
                self.info["leave_deadline"] = time.time() + leave_within
            self.info.update(extra)
            self.info["updated_at"] = time.time()
            raw = dumps(self.info, f"{self.keys.workers}[{wid}]", self.max_value_bytes)
        written = self.client.decided("set state", lambda r: self._hset_live(
            keys=[self.keys.workers, self.keys.ended], args=[wid, raw]), self._ack_key)
        if not int(written):
            self.ended = True
            return
        self.emit("worker.state", state=state, previous=old, rank=self.info.get("rank"),
                  leave_deadline=self.info.get("leave_deadline"))

    def hold(self, generation: int) -> None:
        """Say that this worker, after generation ``generation`` failed, is back on its old
        state and outside every rendezvous.  The one that publishes the next generation
        waits for every live member to say so: a member still inside the failed
        rendezvous (gloo keeps it there for up to 5x the group's timeout) would miss the
        next one, and that would fail too."""
        wid = self._require_worker()
        self.client.call("hold", lambda r: self._hset_live(
            keys=[self.keys.holding, self.keys.ended], args=[wid, str(int(generation))]))

    def holding(self) -> dict[str, int]:
        """worker id -> the failed generation it last said it stands by after (:meth:`hold`)."""
        raw = self.client.call(f"read {self.keys.holding}",
                               lambda r: r.hgetall(self.keys.holding))
        return {schema.text(k): int(v) for k, v in raw.items()}

    def leave(self, within: float, reason: str = "signal") -> None:
        """Announce that this worker leaves within ``within`` seconds; asks for a resize
        (a change request draining this worker)."""
        wid = self._require_worker()
        self.set_state(LEAVING, leave_within=within)
        self.request_change(ChangeRequest(to=None, drain=(wid,), by=wid, ts=time.time(),
                                          reason=f"{wid} leaving ({reason})"))

    def mark_gone(self, worker_id: str, reason: str) -> None:
        """Record another (dead or departed) worker as ``gone``; emits ``worker.gone``."""
        key = self.keys.workers

        def tx(pipe: Any) -> None:
            raw = pipe.hget(key, worker_id)
            info = loads_dict(raw, f"{key}[{worker_id}]", self.max_value_bytes)
            if info is None:
                return
            info.update(state=GONE, gone_reason=reason, updated_at=time.time())
            pipe.multi()
            pipe.hset(key, worker_id, dumps(info, f"{key}[{worker_id}]", self.max_value_bytes))

        self.client.decided("mark gone", lambda r: r.transaction(tx, key), self._ack_key)
        self.emit("worker.gone", worker=worker_id, reason=reason)

    def members(self, deadline: float | None = None) -> dict[str, dict[str, Any]]:
        """All workers ever registered: info + ``alive`` (heartbeat key present).

        ``deadline``: seconds to retry an outage (default: the client's ``retry_deadline``).
        """
        workers = self._workers_raw(deadline)
        ids = list(workers)
        if ids:
            alive = self.client.call(
                "read heartbeats",
                lambda r: _pipeline_exists(r, [self.keys.hb(w) for w in ids]),
                deadline,
            )
            for wid, ok in zip(ids, alive, strict=True):
                workers[wid]["alive"] = bool(ok)
        return dict(sorted(workers.items(), key=lambda kv: (_seq(kv[0]), kv[0])))

    def live_members(self) -> dict[str, dict[str, Any]]:
        """Workers that are not gone and whose heartbeat has not expired."""
        return {w: i for w, i in self.members().items() if i["alive"] and i["state"] != GONE}

    def dead_workers(self) -> list[str]:
        """Workers not marked gone whose heartbeat expired (``dead_after`` without a beat)."""
        return [w for w, i in self.members().items() if i["state"] != GONE and not i["alive"]]

    # ------------------------------------------------------------------ leader
    def leader(self) -> str | None:
        """The live worker with the lowest active rank, else the lowest live worker id.

        Leaving, gone and dead workers are never leader, so the role moves on by itself
        when the leader leaves or dies.
        """
        live = {w: i for w, i in self.live_members().items() if i["state"] in (JOINING, ACTIVE)}
        ranked = [(i["rank"], w) for w, i in live.items()
                  if i["state"] == ACTIVE and isinstance(i.get("rank"), int)]
        if ranked:
            return min(ranked)[1]
        return min(live, key=lambda w: (_seq(w), w)) if live else None

    def is_leader(self) -> bool:
        return self.worker_id is not None and self.leader() == self.worker_id

    # ------------------------------------------------------------------ generations
    def publish_generation(self, record: GenerationRecord) -> bool:
        """Publish ``record`` if the current generation is ``record.generation - 1``.

        Atomic compare-and-set: among concurrent publishers of the same number exactly one
        gets ``True``; the others get ``False`` and should :meth:`wait_generation`.  The
        stored record gets ``published_by`` / ``published_at``.  Emits ``generation.start``
        on success.
        """
        if not isinstance(record, GenerationRecord):
            raise UsageError(f"publish_generation needs a GenerationRecord, got "
                             f"{type(record).__name__}")
        n = record.generation
        doc = replace(record, published_by=self.worker_id or "operator",
                      published_at=time.time()).to_json()
        raw = dumps(doc, self.keys.gen, self.max_value_bytes)

        k = self.keys

        def _cas(r: Any) -> tuple[int, int]:
            won, prev = self._gen_cas(keys=[k.gen, k.gen_no, k.news],
                                      args=[n - 1, raw, n, NEWS_CAP])
            if not int(won) and int(prev) == n and r.get(self.keys.gen) == raw:
                return 1, n - 1  # our own write, done before a failover, survived
            return int(won), int(prev)

        won, _prev = self.client.decided("publish generation", _cas, self._ack_key)
        if int(won):
            self.emit("generation.start", **GenerationStart.of(record).to_json())
        return bool(int(won))

    def commit_generation(self, generation: int) -> None:
        """Record that every member of ``generation`` has entered it (its state is complete
        everywhere): workers that left the world may go.  One small key, so waiting
        workers read it cheaply; it only moves forward, and a move wakes the workers
        blocked in :meth:`watch` (a ``committed`` notice on the ``news`` stream)."""
        k = self.keys
        self.client.decided("commit generation", lambda r: self._commit(
            keys=[k.committed, k.ended, k.news], args=[int(generation), NEWS_CAP]),
            self._ack_key)

    def committed_generation(self) -> int:
        """The last committed generation (``-1`` before the first)."""
        raw = self.client.call("read commit", lambda r: r.get(self.keys.committed))
        return -1 if raw is None else int(schema.text(raw))

    def current_generation(self) -> GenerationRecord | None:
        """The current generation record, or ``None`` before the first.

        A record this version cannot read raises :class:`RecordError` naming the field.
        """
        key = self.keys.gen
        raw = self.client.call(
            f"read {key}", lambda r: self._get(keys=[key], args=[self.max_value_bytes]))
        return _parse_record(raw, key, self.max_value_bytes)

    def head(self) -> GenerationHead:
        """The current and committed generation numbers and the news cursor: one O(1)
        call, whatever the size of the run or of its record."""
        k = self.keys
        gen, committed, cursor = self.client.call(
            "read generation head",
            lambda r: self._gen_head(keys=[k.gen, k.gen_no, k.committed, k.news]))
        return GenerationHead(int(gen), int(committed), schema.text(cursor))

    def watch(self, generation: int, timeout: float,
              committed: int | None = None) -> GenerationHead:
        """Block until a generation numbered above ``generation`` is published (or, with
        ``committed``, one above it is committed), at most ``timeout`` seconds; return
        the head then (the caller sees which, or that neither happened: no exception).

        Why a stream and not a poll of the record: a waiter costs Redis O(1) per
        ``NEWS_BLOCK_S`` instead of reading (and parsing) the whole O(N) record every
        0.1 s, and wakes as soon as the publish or the commit happens, not at its next
        poll.  The record itself is read once, by :meth:`wait_generation`.
        """
        end = time.monotonic() + timeout
        head = self.head()
        sock = self.client.redis.connection_pool.connection_kwargs.get("socket_timeout") or 5
        cap = max(0.001, min(NEWS_BLOCK_S, float(sock) - 0.5))
        while not (head.generation > generation
                   or (committed is not None and head.committed > committed)):
            left = end - time.monotonic()
            if left <= 0:
                break
            block_ms = max(1, int(min(left, cap) * 1000))
            cursor = head.cursor
            resp = self.client.call(
                "wait for generation news",
                lambda r, c=cursor, b=block_ms: r.xread({self.keys.news: c}, count=NEWS_CAP,
                                                       block=b))
            head = self._advance(head, resp) if resp else self.head()
        return head

    @staticmethod
    def _advance(head: GenerationHead, resp: Any) -> GenerationHead:
        """``head`` moved past the notices of an XREAD answer (no further round trip)."""
        gen, committed, cursor = head.generation, head.committed, head.cursor
        for _stream, entries in resp:
            for eid, fields in entries:
                cursor = schema.text(eid)
                for name, value in fields.items():
                    try:
                        number = int(schema.text(value))
                    except ValueError:
                        continue  # not ours to judge: the head re-read will say
                    if schema.text(name) == "gen":
                        gen = max(gen, number)
                    elif schema.text(name) == "committed":
                        committed = max(committed, number)
        return GenerationHead(gen, committed, cursor)

    def wait_generation(self, after: int, timeout: float) -> GenerationRecord:
        """Wait until a generation numbered above ``after`` is published; return it.

        The wait blocks on the ``news`` stream (:meth:`watch`, O(1) per waiter); the
        record is read once, when its number says it is there.  With a replicated
        coordinator the record is returned only once a replica has it (read again
        behind a ``WAIT``), so no worker acts on a record a failover could still forget.
        """
        end = time.monotonic() + timeout
        while True:
            head = self.watch(after, max(0.0, end - time.monotonic()))
            if head.generation > after:
                rec = (self._confirmed_generation() if self.client.acks > 0
                       else self.current_generation())
                if rec is not None and rec.generation > after:
                    return rec
                # the number ran ahead of the record (a key deleted by hand): look again
            left = end - time.monotonic()
            if left <= 0:
                raise WaitTimeout(
                    f"run {self.run_id}: no generation after {after} published within "
                    f"{timeout:g} s (current: {head.generation if head.generation >= 0 else None}, "
                    f"committed: {head.committed}, leader: {self.leader()})"
                )
            time.sleep(min(0.05, left))

    def alive(self, worker_id: str) -> bool:
        """Whether ``worker_id`` is live (heartbeat key present) and neither leaving nor
        gone: O(1), so a waiting worker can watch the one worker it defers to instead of
        reading every member."""
        k = self.keys

        def _probe(r: Any) -> tuple[Any, Any]:
            p = r.pipeline(transaction=False)
            p.exists(k.hb(worker_id))
            p.hget(k.workers, worker_id)
            return tuple(p.execute())

        beat, raw = self.client.call("read worker", _probe)
        info = loads_dict(raw, f"{k.workers}[{worker_id}]", self.max_value_bytes)
        return bool(beat) and info is not None and info.get("state") in (JOINING, ACTIVE)

    def _confirmed_generation(self) -> GenerationRecord | None:
        """The current generation record, read again and acknowledged by a replica."""
        key = self.keys.gen
        raw = self.client.decided(
            "confirm generation",
            lambda r: self._get(keys=[key], args=[self.max_value_bytes]),
            self._ack_key,
        )
        return _parse_record(raw, key, self.max_value_bytes)

    # ------------------------------------------------------------------ change requests
    def request_change(self, request: ChangeRequest) -> None:
        """Queue ``request`` for the leader's next step boundary; emits ``change.requested``.

        Any worker or the operator (``etcslurm resize``) may ask; the queue keeps the
        newest 1000.
        """
        if not isinstance(request, ChangeRequest):
            raise UsageError(f"request_change needs a ChangeRequest, got {type(request).__name__}")
        raw = dumps(request.to_json(), self.keys.changes, self.max_value_bytes)

        def _push(r: Any) -> None:
            p = r.pipeline(transaction=True)
            p.rpush(self.keys.changes, raw)
            p.ltrim(self.keys.changes, -1000, -1)
            p.execute()

        # a redo after a failover may queue it twice: merging requests makes that harmless
        self.client.decided("request change", _push, self._ack_key)
        self.emit("change.requested", **ChangeRequested.of(request).to_json())

    def pending_changes(self, deadline: float | None = None) -> list[ChangeRequest]:
        """The change requests not yet taken, oldest first (empty: nothing pending).

        ``deadline``: seconds to retry an unreachable coordinator (``None``: the client's
        ``retry_deadline``; ``0``: one try, as the step boundary asks).  A malformed entry
        raises :class:`RecordError` naming it.
        """
        key = self.keys.changes
        raws = self.client.call("read changes", lambda r: r.lrange(key, 0, 999), deadline)
        out = []
        for i, raw in enumerate(raws or []):
            try:
                out.append(ChangeRequest.from_json(loads(raw, f"{key}[{i}]", self.max_value_bytes)))
            except RecordError as exc:
                raise RecordError(f"coordinator entry {key}[{i}]: {exc}") from None
        return out

    def take_changes(self, count: int) -> None:
        """Drop the ``count`` oldest requests (the leader handled them at a boundary)."""
        if count > 0:
            self.client.call("take changes", lambda r: r.ltrim(self.keys.changes, count, -1))

    # ------------------------------------------------------------------ checkpoint requests
    def request_checkpoint(self, request: CheckpointRequest) -> None:
        """Ask for a checkpoint at the next step boundary (``etcslurm checkpoint``); emits
        ``checkpoint.requested``.  Requests made before one is taken are one request."""
        if not isinstance(request, CheckpointRequest):
            raise UsageError("request_checkpoint needs a CheckpointRequest, got "
                             f"{type(request).__name__}")
        raw = dumps(request.to_json(), self.keys.checkpoint, self.max_value_bytes)
        self.client.decided("request checkpoint", lambda r: r.set(self.keys.checkpoint, raw),
                            self._ack_key)
        self.emit("checkpoint.requested", **CheckpointRequested.of(request).to_json())

    def checkpoint_request(self, deadline: float | None = None) -> CheckpointRequest | None:
        """The checkpoint request not yet taken, if any (``deadline``: as for
        :meth:`pending_changes`)."""
        key = self.keys.checkpoint
        raw = self.client.call("read checkpoint request", lambda r: r.get(key), deadline)
        if raw is None:
            return None
        try:
            return CheckpointRequest.from_json(loads(raw, key, self.max_value_bytes))
        except RecordError as exc:
            raise RecordError(f"coordinator entry {key}: {exc}") from None

    def take_checkpoint_request(self) -> None:
        """Drop the checkpoint request (the step boundary began its save)."""
        key = self.keys.checkpoint
        self.client.call("take checkpoint request", lambda r: r.delete(key))

    # ------------------------------------------------------------------ events
    def emit(self, type: str, *, at_ts: float | None = None, retry_s: float | None = None,
             **data: Any) -> str:
        """Append an event to the run's ``events`` stream; returns its stream id.

        After :meth:`end_run` nothing is written (returns ``""``), so exiting workers do
        not re-create the run's keys.  ``at_ts``: when it happened (default now; events
        kept through an outage are sent later with their own time); ``retry_s``: seconds
        to retry an outage (default the client's ``retry_deadline``).

        ``type`` and the fields must match an event of :mod:`etcslurm.coord.records`
        (``EVENT_TYPES``), else :class:`RecordError` names the problem and nothing is
        written.  Stream fields: ``type``, ``ts`` (unix seconds), ``worker`` (id or
        ``operator``), ``data`` (JSON).  The stream is capped at about ``max_events``.
        """
        payload = event_data(type, data).to_json()
        fields = {
            "type": type,
            "ts": f"{time.time() if at_ts is None else at_ts:.6f}",
            "worker": self.worker_id or "operator",
            "data": dumps(payload, f"{self.keys.events} {type}", self.max_value_bytes),
        }
        flat = [x for kv in fields.items() for x in kv]
        eid = self.client.call(
            f"emit {type}",
            lambda r: self._xadd_live(keys=[self.keys.events, self.keys.ended],
                                      args=[self.max_events, *flat]),
            retry_s,
        )
        if eid is None:  # the run has ended: events are no longer recorded
            self.ended = True
            return ""
        return schema.text(eid)

    def read_events(
        self, last_id: str = "0", block_ms: int | None = None, count: int = 1000
    ) -> list[dict[str, Any]]:
        """Events after ``last_id`` (``"0"``: from the start; ``"$"``: only new ones).

        Each is ``{"id", "type", "ts", "worker", "data"}``.  ``block_ms`` waits up to that
        long for new events (capped below the socket timeout; loop for longer waits).
        """
        key = self.keys.events
        sock = self.client.redis.connection_pool.connection_kwargs.get("socket_timeout") or 5
        block = None if block_ms is None else max(1, min(int(block_ms), int(sock * 1000) - 500))
        resp = self.client.call(
            "read events", lambda r: r.xread({key: last_id}, count=count, block=block)
        )
        out: list[dict[str, Any]] = []
        for _stream, entries in resp or []:
            for eid, fields in entries:
                f = {schema.text(k): v for k, v in fields.items()}
                eid_s = schema.text(eid)
                try:
                    ts = float(schema.text(f.get("ts", b"0")))
                except ValueError:
                    ts = 0.0
                out.append({
                    "id": eid_s,
                    "type": schema.text(f.get("type", b"")),
                    "ts": ts,
                    "worker": schema.text(f.get("worker", b"")),
                    "data": schema.loads(f.get("data", b"{}"), f"{key}[{eid_s}]",
                                         self.max_value_bytes),
                })
        return out

    # ------------------------------------------------------------------ end
    def run_keys(self) -> list[str]:
        """All existing keys of this run.

        Derived from what the run tracks (workers, store generations), not
        from ``SCAN``: a per-run ACL user may not list key names (see ``coord/acl.py``).
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
        marker = dumps({"ts": time.time(), "by": self.worker_id or "operator"}, self.keys.ended)
        self.client.decided("end run", lambda r: r.set(self.keys.ended, marker, px=ttl_ms),
                            self._ack_key)
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

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _require_worker(self) -> str:
        if self.worker_id is None:
            raise UsageError("register() this worker with the coordinator first")
        return self.worker_id


#: the last generation record parsed in this process: (key, stored bytes, record)
_last_record: tuple[str, bytes, GenerationRecord] | None = None


def _parse_record(raw: bytes | None, key: str, max_bytes: int) -> GenerationRecord | None:
    """The record stored as ``raw`` under ``key`` (``None``: no record).

    Records are immutable and a worker reads the same one several times (the wait, the
    follower's checks, the leaver's), as do the threads of one process (several handles,
    the benchmark's simulated workers): the same bytes are parsed once (O(N) at N
    workers: some milliseconds at 1024) and the same record is handed out again.
    """
    global _last_record
    if raw is None:
        return None
    raw = bytes(raw)
    last = _last_record
    if last is not None and last[0] == key and last[1] == raw:
        return last[2]
    doc = loads_dict(raw, key, max_bytes)
    if doc is None:
        return None
    try:
        record = GenerationRecord.from_json(doc)
    except RecordError as exc:
        raise RecordError(f"coordinator entry {key}: {exc}") from None
    _last_record = (key, raw, record)  # one tuple: threads see an old entry or a new one
    return record


def _pipeline_exists(r: Any, keys: list[str]) -> list[int]:
    p = r.pipeline(transaction=False)
    for k in keys:
        p.exists(k)
    return p.execute()
