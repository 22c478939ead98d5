"""Injection points for tests: one object, no-op in production.

Fault tests must widen the windows in which a peer can be killed, corrupt a message on
the wire, or pace steps so that joiners arrive in time.  Production code calls these
methods on the :class:`Hooks` it was given (the no-op base by default) and never reads
test variables itself; the implementations that do something live in
:mod:`etcslurm.testing` (which no production module imports).
"""

from __future__ import annotations

from typing import Any


class Hooks:
    """No-op injection points; subclass in tests.  Every method must be cheap when unused."""

    def before_new_world(self, generation: int) -> None:
        """A member of generation ``generation`` is about to form its new world."""

    def after_round(self, generation: int, round_index: int) -> None:
        """This worker finished round ``round_index`` of a state exchange."""

    def message_received(self, message: Any, buffers: list[Any]) -> None:
        """A message arrived (before its checksum is verified); buffers may be changed."""

    def after_step(self, step: int, seconds: float) -> None:
        """Step ``step`` finished after ``seconds`` (its update applied, loss reduced)."""


#: the hooks production code uses when none are given
NO_HOOKS = Hooks()
