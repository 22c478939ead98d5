"""How long the group operations of :mod:`etcslurm.groups.lifecycle` can take to fail.

Kept apart from it (no torch import) so that the launcher, which only waits for workers,
can size its waits from the same figures as the workers do.
"""

from __future__ import annotations

#: A rank whose rendezvous meets a peer that hangs after publishing its address (its
#: listening socket accepts, nothing answers: a stopped or wedged process) fails only
#: after this many times the group's timeout, in gloo's connectFullMesh (torch 2.13,
#: with or without gloo's connection retries; measured with a SIGSTOPped rank: 5.0 s at
#: a 1-s timeout, 50 s at 10 s).  ``tests/test_groups_rendezvous.py`` holds gloo to it.
RENDEZVOUS_TIMEOUTS = 5


def rendezvous_fails_within(timeout: float) -> float:
    """The longest a rank can stay in a failing rendezvous of a group with ``timeout``.

    Why it matters: a survivor that waits for another to notice a failed change and act
    (the one that publishes the next generation) must allow for it, or it gives up while
    that one is still, legitimately, inside the rendezvous (seen in CI: a follower's 30-s
    window ran out 10 s before the decider's rendezvous failed, 50 s in).
    """
    return RENDEZVOUS_TIMEOUTS * timeout
