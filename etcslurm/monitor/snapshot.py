"""Project a :class:`~etcslurm.monitor.model.RunModel`'s fold into the immutable
:class:`~etcslurm.monitor.views.RunView` the renderers draw, at a given time (seconds
left, rates and ETAs depend on it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from etcslurm.coord import records as rec
from etcslurm.monitor.text import natural_key
from etcslurm.monitor.views import (
    STATES,
    DeviceView,
    LogLine,
    MigrationView,
    NodeView,
    RankProgress,
    RunView,
)

if TYPE_CHECKING:
    from etcslurm.monitor.model import RunModel


def snapshot(model: RunModel, now: float) -> RunView:
    """An immutable snapshot at time ``now`` (seconds left and ETAs depend on it)."""
    nodes: dict[str, list[DeviceView]] = {}
    for w in model.workers.values():
        a = model.assignment.get(w.worker)
        node = w.node if w.node != "?" or a is None else a.node
        left = None
        if w.state == "leaving" and w.leave_by is not None:
            left = max(0.0, w.leave_by - now)
        in_gen = a is not None and w.state != "gone"
        nodes.setdefault(node, []).append(
            DeviceView(
                worker=w.worker,
                node=node,
                state=w.state if w.state in STATES else w.state or "active",
                rank=a.rank if a is not None and in_gen else None,
                tp=a.tp if a is not None and in_gen else None,
                pp=a.pp if a is not None and in_gen else None,
                dp=a.dp if a is not None and in_gen else None,
                seconds_left=left,
            )
        )
    node_views = [
        NodeView(
            name,
            sorted(
                devs,
                key=lambda d: (d.rank is None, d.rank or 0, natural_key(d.worker)),
            ),
        )
        for name, devs in sorted(nodes.items(), key=lambda kv: natural_key(kv[0]))
    ]
    mig = _migration_view(model, now)
    return RunView(
        run=model.run,
        phase=model.phase,
        gen=model.gen,
        layout=model.layout,
        world=model.world,
        step=model.step,
        tokens_per_s=model.tokens_per_s,
        loss=model.losses[-1] if model.losses else None,
        loss_trend=model.loss_trend(),
        loss_history=list(model.losses),
        nodes=node_views,
        migration=mig,
        events=[LogLine(x.ts, x.type, x.text, x.count) for x in model.log],
        last_event_ts=model.last_event_ts,
        coordinator=model.coordinator,
        resizes=dict(model.resizes),
        last_step_ts=model.last_step_ts,
        moved_vs_lower_bound=_moved_ratio(model),
        failovers=model.failovers,
    )

def _moved_ratio(model: RunModel) -> float | None:
    """The last finished migration's bytes moved ÷ its plan's lower bound."""
    done = [m for m in model.migrations.values() if m.done is not None]
    if not done:
        return None
    last = max(done, key=lambda m: m.gen)
    moved = last.done.moved_bytes if last.done is not None else None
    return rec.moved_over_lower_bound(moved, model.lower_bound.get(last.gen))

def _migration_view(model: RunModel, now: float) -> MigrationView | None:
    if model.current_migration is None:
        return None
    m = model.migrations[model.current_migration]
    done = m.done is not None
    ranks = []
    for r in sorted(m.ranks.values(), key=lambda r: (r.rank is None, r.rank or 0, r.worker)):
        moved = r.sent + r.recv
        total = r.total_send + r.total_recv
        frac = 1.0 if total == 0 else min(1.0, moved / total)
        t0 = m.start_ts if m.start_ts is not None else r.first_ts
        finished = frac >= 1.0 or done
        # a rank still moving is rated up to now, so a stall shows as a falling rate
        t1 = r.last_ts if finished else max(now, r.last_ts or now)
        gbps = None
        if t0 is not None and t1 is not None and t1 > t0 and moved:
            gbps = moved / (t1 - t0) / 1e9
        eta = 0.0 if finished else (total - moved) / (gbps * 1e9) if gbps else None
        ranks.append(
            RankProgress(
                r.rank, r.worker, r.sent, r.recv, r.total_send, r.total_recv,
                frac, gbps, eta,
            )
        )
    d = m.done
    return MigrationView(
        gen=m.gen,
        from_layout=m.from_layout,
        to_layout=m.to_layout,
        done=done,
        seconds=d.seconds if d else None,
        bytes_done=sum(r.sent for r in m.ranks.values()),
        bytes_total=sum(r.total_send for r in m.ranks.values()),
        moved_bytes=d.moved_bytes if d else None,
        local_bytes=d.local_bytes if d else None,
        checkpoint_bytes=d.checkpoint_bytes if d else None,
        pause_seconds=d.pause_seconds if d else None,
        ranks=ranks,
    )
