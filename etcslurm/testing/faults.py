"""Fault-injecting :class:`~etcslurm.hooks.Hooks` for tests.

Fault tests widen the windows in which a peer can be killed (a pause before the new
world forms, a pause after the first round of a state exchange), corrupt one message on
the wire, or pace the steps so that joiners arrive in time.  Each is a small subclass;
:class:`Several` chains them and :func:`hooks_from_json` builds the lot from the JSON that
``python -m etcslurm.testing.worker --faults JSON`` is given, e.g.
``{"rebuild_delay": 0, "migration_delay": 3, "min_step_seconds": 1.5,
"corrupt": {"src": "0", "dst": "1"}, "hold": {"step": 2, "file": "/run/dir/go"}}``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from etcslurm.errors import UsageError
from etcslurm.hooks import NO_HOOKS, Hooks


class RebuildDelay(Hooks):
    """Pause ``seconds`` before each new world forms (a new member is then easy to kill
    while the others wait for it)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)

    def before_new_world(self, generation: int) -> None:
        if self.seconds > 0:
            time.sleep(self.seconds)


class MigrationDelay(Hooks):
    """Pause ``seconds`` after round 0 of every state exchange (mid-migration kills)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)

    def after_round(self, generation: int, round_index: int) -> None:
        if round_index == 0 and self.seconds > 0:
            time.sleep(self.seconds)


class CorruptOnce(Hooks):
    """Flip ``mask`` in byte ``offset`` of the first received message that matches
    (``src``/``dst`` device ids, ``None`` = any), once: in its last buffer -- the last
    segment if it has segments, else the packed buffer -- so the checksum check fails."""

    def __init__(self, src: str | None = None, dst: str | None = None, offset: int = 3,
                 mask: int = 0x10) -> None:
        self.src, self.dst, self.offset, self.mask = src, dst, int(offset), int(mask)
        self.fired = False
        self._lock = threading.Lock()

    def message_received(self, message: Any, buffers: list[Any]) -> None:
        if self.src is not None and str(message.src) != self.src:
            return
        if self.dst is not None and str(message.dst) != self.dst:
            return
        with self._lock:
            if self.fired:
                return
            self.fired = True
        buffers[-1][self.offset] ^= self.mask


class StepPacing(Hooks):
    """Make each step last at least ``min_seconds`` (the pause comes after the step's
    update, so losses and data order are unchanged)."""

    def __init__(self, min_seconds: float) -> None:
        self.min_seconds = float(min_seconds)

    def after_step(self, step: int, seconds: float) -> None:
        if self.min_seconds > seconds:
            time.sleep(self.min_seconds - seconds)


class HoldAfterStep(Hooks):
    """After step ``step``, hold until ``file`` exists (at most ``timeout`` s, then go on).

    A joiner needs 15-30 s to start on a loaded 2-core host; a paced run of a dozen
    steps can end before it registers.  Fault scenarios that strike a joiner's
    migration hold every rank here and create ``file`` once the joiner has registered,
    so the change that takes it in always comes (the steps' losses are unchanged)."""

    def __init__(self, step: int, file: str, timeout: float = 180.0) -> None:
        self.step, self.file, self.timeout = int(step), Path(file), float(timeout)

    def after_step(self, step: int, seconds: float) -> None:
        if step != self.step:
            return
        end = time.monotonic() + self.timeout
        while not self.file.exists() and time.monotonic() < end:
            time.sleep(0.05)


class Several(Hooks):
    """Every hook of ``parts``, in order."""

    def __init__(self, *parts: Hooks) -> None:
        self.parts = parts

    def before_new_world(self, generation: int) -> None:
        for h in self.parts:
            h.before_new_world(generation)

    def after_round(self, generation: int, round_index: int) -> None:
        for h in self.parts:
            h.after_round(generation, round_index)

    def message_received(self, message: Any, buffers: list[Any]) -> None:
        for h in self.parts:
            h.message_received(message, buffers)

    def after_step(self, step: int, seconds: float) -> None:
        for h in self.parts:
            h.after_step(step, seconds)


def raising_step(spec: Mapping[str, Any] | None) -> Any:
    """A ``train_step`` that raises ``spec["error"]`` (``ValueError`` or
    ``OutOfMemoryError``) at global step ``spec["step"]`` on the ranks ``spec["ranks"]``
    (every rank when absent), and else trains as etcslurm's own: a bug in the user's
    step, or a device out of memory, for the tests that it ends the worker, not the run.
    ``None`` when ``spec`` is empty."""
    if not spec:
        return None
    if not isinstance(spec, Mapping) or not {"step", "error"} <= set(spec):
        raise UsageError("--faults raise must be an object with step, error [, ranks]")
    errors = {"ValueError": ValueError, "OutOfMemoryError": None}
    if spec["error"] not in errors:
        raise UsageError(f"--faults raise: error must be one of {', '.join(errors)}")
    at, ranks = int(spec["step"]), spec.get("ranks")

    def train_step(trainee: Any) -> float:
        import torch
        import torch.distributed as dist

        from etcslurm.megatron.train import train_step as real

        if trainee.iteration == at and (ranks is None or dist.get_rank() in ranks):
            if spec["error"] == "ValueError":
                raise ValueError(f"injected: a bug in the training step at step {at}")
            raise torch.OutOfMemoryError(f"injected: out of memory at step {at}")
        return real(trainee)

    return train_step


#: the keys :func:`hooks_from_json` accepts (``raise`` is :func:`raising_step`'s)
FAULT_KEYS = ("rebuild_delay", "migration_delay", "min_step_seconds", "corrupt", "hold",
              "raise")
_HOLD_KEYS = ("step", "file", "timeout")
_CORRUPT_KEYS = ("src", "dst", "offset", "mask")


def hooks_from_json(spec: Mapping[str, Any] | None) -> Hooks:
    """The hooks ``spec`` asks for (keys: :data:`FAULT_KEYS`; zero or absent = off);
    :data:`~etcslurm.hooks.NO_HOOKS` for none.  Unknown keys raise :class:`UsageError`."""
    if not spec:
        return NO_HOOKS
    if not isinstance(spec, Mapping):
        raise UsageError(f"--faults must be a JSON object, got {type(spec).__name__}")
    spec = {k: v for k, v in spec.items() if k != "raise"}
    unknown = sorted(set(spec) - set(FAULT_KEYS))
    if unknown:
        raise UsageError(f"unknown fault(s) {', '.join(unknown)}; known: {', '.join(FAULT_KEYS)}")
    parts: list[Hooks] = []
    try:
        if float(spec.get("rebuild_delay") or 0) > 0:
            parts.append(RebuildDelay(float(spec["rebuild_delay"])))
        if float(spec.get("migration_delay") or 0) > 0:
            parts.append(MigrationDelay(float(spec["migration_delay"])))
        if float(spec.get("min_step_seconds") or 0) > 0:
            parts.append(StepPacing(float(spec["min_step_seconds"])))
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--faults: delays must be numbers: {exc}") from None
    corrupt = spec.get("corrupt")
    if corrupt:
        if not isinstance(corrupt, Mapping) or set(corrupt) - set(_CORRUPT_KEYS):
            raise UsageError(f"--faults corrupt must be an object with keys from {_CORRUPT_KEYS}")
        parts.append(CorruptOnce(**corrupt))
    hold = spec.get("hold")
    if hold:
        if (not isinstance(hold, Mapping) or set(hold) - set(_HOLD_KEYS)
                or not {"step", "file"} <= set(hold)):
            raise UsageError(f"--faults hold must be an object with keys from {_HOLD_KEYS} "
                             "(step and file required)")
        try:
            parts.append(HoldAfterStep(**hold))
        except (TypeError, ValueError) as exc:
            raise UsageError(f"--faults hold: {exc}") from None
    if not parts:
        return NO_HOOKS
    return parts[0] if len(parts) == 1 else Several(*parts)
