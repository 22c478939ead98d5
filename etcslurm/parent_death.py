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
