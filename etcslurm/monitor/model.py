"""The monitor's view model: fold the coordinator's event stream and keys into a RunView.

Pure: no Redis, no terminal, no clock of its own (``now`` is passed in), so the same fold
drives the live view, ``etcslurm status --json`` and the tests.  It reads only the typed
records of :mod:`etcslurm.coord.records` (events parsed by ``parse_event``, the
:class:`GenerationRecord` of the ``gen`` key); a stream entry that does not parse arrives
as a :class:`Refused` and becomes one log line: a bad entry must never crash the monitor.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from etcslurm.coord import records as rec
from etcslurm.coord.records import Assignment, Event, GenerationRecord
from etcslurm.monitor.snapshot import snapshot
from etcslurm.monitor.text import as_float, compact_ids, fmt_bytes, fmt_seconds, signal_name
from etcslurm.monitor.views import LOG_LINES, LOSS_HISTORY, LogLine, Refused, RunView

# ---------------------------------------------------------------- the fold


@dataclass
class _Worker:
    worker: str
    node: str = "?"
    state: str = "active"
    leave_by: float | None = None
    signalled: bool = False  # a worker.signal already told the log it is leaving
    cause: str | None = None  # why it leaves (records.leave_cause), once it does


@dataclass
class _Rank:
    rank: int | None
    worker: str
    sent: int = 0
    recv: int = 0
    total_send: int = 0
    total_recv: int = 0
    first_ts: float | None = None
    last_ts: float | None = None

    @property
    def finished(self) -> bool:
        total = self.total_send + self.total_recv
        return total > 0 and self.sent >= self.total_send and self.recv >= self.total_recv


@dataclass
class _Migration:
    gen: int
    from_layout: str | None
    to_layout: str | None
    start_ts: float | None
    ranks: dict[str, _Rank] = field(default_factory=dict)
    done: rec.MigrationDone | None = None


class RunModel:
    """Accumulates events (:meth:`apply`) and key snapshots (:meth:`set_keys`) of one run.

    Cheap to update per event; :meth:`view` builds the immutable snapshot to render.
    """

    def __init__(self, run: str) -> None:
        self.run = run
        self.phase = "waiting"
        self.gen: int | None = None
        self.layout: str | None = None
        self.layout_by_gen: dict[int, str] = {}  # the last two generations' layouts
        self.world: int | None = None
        self.assignment: dict[str, Assignment] = {}  # worker -> its rank in the generation
        self.step: int | None = None
        self.tokens_per_s: float | None = None
        self.losses: deque[float] = deque(maxlen=LOSS_HISTORY)
        self.workers: dict[str, _Worker] = {}
        self.migrations: dict[int, _Migration] = {}
        self.current_migration: int | None = None
        self.log: deque[LogLine] = deque(maxlen=LOG_LINES)
        self.last_event_ts: float | None = None
        self.last_id: str = "0"
        self.finished_rank: _Rank | None = None  # set by the event that completed a rank
        self.ended = False
        self.primary: str | None = None  # replicated coordinator: "ip:port" of the primary
        self.coordinator: str | None = None  # what the header shows of it
        self.addresses: dict[str, set[str]] = {}  # worker IP -> its nodes (names a site)
        self.resizes: dict[str, int] = {}  # cause -> resizes
        self.counted: set[int] = set()  # generations already counted in ``resizes``
        self.last_step_ts: float | None = None
        self.lower_bound: dict[int, int] = {}  # generation -> planner's lower bound (bytes)
        self.failovers = 0

    # ---------------------------------------------------------------- events

    def apply(self, event: Event | Refused) -> str | None:
        """Fold one event; returns its own human line (``None`` for silent events).

        In the log, consecutive lines that differ only in the worker merge
        (``w9–w12 on n3 gone``) and identical ones count up (``(×4)``).
        """
        self.last_id = event.id or self.last_id
        self.last_event_ts = event.ts
        self.finished_rank = None
        if isinstance(event, Refused):
            return self._log(event.ts, event.type, f"refused event: {event.message}", None)
        handler = getattr(self, "_on_" + event.type.replace(".", "_"), None)
        out = handler(event) if handler else self._generic(event)
        if not out:
            return None
        template, who = out if isinstance(out, tuple) else (out, None)
        return self._log(event.ts, event.type, template, who)

    def _log(self, ts: float, type_: str, template: str, who: str | None) -> str:
        text = template.replace("{who}", who or "")
        last = self.log[-1] if self.log else None
        if last is not None and last.text == text:
            last.count += 1
            last.ts = ts
        elif (
            last is not None and who is not None and last.template == template
            and who not in last.who
        ):
            last.who.append(who)
            last.text = template.replace("{who}", compact_ids(last.who))
            last.ts = ts
        else:
            self.log.append(LogLine(ts, type_, text, template=template,
                                    who=[who] if who else []))
        return text

    def _generic(self, event: Event) -> str:
        body = json.dumps(event.data.to_json(), separators=(",", ":"), sort_keys=True)
        return f"{event.type}: {body[:120]}"

    def _worker(self, wid: str | None, node: str | None = None) -> _Worker | None:
        if not wid or wid == "operator":
            return None
        w = self.workers.get(wid)
        if w is None:
            w = self.workers[wid] = _Worker(wid)
        if node:
            w.node = node
        return w

    def _on_worker_registered(self, ev: Event) -> Any:
        d: rec.WorkerRegistered = ev.data  # type: ignore[assignment]
        w = self._worker(ev.worker, d.node or d.host)
        if w is None:
            return None
        w.state = "joining"  # the coordinator registers every worker as joining
        w.leave_by = None
        if d.address and w.node != "?":
            self.addresses.setdefault(str(d.address), set()).add(w.node)
        return "{who} registered on " + w.node, w.worker

    def _on_worker_signal(self, ev: Event) -> Any:
        d: rec.WorkerSignal = ev.data  # type: ignore[assignment]
        w = self._worker(d.worker, d.node)
        budget = d.budget_s
        if w is not None:
            w.state = "leaving"
            w.signalled = True
            w.cause = "preemption"
            w.leave_by = ev.ts + budget if budget is not None else None
        who = (w.node if w and w.node != "?" else None) or d.node or d.worker or "?"
        sig = signal_name(d.signal)
        tail = f", {budget:.0f} s budget" if budget is not None else ""
        return f"{who} preempted: {sig}{tail}"

    def _on_node_released(self, ev: Event) -> Any:
        d: rec.NodeReleased = ev.data  # type: ignore[assignment]
        w = self._worker(d.worker, d.node)
        budget = d.budget_s
        if w is not None:
            w.state = "leaving"
            w.signalled = True
            w.cause = "release"
            w.leave_by = ev.ts + budget if budget is not None else None
        who = (w.node if w and w.node != "?" else None) or d.node or d.worker or "?"
        tail = f", {budget:.0f} s budget" if budget is not None else ""
        return f"{who} released: {d.reason}{tail}"

    def _on_autogrow(self, ev: Event) -> Any:
        d: rec.Autogrow = ev.data  # type: ignore[assignment]
        what = {"submit": "submitted", "cancel": "cancelled"}.get(d.action, d.action)
        jobs = f" job{'s' if len(d.jobs) > 1 else ''} {', '.join(d.jobs)}" if d.jobs else ""
        counts = []
        if d.nodes is not None:
            counts.append(f"{d.nodes}/{d.max_nodes} nodes" if d.max_nodes else f"{d.nodes} nodes")
        if d.idle is not None:
            counts.append(f"{d.idle} idle")
        tail = f" ({', '.join(counts)})" if counts else ""
        return f"autogrow {what}{jobs}: {d.reason}{tail}"

    def _on_worker_state(self, ev: Event) -> Any:
        d: rec.WorkerState = ev.data  # type: ignore[assignment]
        w = self._worker(ev.worker)  # emitted by the worker it is about
        if w is None:
            return None
        state = d.state
        deadline = d.leave_deadline
        # the event says what it changed; our state may already be newer (keys read
        # between the coordinator's HSET and its XADD)
        changed = d.previous != state if d.previous is not None else state != w.state
        w.state = state
        if deadline is not None:
            w.leave_by = deadline
        elif state != "leaving":
            w.leave_by = None
        if not changed or state in ("active", "joining"):
            return None  # every rank turns active each generation: the gen line says it
        if state == "leaving" and w.signalled:
            return None  # "n3 preempted: USR2, 88 s budget" said it
        left = f" ({max(0.0, deadline - ev.ts):.0f} s left)" if deadline and state == "leaving" else ""
        return "{who} on " + f"{w.node}: {state}{left}", w.worker

    def _on_worker_gone(self, ev: Event) -> Any:
        d: rec.WorkerGone = ev.data  # type: ignore[assignment]
        w = self._worker(d.worker)
        if w is None:
            return None
        w.state = "gone"
        w.leave_by = None
        return "{who} on " + f"{w.node} gone" + (f" ({d.reason})" if d.reason else ""), w.worker

    def _on_generation_start(self, ev: Event) -> Any:
        d: rec.GenerationStart = ev.data  # type: ignore[assignment]
        gen = d.generation
        if d.kind == "end":  # the run's closing record: no new layout
            return None
        # not self.layout: a read of the gen key may already have brought the new one
        prev = d.from_layout or self.layout_by_gen.get(gen - 1)
        new = d.to_layout
        self._set_generation(gen, new, d.world, d.assignment)
        self._count_resize(gen, d.kind, d.reason, d.leaving, (), d.joining)
        for wid in d.joining:
            w = self._worker(wid)
            if w and w.state != "gone":
                w.state = "joining"
        if prev:  # the first generation has nothing to migrate
            self.migrations[gen] = _Migration(gen, prev, new, ev.ts)
            self.current_migration = gen
            for old in [g for g in self.migrations if g < gen - 1]:
                del self.migrations[old]  # a long run must not grow without bound
            self.phase = "migrating"
        elif self.phase == "waiting":
            self.phase = "starting"
        n_leave = len(d.leaving) or sum(1 for w in self.workers.values() if w.state == "leaving")
        n_join = len(d.joining)
        arrow = f"{prev} → {new}" if prev else f"start in {new}"
        extras = []
        if n_leave:
            extras.append(f"{n_leave} leaving")
        if n_join:
            extras.append(f"{n_join} joining")
        world = f"{self.world} ranks" if self.world else ""
        detail = ", ".join(x for x in [world, *extras] if x)
        return f"gen {gen}: {arrow}" + (f" ({detail})" if detail else "")

    def _count_resize(self, gen: int, kind: str, reason: str, leaving: tuple[str, ...],
                      dead: tuple[str, ...], joining: tuple[str, ...]) -> None:
        if gen in self.counted:
            return
        causes = [self.workers[w].cause or "operator" if w in self.workers else "operator"
                  for w in leaving]
        cause = rec.resize_cause(kind, reason, causes, dead, joining)
        if cause is not None:
            self.counted.add(gen)
            self.resizes[cause] = self.resizes.get(cause, 0) + 1

    def _set_generation(
        self, gen: int, layout: str, world: int, assignment: tuple[Assignment, ...]
    ) -> None:
        self.gen = gen
        self.layout = layout
        self.layout_by_gen[gen] = layout
        for old in [g for g in self.layout_by_gen if g < gen - 1]:
            del self.layout_by_gen[old]
        self.world = world
        self.assignment = {}
        for item in assignment:
            self.assignment[item.worker] = item
            # joiners stay "joining" until they say active (or the migration is done)
            self._worker(item.worker, item.node if item.node != "?" else None)

    def _migration(self, gen: int | None) -> _Migration | None:
        if gen is None:
            gen = self.current_migration
        if gen is None:
            return None
        if gen not in self.migrations:
            self.migrations[gen] = _Migration(gen, None, self.layout, None)
            self.current_migration = max(gen, self.current_migration or gen)
        return self.migrations[gen]

    def _on_migration_rebuild(self, ev: Event) -> Any:
        return None  # the progress bars say it

    def _on_migration_progress(self, ev: Event) -> Any:
        d: rec.MigrationProgress = ev.data  # type: ignore[assignment]
        mig = self._migration(d.gen)
        if mig is None:
            return None
        r = mig.ranks.get(d.worker)
        if r is None:
            r = mig.ranks[d.worker] = _Rank(d.rank, d.worker, first_ts=ev.ts)
        was_done = r.finished
        r.sent = max(r.sent, d.sent)
        r.recv = max(r.recv, d.recv)
        r.total_send = d.total_send
        r.total_recv = d.total_recv
        r.last_ts = ev.ts
        if r.finished and not was_done:
            self.finished_rank = r  # plain mode prints one line per rank that completes
        return None

    def _on_migration_done(self, ev: Event) -> Any:
        d: rec.MigrationDone = ev.data  # type: ignore[assignment]
        mig = self._migration(d.gen)
        if mig is None:
            return None
        mig.done = d
        mig.from_layout = mig.from_layout or d.from_layout
        mig.to_layout = mig.to_layout or d.to_layout
        if self.phase == "migrating":
            self.phase = "training"
        for w in self.workers.values():
            if w.state == "joining" and w.worker in self.assignment:
                w.state = "active"
        arrow = f"{mig.from_layout} → {mig.to_layout}" if mig.from_layout else f"{mig.to_layout}"
        parts = [f"gen {mig.gen}: {arrow}", f"{fmt_bytes(d.moved_bytes)} in {fmt_seconds(d.seconds)}"]
        if d.checkpoint_bytes:
            parts.append(f"{fmt_bytes(d.checkpoint_bytes)} from checkpoint")
        return ", ".join(parts)

    def _on_step(self, ev: Event) -> Any:
        d: rec.Step = ev.data  # type: ignore[assignment]
        self.step = d.step
        self.last_step_ts = ev.ts
        if d.tokens_per_s is not None:
            self.tokens_per_s = d.tokens_per_s
        self.losses.append(d.loss)
        if self.gen is None or d.gen > self.gen:
            self.gen = d.gen
        if self.phase in ("waiting", "migrating", "starting", "running"):
            self.phase = "training"
        return None

    def _on_change_requested(self, ev: Event) -> Any:
        d: rec.ChangeRequested = ev.data  # type: ignore[assignment]
        w = self.workers.get(d.by)
        if d.drain == (d.by,) and d.to is None and w is not None and w.state == "leaving":
            return None  # a worker leaving on a signal: the signal line already said it
        for wid in d.drain:  # an operator's drain (a leaver's own request said its cause)
            drained = self._worker(wid)
            if drained is not None and drained.cause is None:
                drained.cause = "operator"
        what = [f"layout {d.to}"] if d.to else []
        if d.drain:
            what.append(f"drain {compact_ids(list(d.drain))}")
        tail = f" ({d.reason})" if d.reason else ""
        return f"change requested by {d.by}: {', '.join(what)}{tail}"

    def _on_run_end(self, ev: Event) -> Any:
        d: rec.RunEnd = ev.data  # type: ignore[assignment]
        self.phase = "ended"
        self.ended = True
        if d.step is not None:
            self.step = d.step
        return "run ended" + (f": {d.reason}" if d.reason else "")

    def _on_run_rollback(self, ev: Event) -> Any:
        d: rec.RunRollback = ev.data  # type: ignore[assignment]
        self.step = d.step
        return f"rolled back to step {d.step} ({d.lost_steps} steps lost)"

    def _on_error(self, ev: Event) -> Any:
        d: rec.Error = ev.data  # type: ignore[assignment]
        who = d.worker or ev.subject()
        return "error" + (f" on {who}" if who else "") + f": {d.message}"

    def _on_coordinator_back(self, ev: Event) -> Any:
        d: rec.CoordinatorBack = ev.data  # type: ignore[assignment]
        who = d.worker or ev.subject()
        return (f"coordinator answers {who} again after {d.unreachable_s:.0f} s: "
                f"{d.kept_events} events kept meanwhile, {d.failed_calls} calls met it down")

    def _on_job_requeued(self, ev: Event) -> Any:
        d: rec.JobRequeued = ev.data  # type: ignore[assignment]
        return f"job {d.job} requeued by {d.worker}"

    # ---------------------------------------------------------------- keys

    def set_keys(
        self,
        workers: dict[str, dict[str, Any]] | None = None,
        gen: GenerationRecord | None = None,
    ) -> None:
        """Merge the ``workers`` hash (``Coordinator.members()``) and the ``gen`` record
        (the ground truth).

        Events stay the fast path; the keys repair what a trimmed stream or a late start
        missed.
        """
        for wid, info in (workers or {}).items():
            w = self._worker(str(wid), info.get("node") or info.get("host"))
            if w is None:
                continue
            state = info.get("state")
            if state:
                w.state = str(state)
            if info.get("alive") is False and w.state != "gone":
                w.state = "gone"  # heartbeat expired: dead, whether or not marked yet
            deadline = info.get("leave_deadline")
            if deadline is not None:
                w.leave_by = as_float(deadline)
            if info.get("leave_reason") and w.cause is None:
                w.cause = rec.leave_cause(str(info["leave_reason"]))
            if info.get("address") and w.node != "?":
                self.addresses.setdefault(str(info["address"]), set()).add(w.node)
        if gen is not None and gen.kind != "end" and (self.gen is None or gen.generation >= self.gen):
            if gen.from_layout and gen.generation - 1 not in self.layout_by_gen:
                self.layout_by_gen[gen.generation - 1] = gen.from_layout
            self._set_generation(gen.generation, gen.to_layout, gen.world, gen.assignment)
            self._count_resize(gen.generation, gen.kind, gen.reason, gen.leaving, gen.dead,
                               gen.joining)
        if gen is not None and gen.plan_stats and gen.plan_stats.get("lower_bound_moved_bytes") is not None:
            self.lower_bound[gen.generation] = int(gen.plan_stats["lower_bound_moved_bytes"])
            for old in [g for g in self.lower_bound if g < gen.generation - 1]:
                del self.lower_bound[old]
        if self.phase == "waiting" and self.gen is not None:
            self.phase = "running"

    def set_coordinator(self, info: dict[str, Any] | None, ts: float) -> str | None:
        """Fold where a replicated coordinator's primary is now
        (:meth:`RunSource.read_coordinator`); a change of primary since the last call is
        logged as a ``coordinator.primary`` event (hand-over or Sentinel failover), a
        primary nobody names as ``coordinator.error`` (once).  Returns the new log line."""
        if info is None:
            self.coordinator = None
            return None
        if "error" in info:
            was, self.coordinator = self.coordinator, f"no primary: {info['error']}"
            if was is not None and was.startswith("no primary"):
                return None
            return self._log(ts, "coordinator.error", f"coordinator: {info['error']}", None)
        primary = str(info["primary"])
        nodes = sorted(self.addresses.get(primary.rsplit(":", 1)[0], ()))
        where = f" (node {nodes[0]})" if len(nodes) == 1 else ""
        replicas = int(info.get("replicas") or 0)
        self.coordinator = (f"primary {primary}{where}, {replicas} "
                            f"replica{'' if replicas == 1 else 's'}")
        old, self.primary = self.primary, primary
        if old is None or old == primary:
            return None
        self.failovers += 1
        return self._log(ts, "coordinator.primary",
                         f"coordinator primary moved {old} → {primary}{where}", None)

    # ---------------------------------------------------------------- snapshot

    def loss_trend(self) -> str:
        """``down``, ``up`` or ``flat`` (mean of the newer half vs the older half)."""
        xs = list(self.losses)
        if len(xs) < 2:
            return ""
        half = len(xs) // 2
        old, new = sum(xs[:half]) / half, sum(xs[half:]) / (len(xs) - half)
        scale = max(abs(old), 1e-12)
        if (new - old) / scale < -0.002:
            return "down"
        if (new - old) / scale > 0.002:
            return "up"
        return "flat"

    def view(self, now: float) -> RunView:
        """An immutable snapshot at time ``now`` (seconds left and ETAs depend on it)."""
        return snapshot(self, now)


def fold(run: str, events: list[Event | Refused], now: float, **keys: Any) -> RunView:
    """Convenience: a fresh model, all ``events``, then the keys; the view at ``now``."""
    model = RunModel(run)
    for e in events:
        model.apply(e)
    model.set_keys(**keys)
    return model.view(now)
