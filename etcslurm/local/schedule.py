"""The demo's resize schedule: ``"15:leave=1;30:join=2;45:leave=2"``.

Each entry is ``STEP:ACTION=COUNT`` with ACTION ``leave`` (that many workers receive the
preemption signal once the run has finished STEP steps) or ``join`` (that many new
worker processes start then and join at a later step boundary).  Pure parsing, so bad
input is a one-line :class:`~etcslurm.errors.UsageError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from etcslurm.errors import UsageError

_ENTRY = re.compile(r"^\s*(\d+)\s*:\s*(leave|join|kill)\s*=\s*(\d+)\s*$")


@dataclass(frozen=True)
class ScheduledEvent:
    """One resize trigger: at ``step`` (steps completed), ``action`` ``count`` workers."""

    step: int
    # "leave" (signal), "join" (new process), "kill" (SIGKILL: a crashed node)
    action: str
    count: int


def parse_schedule(text: str, *, steps: int | None = None) -> tuple[ScheduledEvent, ...]:
    """Parse a schedule string; raise UsageError naming the bad entry."""
    if not text or not text.strip():
        return ()
    events: list[ScheduledEvent] = []
    for raw in text.split(";"):
        if not raw.strip():
            continue
        match = _ENTRY.match(raw)
        if not match:
            raise UsageError(
                f"bad schedule entry {raw.strip()!r}: expected STEP:leave=N, STEP:join=N "
                "or STEP:kill=N, e.g. '15:leave=1;30:join=2'"
            )
        step, action, count = int(match[1]), match[2], int(match[3])
        if count < 1:
            raise UsageError(f"bad schedule entry {raw.strip()!r}: count must be >= 1")
        if steps is not None and step >= steps:
            raise UsageError(
                f"schedule entry {raw.strip()!r} is at step {step}, but the run has only "
                f"{steps} steps"
            )
        events.append(ScheduledEvent(step, action, count))
    return tuple(sorted(events, key=lambda e: e.step))


def active_after(initial: int, events: tuple[ScheduledEvent, ...]) -> list[int]:
    """Worker counts after each event; raises UsageError if a count would drop below 1."""
    counts, n = [], initial
    for event in events:
        n += event.count if event.action == "join" else -event.count
        if n < 0:
            raise UsageError(
                f"schedule removes more workers than are running at step {event.step} "
                f"({n + event.count} running, {event.action}={event.count})"
            )
        counts.append(n)
    return counts
