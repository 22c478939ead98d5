"""The benchmark's view of a migration: each phase as its slowest participant's, and the
transport's floor measured on the plan's own buffers before anything moves.

Handed to :meth:`etcslurm.runtime.world.World.migrate`, so the benchmark times the very
sequence the runtime runs instead of a copy of it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from etcslurm.groups import lifecycle as groups
from etcslurm.runtime.migration import Migration, Observer
from etcslurm.transfer.executor import transport_only


def world_max(value: float) -> float:
    """The maximum of ``value`` over the current world (every rank gets it)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def group_max(group: Any, value: float, timeout: float) -> float:
    """The maximum of ``value`` over an exchange group (every member gets it)."""
    return float(groups.group_max(group, torch.tensor([value], dtype=torch.float64),
                                  timeout).item())


class SlowestObserver(Observer):
    """Times each phase as its slowest participant's: between two all-reduces of the
    exchange group (plan, prepare, exchange), or of the new world (fill, commit).  The
    build and the group's formation are timed locally (members arrive at different
    times; the checkpoint path's build is untimed too).

    At :meth:`prepared`: one pair's bandwidth (``measure_bandwidth``) and the plan's
    transfers alone through the same group, buffers and memory (the transport's floor,
    measured before the exchange: it leaves stale bytes in the new model).
    """

    def __init__(self, timeout: float, measure_bandwidth: bool = False,
                 bandwidth_mbytes: int = 128) -> None:
        super().__init__()
        self.timeout = timeout
        self.measure_bandwidth = measure_bandwidth
        self.bandwidth_mbytes = bandwidth_mbytes
        self.measured: dict[str, Any] = {}

    @contextlib.contextmanager
    def phase(self, name: str, migration: Migration) -> Iterator[None]:
        group, new_member = migration.group, migration.trainee is not None
        if name in ("build", "group") or (group is None and not new_member):
            with super().phase(name, migration):
                yield
            return
        if group is not None:
            group_max(group, 0.0, self.timeout)
        else:
            dist.barrier()
        t0 = time.perf_counter()
        yield
        seconds = time.perf_counter() - t0
        worst = (group_max(group, seconds, self.timeout) if group is not None
                 else world_max(seconds))
        self.seconds.setdefault(name, []).append(worst)

    def prepared(self, migration: Migration) -> None:
        group, job = migration.group, migration.job
        assert migration.plan is not None and migration.arena is not None
        me = job.members.index(job.me)
        if self.measure_bandwidth and len(job.members) >= 2:
            self.measured["pair_bandwidth"] = self._pair_bandwidth(group, me)
        group_max(group, 0.0, self.timeout)
        t0 = time.perf_counter()
        transport_only(migration.plan.messages, job.me, migration.ranks, migration.arena,
                       job.held, migration.needed, group=group, timeout=self.timeout,
                       direct_min=migration.direct_min)
        self.measured["transport_seconds"] = group_max(group, time.perf_counter() - t0,
                                                       self.timeout)

    def _pair_bandwidth(self, group: Any, me: int) -> dict[str, float]:
        """Best-of-3 one-way bandwidth member 0 -> member 1 (resident buffers)."""
        buf = torch.ones(self.bandwidth_mbytes << 20, dtype=torch.uint8)
        wait = timedelta(seconds=self.timeout)
        best = float("inf")
        for _ in range(3):
            group_max(group, 0.0, self.timeout)
            t0 = time.perf_counter()
            if me == 0:
                group.send([buf], 1, 0).wait(wait)
            elif me == 1:
                group.recv([buf], 0, 0).wait(wait)
            best = min(best, group_max(group, time.perf_counter() - t0, self.timeout))
        return {"bytes": buf.numel(), "seconds": best, "gbps": buf.numel() / best / 1e9}
