"""Which exceptions of a training step are a peer's failure, and which are the step's own.

Why it matters: a peer that dies (or hangs) inside a step makes every survivor's next
collective fail, and the run recovers without it (the step is redone).  Anything else --
a shape error, an out-of-memory error, a bug in the user's step -- is that worker's own:
retrying it elsewhere would only hide it, so the worker ends with its traceback, and its
peers, whose collectives then fail, carry on without it.

torch.distributed reports a failed communication as a ``DistError`` (NCCL: a
``DistBackendError``; the store: ``DistStoreError``/``DistNetworkError``) or, for gloo's
transport, as a plain ``RuntimeError`` whose message comes from gloo (its source path,
``Connection closed by peer``, ``Timed out waiting ... for recv operation``).
"""

from __future__ import annotations

import re

import torch.distributed as dist

#: what gloo's, NCCL's and the socket layer's failures say (and a user's step never does)
_COMMUNICATION = re.compile(
    r"gloo/|\bgloo\b|\bnccl\b|ProcessGroup|Connection (closed|reset) by peer|Broken pipe|"
    r"Timed out waiting \d+ms for (send|recv) operation|connectFullMesh",
    re.IGNORECASE,
)


def peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (raised inside a training step) is a failed communication with a
    peer, which the run recovers from, rather than the step's own error."""
    if isinstance(exc, dist.DistError):
        return True
    if type(exc) is not RuntimeError:  # OutOfMemoryError, NotImplementedError, ...
        return False
    return bool(_COMMUNICATION.search(str(exc)))
