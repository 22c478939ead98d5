"""A scripted resize, emitted in real time through the real coordinator API.

Why: the monitor must be tried and tested without a cluster.  This registers workers as
real :class:`Coordinator` handles (heartbeats and all), trains a few "steps", preempts one
node (``worker.signal`` + ``leave``), publishes the next generation and emits the
migration progress a real runtime would, then trains on.  Only the numbers are made up.
Used by the monitor tests (incl. the tmux test) and for the docs' screen captures::

    python -m etcslurm.testing.scenario --redis URL --run demo-resize [--speed 1]
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import time
from dataclasses import dataclass, field

from etcslurm.coord.client import CoordClient, connect
from etcslurm.coord.coordinator import Coordinator
from etcslurm.coord.records import Assignment, GenerationRecord
from etcslurm.core.layout import ParallelConfig


@dataclass
class Scenario:
    """``nodes`` × ``per_node`` workers in ``before``; the last node is preempted → ``after``.

    ``speed`` scales every pause (2 = twice as fast); ``rounds`` progress events per rank.
    """

    client: CoordClient
    run: str
    before: tuple[int, int, int] = (2, 2, 3)
    after: tuple[int, int, int] = (2, 2, 2)
    nodes: int = 3
    per_node: int = 4
    speed: float = 1.0
    steps_before: int = 6
    steps_after: int = 6
    rounds: int = 8
    budget_s: float = 88.0
    end: bool = True
    #: Optional pauses for tests: the scenario waits (at most ``gate_timeout`` s) at
    #: ``"preempt"``, ``"mid_migration"`` and ``"end"`` until the named event is set.
    gates: dict[str, threading.Event] = field(default_factory=dict)
    gate_timeout: float = 60.0
    #: Heartbeat TTL: after the scenario ends its workers count as dead this much later.
    dead_after: float = 5.0

    def _sleep(self, s: float) -> None:
        time.sleep(s / self.speed)

    def _gate(self, name: str) -> None:
        gate = self.gates.get(name)
        if gate is not None and not gate.wait(self.gate_timeout):
            raise TimeoutError(f"scenario gate {name!r} not opened within {self.gate_timeout} s")

    def play(self) -> None:
        handles: list[Coordinator] = []
        try:
            self._play(handles)
        finally:
            for h in handles:
                h.stop_heartbeat()

    def _play(self, handles: list[Coordinator]) -> None:
        tp, pp, dp = self.before
        world = tp * pp * dp
        assert world == self.nodes * self.per_node, "before layout must use every worker"
        for i in range(world):
            h = Coordinator(self.client, self.run, heartbeat_interval=0.5,
                            dead_after=self.dead_after)
            h.register({"node": f"n{i // self.per_node + 1}", "device": f"cpu:{i % self.per_node}"})
            handles.append(h)
        lead = handles[0]
        before = f"tp{tp}pp{pp}dp{dp}"
        lead.publish_generation(self._record(0, "start", 0, None, before, handles, handles,
                                             leaving=(), reason="start"))
        for rank, h in enumerate(handles):
            h.set_state("active", rank=rank, generation=0)
        step = 0
        for _ in range(self.steps_before):
            step += 1
            self._step(lead, 0, step)
            self._sleep(0.4)
        self._gate("preempt")
        # preemption of the last node
        leavers = handles[world - self.per_node:]
        for h in leavers:
            h.emit("worker.signal", worker=h.worker_id, node=h.info["node"], signal="USR2",
                   budget_s=self.budget_s)
            h.leave(self.budget_s, reason="USR2")
        self._sleep(1.0)
        stay = handles[: world - self.per_node]
        atp, app, adp = self.after
        after = f"tp{atp}pp{app}dp{adp}"
        lead.publish_generation(self._record(
            1, "resize", step, before, after, stay, handles,
            leaving=tuple(h.worker_id for h in leavers), reason="preempted"))
        self._migrate(stay, gen=1)
        for h in leavers:
            h.close()  # gone
        for rank, h in enumerate(stay):
            h.set_state("active", rank=rank, generation=1)
        for _ in range(self.steps_after):
            step += 1
            self._step(lead, 1, step)
            self._sleep(0.4)
        self._gate("end")
        if self.end:
            lead.emit("run.end", reason="finished", step=step)

    def _record(self, gen: int, kind: str, step: int, before: str | None, layout: str,
                world: list[Coordinator], union: list[Coordinator], leaving: tuple[str, ...],
                reason: str) -> GenerationRecord:
        cfg = ParallelConfig.parse(layout)
        tp, dp = cfg.tp, cfg.dp
        assignment = tuple(
            Assignment(rank=r, worker=h.worker_id, node=h.info["node"],
                       tp=r % tp, pp=r // (tp * dp), dp=(r // tp) % dp)
            for r, h in enumerate(world))
        return GenerationRecord(
            generation=gen, kind=kind, step=step, from_layout=before, to_layout=layout,
            world=len(world), assignment=assignment,
            old_world=None if before is None else tuple(h.worker_id for h in union),
            union=tuple(h.worker_id for h in union), leaving=leaving, joining=(), dead=(),
            idle=(), nodes={h.worker_id: h.info["node"] for h in union},
            planner_ids={h.worker_id: str(r) for r, h in enumerate(union)}, scalars={},
            reason=reason)

    def _step(self, lead: Coordinator, gen: int, step: int) -> None:
        loss = 6.0 * math.exp(-step / 20) + 0.05 * (step % 3)
        tps = 3100.0 * (1.0 if gen == 0 else 2 / 3)
        lead.emit("step", gen=gen, step=step, loss=round(loss, 4), tokens_per_s=tps)

    def _migrate(self, stay: list[Coordinator], gen: int) -> None:
        t0 = time.time()
        totals = [(int(150e6 + 10e6 * r), int(140e6 + 12e6 * r)) for r in range(len(stay))]
        for rnd in range(self.rounds + 1):
            for rank, h in enumerate(stay):
                ts, tr = totals[rank]
                # ranks progress at different speeds; all are through by the last round
                f = min(1.0, rnd / self.rounds * (1.0 + 0.15 * (rank % 3)))
                h.emit("migration.progress", gen=gen, worker=h.worker_id, rank=rank,
                       sent=int(ts * f), recv=int(tr * f), total_send=ts, total_recv=tr)
            self._sleep(0.5)
            if rnd == self.rounds // 2:
                self._gate("mid_migration")
        moved = sum(t for t, _ in totals)
        stay[0].emit("migration.done", gen=gen, seconds=round(time.time() - t0, 3),
                     moved_bytes=moved, local_bytes=3 * moved, checkpoint_bytes=0,
                     pause_seconds=round(time.time() - t0 + 0.3, 3))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--redis", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--speed", type=float, default=1.0)
    ap.add_argument("--no-end", action="store_true", help="do not emit run.end")
    args = ap.parse_args(argv)
    with connect(args.redis) as client:
        Scenario(client, args.run, speed=args.speed, end=not args.no_end).play()
    return 0


if __name__ == "__main__":
    sys.exit(main())
