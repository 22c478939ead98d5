"""TensorBoard scalars of a run, from its rank 0: ``RunSettings(tensorboard_dir=...)``.

An observer of the worker's own coordinator events (``Coordinator.observers``): rank 0
emits ``step`` and, after each resize, ``migration.done``, so the process that is rank 0
at the time writes them; a later rank 0 (after a resize) writes its own event file into
the same directory and TensorBoard shows one run.  No other worker creates a file.

Scalars (tags; the same quantities as ``etcslurm metrics`` exports, docs/metrics.md):
``etcslurm/loss``, ``etcslurm/tokens_per_s``, ``etcslurm/step_seconds`` (time between
two steps), ``etcslurm/world_size``, ``etcslurm/generation`` (at each step);
``etcslurm/pause_seconds``, ``etcslurm/moved_bytes``, ``etcslurm/moved_over_lower_bound``
and ``etcslurm/resize/<cause>`` (1 at the step of each resize of that cause) per resize;
the layout as text (``etcslurm/layout``) per generation.  Needs the ``tensorboard``
package (``pip install 'etcslurm[tensorboard]'``); writes through
``torch.utils.tensorboard``.
"""

from __future__ import annotations

import os
from typing import Any

from etcslurm.coord.records import leave_cause, moved_over_lower_bound, resize_cause
from etcslurm.errors import UsageError


class Scalars:
    """``observer(type, payload, ts)`` writing this worker's rank-0 events as scalars."""

    def __init__(self, coord: Any, logdir: str, flush_secs: int = 5) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UsageError("tensorboard_dir needs the tensorboard package: "
                             "pip install 'etcslurm[tensorboard]'") from None
        self._writer_cls = SummaryWriter
        self.coord = coord
        self.logdir = logdir
        self.flush_secs = flush_secs
        self.writer: Any = None
        self.gen: int | None = None
        self.world: int | None = None
        self.last_step_ts: float | None = None

    def _w(self) -> Any:
        if self.writer is None:  # only a process that is rank 0 some time writes a file
            os.makedirs(self.logdir, exist_ok=True)
            self.writer = self._writer_cls(self.logdir, flush_secs=self.flush_secs,
                                           filename_suffix=f".{os.getpid()}")
        return self.writer

    def __call__(self, type: str, data: dict[str, Any], ts: float) -> None:
        if type == "step":
            self._step(data, ts)
        elif type == "migration.done":
            self._resize(data)

    def _generation(self, gen: int) -> None:
        if gen == self.gen:
            return
        rec = self.coord.current_generation()
        if rec is None or rec.generation != gen:
            return
        self.gen, self.world = gen, rec.world
        self._w().add_text("etcslurm/layout", f"generation {gen}: {rec.to_layout} "
                                              f"(world {rec.world}, {rec.kind})", rec.step)

    def _step(self, data: dict[str, Any], ts: float) -> None:
        step = int(data["step"])
        self._generation(int(data["gen"]))
        w = self._w()
        w.add_scalar("etcslurm/loss", float(data["loss"]), step, walltime=ts)
        if data.get("tokens_per_s") is not None:
            w.add_scalar("etcslurm/tokens_per_s", float(data["tokens_per_s"]), step, walltime=ts)
        if self.last_step_ts is not None:
            w.add_scalar("etcslurm/step_seconds", ts - self.last_step_ts, step, walltime=ts)
        self.last_step_ts = ts
        if self.world is not None:
            w.add_scalar("etcslurm/world_size", self.world, step, walltime=ts)
        w.add_scalar("etcslurm/generation", int(data["gen"]), step, walltime=ts)

    def _resize(self, data: dict[str, Any]) -> None:
        rec = self.coord.current_generation()
        if rec is None or rec.generation != int(data["gen"]):
            return
        self._generation(rec.generation)
        w, step = self._w(), rec.step
        if data.get("pause_seconds") is not None:
            w.add_scalar("etcslurm/pause_seconds", float(data["pause_seconds"]), step)
        moved = int(data.get("moved_bytes") or 0)
        w.add_scalar("etcslurm/moved_bytes", moved, step)
        bound = (rec.plan_stats or {}).get("lower_bound_moved_bytes")
        ratio = moved_over_lower_bound(moved, None if bound is None else int(bound))
        if ratio is not None:
            w.add_scalar("etcslurm/moved_over_lower_bound", ratio, step)
        members = self.coord.members()
        causes = [leave_cause(members.get(x, {}).get("leave_reason")) for x in rec.leaving]
        cause = resize_cause(rec.kind, rec.reason, causes, rec.dead, rec.joining)
        if cause is not None:
            w.add_scalar(f"etcslurm/resize/{cause}", 1, step)
        w.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
