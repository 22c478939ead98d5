"""What the step boundary needs besides the world: signals, the coordinator's view, outages.

* **Signals**: a trap records a preemption signal (watcher thread: only record); the next
  boundary announces this worker leaving, with the time budget it has.
* **World view**: who leaves, who is dead, who is ready to join, as the coordinator says.
* **Outages**: training needs the coordinator only to change the world.  While it is
  unreachable (restart, network), steps go on: the boundary poll is skipped, a signal is
  announced once it answers again, and events are kept in order, with their own time,
  and sent when it is back.  "Reachable" is judged by the heartbeat thread, so a step
  never waits for a socket timeout more than once per outage.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from etcslurm.coord.coordinator import ACTIVE, GONE, JOINING, LEAVING
from etcslurm.coord.records import RELEASED, ChangeRequest, GenerationRecord
from etcslurm.errors import EtcslurmError, RecordError
from etcslurm.runtime.config import WorkerOptions

log = logging.getLogger("etcslurm.runtime")

#: events kept through a coordinator outage, at most (the oldest are dropped, and counted)
BACKLOG_LIMIT = 100_000
#: the leader asks the coordinator whether anything changed at most this often
POLL_INTERVAL_S = 0.25


@dataclass(frozen=True)
class WorldView:
    """Who leaves, who died, who is ready to join, and where everybody runs."""

    leaving: list[str]
    dead: list[str]
    ready: list[str]
    nodes: dict[str, str]


class Boundary:
    """Signals, the outage backlog and the coordinator's view, for one worker."""

    def __init__(self, coord: Any, options: WorkerOptions) -> None:
        self.coord = coord
        self.options = options
        self.trap: Any = None
        self.signal_at: float | None = None
        self.signal_event: Any = None
        self.announced = False
        self._last_poll = 0.0
        self._backlog: deque[tuple[float, str, dict[str, Any]]] = deque()
        self._dropped = 0
        self._failed_at: float | None = None
        self._outage: tuple[float, int] | None = None  # (since, calls that failed) while down

    # ------------------------------------------------------------------ signals
    def install(self, trap: Any) -> None:
        self.trap = trap
        trap.install()

    def uninstall(self) -> None:
        if self.trap is not None:
            self.trap.uninstall()
            self.trap = None

    def on_signal(self, event: Any) -> None:
        """The trap's callback (watcher thread): record it (the boundary acts on it), and
        if this node hosts the coordinator's primary, hand the primary to a replica now,
        before the node goes (one worker per node; a no-op on a single Redis)."""
        if self.signal_at is None:
            self.signal_at = time.perf_counter()
            self.signal_event = event
            if os.environ.get("SLURM_LOCALID", "0") == "0":
                threading.Thread(target=self._hand_over, name="etcslurm-hand-over",
                                 daemon=True).start()

    def _hand_over(self) -> None:
        from etcslurm.redis_host.failover import hand_over_local

        try:
            done = hand_over_local(self.coord.client)
        except EtcslurmError as exc:  # the run goes on with Sentinel's own failover
            log.warning("coordinator hand-over failed: %s", exc)
            return
        if done is not None:
            log.info("coordinator primary handed over: %s", done)

    @property
    def signalled(self) -> bool:
        return self.signal_at is not None

    def announce_leaving(self, worker: str) -> None:
        """Tell the coordinator this worker leaves (once, when it answers)."""
        if not self.signalled or self.announced or not self.reachable():
            return
        ev = self.signal_event
        budget = ev.budget if ev.budget is not None else self.options.leave_budget
        reason = getattr(ev, "reason", None)  # a node watcher's notice: drain, reservation
        try:  # one try: peers wait in the boundary's all-reduce meanwhile
            if reason:
                self.coord.emit("node.released", worker=worker, node=self.options.node,
                                reason=reason, budget_s=budget, retry_s=0)
            else:
                self.coord.emit("worker.signal", worker=worker, node=self.options.node,
                                signal=ev.signal, budget_s=budget, received_at=ev.received_at,
                                retry_s=0)
            self.coord.leave(within=budget,
                             reason=f"{RELEASED}: {reason}" if reason else f"SIG{ev.signal}")
            self.announced = True
        except EtcslurmError as exc:  # coordinator down: train on, announce next boundary
            self.failed(exc)

    # ------------------------------------------------------------------ the coordinator's view
    def poll_due(self) -> bool:
        """Rate limit of the leader's poll: true at most every :data:`POLL_INTERVAL_S`."""
        now = time.monotonic()
        if now - self._last_poll < POLL_INTERVAL_S:
            return False
        self._last_poll = now
        return True

    def world_view(self, record: GenerationRecord, deadline: float | None = None) -> WorldView:
        """(leaving, dead, ready, nodes) as the coordinator sees them now.

        ``dead`` (heartbeat expired or marked gone) is only trusted after a failed
        collective: at a step boundary every world member has just taken part in the
        boundary all-reduce, so it is alive even if an overloaded host delayed its
        heartbeat.
        """
        world = record.workers_by_rank()
        members = self.coord.members(deadline)
        leaving = [w for w in world if members.get(w, {}).get("state") == LEAVING]
        dead = [w for w in world if (w in members and not members[w].get("alive"))
                or members.get(w, {}).get("state") == GONE or w not in members]
        ready = [w for w, i in members.items()
                 if w not in world and i.get("alive") and i["state"] in (JOINING, ACTIVE)]
        nodes = {w: str(i.get("node") or i.get("host") or "?") for w, i in members.items()}
        return WorldView(leaving, dead, ready, nodes)

    def pending_request(self, settings: Any, record: GenerationRecord,
                        view: WorldView, deadline: float | None = None) -> ChangeRequest | None:
        """The pending change requests (``etcslurm resize``, leavers' drains) as one, if it
        can be carried out now; one that cannot is taken off the queue with an ``error``
        event saying why (else it would stay pending forever).  ``deadline``: as for
        :meth:`world_view` (0 at the step boundary: the other ranks wait in a collective
        while this one reads, so an unreachable coordinator must not hold it)."""
        from etcslurm.runtime.generation import check_request, merge_requests

        pending = self.coord.pending_changes(deadline)
        request = merge_requests(pending)
        if request is None:
            return None
        problem = check_request(settings, record, request, leaving=view.leaving, dead=[],
                                ready=view.ready)
        if problem is None:
            return request
        self.coord.take_changes(len(pending))
        self.coord.emit("error", message=f"change request by {request.by} dropped: {problem}")
        return None

    def decider(self, record: GenerationRecord) -> str:
        """The lowest-ranked world member that is active and alive (every rank agrees: the
        leaving flags were set before the boundary's all-reduce)."""
        members = self.coord.members()
        ranked = record.workers_by_rank()
        for worker in ranked:
            info = members.get(worker, {})
            if info.get("state") == ACTIVE and info.get("alive"):
                return worker
        return ranked[0]

    # ------------------------------------------------------------------ outages
    def reachable(self) -> bool:
        if self.coord.last_beat_error is not None:
            return False
        return self._failed_at is None or self.coord.last_beat_ok > self._failed_at

    def failed(self, exc: BaseException) -> None:
        if self._failed_at is None or self.reachable():
            log.warning("coordinator unreachable, training goes on: %s", str(exc)[:200])
        self._failed_at = time.monotonic()
        since, calls = self._outage or (time.time(), 0)
        self._outage = (since, calls + 1)

    def emit_soft(self, type: str, **data: Any) -> None:
        """An event from the training loop: kept and sent later if the coordinator is down."""
        if len(self._backlog) >= BACKLOG_LIMIT:  # bounded: drop the oldest, say so later
            self._backlog.popleft()
            self._dropped += 1
        self._backlog.append((time.time(), type, data))
        if self.reachable():
            self.flush(retry_s=0)

    def flush(self, retry_s: float | None, worker: str | None = None) -> None:
        """Send the kept events in order; ``retry_s=None`` raises if the coordinator is down."""
        try:
            if self._dropped:
                self.coord.emit("error", worker=worker, retry_s=retry_s,
                                message=f"{self._dropped} events dropped during a "
                                        "coordinator outage")
                self._dropped = 0
            outage, kept = self._outage, len(self._backlog)
            while self._backlog:
                ts, type, data = self._backlog[0]
                try:
                    self.coord.emit(type, at_ts=ts, retry_s=retry_s, **data)
                except RecordError as exc:  # a malformed event is dropped, not an outage
                    log.error("event %s dropped: %s", type, exc)
                self._backlog.popleft()
            if outage is not None:  # what the outage cost, once it is over
                since, calls = outage
                self.coord.emit("coordinator.back", worker=worker, retry_s=retry_s,
                                unreachable_s=round(time.time() - since, 3),
                                failed_calls=calls, kept_events=kept)
                self._outage = None
        except EtcslurmError as exc:
            if retry_s is None:
                raise
            self.failed(exc)

    @property
    def backlog(self) -> int:
        return len(self._backlog)


class DataLog:
    """One JSON line per step and data-parallel replica: which samples it trained (the
    tests check that no sample is repeated or skipped across resizes)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", buffering=1)

    def write(self, *, step: int, record: GenerationRecord, position: tuple[int, int],
              global_batch: int, loss: float, worker: str) -> None:
        dp, dp_rank = position
        per = global_batch // dp
        start = step * global_batch + dp_rank * per
        self._file.write(json.dumps({
            "step": step, "gen": record.generation, "layout": record.to_layout,
            "dp": dp, "dp_rank": dp_rank, "start": start, "stop": start + per,
            "loss": loss, "worker": worker,
        }) + "\n")

    def close(self) -> None:
        self._file.close()
