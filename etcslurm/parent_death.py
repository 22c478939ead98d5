"""Helper processes that must not outlive the process that started them.

Workers of a demo, the bundled Redis, megatron's checkpoint writer and its results-queue
manager are all children that block forever once orphaned (a killed trainer left 270 MB
each behind).  Linux's ``PR_SET_PDEATHSIG`` makes the kernel signal them when their
parent dies, clean exit or not.
"""

from __future__ import annotations

import contextlib
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """In the child (a ``preexec_fn``, an initializer, a process's first line): get ``sig``
    when the parent dies.  ``parent``: the parent's PID read before the call; if it is gone
    by the time the call took effect, exit now.  A no-op where prctl does not exist."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux/glibc
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    if parent is not None and os.getppid() != parent:
        os._exit(0)


def forked_children_die_with_us(sig: int = signal.SIGKILL) -> None:
    """Arm every child this process forks from now on (``os.fork``, multiprocessing's
    fork context) to get ``sig`` when this process dies.

    Why: ``PR_SET_PDEATHSIG`` is cleared in a forked child.  megatron's checkpoint writer
    forks its file-writing workers; when a trainer was killed its writer died with it, but
    a worker forked by the writer stayed, blocked in a queue's lock, holding ~300 MB of
    shared memory (seen after a rollback test).  libc's ``prctl`` is looked up
    here, before any fork: the child only calls it (no ``dlopen`` after a fork).
    """
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux/glibc
        return
    me = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, sig)
        if os.getppid() != me:  # this process died between the fork and the prctl
            os._exit(0)

    os.register_at_fork(after_in_child=arm)
