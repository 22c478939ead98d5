"""Membership: the run spec, registration, heartbeats, worker states, liveness, the leader.

A worker registers (``w<n>``, state ``joining``), a daemon thread refreshes its
``hb:{worker}`` key (TTL ``dead_after``) every ``heartbeat_interval``, and its state moves
``joining → active → leaving → gone``.  A worker is dead when its key has expired; the
leader is the live worker with the lowest active rank.  Writes that decide the run
(registration, states, ``mark_gone``) are acknowledged by a replica when the coordinator
is replicated (:meth:`RunHandle.decided`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

from etcslurm.coord import schema, scripts
from etcslurm.coord.events import EventLog
from etcslurm.coord.run import RunHandle
from etcslurm.coord.schema import dumps, loads_dict
from etcslurm.errors import CoordinatorError, UsageError

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


class Membership:
    """Who is in the run: one worker's registration, heartbeat and state, everyone's view.

    ``spec`` is the run spec: the first to register stores it, a joiner whose spec
    differs is refused with :class:`SpecMismatch`.  ``heartbeat_interval`` and
    ``dead_after`` (seconds) decide how fast a dead worker is noticed.
    """

    def __init__(self, run: RunHandle, events: EventLog, *, spec: dict[str, Any] | None,
                 heartbeat_interval: float, dead_after: float, max_workers: int) -> None:
        self.run = run
        self.events = events
        self.spec = spec
        self.heartbeat_interval = heartbeat_interval
        self.dead_after = dead_after
        self.max_workers = max_workers
        self.info: dict[str, Any] = {}
        self.last_beat_ok = 0.0  # time.monotonic() of the last successful heartbeat
        self.last_beat_error: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        r = run.client.redis
        self._hgetall = r.register_script(scripts.HGETALL_BOUNDED)
        self._beat = r.register_script(scripts.HEARTBEAT)
        self._hset_live = r.register_script(scripts.HSET_UNLESS_ENDED)

    # ------------------------------------------------------------------ run spec
    def ensure_spec(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Store ``spec`` as the run's spec if none is set; else require it to be equal.

        Raises :class:`SpecMismatch` listing the fields that differ.
        """
        run, key = self.run, self.run.keys.spec
        raw = run.dumps(spec, key)
        run.client.call(f"write {key}", lambda r: r.set(key, raw, nx=True))
        stored = run.read(key)
        if stored is None:  # deleted in between (end_run): store ours
            run.client.call(f"write {key}", lambda r: r.set(key, raw, nx=True))
            return spec
        canon = schema.loads(raw, key)
        if stored != canon:
            diffs = [
                f"{k}: run has {stored.get(k)!r}, this worker {canon.get(k)!r}"
                for k in sorted(set(stored) | set(canon))
                if stored.get(k) != canon.get(k)
            ]
            raise SpecMismatch(
                f"refused to join run {run.run_id}: spec differs ({'; '.join(diffs[:5])})"
            )
        return stored

    def run_spec(self) -> dict[str, Any] | None:
        """The run's stored spec, or ``None``."""
        return self.run.read(self.run.keys.spec)

    def record_shapes(self, shapes: dict[str, Any]) -> None:
        """Store the shapes read from the user's model at its first build (the first
        write stays: every member read the same model)."""
        run, key = self.run, self.run.keys.shapes
        raw = run.dumps(shapes, key)
        run.client.call(f"write {key}", lambda r: r.set(key, raw, nx=True))

    def shapes(self) -> dict[str, Any] | None:
        """The user's model's shapes, once a member has built it (else ``None``)."""
        return self.run.read(self.run.keys.shapes)

    # ------------------------------------------------------------------ this worker
    def register(self, info: dict[str, Any] | None = None, *, heartbeat: bool = True) -> str:
        """Join the run as a new worker in state ``joining``; returns its worker id ``w<n>``.

        ``info`` adds/overrides fields (``device``, ``address``, ...); host, pid and the
        Slurm job/step/node come from the environment.  Starts the heartbeat thread unless
        ``heartbeat=False`` (then call :meth:`beat` yourself, e.g. for 1000 simulated
        workers).  Emits ``worker.registered``.
        """
        run, keys = self.run, self.run.keys
        if run.worker_id is not None:
            raise UsageError(f"this coordinator handle is already worker {run.worker_id}")
        ended = run.read(keys.ended)
        if ended is not None:
            raise CoordinatorError(
                f"run {run.run_id} has ended (end_run at {ended.get('ts', 0):.0f}); "
                "use a new run id"
            )
        if self.spec is not None:
            self.ensure_spec(self.spec)
        n = int(run.client.call("register", lambda r: r.incr(keys.worker_seq)))
        wid = f"w{n}"
        now = time.time()
        base: dict[str, Any] = {
            "worker_id": wid,
            "run_id": run.run_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "device": None,
            "address": None,
            **_slurm_env(),
        }
        base.update(info or {})
        base.update(
            worker_id=wid,
            run_id=run.run_id,
            state=JOINING,
            rank=None,
            generation=None,
            leave_deadline=None,
            registered_at=now,
            updated_at=now,
        )
        raw = run.dumps(base, f"{keys.workers}[{wid}]")
        with self._lock:
            run.worker_id, self.info = wid, base
        run.decided("register", lambda r: r.hset(keys.workers, wid, raw))
        self.beat(deadline=None)
        self.events.emit("worker.registered", **{k: base.get(k) for k in (
            "host", "node", "pid", "device", "address", "slurm_job", "slurm_step")})
        if heartbeat:
            self.start_heartbeat()
        return wid

    def beat(self, deadline: float | None = 0) -> str:
        """One heartbeat: refresh ``hb:{worker}`` (TTL ``dead_after``), heal a lost entry.

        ``deadline``: seconds to retry an outage (default 0: one try, the heartbeat
        thread just tries again next interval).  Returns the state stored for this
        worker; after ``end_run`` it returns ``"ended"``, sets the run's ``ended`` and
        stops the heartbeat thread (nothing is re-created).
        """
        run, k = self.run, self.run.keys
        wid = run.require_worker()
        with self._lock:
            info_raw = run.dumps(self.info, f"{k.workers}[{wid}]")
        spec_raw = dumps(self.spec, k.spec) if self.spec is not None else b""
        state = run.client.call(
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
            run.ended = True
            self._stop.set()  # the run is over: the heartbeat thread ends by itself
        return state

    def start_heartbeat(self) -> None:
        """Start the daemon thread that calls :meth:`beat` every ``heartbeat_interval``."""
        self.run.require_worker()
        if self._thread and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._heartbeat_loop, name=f"etcslurm-hb-{self.run.worker_id}", daemon=True
        )
        self._thread.start()

    def stop_heartbeat(self) -> None:
        """Stop the heartbeat thread (the key then expires after ``dead_after``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.run.socket_timeout())
            self._thread = None

    def _heartbeat_loop(self) -> None:
        # Redis may be unreachable for a while (restart, network): keep trying at the same
        # cadence and never let the thread die; others judge liveness by the TTL key.
        while not self._stop.wait(self.heartbeat_interval):
            try:
                self.beat()
            except Exception as exc:  # the thread must survive anything
                if self.last_beat_error is None:
                    log.warning("heartbeat of %s failed (will retry): %s",
                                self.run.worker_id, exc)
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
        After ``end_run`` only the local copy changes.
        """
        run, k = self.run, self.run.keys
        wid = run.require_worker()
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
            raw = run.dumps(self.info, f"{k.workers}[{wid}]")
        written = run.decided("set state", lambda r: self._hset_live(
            keys=[k.workers, k.ended], args=[wid, raw]))
        if not int(written):
            run.ended = True
            return
        self.events.emit("worker.state", state=state, previous=old,
                         rank=self.info.get("rank"),
                         leave_deadline=self.info.get("leave_deadline"))

    def hold(self, generation: int) -> None:
        """Say that this worker, after generation ``generation`` failed, is back on its old
        state and outside every rendezvous.  The one that publishes the next generation
        waits for every live member to say so: a member still inside the failed
        rendezvous (gloo keeps it there for up to 5x the group's timeout) would miss the
        next one, and that would fail too."""
        run, k = self.run, self.run.keys
        wid = run.require_worker()
        run.client.call("hold", lambda r: self._hset_live(
            keys=[k.holding, k.ended], args=[wid, str(int(generation))]))

    # ------------------------------------------------------------------ everyone
    def holding(self) -> dict[str, int]:
        """worker id -> the failed generation it last said it stands by after (:meth:`hold`)."""
        key = self.run.keys.holding
        raw = self.run.client.call(f"read {key}", lambda r: r.hgetall(key))
        return {schema.text(k): int(v) for k, v in raw.items()}

    def mark_gone(self, worker_id: str, reason: str) -> None:
        """Record another (dead or departed) worker as ``gone``; emits ``worker.gone``."""
        run, key = self.run, self.run.keys.workers

        def tx(pipe: Any) -> None:
            raw = pipe.hget(key, worker_id)
            info = loads_dict(raw, f"{key}[{worker_id}]", run.max_value_bytes)
            if info is None:
                return
            info.update(state=GONE, gone_reason=reason, updated_at=time.time())
            pipe.multi()
            pipe.hset(key, worker_id, run.dumps(info, f"{key}[{worker_id}]"))

        run.decided("mark gone", lambda r: r.transaction(tx, key))
        self.events.emit("worker.gone", worker=worker_id, reason=reason)

    def _workers_raw(self, deadline: float | None = None) -> dict[str, dict]:
        run, key = self.run, self.run.keys.workers
        flat = run.client.call(
            f"read {key}",
            lambda r: self._hgetall(keys=[key], args=[run.max_value_bytes, self.max_workers]),
            deadline,
        )
        out: dict[str, dict] = {}
        for i in range(0, len(flat), 2):
            wid = schema.text(flat[i])
            info = loads_dict(flat[i + 1], f"{key}[{wid}]", run.max_value_bytes)
            assert info is not None
            if info.get("run_id") != run.run_id:
                raise CoordinatorError(
                    f"coordinator entry {key}[{wid}] belongs to run {info.get('run_id')!r}, "
                    f"not {run.run_id!r}"
                )
            out[wid] = info
        return out

    def members(self, deadline: float | None = None) -> dict[str, dict[str, Any]]:
        """All workers ever registered: info + ``alive`` (heartbeat key present).

        ``deadline``: seconds to retry an outage (default: the client's ``retry_deadline``).
        """
        k = self.run.keys
        workers = self._workers_raw(deadline)
        ids = list(workers)
        if ids:
            alive = self.run.client.call(
                "read heartbeats",
                lambda r: _pipeline_exists(r, [k.hb(w) for w in ids]),
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

    def alive(self, worker_id: str) -> bool:
        """Whether ``worker_id`` is live (heartbeat key present) and neither leaving nor
        gone: O(1), so a waiting worker can watch the one worker it defers to instead of
        reading every member."""
        run, k = self.run, self.run.keys

        def _probe(r: Any) -> tuple[Any, Any]:
            p = r.pipeline(transaction=False)
            p.exists(k.hb(worker_id))
            p.hget(k.workers, worker_id)
            return tuple(p.execute())

        beat, raw = run.client.call("read worker", _probe)
        info = loads_dict(raw, f"{k.workers}[{worker_id}]", run.max_value_bytes)
        return bool(beat) and info is not None and info.get("state") in (JOINING, ACTIVE)

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
        return self.run.worker_id is not None and self.leader() == self.run.worker_id


def _pipeline_exists(r: Any, keys: list[str]) -> list[int]:
    p = r.pipeline(transaction=False)
    for k in keys:
        p.exists(k)
    return p.execute()
