"""Grow a run into idle nodes by itself: ``etcslurm autogrow``.

A pure decision (:func:`decide`: what Slurm and the coordinator show now → what to do)
and a thin loop that does the I/O (:class:`Autogrow`): every ``interval`` seconds it
reads ``sinfo`` (idle nodes of the partition), ``squeue`` (its own jobs, by job name)
and the coordinator (the run's live nodes, whether it ended), then submits one-node grow
jobs (the grow path of :mod:`etcslurm.slurm.submission`: each can be preempted alone),
cancels pending ones, or backs off.  The layout policy keeps the global batch: a joiner
only changes the data-parallel degree and the gradient accumulation.

Rules (:func:`decide`):

* the run's nodes = nodes of its live workers that are not leaving, plus nodes of this
  autogrow's running jobs (a job whose worker is still starting already takes a node);
  with the pending jobs they never exceed ``max_nodes``;
* submit while at least ``min_idle`` idle nodes are left once the pending jobs are placed,
  never more than ``max_pending`` pending;
* a pending job that has not started within ``start_timeout`` s is cancelled and the next
  submission waits (``backoff`` s, doubling up to ``backoff_max``);
* cap reached, or the run ended: its pending jobs are cancelled; at the end it stops.

Every decision that acts is an ``autogrow`` event in the coordinator (the monitor shows
it) and a line on stdout.
"""

from __future__ import annotations

import getpass
import logging
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from etcslurm.errors import CoordinatorError, EtcslurmError, UsageError
from etcslurm.job.environment import expand_hostlist, parse_slurm_time

log = logging.getLogger("etcslurm.slurm")

#: squeue's output format this module reads (``-o``): id, state, nodes, submit time
SQUEUE_FORMAT = "%i|%T|%N|%V"
#: sinfo's (``-N -o``): one line per node and partition
SINFO_FORMAT = "%N|%T"
#: job states that hold (or are about to hold) a node
RUNNING = {"RUNNING", "CONFIGURING", "COMPLETING", "STAGE_OUT", "RESIZING", "SIGNALING"}
PENDING = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED"}


@dataclass(frozen=True)
class Job:
    """One of this autogrow's Slurm jobs, as squeue shows it."""

    id: str
    state: str
    nodes: tuple[str, ...] = ()
    submitted: float | None = None  # epoch seconds


@dataclass(frozen=True)
class Observation:
    """What the loop saw: ``run`` is ``waiting`` (no world yet, or a whole-run checkpoint
    waiting for its requeue), ``running``, or ``ended`` (finished or stopped)."""

    now: float
    run: str
    run_nodes: frozenset[str]
    jobs: tuple[Job, ...]
    idle: int


@dataclass(frozen=True)
class Policy:
    """The operator's limits (``etcslurm autogrow`` flags)."""

    max_nodes: int
    min_idle: int = 1
    max_pending: int = 1
    start_timeout: float = 120.0
    backoff: float = 30.0
    backoff_max: float = 600.0

    def __post_init__(self) -> None:
        for name in ("max_nodes", "min_idle", "max_pending"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("start_timeout", "backoff", "backoff_max"):
            if getattr(self, name) <= 0:
                raise UsageError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class State:
    """What :func:`decide` carries from one look to the next."""

    backoff_until: float = 0.0
    failures: int = 0  # pending jobs in a row that did not start
    watching: frozenset[str] = frozenset()  # submitted, not yet seen running


@dataclass(frozen=True)
class Action:
    """``submit`` (``count`` one-node jobs), ``cancel`` (``jobs``), ``backoff``, ``stop``."""

    kind: str
    reason: str
    jobs: tuple[str, ...] = ()
    count: int = 0


@dataclass
class Counts:
    """The numbers a decision names (the ``autogrow`` event's fields)."""

    nodes: int
    idle: int
    pending: int
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------- parsing
def parse_squeue(text: str) -> list[Job]:
    """``squeue -h -o '%i|%T|%N|%V'`` → jobs (array elements keep their ``id_n`` ids)."""
    jobs = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 4 or not parts[0]:
            continue
        jid, state, nodes, submitted = parts
        node_list = tuple(expand_hostlist(nodes)) if nodes and not nodes.startswith("(") else ()
        jobs.append(Job(jid, state.upper(), node_list, parse_slurm_time(submitted)))
    return jobs


def parse_sinfo(text: str) -> dict[str, str]:
    """``sinfo -h -N -p P -o '%N|%T'`` → node → state (``idle``, ``mixed``, ``drained``...)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 2 and parts[0]:
            out[parts[0]] = parts[1].strip().lower()
    return out


def idle_nodes(states: Mapping[str, str]) -> list[str]:
    """Nodes Slurm would start a job on now: ``idle`` exactly (not ``idle*``, not responding;
    not ``idle~``, powered down; drained, reserved and planned nodes are not idle)."""
    return sorted(n for n, s in states.items() if s == "idle")


# ---------------------------------------------------------------------------- deciding
def decide(obs: Observation, policy: Policy, state: State) -> tuple[list[Action], State]:
    """What to do now; see the module docstring for the rules."""
    pending = sorted((j for j in obs.jobs if j.state in PENDING),
                     key=lambda j: (j.submitted or 0.0, j.id))
    running = [j for j in obs.jobs if j.state in RUNNING]
    pending_ids = [j.id for j in pending]
    if obs.run == "ended":
        actions = [Action("cancel", "the run ended", tuple(pending_ids))] if pending else []
        return [*actions, Action("stop", "the run ended")], state
    started = {j.id for j in running} & state.watching
    if started:
        state = replace(state, failures=0)
    state = replace(state, watching=frozenset(state.watching & set(pending_ids)))
    in_use = set(obs.run_nodes).union(*(j.nodes for j in running))
    n_use = len(in_use)
    actions: list[Action] = []
    cancel: list[str] = []
    if n_use >= policy.max_nodes and pending:
        cancel = pending_ids
        actions.append(Action("cancel", f"the run has {n_use} nodes, its cap is "
                                        f"{policy.max_nodes}", tuple(cancel)))
    elif n_use + len(pending) > policy.max_nodes:
        cancel = pending_ids[policy.max_nodes - n_use:]  # the newest
        actions.append(Action("cancel", f"{n_use} nodes and {len(pending)} pending exceed "
                                        f"the cap {policy.max_nodes}", tuple(cancel)))
    stale = [j.id for j in pending if j.id not in cancel and j.submitted is not None
             and obs.now - j.submitted > policy.start_timeout]
    if stale:
        failures = state.failures + 1
        wait = min(policy.backoff * 2 ** (failures - 1), policy.backoff_max)
        state = replace(state, failures=failures, backoff_until=obs.now + wait)
        actions.append(Action("cancel", f"not started within {policy.start_timeout:.0f} s",
                              tuple(stale)))
        actions.append(Action("backoff", f"next submission in {wait:.0f} s"))
        cancel += stale
    left = len(pending) - len(cancel)
    if obs.run != "running" or obs.now < state.backoff_until:
        return actions, state
    room = policy.max_nodes - n_use - left
    slots = policy.max_pending - left
    spare = obs.idle - left - policy.min_idle + 1  # idle nodes once the pending are placed
    count = min(room, slots, spare)
    if count > 0:
        actions.append(Action("submit", f"{obs.idle} idle node{'s' if obs.idle != 1 else ''}",
                              count=count))
    return actions, state


# ---------------------------------------------------------------------------- the loop
def _run(cmd: list[str], timeout: float) -> str:
    if not shutil.which(cmd[0]):
        raise EtcslurmError(f"{cmd[0]} not found: run on a Slurm login node")
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise EtcslurmError(f"{cmd[0]} did not answer within {timeout:.0f} s") from None
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1]
        raise EtcslurmError(f"{' '.join(cmd[:2])} failed: {tail}")
    return res.stdout


@dataclass
class Slurm:
    """The three Slurm commands the loop runs (bounded), in one place to fake in tests."""

    partition: str
    job_name: str
    user: str = field(default_factory=getpass.getuser)
    timeout: float = 30.0

    def idle(self) -> int:
        out = _run(["sinfo", "-h", "-N", "-p", self.partition, "-o", SINFO_FORMAT], self.timeout)
        return len(idle_nodes(parse_sinfo(out)))

    def jobs(self) -> list[Job]:
        out = _run(["squeue", "-h", "-u", self.user, "-n", self.job_name, "-o", SQUEUE_FORMAT],
                   self.timeout)
        return parse_squeue(out)

    def cancel(self, ids: Iterable[str]) -> None:
        ids = list(ids)
        if ids:
            _run(["scancel", *ids], self.timeout)


def run_state(coord: Any) -> tuple[str, frozenset[str]]:
    """(``absent`` | ``waiting`` | ``running`` | ``ended``, nodes of live workers not
    leaving); ``absent``: no generation and no worker (not started yet, or its keys are
    gone)."""
    from etcslurm.coord.coordinator import ACTIVE, JOINING

    rec = coord.current_generation()
    if rec is not None and rec.kind in ("end", "stop"):
        return "ended", frozenset()
    members = coord.members()
    nodes = frozenset(str(i.get("node") or i.get("host") or w) for w, i in members.items()
                      if i.get("alive") and i.get("state") in (JOINING, ACTIVE))
    if rec is None and not members:
        return "absent", nodes
    if rec is None or rec.kind == "checkpoint":
        return "waiting", nodes
    return "running", nodes


class Autogrow:
    """The loop: look, :func:`decide`, act, log; until the run ends or a stop signal.

    ``submit()`` submits one one-node grow job and returns its id; ``coord`` is an
    operator's :class:`~etcslurm.coord.coordinator.Coordinator` of the run (read, and
    ``emit`` the decisions).  ``outage``: how long the coordinator may be unreachable
    before the loop gives up (its pending jobs cancelled, exit 3).
    """

    def __init__(self, coord: Any, slurm: Slurm, policy: Policy, submit: Callable[[], str],
                 *, interval: float = 10.0, outage: float = 120.0,
                 out: Callable[[str], None] = print, clock: Callable[[], float] = time.time) -> None:
        if interval <= 0:
            raise UsageError(f"--interval must be > 0, got {interval}")
        self.coord = coord
        self.slurm = slurm
        self.policy = policy
        self.submit = submit
        self.interval = interval
        self.outage = outage
        self.out = out
        self.clock = clock
        self.state = State()
        self.submitted: list[str] = []
        self.stop_event = threading.Event()
        self.seen = False  # the run was seen running (or waiting with workers)
        self._last: Counts | None = None

    def observe(self) -> Observation:
        run, nodes = run_state(self.coord)
        if run == "absent":  # keys gone after the run was seen: it ended (end_run)
            run = "ended" if self.seen else "waiting"
        self.seen = self.seen or run != "waiting"
        return Observation(self.clock(), run, nodes, tuple(self.slurm.jobs()), self.slurm.idle())

    def step(self) -> bool:
        """One look and its actions; False once the run ended."""
        obs = self.observe()
        actions, self.state = decide(obs, self.policy, self.state)
        pending = sum(1 for j in obs.jobs if j.state in PENDING)
        in_use = set(obs.run_nodes).union(*(j.nodes for j in obs.jobs if j.state in RUNNING))
        self._last = Counts(len(in_use), obs.idle, pending)
        for action in actions:
            self._act(action)
        return not any(a.kind == "stop" for a in actions)

    def _act(self, action: Action) -> None:
        jobs = action.jobs
        if action.kind == "submit":
            new = []
            for _ in range(action.count):
                new.append(self.submit())
            self.submitted += new
            self.state = replace(self.state, watching=self.state.watching | set(new))
            jobs = tuple(new)
        elif action.kind == "cancel":
            self.slurm.cancel(jobs)
        self._log(action.kind, action.reason, jobs)

    def _log(self, kind: str, reason: str, jobs: tuple[str, ...] = ()) -> None:
        c = self._last
        counts = {"nodes": c.nodes, "idle": c.idle, "pending": c.pending} if c else {}
        self.out(f"autogrow {kind}: {reason}" + (f" (jobs {', '.join(jobs)})" if jobs else "")
                 + (f" [{c.nodes}/{self.policy.max_nodes} nodes, {c.idle} idle, "
                    f"{c.pending} pending]" if c else ""))
        try:
            self.coord.emit("autogrow", action=kind, reason=reason, jobs=list(jobs),
                            max_nodes=self.policy.max_nodes, retry_s=5, **counts)
        except EtcslurmError as exc:  # the decision stands; only its event is lost
            log.warning("autogrow event not recorded: %s", exc)

    def cancel_pending(self, reason: str) -> None:
        """Cancel every pending job of this autogrow (bounded; used on every way out)."""
        try:
            pending = [j.id for j in self.slurm.jobs() if j.state in PENDING]
            if pending:
                self.slurm.cancel(pending)
                self._log("cancel", reason, tuple(pending))
        except EtcslurmError as exc:
            self.out(f"autogrow: could not cancel its pending jobs: {exc}")

    def run(self) -> int:
        """Loop until the run ends (0), a stop signal (0), or a coordinator outage (3)."""
        p = self.policy
        self._log("start", f"grow {self.slurm.partition} up to {p.max_nodes} nodes, "
                           f"{p.max_pending} pending at most, with {p.min_idle} idle")
        failing_since: float | None = None
        try:
            while not self.stop_event.is_set():
                try:
                    if not self.step():
                        return 0
                    failing_since = None
                except CoordinatorError as exc:
                    now = self.clock()
                    failing_since = failing_since or now
                    if now - failing_since > self.outage:
                        self.cancel_pending("the coordinator is unreachable")
                        raise CoordinatorError(f"autogrow gave up after {self.outage:.0f} s "
                                               f"without the coordinator: {exc}") from None
                except EtcslurmError as exc:  # squeue/sinfo/sbatch: try again next time
                    self.out(f"autogrow: {exc}")
                self.stop_event.wait(self.interval)
            self.cancel_pending("autogrow stopped")
            self._log("stop", "autogrow stopped")
            return 0
        except KeyboardInterrupt:
            self.cancel_pending("autogrow interrupted")
            self._log("stop", "autogrow interrupted")
            return 130

    def stop_on_signals(self) -> None:
        """SIGTERM / SIGHUP (the batch shell's exit, ``kill``) end the loop cleanly."""
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda *_: self.stop_event.set())


def job_name(run_id: str) -> str:
    """The name of an autogrow's grow jobs (how it finds its own in squeue)."""
    if not re.fullmatch(r"[A-Za-z0-9._:+-]+", run_id):
        raise UsageError(f"bad run id {run_id!r}")
    return f"{run_id}-autogrow"
