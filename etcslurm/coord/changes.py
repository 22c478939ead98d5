"""The change queue: requests for the next step boundary (changes of the world, and a
checkpoint now).

An operator (``etcslurm resize``) or a leaving worker (draining itself) queues a
:class:`~etcslurm.coord.records.ChangeRequest`; the leader reads the queue at its next
step boundary, carries the requests out in its next generation and takes them.
"""

from __future__ import annotations

from typing import Any

from etcslurm.coord.events import EventLog
from etcslurm.coord.records import (
    ChangeRequest,
    ChangeRequested,
    CheckpointRequest,
    CheckpointRequested,
)
from etcslurm.coord.run import RunHandle
from etcslurm.coord.schema import loads
from etcslurm.errors import RecordError, UsageError

#: requests kept on the queue (the newest)
QUEUE_CAP = 1000


class ChangeQueue:
    """The ``changes`` list of one run."""

    def __init__(self, run: RunHandle, events: EventLog) -> None:
        self.run = run
        self.events = events

    def request(self, request: ChangeRequest) -> None:
        """Queue ``request`` for the leader's next step boundary; emits ``change.requested``."""
        if not isinstance(request, ChangeRequest):
            raise UsageError(f"request_change needs a ChangeRequest, got {type(request).__name__}")
        key = self.run.keys.changes
        raw = self.run.dumps(request.to_json(), key)

        def _push(r: Any) -> None:
            p = r.pipeline(transaction=True)
            p.rpush(key, raw)
            p.ltrim(key, -QUEUE_CAP, -1)
            p.execute()

        # a redo after a failover may queue it twice: merging requests makes that harmless
        self.run.decided("request change", _push)
        self.events.emit("change.requested", **ChangeRequested.of(request).to_json())

    def pending(self, deadline: float | None = None) -> list[ChangeRequest]:
        """The change requests not yet taken, oldest first (empty: nothing pending).

        ``deadline``: seconds to retry an unreachable coordinator (``None``: the client's
        ``retry_deadline``; ``0``: one try, as the step boundary asks).  A malformed entry
        raises :class:`RecordError` naming it.
        """
        key, limit = self.run.keys.changes, self.run.max_value_bytes
        raws = self.run.client.call("read changes", lambda r: r.lrange(key, 0, QUEUE_CAP - 1),
                                    deadline)
        out = []
        for i, raw in enumerate(raws or []):
            try:
                out.append(ChangeRequest.from_json(loads(raw, f"{key}[{i}]", limit)))
            except RecordError as exc:
                raise RecordError(f"coordinator entry {key}[{i}]: {exc}") from None
        return out

    def take(self, count: int) -> None:
        """Drop the ``count`` oldest requests (the leader handled them at a boundary)."""
        if count > 0:
            key = self.run.keys.changes
            self.run.client.call("take changes", lambda r: r.ltrim(key, count, -1))

    # ------------------------------------------------------------------ checkpoint requests
    def request_checkpoint(self, request: CheckpointRequest) -> None:
        """Ask for a checkpoint at the next step boundary (``etcslurm checkpoint``); emits
        ``checkpoint.requested``.  Requests made before one is taken are one request."""
        if not isinstance(request, CheckpointRequest):
            raise UsageError("request_checkpoint needs a CheckpointRequest, got "
                             f"{type(request).__name__}")
        key = self.run.keys.checkpoint
        raw = self.run.dumps(request.to_json(), key)
        self.run.decided("request checkpoint", lambda r: r.set(key, raw))
        self.events.emit("checkpoint.requested", **CheckpointRequested.of(request).to_json())

    def checkpoint_request(self, deadline: float | None = None) -> CheckpointRequest | None:
        """The checkpoint request not yet taken, if any (``deadline``: as for
        :meth:`pending`)."""
        key = self.run.keys.checkpoint
        raw = self.run.client.call("read checkpoint request", lambda r: r.get(key), deadline)
        if raw is None:
            return None
        try:
            return CheckpointRequest.from_json(loads(raw, key, self.run.max_value_bytes))
        except RecordError as exc:
            raise RecordError(f"coordinator entry {key}: {exc}") from None

    def take_checkpoint_request(self) -> None:
        """Drop the checkpoint request (the step boundary began its save)."""
        key = self.run.keys.checkpoint
        self.run.client.call("take checkpoint request", lambda r: r.delete(key))
