"""Errors that reach the user as one line and a documented exit code.

Every error a user can cause (bad layout, unknown model, wrong password, unreachable
coordinator, ...) is raised as an :class:`EtcslurmError` subclass.  The CLI prints
``etcslurm: <message>`` on stderr and exits with the class's ``exit_code``; it never shows
a traceback for these.  Anything else is a bug and keeps its traceback.

Exit codes (also in the README):

==  =====================================================================
0   success
1   runtime failure (a migration or a worker failed; the message says which)
2   bad input: invalid arguments, layouts, model specs, templates, files
3   coordinator unreachable or refused (wrong password, other run, bad entry)
4   a bounded wait timed out (barrier, joiner, peer, store)
5   state would be lost: pieces with no surviving holder and no checkpoint
130 interrupted (Ctrl-C)
==  =====================================================================
"""

from __future__ import annotations


class EtcslurmError(Exception):
    """Base class: a problem the user can act on, reported without a traceback."""

    exit_code = 1


class UsageError(EtcslurmError, ValueError):
    """Bad input: arguments, layouts, model specs, template fields, paths."""

    exit_code = 2


class LayoutError(UsageError):
    """A parallel layout that cannot work for the world size or the model."""


class CoordinatorError(EtcslurmError):
    """The coordinator (Redis) cannot be reached, refused us, or holds bad data."""

    exit_code = 3


class WaitTimeout(EtcslurmError, TimeoutError):
    """A bounded wait ran out; the message names what was awaited and for how long."""

    exit_code = 4


class StateLostError(EtcslurmError):
    """Some state has no surviving holder and cannot be restored from a checkpoint."""

    exit_code = 5


class MigrationError(EtcslurmError):
    """A migration failed (checksum mismatch, peer lost, ...); the message says where."""

    exit_code = 1


class RecordError(CoordinatorError):
    """A generation record, event or change request that is unknown or malformed; the
    message names the record and the field."""
