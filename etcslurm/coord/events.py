"""The run's event stream: what happened, for the monitor and the logs.

Every event is checked against its typed payload in :mod:`etcslurm.coord.records` before
it is written.  Events are not decisions: they are never waited for by a replica, and
after ``end_run`` nothing is written (exiting workers must not re-create the run's keys).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from etcslurm.coord import schema, scripts
from etcslurm.coord.records import event_data
from etcslurm.coord.run import RunHandle

log = logging.getLogger("etcslurm.coord")


class EventLog:
    """The ``events`` stream of one run, capped at about ``max_events`` entries."""

    def __init__(self, run: RunHandle, max_events: int = 10_000) -> None:
        self.run = run
        self.max_events = max_events
        self._xadd_live = run.client.redis.register_script(scripts.XADD_UNLESS_ENDED)
        #: called as ``observer(type, payload, ts)`` after each event this handle wrote
        #: (e.g. a TensorBoard writer); one that fails is logged, never raised; one with a
        #: ``close()`` is closed when the coordinator handle is
        self.observers: list[Any] = []

    def emit(self, type: str, *, at_ts: float | None = None, retry_s: float | None = None,
             **data: Any) -> str:
        """Append an event to the run's ``events`` stream; returns its stream id.

        After ``end_run`` nothing is written (returns ``""``), so exiting workers do
        not re-create the run's keys.  ``at_ts``: when it happened (default now; events
        kept through an outage are sent later with their own time); ``retry_s``: seconds
        to retry an outage (default the client's ``retry_deadline``).

        ``type`` and the fields must match an event of :mod:`etcslurm.coord.records`
        (``EVENT_TYPES``), else :class:`RecordError` names the problem and nothing is
        written.  Stream fields: ``type``, ``ts`` (unix seconds), ``worker`` (id or
        ``operator``), ``data`` (JSON).
        """
        run, k = self.run, self.run.keys
        payload = event_data(type, data).to_json()
        fields = {
            "type": type,
            "ts": f"{time.time() if at_ts is None else at_ts:.6f}",
            "worker": run.who,
            "data": run.dumps(payload, f"{k.events} {type}"),
        }
        flat = [x for kv in fields.items() for x in kv]
        eid = run.client.call(
            f"emit {type}",
            lambda r: self._xadd_live(keys=[k.events, k.ended], args=[self.max_events, *flat]),
            retry_s,
        )
        if eid is None:  # the run has ended: events are no longer recorded
            run.ended = True
            return ""
        for observer in self.observers:
            try:
                observer(type, payload, float(fields["ts"]))
            except Exception as exc:  # an observer must never break the run
                log.warning("event observer %r failed on %s: %s", observer, type, exc)
        return schema.text(eid)

    def read(self, last_id: str = "0", block_ms: int | None = None,
             count: int = 1000) -> list[dict[str, Any]]:
        """Events after ``last_id`` (``"0"``: from the start; ``"$"``: only new ones).

        Each is ``{"id", "type", "ts", "worker", "data"}``.  ``block_ms`` waits up to that
        long for new events (capped below the socket timeout; loop for longer waits).
        """
        run, key = self.run, self.run.keys.events
        sock = run.socket_timeout()
        block = None if block_ms is None else max(1, min(int(block_ms), int(sock * 1000) - 500))
        resp = run.client.call(
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
                                         run.max_value_bytes),
                })
        return out
