"""Slurm's warning and preemption signals → a flag, an event with a time budget, a callback.

Slurm tells a job it must go in two ways: the ``--signal=SIG@LEAD`` warning LEAD seconds
before the end time (and, with ``SlurmctldParameters=preempt_send_user_signal``, at
preemption), and SIGTERM when it preempts or cancels (SIGKILL follows after the partition's
GraceTime / KillWait).  An elastic worker must not die on either: it marks itself leaving,
hands its state to the survivors at the next step boundary and exits before the deadline.

Why the design is what it is:

* **Async-signal safety.**  The Python-level handler only sets flags (no locks, no Redis,
  no logging).  The signal is *recorded* by a watcher thread that reads the signal numbers
  the C-level handler writes to ``signal.set_wakeup_fd`` — so it is noticed at once even
  while the main thread sits in a long C call (a gloo collective), when Python-level
  handlers are deferred.  The user callback runs in that thread, outside handler context,
  so it may talk to Redis (mark the worker leaving).
* **SIGUSR1 is refused**: NCCL uses it internally; trapping it breaks NCCL.
* **Budget** = min(lead time of that signal, partition GraceTime, end time − now) over
  whatever is known: conservative, because inside a handler nothing tells a time-limit
  warning (lead seconds left) from a preemption (only GraceTime left).
* **Second line of defence**: previous handlers (e.g. Submitit's checkpoint-and-requeue)
  are kept; :meth:`SignalTrap.fallback` hands the signal to them when the elastic path
  cannot save the state (nothing survives).
* **Notices without a signal** (:mod:`etcslurm.job.drain`: the node is drained, or a
  reservation starts on it soon) enter through :meth:`SignalTrap.notify` and take the
  same path: an event with a budget (and a ``reason``), the same callback.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from types import FrameType
from typing import Any

from etcslurm.errors import UsageError

DEFAULT_SIGNALS: tuple[str, ...] = ("USR2", "TERM")
_FORBIDDEN = {
    "USR1": "SIGUSR1 is used by NCCL internally; use USR2 (Submitit's default) instead",
    "KILL": "SIGKILL cannot be trapped",
    "STOP": "SIGSTOP cannot be trapped",
}


def parse_signal(name: str | int | signal.Signals) -> signal.Signals:
    """``"USR2"``, ``"SIGUSR2"``, ``12`` → ``Signals.SIGUSR2``; refuses USR1/KILL/STOP."""
    try:
        if isinstance(name, str):
            key = name.strip().upper()
            key = key[3:] if key.startswith("SIG") else key
            sig = signal.Signals(int(key)) if key.isdigit() else signal.Signals["SIG" + key]
        else:
            sig = signal.Signals(int(name))
    except (KeyError, ValueError):
        raise UsageError(f"unknown signal {name!r} (use e.g. USR2, TERM, INT)") from None
    short = sig.name[3:]
    if short in _FORBIDDEN:
        raise UsageError(f"cannot trap SIG{short}: {_FORBIDDEN[short]}")
    return sig


@dataclass(frozen=True)
class SignalEvent:
    """One received signal: what, when, and how long this worker has left to leave."""

    signal: str  # "USR2"; a notice's kind ("RELEASE") for a notice without a signal
    received_at: float  # time.time()
    budget: float | None  # seconds to finish leaving, None if nothing is known
    deadline: float | None  # received_at + budget
    reason: str | None = None  # a notice's reason ("draining (maintenance)"); None: a signal

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (for the coordinator's ``worker.signal`` event)."""
        return asdict(self)


def compute_budget(
    sig: str,
    now: float,
    lead_time: Mapping[str, float] | float | None = None,
    grace_time: float | None = None,
    end_time: float | None = None,
) -> float | None:
    """min(lead time of ``sig``, grace time, end time − now) over the known ones (≥ 0)."""
    candidates: list[float] = []
    lead = lead_time.get(sig) if isinstance(lead_time, Mapping) else lead_time
    if lead is not None:
        candidates.append(float(lead))
    if grace_time:
        candidates.append(float(grace_time))
    if end_time is not None:
        candidates.append(float(end_time) - now)
    return max(0.0, min(candidates)) if candidates else None


_active: SignalTrap | None = None


def installed() -> SignalTrap | None:
    """The trap installed in this process, if any (e.g. by the Submitit task wrapper)."""
    return _active


class SignalTrap:
    """Trap the leave signals of one worker process; see the module doc for the why.

    Use as a context manager or ``install()``/``uninstall()`` from the main thread.
    ``callback(event)`` runs in a watcher thread once per received signal.
    """

    def __init__(
        self,
        signals: Iterable[str | int | signal.Signals] = DEFAULT_SIGNALS,
        *,
        lead_time: Mapping[str, float] | float | None = None,
        grace_time: float | None = None,
        end_time: float | None = None,
        callback: Callable[[SignalEvent], None] | None = None,
    ) -> None:
        self.signals: tuple[signal.Signals, ...] = tuple(dict.fromkeys(parse_signal(s) for s in signals))
        if not self.signals:
            raise UsageError("no signals to trap (give e.g. USR2,TERM)")
        self.lead_time = lead_time
        self.grace_time = grace_time
        self.end_time = end_time
        self.callback = callback
        self.events: list[SignalEvent] = []
        self.callback_errors: list[BaseException] = []
        #: started by :meth:`install`, stopped by :meth:`uninstall` (``start()``/``stop()``),
        #: e.g. the :class:`etcslurm.job.drain.NodeWatcher` that calls :meth:`notify`
        self.watchers: list[Any] = []
        self._flag = False  # set by the Python-level handler (async-signal-safe: one store)
        self._previous: dict[signal.Signals, Any] = {}
        self._old_wakeup_fd = -1
        self._pipe: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, env: Any = None, callback: Callable[[SignalEvent], None] | None = None) -> SignalTrap:
        """Configure from a :class:`SlurmEnvironment` (``ETCSLURM_SIGNALS``, lead, grace, end)."""
        from etcslurm.job.environment import SlurmEnvironment

        env = env or SlurmEnvironment.from_env()
        names = env.signals or DEFAULT_SIGNALS
        lead = None
        if env.signal_lead is not None:
            # the lead applies to the --signal signal (the first one configured)
            lead = {parse_signal(names[0]).name[3:]: env.signal_lead}
        return cls(names, lead_time=lead, grace_time=env.grace_time, end_time=env.end_time,
                   callback=callback)

    # ---- state --------------------------------------------------------------------------
    @property
    def received(self) -> bool:
        """True once any trapped signal arrived (cheap: check it at every step boundary)."""
        return self._flag or bool(self.events)

    @property
    def first(self) -> SignalEvent | None:
        return self.events[0] if self.events else None

    def wait(self, timeout: float) -> SignalEvent | None:
        """Block up to ``timeout`` s for the first event (polls; safe with signals)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.events:
                return self.events[0]
            time.sleep(0.02)
        return self.first

    # ---- install / uninstall ------------------------------------------------------------
    def install(self) -> SignalTrap:
        global _active
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("SignalTrap.install() must run in the main thread")
        if self._pipe is not None:
            return self
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._pipe = (r, w)
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handler)
        self._old_wakeup_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="etcslurm-signals", daemon=True)
        self._thread.start()
        for watcher in self.watchers:
            watcher.start()
        _active = self
        return self

    def uninstall(self) -> None:
        global _active
        if self._pipe is None:
            return
        for watcher in self.watchers:
            watcher.stop()
        signal.set_wakeup_fd(self._old_wakeup_fd)
        for sig, prev in self._previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        r, w = self._pipe
        self._pipe = None
        os.close(w)  # the watcher sees EOF and ends
        if self._thread is not None:
            self._thread.join(timeout=5)
        os.close(r)
        if _active is self:
            _active = None

    def __enter__(self) -> SignalTrap:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # ---- the handler and the watcher ----------------------------------------------------
    def _handler(self, signum: int, frame: FrameType | None) -> None:
        # Python-level handler: a single attribute store, nothing that can block.  The
        # wakeup fd (written by the C-level handler) is what records the event.
        self._flag = True

    def _watch(self) -> None:
        assert self._pipe is not None
        r = self._pipe[0]
        wanted = {int(s) for s in self.signals}
        while True:
            try:
                data = os.read(r, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in wanted:
                    self._record(signal.Signals(signum))

    def _record(self, sig: signal.Signals) -> None:
        now = time.time()
        name = sig.name[3:]
        budget = compute_budget(name, now, self.lead_time, self.grace_time, self.end_time)
        self._deliver(SignalEvent(name, now, budget, None if budget is None else now + budget))

    def notify(self, reason: str, budget: float | None, kind: str = "RELEASE") -> None:
        """A reason to leave that came without a signal (from a watcher's thread): recorded
        and handed to the callback like a signal, with ``budget`` capped by the job's end
        time."""
        now = time.time()
        if self.end_time is not None:
            left = max(0.0, float(self.end_time) - now)
            budget = left if budget is None else min(budget, left)
        self._flag = True
        self._deliver(SignalEvent(kind, now, budget, None if budget is None else now + budget,
                                  reason=reason))

    def _deliver(self, event: SignalEvent) -> None:
        with self._lock:
            self.events.append(event)
        if self.callback is not None:
            try:
                self.callback(event)
            except BaseException as exc:  # keep the watcher alive; the runtime can inspect
                self.callback_errors.append(exc)

    # ---- second line of defence ---------------------------------------------------------
    def fallback(self, sig: str | int | signal.Signals | None = None) -> bool:
        """Hand a received signal to the handler that was installed before us.

        Under Submitit that is its checkpoint-and-requeue handler: it calls the task's
        ``checkpoint()`` and requeues the job.  Call from the main thread, when the elastic
        path cannot keep the state (nothing survives).  Returns False if there was no
        callable previous handler.
        """
        if sig is None:
            signals = [e for e in self.events if e.reason is None]  # not a notice
            if not signals:
                return False
            target = parse_signal(signals[0].signal)
        else:
            target = parse_signal(sig)
        prev = self._previous.get(target)
        if callable(prev):
            prev(int(target), None)
            return True
        return False


def trap_for_job(signals: Iterable[str], leave_budget: float,
                 callback: Callable[[SignalEvent], None]) -> SignalTrap:
    """The leave-signal trap of a worker.

    Under Slurm (or with ``ETCSLURM_SIGNALS`` exported by a template / Submitit task) the
    signals and the time budget come from the job: min(signal lead, partition GraceTime,
    ``SLURM_JOB_END_TIME`` − now), so a preempted worker announces the budget it really
    has; in a Slurm job the trap also watches the node (:mod:`etcslurm.job.drain`): a
    drain or a reservation about to start on it is a notice on the same path.
    Elsewhere (``etcslurm demo``) ``signals`` with ``leave_budget`` as the assumed lead.
    """
    from etcslurm.job.drain import NodeWatcher
    from etcslurm.job.environment import SlurmEnvironment

    env = SlurmEnvironment.from_env()
    if env.is_slurm or env.signals:
        trap = SignalTrap.from_env(env, callback=callback)
        watcher = NodeWatcher.for_job(env, trap.notify)
        if watcher is not None:
            trap.watchers.append(watcher)
        return trap
    return SignalTrap(tuple(signals), lead_time=leave_budget, callback=callback)
