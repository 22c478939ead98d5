"""Recovery: a collective failed (a peer probably died), or a change failed before its
commit.  A transition of the state machine (see :mod:`etcslurm.runtime.machine`).

Failure model: a step is atomic (the loss is reduced before the optimizer update and
nothing communicates after it), so a peer that dies inside a step leaves every survivor
at the start of that step; a change that fails before its commit leaves every old member
with the previous generation's state intact (the exchange wrote only into the new
model).  Either way the next generation is planned from that state without the dead,
and the step is redone.  If no replica holds some piece, the decider publishes a
``stop`` and every survivor stops with :class:`~etcslurm.errors.StateLostError`.

A collective can also fail with every peer alive (one held up past the collective
timeout, a dropped connection): once every member is back on its old state the world is
formed again, with the same members (and whatever changes are pending), and the step is
redone.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import replace

from etcslurm.coord.coordinator import GONE
from etcslurm.errors import EtcslurmError, WaitTimeout
from etcslurm.runtime.machine import Context, Phase, State, Waiting
from etcslurm.runtime.transitions import publish_next

log = logging.getLogger("etcslurm.runtime")

#: why a generation forms the same world again (every peer alive, a collective failed)
REFORMED = "recover: a collective failed with every peer alive"


def recover(ctx: Context, state: State) -> State:
    """Find the dead, let the first surviving member publish the next generation without
    them, and follow it.  ``state.failed``: the change that broke off, if any (its
    ``union`` are the suspects; else the whole world is).  A wait: the first call leaves
    the broken world; each call then looks once."""
    assert ctx.record is not None
    coord = ctx.coord
    current = (state.failed or ctx.record).generation
    w = state.waiting
    if w is None:
        w = _leave_broken_world(ctx, state, current)
    # beat from here too: a heartbeat thread starved while the groups were torn down
    # must not let a live survivor look dead to the one deciding
    with contextlib.suppress(EtcslurmError):
        coord.beat(deadline=0)
    latest = coord.current_generation()
    if latest is not None and latest.generation > current:
        return State(Phase.FOLLOW, record=latest)
    world = ctx.record.workers_by_rank()
    suspects = list(state.failed.union) if state.failed is not None else world
    members = coord.members()
    dead = [m for m in suspects if not members.get(m, {}).get("alive")
            or members.get(m, {}).get("state") == GONE]
    alive_world = [m for m in world if m not in dead]
    if time.monotonic() >= w.until:
        found = (f"{', '.join(dead)} found dead, {alive_world[0]} was to publish it"
                 if dead and alive_world else "no peer was found dead")
        raise WaitTimeout(
            f"worker {ctx.worker_id}: a step failed ({str(state.error)[:120]}) and no new "
            f"generation came within {w.until - w.since:g} s ({found})")
    if dead and alive_world and alive_world[0] == ctx.worker_id:
        # the first survivor of the old world publishes, once the others are back too (a
        # member still inside the failed rendezvous would miss the next one), or once
        # they had the time that takes (World.notice_seconds)
        holding = coord.holding()
        away = [m for m in alive_world if holding.get(m, -1) < current]
        if not away or time.monotonic() > w.stragglers_until:
            if away:
                log.warning("publishing without waiting longer for %s to come back from "
                            "generation %s", ", ".join(away), current)
            for gone in dead:
                coord.mark_gone(gone, "heartbeat lost")
            publish_next(ctx, reason=f"recover: {', '.join(dead)} died",
                         extra_dead=tuple(m for m in dead if m in world))
            return replace(state, waiting=w)
    if (not dead and alive_world and alive_world[0] == ctx.worker_id
            and ctx.reformed_at != ctx.step):
        # every peer alive: the collective timed out (a peer held up past the timeout,
        # a connection dropped).  Once all of them are back on their old state the world
        # is formed again and the step redone; once per step, so a failure that comes
        # back every time ends in the bounded wait below instead of a loop
        holding = coord.holding()
        if all(holding.get(m, -1) >= current for m in alive_world):
            ctx.reformed_at = ctx.step
            publish_next(ctx, reason=REFORMED)
            return replace(state, waiting=w)
    time.sleep(0.2)
    return replace(state, waiting=w)


def _leave_broken_world(ctx: Context, state: State, current: int) -> Waiting:
    """Once per recovery: read the old state (while its ``parallel_state`` exists), drop
    every group, say so, and how long to wait (``Context.recovery_window``)."""
    coord, exc = ctx.coord, state.error
    log.warning("step failed on %s (%s); recovering", ctx.worker_id, str(exc)[:200])
    ctx.change_started = time.perf_counter()
    ctx.holdings()
    if ctx.periodic is not None:  # a pending save cannot be finalised without the dead
        ctx.periodic.abandon(ctx.world)
    ctx.world.abort()
    if state.failed is None:  # a change that failed has said so already
        coord.emit("error", worker=ctx.worker_id, message=f"collective failed: {str(exc)[:200]}")
    coord.hold(current)  # back on the old state, outside every rendezvous
    now = time.monotonic()
    return Waiting(until=now + ctx.recovery_window(), since=now,
                   stragglers_until=(now + ctx.options.collective_timeout
                                     + ctx.world.notice_seconds()))
