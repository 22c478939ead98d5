"""Change requests: what an operator (``etcslurm resize``) or a leaving worker asks for.

Queued in the ``changes`` list, read by the leader at its next step boundary, and the
payload of the ``change.requested`` event.
"""

from __future__ import annotations

from typing import ClassVar

from etcslurm.coord.records.codec import Number, Record
from etcslurm.coord.records.generation import layout_field
from etcslurm.errors import RecordError


class ChangeRequest(Record):
    """A request to change the world at the next step boundary.

    ``to``: the layout asked for (``tp1pp1dp2``), ``auto`` to go back to the automatic
    choice, or ``None`` (keep choosing); ``drain``: worker ids to take out of the world
    (treated as leaving); ``by``: who asked (worker id or ``operator``); ``ts``: unix time;
    ``reason``: free text for the log.
    """

    WHAT: ClassVar[str] = "change request"

    to: str | None
    drain: tuple[str, ...]
    by: str
    ts: Number
    reason: str = ""

    def __post_init__(self) -> None:
        if self.to is None and not self.drain:
            raise RecordError("change request: needs 'to' or a non-empty 'drain'")
        if self.to is not None and self.to != "auto":
            layout_field(self.to, "change request: field 'to'")


class CheckpointRequest(Record):
    """A request for a checkpoint at the next step boundary (the run's periodic save,
    now); ``by``: who asked, ``ts``: unix time, ``reason``: free text for the log.  The
    ``checkpoint`` key until the next step boundary takes it."""

    WHAT: ClassVar[str] = "checkpoint request"

    by: str
    ts: Number
    reason: str = ""
