"""Why a world changed, as the metrics and the monitor count resizes.

A worker got a preemption signal, its node was released (drain, reservation), a worker
died, an operator asked (``etcslurm resize``), new workers joined.
"""

from __future__ import annotations

from typing import Any

RESIZE_CAUSES = ("preemption", "release", "failure", "operator", "grow")
#: the leave reason (``Coordinator.leave``) of a worker whose node is released
RELEASED = "released"


def leave_cause(reason: str | None) -> str:
    """The cause of one worker leaving, from its leave reason (``SIGUSR2`` → preemption,
    ``released: ...`` → release, anything else → operator)."""
    text = (reason or "").strip()
    if text.startswith("SIG"):
        return "preemption"
    if text.startswith(RELEASED):
        return "release"
    return "operator"


def resize_cause(kind: str, reason: str, leaving: Any, dead: Any, joining: Any) -> str | None:
    """The one cause a generation change is counted under (``None``: not a resize).

    ``leaving``: the causes of its leaving workers (:func:`leave_cause`); a death counts
    first, then a release, a preemption, an operator's drain, then growth."""
    if kind != "resize":
        return None
    causes = set(leaving)
    if dead or reason.startswith("recover"):
        return "failure"
    for cause in ("release", "preemption", "operator"):
        if cause in causes:
            return cause
    return "grow" if joining else "operator"


def moved_over_lower_bound(moved: int | None, bound: int | None) -> float | None:
    """Bytes a migration moved ÷ the planner's lower bound (1.0: nothing more than
    needed; also when both are 0); ``None`` when unknown."""
    if moved is None or bound is None:
        return None
    if bound <= 0:
        return 1.0 if moved <= 0 else None
    return moved / bound
