"""Leave a node before Slurm kills anything on it: drained nodes and reservations.

An administrator who drains a node (``scontrol update NodeName=n3 State=DRAIN``) waits
for its jobs to end, and an elastic run never ends by itself; a maintenance reservation
that starts on a node kills what still runs there.  Neither sends the job a signal, so a
:class:`NodeWatcher` asks slurmctld about this worker's node every ``interval`` seconds,
in a thread: a node that is draining (or failing), or inside a reservation that is not
the job's own and starts within the lead time, is a *release*.  A release takes exactly
the path of a preemption signal (:meth:`etcslurm.job.signals.SignalTrap.notify`): the
worker hands its state over at the next step boundary and exits 0, so its job ends
COMPLETED, the drain completes and the reservation starts on an empty node.

One worker per node asks slurmctld (``SLURM_LOCALID`` 0); the others on the node read
what it found from a node-local file, so a node of 8 workers costs slurmctld two small
RPCs per interval, not sixteen.  The parsing is pure (tests feed recorded outputs).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from etcslurm.job.environment import SlurmEnvironment, expand_hostlist, parse_slurm_time

log = logging.getLogger("etcslurm.job")

#: seconds between two looks at the node (``ETCSLURM_NODE_WATCH_S``; 0: no watcher)
DEFAULT_INTERVAL = 30.0
#: a reservation starting within this many seconds is a release, when the job names no
#: signal lead (the template's ``signal_lead``)
DEFAULT_LEAD = 90.0
ENV_INTERVAL = "ETCSLURM_NODE_WATCH_S"
#: node state flags after which Slurm will not give the node back to running jobs
RELEASE_FLAGS = {"DRAIN": "draining", "FAIL": "failing"}


@dataclass(frozen=True)
class NodeInfo:
    """What ``scontrol show node NAME`` says about one node."""

    name: str
    state: str  # e.g. MIXED+DRAIN
    reason: str | None = None

    @property
    def flags(self) -> set[str]:
        return {part for part in self.state.upper().split("+") if part}


@dataclass(frozen=True)
class Reservation:
    """One entry of ``scontrol show reservation``."""

    name: str
    start: float | None  # epoch seconds
    end: float | None
    nodes: tuple[str, ...]
    state: str = ""  # ACTIVE | INACTIVE
    flags: str = ""


@dataclass(frozen=True)
class Release:
    """Why this node must be left, and the seconds left to do it (``None``: no deadline)."""

    reason: str
    budget: float | None


def _fields(text: str) -> dict[str, str]:
    """``Key=value`` pairs of scontrol's output (``Reason=`` takes the rest of its line)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("Reason="):
            out["Reason"] = stripped[len("Reason="):]
            continue
        for m in re.finditer(r"(\w+)=(\S*)", stripped):
            out.setdefault(m.group(1), m.group(2))
    return out


def parse_node(text: str) -> NodeInfo | None:
    """``scontrol show node NAME`` → :class:`NodeInfo` (``None``: not a node's output)."""
    f = _fields(text)
    if "NodeName" not in f or "State" not in f:
        return None
    reason = f.get("Reason")
    if reason:  # "maintenance [root@<when>]" → "maintenance"
        reason = re.sub(r"\s*\[[^\]]*\]\s*$", "", reason).strip() or None
    return NodeInfo(f["NodeName"], f["State"], None if reason in (None, "(null)") else reason)


def parse_reservations(text: str) -> list[Reservation]:
    """``scontrol show reservation`` → its reservations (none: "No reservations ...")."""
    out = []
    for block in re.split(r"\n\s*\n", text.strip()):
        f = _fields(block)
        if "ReservationName" not in f:
            continue
        nodes = f.get("Nodes", "")
        out.append(Reservation(
            name=f["ReservationName"], start=parse_slurm_time(f.get("StartTime", "")),
            end=parse_slurm_time(f.get("EndTime", "")),
            nodes=tuple(expand_hostlist(nodes)) if nodes and nodes != "(null)" else (),
            state=f.get("State", ""), flags=f.get("Flags", "")))
    return out


def release_of(node: NodeInfo | None, reservations: Sequence[Reservation], name: str,
               now: float, lead: float, own: Sequence[str] = ()) -> Release | None:
    """Whether node ``name`` must be left now, and why.

    Drained or failing: yes, within ``lead`` (Slurm kills nothing for it, but the run
    should not hold the node longer than a signal would).  A reservation on the node that
    is not one of the job's own (``own``) and starts within ``lead`` s (or already
    began): yes, within the seconds left until it starts.
    """
    if node is not None:
        for flag, what in RELEASE_FLAGS.items():
            if any(f.startswith(flag) for f in node.flags):
                return Release(f"{what} ({node.reason})" if node.reason else what, lead)
    for r in reservations:
        if name not in r.nodes or r.name in own or r.start is None:
            continue
        if r.end is not None and r.end <= now:
            continue
        left = r.start - now
        if left <= lead:
            when = time.strftime("%H:%M:%S", time.localtime(r.start))
            return Release(f"reservation {r.name} starts at {when}", max(0.0, left))
    return None


def _scontrol(args: list[str], timeout: float) -> str | None:
    if not shutil.which("scontrol"):
        return None
    try:
        res = subprocess.run(["scontrol", *args], capture_output=True, text=True,
                             timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout if res.returncode == 0 else None


def query(name: str, timeout: float = 10.0) -> tuple[NodeInfo | None, list[Reservation]] | None:
    """Ask slurmctld about node ``name`` and the reservations (``None``: it did not answer)."""
    node = _scontrol(["show", "node", name], timeout)
    if node is None:
        return None
    resv = _scontrol(["show", "reservation"], timeout)
    return parse_node(node), parse_reservations(resv or "")


class NodeWatcher:
    """Watch one node in a thread; call ``notify(reason, budget)`` once on a release.

    ``poll``: this worker asks slurmctld (``ask(name)``, default :func:`query`) and writes
    what it found to ``share`` (a node-local file); otherwise it only reads ``share``.
    """

    def __init__(self, name: str, notify: Callable[[str, float | None], None], *,
                 interval: float = DEFAULT_INTERVAL, lead: float = DEFAULT_LEAD,
                 own: Sequence[str] = (), share: Path | None = None, poll: bool = True,
                 ask: Callable[[str], Any] = query, clock: Callable[[], float] = time.time) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        self.name = name
        self.notify = notify
        self.interval = interval
        self.lead = lead
        self.own = tuple(own)
        self.share = share
        self.poll = poll
        self.ask = ask
        self.clock = clock
        self.released: Release | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unanswered = False

    @classmethod
    def for_job(cls, env: SlurmEnvironment,
                notify: Callable[[str, float | None], None]) -> NodeWatcher | None:
        """The watcher of a worker in a Slurm job (``None`` off Slurm, without a node
        name, or with ``ETCSLURM_NODE_WATCH_S=0``)."""
        try:
            interval = float(env.raw.get(ENV_INTERVAL, DEFAULT_INTERVAL))
        except ValueError:
            interval = DEFAULT_INTERVAL
        if not env.is_slurm or not env.node_name or interval <= 0:
            return None
        own = [r for r in (env.raw.get("SLURM_JOB_RESERVATION") or "").split(",") if r]
        share = Path(tempfile.gettempdir()) / (
            f"etcslurm-release-{env.job_id}.{env.restart_count}-{env.node_name}.json")
        return cls(env.node_name, notify, interval=interval,
                   lead=env.signal_lead if env.signal_lead is not None else DEFAULT_LEAD,
                   own=own, share=share, poll=env.local_id == 0)

    # ---- one look --------------------------------------------------------------------
    def check(self) -> Release | None:
        """Look once (slurmctld, or the shared file); notify on the first release."""
        if self.released is not None:
            return self.released
        found = self._ask() if self.poll else self._read_share()
        if found is not None:
            self.released = found
            if self.poll:
                self._write_share(found)
            self.notify(found.reason, found.budget)
        return found

    def _ask(self) -> Release | None:
        answer = self.ask(self.name)
        if answer is None:
            if not self._unanswered:
                log.warning("node watcher: scontrol did not answer about %s", self.name)
            self._unanswered = True
            return None
        self._unanswered = False
        node, reservations = answer
        return release_of(node, reservations, self.name, self.clock(), self.lead, self.own)

    def _write_share(self, found: Release) -> None:
        if self.share is None:
            return
        try:
            tmp = self.share.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"reason": found.reason, "budget": found.budget,
                                       "at": self.clock()}))
            tmp.replace(self.share)
        except OSError as exc:
            log.warning("node watcher: cannot write %s: %s", self.share, exc)

    def _read_share(self) -> Release | None:
        if self.share is None or not self.share.is_file():
            return None
        try:
            data = json.loads(self.share.read_text())
            budget = data.get("budget")
            if budget is not None:  # the seconds left when the poller found it
                budget = max(0.0, float(budget) - (self.clock() - float(data.get("at", 0))))
            return Release(str(data["reason"]), budget)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    # ---- the thread ------------------------------------------------------------------
    def start(self) -> NodeWatcher:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="etcslurm-node-watch",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)
            self._thread = None
        if self.poll and self.share is not None:
            try:
                self.share.unlink()
            except OSError:
                pass

    def _loop(self) -> None:
        # a reader looks at the shared file often (a stat), the poller every interval
        every = self.interval if self.poll else min(self.interval, 1.0)
        while not self._stop.wait(every):
            try:
                if self.check() is not None:
                    return
            except Exception as exc:  # never let the watcher kill the worker
                log.warning("node watcher failed: %s", exc)
