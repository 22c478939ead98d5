"""``ElasticSession``: the step-boundary hook a training loop calls.

A worker process opens a session; the session registers with the Redis coordinator,
waits for a generation that includes it, builds its model for that generation's layout,
and hands it to the training loop.  At every step boundary (:meth:`ElasticSession.step_done`)
the world agrees, with one tiny all-reduce, whether anything changed: a worker got a
preemption signal, new workers are ready to join, a worker died, or an operator asked.
If so the leader publishes the next generation, every participant replays the planner on
it, the new world forms (process groups, megatron-core ``parallel_state``) and builds its
model, the state moves peer to peer straight into that model (coalesced, checksummed, on
an exchange group of old members + joiners), the new world commits, the leavers exit, and
training goes on at the same step with the same global batch.

The typical loop (see the README)::

    with ElasticSession(config) as session:
        while not session.finished:
            with session.step():                       # a peer failure inside: recover, redo
                loss = train_step(session.trainee)
                session.step_done(loss)

Failure model: a step is atomic (the loss is reduced before the optimizer update and
nothing communicates after it), so a peer that dies inside a step leaves every survivor
at the start of that step; the next generation is rebuilt from the surviving replicas and
the step is redone.  If no replica holds some piece, the run stops with
:class:`~etcslurm.errors.StateLostError` (exit 5) naming the pieces, or, with a
checkpoint directory, restores the last checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from etcslurm.coord.client import connect
from etcslurm.coord.coordinator import ACTIVE, GONE, JOINING, LEAVING, Coordinator
from etcslurm.coord.store import RedisStore
from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import GPTSpec
from etcslurm.errors import EtcslurmError, MigrationError, StateLostError, UsageError, WaitTimeout
from etcslurm.runtime.generation import (
    RunSettings,
    first_generation,
    next_generation,
    plan_inputs,
    worth_changing,
)

log = logging.getLogger("etcslurm.runtime")

Builder = Callable[[GPTSpec, ParallelConfig, "SessionConfig"], Any]


@dataclass
class SessionConfig:
    """Everything a worker needs to take part in a run (the run spec plus local bits).

    The run spec part (model, optimizer, batch, seed, steps) is stored in the coordinator
    by the first worker; a joiner whose spec differs is refused.
    """

    run_id: str
    redis_url: str
    spec: GPTSpec
    password_file: str | None = None
    optimizer: str = "adam"
    global_batch: int = 12
    micro_batch: int = 1
    seed: int = 1234
    steps: int = 60
    lr: float = 1e-3
    initial_workers: int = 1
    gpus_per_node: int = 8
    node: str = field(default_factory=socket.gethostname)
    run_dir: str = "."
    staging_bytes: int = 512 * 2**20
    heartbeat_interval: float = 1.0
    dead_after: float = 10.0  # heartbeat TTL: a SIGKILLed worker is noticed within this
    collective_timeout: float = 10.0  # a collective stuck on a dead peer fails after this
    join_timeout: float = 600.0  # how long a joiner waits for a generation to take it
    barrier_timeout: float = 120.0
    checkpoint_dir: str | None = None  # fallback when all leave / pieces are lost
    signals: tuple[str, ...] = ("USR2", "TERM")
    leave_budget: float = 60.0  # seconds a signalled worker assumes it has, when unknown
    log_data: bool = True

    def run_spec(self) -> dict[str, Any]:
        """The fields every worker of the run must agree on (stored in the coordinator)."""
        return {
            "model": self.spec.to_json(),
            "optimizer": self.optimizer,
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
            "seed": self.seed,
            "steps": self.steps,
            "lr": self.lr,
            "initial_workers": self.initial_workers,
            "gpus_per_node": self.gpus_per_node,
        }

    def settings(self) -> RunSettings:
        return RunSettings(
            spec=self.spec,
            optimizer=self.optimizer,
            global_batch=self.global_batch,
            micro_batch=self.micro_batch,
            gpus_per_node=self.gpus_per_node,
            staging_bytes=self.staging_bytes,
        )


def default_builder(spec: GPTSpec, config: ParallelConfig, cfg: SessionConfig) -> Any:
    """Build etcslurm's megatron-core GPT (+ Adam) for ``config`` (parallel_state is ready)."""
    from etcslurm.megatron.adapter import TrainHyper, build_gpt

    hyper = TrainHyper(lr=cfg.lr, global_batch=cfg.global_batch, micro_batch=cfg.micro_batch)
    return build_gpt(spec, config, optimizer=cfg.optimizer, seed=cfg.seed, hyper=hyper)


class LeftRun(Exception):
    """Raised inside the session when this worker leaves the run (signal, idle, end)."""


@dataclass
class MigrationReport:
    """What one generation change cost on this worker (emitted, and kept for the demo)."""

    generation: int
    kind: str
    from_layout: str | None
    to_layout: str
    seconds: float = 0.0
    transfer_seconds: float = 0.0
    rebuild_seconds: float = 0.0
    moved_bytes: int = 0
    local_bytes: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    pause_seconds: float | None = None


class ElasticSession:
    """One worker's membership in an elastic run; see the module docstring."""

    def __init__(self, config: SessionConfig, build: Builder | None = None) -> None:
        self.cfg = config
        self.build = build or default_builder
        self.settings = config.settings()
        self.coord: Coordinator | None = None
        self.worker_id: str | None = None
        self.record: dict[str, Any] | None = None  # current generation
        self.trainee: Any = None
        self.rank: int | None = None
        self.finished = False
        self.reports: list[MigrationReport] = []
        self._store: RedisStore | None = None
        self._trap: Any = None
        self._signal_at: float | None = None
        self._leaving_announced = False
        self._last_poll = 0.0
        self._step_started = time.perf_counter()
        self._change_started: float | None = None
        self._data_log: Any = None
        self._held: list[tuple[Any, torch.Tensor]] | None = None
        self._held_scalars: dict[str, Any] | None = None
        #: the longest world formation + model build seen: how long the members of an
        #: exchange group may take to arrive (they build the new model first)
        self._build_seconds = 0.0
        #: the staging arena, kept from one migration to the next (resident memory)
        self._arena: torch.Tensor | None = None
        self._backlog: deque[tuple[float, str, dict[str, Any]]] = deque()
        self._dropped_events = 0
        self._coord_failed_at: float | None = None
        self.exit_reason = "finished"

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> ElasticSession:
        self.start()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc_type is LeftRun:
            self.close(GONE)
            return True
        self.close(GONE)
        return False

    def start(self) -> None:
        """Register, wait for a generation that takes this worker, enter it."""
        from etcslurm.megatron.cpu_shim import install_if_needed

        install_if_needed()
        import etcslurm.megatron.adapter  # noqa: F401  (import before registering: a joiner
        # that is taken in must be ready at once, not spend seconds importing megatron)

        cfg = self.cfg
        client = connect(cfg.redis_url, cfg.password_file)
        self.coord = Coordinator(
            client, cfg.run_id, spec=cfg.run_spec(),
            heartbeat_interval=cfg.heartbeat_interval, dead_after=cfg.dead_after,
        )
        self._store = RedisStore(client, cfg.run_id, "pg")
        self._trap = self._make_trap()
        self._trap.install()
        self.worker_id = self.coord.register({"node": cfg.node, "device": "cpu"})
        log.info("registered as %s on %s", self.worker_id, cfg.node)
        if cfg.log_data:
            path = Path(cfg.run_dir) / f"data-{self.worker_id}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._data_log = path.open("a", buffering=1)
        current = self.coord.current_generation()
        if current is None or current.get("kind") == "checkpoint":
            # a new run, or the restart of one whose every worker left with a checkpoint
            # (requeued by Slurm): start afresh from the checkpoint
            self._start_first_generation(after=current)
        else:
            self._wait_to_join(after=int(current["generation"]) - 1)

    def close(self, state: str = GONE) -> None:
        """Leave the coordinator and tear every process group down (idempotent)."""
        from etcslurm.groups import lifecycle as groups

        groups.abort()
        if self._trap is not None:
            self._trap.uninstall()
            self._trap = None
        if self.coord is not None:
            with contextlib.suppress(Exception):
                if self._backlog:  # events kept through an outage: a last, bounded try
                    self._flush_backlog(retry_s=5)
                self.coord.close(state)
            self.coord = None
        if self._data_log is not None:
            self._data_log.close()
            self._data_log = None

    # ------------------------------------------------------------------ signals
    def _make_trap(self) -> Any:
        """The leave-signal trap.  Under Slurm (or with ``ETCSLURM_SIGNALS`` exported by a
        template / Submitit task) the signals and the time budget come from the job:
        min(signal lead, partition GraceTime, ``SLURM_JOB_END_TIME`` − now), so a preempted
        worker announces the budget it really has.  Elsewhere (``etcslurm demo``) the
        configured signals with ``leave_budget`` as the assumed lead."""
        from etcslurm.slurm.environment import SlurmEnvironment
        from etcslurm.slurm.signals import SignalTrap

        env = SlurmEnvironment.from_env()
        if env.is_slurm or env.signals:
            return SignalTrap.from_env(env, callback=self._on_signal)
        return SignalTrap(self.cfg.signals, lead_time=self.cfg.leave_budget,
                          callback=self._on_signal)

    def _on_signal(self, event: Any) -> None:
        # watcher thread: only record; the step boundary acts on it
        if self._signal_at is None:
            self._signal_at = time.perf_counter()
            self._signal_event = event

    @property
    def signalled(self) -> bool:
        return self._signal_at is not None

    # ------------------------------------------------------------------ training API
    @property
    def step_index(self) -> int:
        """The global step the next ``train_step`` computes."""
        return int(self.trainee.iteration) if self.trainee is not None else 0

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Wrap one training step: a peer that dies inside it triggers recovery, after
        which the block is left normally (the step is then redone by the loop)."""
        self._step_started = time.perf_counter()
        try:
            yield
        except (RuntimeError, dist.DistError) as exc:
            if isinstance(exc, EtcslurmError) or not dist.is_initialized():
                raise
            self._recover(exc)

    def step_done(self, loss: float) -> None:
        """The step boundary: publish progress, then resize if anything changed."""
        cfg = self.cfg
        assert self.coord is not None and self.record is not None
        step = self.step_index
        elapsed = max(time.perf_counter() - self._step_started, 1e-9)
        if self.rank == 0:
            self._emit_soft(
                "step", gen=self.record["generation"], step=step, loss=float(loss),
                tokens_per_s=cfg.global_batch * cfg.spec.seq / elapsed,
            )
        self._log_data(step - 1, loss)
        if step >= cfg.steps:
            self.finished = True
            self.exit_reason = "finished"
            if self.rank == 0:  # standbys and late joiners waiting for a generation: go home
                self._flush_backlog(retry_s=None)
                cur = self.record
                self.coord.publish_generation({
                    "generation": int(cur["generation"]) + 1, "kind": "end", "step": step,
                    "from": cur["to"], "to": cur["to"], "layout": cur["to"],
                    "world": cur["world"], "assignment": cur["assignment"], "union": [],
                    "leaving": [], "joining": [], "dead": [], "idle": [],
                    "reason": f"finished {step} steps",
                })
            return
        if self._boundary_change():
            self._resize(step)
        self._step_started = time.perf_counter()

    # ------------------------------------------------------------------ boundary
    def _boundary_change(self) -> bool:
        """All ranks agree (one all-reduce) whether to change the world now."""
        assert self.coord is not None and self.record is not None
        if self.signalled and not self._leaving_announced and self._coordinator_reachable():
            ev = self._signal_event
            budget = ev.budget if ev.budget is not None else self.cfg.leave_budget
            try:  # one try: peers wait in the all-reduce below meanwhile
                self.coord.emit("worker.signal", worker=self.worker_id, node=self.cfg.node,
                                signal=ev.signal, budget_s=budget, received_at=ev.received_at,
                                retry_s=0)
                self.coord.leave(within=budget, reason=f"SIG{ev.signal}")
                self._leaving_announced = True
            except EtcslurmError as exc:  # coordinator down: train on, announce next boundary
                self._coordinator_failed(exc)
        flag = 1 if self._leaving_announced else 0
        if self.rank == 0 and not flag and self._coordinator_reachable():
            now = time.monotonic()
            if now - self._last_poll >= 0.25:
                self._last_poll = now
                try:
                    flag = 1 if self._leader_sees_change() else 0
                except EtcslurmError as exc:
                    self._coordinator_failed(exc)
        t = torch.tensor([flag], dtype=torch.int64)
        dist.all_reduce(t)
        return bool(t.item())

    def _leader_sees_change(self) -> bool:
        assert self.coord is not None and self.record is not None
        leaving, _dead, ready, _nodes = self._world_view(deadline=0)
        return worth_changing(self.settings, self.record, leaving=leaving, dead=[], ready=ready)

    # ------------------------------------------------------------------ coordinator outages
    # Training needs the coordinator only to change the world.  While it is unreachable
    # (restart, network), steps go on: the boundary poll is skipped, a preemption signal is
    # announced once it answers again, and events are kept in order, with their own time,
    # and sent when it is back.  "Reachable" is judged by the heartbeat thread, so a step
    # never waits for a socket timeout more than once per outage.
    def _coordinator_reachable(self) -> bool:
        assert self.coord is not None
        if self.coord.last_beat_error is not None:
            return False
        return self._coord_failed_at is None or self.coord.last_beat_ok > self._coord_failed_at

    def _coordinator_failed(self, exc: BaseException) -> None:
        if self._coord_failed_at is None or self._coordinator_reachable():
            log.warning("coordinator unreachable, training goes on: %s", str(exc)[:200])
        self._coord_failed_at = time.monotonic()

    def _emit_soft(self, type: str, **data: Any) -> None:
        """An event from the training loop: kept and sent later if the coordinator is down."""
        if len(self._backlog) >= 100_000:  # bounded: drop the oldest, say so once it is back
            self._backlog.popleft()
            self._dropped_events += 1
        self._backlog.append((time.time(), type, data))
        if self._coordinator_reachable():
            self._flush_backlog(retry_s=0)

    def _flush_backlog(self, retry_s: float | None) -> None:
        assert self.coord is not None
        try:
            if self._dropped_events:
                self.coord.emit("error", worker=self.worker_id, retry_s=retry_s,
                                message=f"{self._dropped_events} events dropped during a "
                                        "coordinator outage")
                self._dropped_events = 0
            while self._backlog:
                ts, type, data = self._backlog[0]
                self.coord.emit(type, at_ts=ts, retry_s=retry_s, **data)
                self._backlog.popleft()
        except EtcslurmError as exc:
            if retry_s is None:
                raise
            self._coordinator_failed(exc)

    def _world_view(self, deadline: float | None = None
                    ) -> tuple[list[str], list[str], list[str], dict[str, str]]:
        """(leaving, dead, ready, nodes) as the coordinator sees them now.

        ``dead`` (heartbeat expired or marked gone) is only trusted after a failed
        collective: at a step boundary every world member has just taken part in the
        boundary all-reduce, so it is alive even if an overloaded host delayed its
        heartbeat.
        """
        assert self.coord is not None and self.record is not None
        world = [a["worker"] for a in self.record["assignment"]]
        members = self.coord.members(deadline)
        leaving = [w for w in world if members.get(w, {}).get("state") == LEAVING]
        dead = [w for w in world if (w in members and not members[w].get("alive"))
                or members.get(w, {}).get("state") == GONE or w not in members]
        ready = [w for w, i in members.items()
                 if w not in world and i.get("alive") and i["state"] in (JOINING, ACTIVE)]
        nodes = {w: str(i.get("node") or i.get("host") or "?") for w, i in members.items()}
        return leaving, dead, ready, nodes

    def _resize(self, step: int) -> None:
        """Everyone at the boundary: the decider publishes, all follow the record."""
        assert self.coord is not None and self.record is not None
        self._change_started = self._signal_at or time.perf_counter()
        current = int(self.record["generation"])
        decider = self._decider()
        if decider == self.worker_id:
            self._publish_next(step, reason="resize at step boundary")
        record = self.coord.wait_generation(after=current, timeout=self.cfg.barrier_timeout)
        self._follow(record)

    def _decider(self) -> str:
        """The lowest-ranked world member that is not leaving (every rank agrees: the
        leaving flags were set before the boundary's all-reduce)."""
        assert self.coord is not None and self.record is not None
        members = self.coord.members()
        for a in sorted(self.record["assignment"], key=lambda a: a["rank"]):
            info = members.get(a["worker"], {})
            if info.get("state") == ACTIVE and info.get("alive"):
                return a["worker"]
        return sorted(self.record["assignment"], key=lambda a: a["rank"])[0]["worker"]

    def _publish_next(self, step: int, reason: str, extra_dead: tuple[str, ...] = ()) -> None:
        assert self.coord is not None and self.record is not None
        leaving, _dead, ready, nodes = self._world_view()
        dead = sorted(extra_dead)  # see _world_view: only a failed collective proves death
        record, migration = next_generation(
            self.settings, self.record, leaving=leaving, dead=dead, ready=ready, nodes=nodes,
            step=step, scalars=self._holdings()[1], reason=reason,
        )
        latest = self.coord.current_generation()
        if latest is not None:  # after a failed migration the failed record is the latest
            record["generation"] = max(record["generation"], int(latest["generation"]) + 1)
        if migration is not None:
            record["plan_stats"] = {k: migration.stats.get(k) for k in (
                "moved_bytes", "local_bytes", "state_bytes", "messages", "rounds",
                "lower_bound_moved_bytes", "missing_bytes")}
        self.coord.take_changes(len(self.coord.pending_change()))
        if self.coord.publish_generation(record):
            log.info("published generation %s: %s", record["generation"], record["reason"])

    # ------------------------------------------------------------------ generations
    def _start_first_generation(self, after: dict[str, Any] | None = None) -> None:
        """Initial workers: the first registered waits for the rest, then publishes gen 0.

        ``after``: the ``checkpoint`` record the previous job of this run ended with (a
        requeued restart); the start record then follows it in number and resumes from
        ``checkpoint/latest.json``.
        """
        assert self.coord is not None
        cfg = self.cfg
        base = -1 if after is None else int(after["generation"])
        deadline = time.monotonic() + cfg.join_timeout
        while True:
            current = self.coord.current_generation()
            if current is not None and int(current["generation"]) > base:
                break
            # only workers not yet in any world: after a whole-run checkpoint the previous
            # job's workers may still be alive (leaving) while the restarted ones register
            live = {w: i for w, i in self.coord.live_members().items() if i["state"] == JOINING}
            if self.coord.is_leader() and len(live) >= cfg.initial_workers:
                workers = list(live)[: cfg.initial_workers]
                nodes = {w: str(i.get("node") or "?") for w, i in live.items()}
                record = first_generation(self.settings, workers, nodes)
                record["generation"] = base + 1
                resume = self._checkpoint_to_resume()
                record["resume"] = resume["path"] if resume else None
                if resume:
                    record["step"] = int(resume.get("step", 0))
                    record["reason"] = f"resume from {resume['path']}; {record['reason']}"
                if self.coord.publish_generation(record):
                    continue
            if time.monotonic() > deadline:
                raise WaitTimeout(
                    f"run {cfg.run_id}: only {len(live)} of {cfg.initial_workers} initial "
                    f"workers registered within {cfg.join_timeout:g} s"
                )
            time.sleep(0.05)
        if self.worker_id in current["union"]:
            self._follow(current)
        else:
            self._wait_to_join(after=int(current["generation"]))

    def _wait_to_join(self, after: int) -> None:
        """A joiner (or an idle standby) waits until a generation takes it in."""
        assert self.coord is not None
        end = time.monotonic() + self.cfg.join_timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise WaitTimeout(
                    f"worker {self.worker_id} was not taken into run {self.cfg.run_id} "
                    f"within {self.cfg.join_timeout:g} s"
                )
            if self.signalled:
                raise LeftRun("signalled while waiting to join")
            try:
                record = self.coord.wait_generation(after=after, timeout=min(left, 1.0))
            except WaitTimeout:
                continue
            after = int(record["generation"])
            if record.get("kind") in ("stop", "end"):
                raise LeftRun(f"the run ended: {record.get('reason')}")
            if self.worker_id in record["union"]:
                self._follow(record)
                return

    def _follow(self, record: dict[str, Any]) -> None:
        """Carry out ``record`` on this worker: migrate, rebuild, or leave."""
        kind = record["kind"]
        if self.worker_id not in record["union"] and self.record is not None:
            self.exit_reason = "evicted"
            raise LeftRun(f"generation {record['generation']} no longer includes "
                          f"{self.worker_id} (it was taken for dead)")
        if kind == "stop":
            self.finished = True
            raise StateLostError(f"run {self.cfg.run_id} stopped: {record['reason']}")
        if kind == "checkpoint":
            self._checkpoint_and_leave(record)
        if kind == "start":
            self._enter_start(record)
        else:
            self._enter_resize(record)

    def _my_rank(self, record: dict[str, Any]) -> int | None:
        for a in record["assignment"]:
            if a["worker"] == self.worker_id:
                return int(a["rank"])
        return None

    def _init_world(self, record: dict[str, Any], config: ParallelConfig) -> None:
        from etcslurm.megatron.parallel import init_parallel

        assert self._store is not None and self.rank is not None
        init_parallel(
            config, self.rank, config.world_size, self._store,
            generation=f"{record['generation']}t", timeout_s=self.cfg.collective_timeout,
        )

    def _enter_start(self, record: dict[str, Any]) -> None:
        assert self.coord is not None
        t0 = time.perf_counter()
        self.rank = self._my_rank(record)
        if self.rank is None:  # idle at start: wait to be taken in later
            self._wait_to_join(after=int(record["generation"]))
            return
        self.trainee = self._form_world_and_build(record, ParallelConfig.parse(record["to"]))
        if record.get("resume"):
            from etcslurm.baseline.checkpoint import load_checkpoint

            load_checkpoint(self.trainee, record["resume"])
        self.record = record
        self.coord.set_state(ACTIVE, rank=self.rank, generation=record["generation"])
        report = MigrationReport(record["generation"], "start", None, record["to"],
                                 seconds=time.perf_counter() - t0)
        self.reports.append(report)

    def _enter_resize(self, record: dict[str, Any]) -> None:
        """The new world and its model first, then the state exchange straight into it (on
        a group of old members + joiners of its own), then the commit."""
        from etcslurm.core.planner import plan
        from etcslurm.megatron.adapter import finish_restore, local_state
        from etcslurm.groups import lifecycle as groups
        from etcslurm.transfer.executor import check_fills, execute, staging_arena

        assert self.coord is not None and self._store is not None
        cfg = self.cfg
        gen = int(record["generation"])
        t0 = time.perf_counter()
        migration = plan(plan_inputs(self.settings, record))
        published = [a["worker"] for a in sorted(record["assignment"], key=lambda a: a["rank"])]
        ids = record["planner_ids"]
        by_id = {v: k for k, v in ids.items()}
        if [by_id[d] for d in migration.assignment] != published:
            raise MigrationError(
                f"generation {gen}: this worker's plan differs from the leader's "
                "(planner inputs are not deterministic)"
            )
        me = ids[self.worker_id]
        union = record["union"]
        new_cfg = ParallelConfig.parse(record["to"])
        new_rank = self._my_rank(record)
        # the old model stays alive (and readable through these views) until the commit
        held = self._holdings()[0]
        local_slices = list(migration.local.get(me, [])) if new_rank is not None else []
        my_msgs = [m for m in migration.messages if me in (m.src, m.dst) and m.src != m.dst]
        total_send = sum(m.nbytes for m in my_msgs if m.src == me)
        total_recv = sum(m.nbytes for m in my_msgs if m.dst == me)
        done = {"sent": 0, "recv": 0}

        def progress(info: dict[str, Any]) -> None:
            done["sent"] += int(info.get("bytes_sent", 0))
            done["recv"] += int(info.get("bytes_received", 0))
            self.coord.emit("migration.progress", gen=gen, worker=self.worker_id, rank=new_rank,
                            sent=min(done["sent"], total_send), recv=min(done["recv"], total_recv),
                            total_send=total_send, total_recv=total_recv)

        old_rank, old_trainee = self.rank, self.trainee
        fresh: Any = None
        t_r = time.perf_counter()
        if new_rank is None:
            groups.teardown()  # a leaver (or idle): it only needs the exchange group
        else:
            try:
                fresh = self._build_new(record, new_rank, new_cfg)
            except (RuntimeError, dist.DistError, WaitTimeout) as exc:
                # a peer was lost while the new world formed: nothing was exchanged, every
                # old member still holds the old generation
                self.rank, self.trainee = old_rank, old_trainee
                self._fall_back(exc, record, f"new world of generation {gen} failed to form")
                return
        build_s = time.perf_counter() - t_r
        progress({})
        t_x = time.perf_counter()
        exchange = None
        needed = local_state(fresh).items() if fresh is not None else []
        self._arena = staging_arena(migration.messages, me, self._arena, held=held,
                                    needed=needed)
        # a plan that misses part of the new model is a bug, not a failure to fall back from
        check_fills(needed, local_slices, migration.messages, me,
                    f"generation {gen}, rank {new_rank}")
        try:
            # the others may still be building their model: wait for that too
            exchange = groups.exchange_group(
                self._store, gen, union.index(self.worker_id), len(union),
                timeout=cfg.collective_timeout + 2 * self._build_seconds)
            stats = execute(
                migration.messages, local_slices, me, {ids[w]: i for i, w in enumerate(union)},
                held, needed,
                staging_cap=cfg.staging_bytes, timeout=cfg.collective_timeout, group=exchange,
                arena=self._arena, progress=_test_delay_after_first_round(progress),
            )
            transfer_s = time.perf_counter() - t_x
            groups.close_exchange_group(exchange)
            exchange = None
            t_f = time.perf_counter()
            if fresh is not None:
                finish_restore(fresh, record["scalars"])
                dist.barrier()  # past it, every new member is complete
            build_s += time.perf_counter() - t_f
        except (RuntimeError, dist.DistError, MigrationError, WaitTimeout) as exc:
            # a peer died before the commit: nothing was applied to the old model (the
            # state went into the new one), so everyone goes back to the old generation
            groups.close_exchange_group(exchange)
            self.rank, self.trainee = old_rank, old_trainee
            self._fall_back(exc, record, f"migration to generation {gen} failed")
            return
        old_layout = record["from"]
        if new_rank is None:
            # a leaver (or a worker no layout uses now): its state stays until the new world
            # is committed, so that a failed change can fall back to the old generation
            self.coord.emit("migration.progress", gen=gen, worker=self.worker_id, rank=None,
                            sent=total_send, recv=total_recv, total_send=total_send,
                            total_recv=total_recv)
            newer = self._await_commit(record)
            if newer is not None:
                self._follow(newer)
                return
            self._held, self._held_scalars, self.trainee = None, None, None
            if self.worker_id in record["leaving"]:
                self.exit_reason = "left"
                raise LeftRun(f"handed over {stats.bytes_sent} bytes and left")
            self.record = None  # idle: no layout uses this worker now; wait as a standby
            self._wait_to_join(after=gen)
            return
        self.trainee = fresh
        del held, old_trainee
        self._held, self._held_scalars = None, None
        self.record = record
        self.coord.set_state(ACTIVE, rank=self.rank, generation=gen)
        if self.rank == 0:  # past the new world's barrier: every member is complete
            self.coord.commit_generation(gen)
        report = MigrationReport(
            gen, "resize", old_layout, record["to"], seconds=time.perf_counter() - t0,
            transfer_seconds=transfer_s, rebuild_seconds=build_s,
            moved_bytes=int(migration.stats.get("moved_bytes", 0)),
            local_bytes=int(migration.stats.get("local_bytes", 0)),
            sent_bytes=stats.bytes_sent, received_bytes=stats.bytes_received,
        )
        if self._change_started is not None:
            report.pause_seconds = time.perf_counter() - self._change_started
        self.reports.append(report)
        if self.rank == 0:
            self.coord.emit(
                "migration.done", gen=gen, seconds=report.seconds,
                moved_bytes=report.moved_bytes, local_bytes=report.local_bytes,
                checkpoint_bytes=0, pause_seconds=report.pause_seconds,
                transfer_seconds=transfer_s, rebuild_seconds=build_s,
                **{"from": old_layout, "to": record["to"]},
            )
        self._change_started = None

    def _fall_back(self, exc: BaseException, failed: dict[str, Any], what: str) -> None:
        """A change failed before its commit: every old member still holds the previous
        generation, so plan again from it without the dead (a joiner, holding nothing,
        waits to be taken in by that plan)."""
        from etcslurm.groups import lifecycle as groups

        assert self.coord is not None
        groups.abort()
        self.coord.emit("error", worker=self.worker_id, message=f"{what}: {str(exc)[:160]}")
        if self.record is None:
            self._wait_to_join(after=int(failed["generation"]))
        else:
            self._recover(exc, failed=failed)

    def _holdings(self) -> tuple[list[tuple[Any, torch.Tensor]], dict[str, Any] | None]:
        """(views of every piece this worker holds, its scalars), taken once per change.

        Kept, with the model, until the next generation is committed: a change that fails
        is planned again from the same state, even after ``parallel_state`` (which
        reading the model's sharded state needs) was torn down for the new layout.
        """
        from etcslurm.megatron.adapter import local_state
        from etcslurm.megatron.scalars import extract_scalars

        if self._held is None:
            if self.trainee is None:
                return [], None
            self._held = local_state(self.trainee).items()
            self._held_scalars = extract_scalars(self.trainee)
        return self._held, self._held_scalars

    def _build_new(self, record: dict[str, Any], new_rank: int, new_cfg: ParallelConfig) -> Any:
        """Form the new world and build the (empty) model and optimizer of its layout; the
        exchange then writes the state straight into it.  Not yet ``self.trainee``: the
        old model stays this worker's until the change is committed."""
        gen = int(record["generation"])
        assert self.coord is not None
        self.coord.emit("migration.rebuild", gen=gen, worker=self.worker_id, rank=new_rank)
        _test_delay("ETCSLURM_TEST_REBUILD_DELAY")
        self.rank = new_rank
        return self._form_world_and_build(record, new_cfg)

    def _form_world_and_build(self, record: dict[str, Any], config: ParallelConfig) -> Any:
        """Start this generation's world as ``self.rank`` and build the model and optimizer
        of ``config``; the longest such start seen bounds how long exchange-group members
        wait for each other (they all build first)."""
        t0 = time.perf_counter()
        self._init_world(record, config)
        trainee = self.build(self.cfg.spec, config, self.cfg)
        self._build_seconds = max(self._build_seconds, time.perf_counter() - t0)
        return trainee

    def _await_commit(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """A worker leaving the world waits until the new world has committed ``record``
        (its rank 0, past the new world's barrier, records the commit); returns ``None`` then,
        or a newer generation to follow when the change failed and was planned again.
        Bounded by the time a failure takes to show (after that it leaves anyway)."""
        assert self.coord is not None
        gen = int(record["generation"])
        limit = self.cfg.dead_after * 2 + self.cfg.collective_timeout * 2 + 30
        end = time.monotonic() + limit
        while time.monotonic() < end:
            if self.coord.committed_generation() >= gen:
                return None
            latest = self.coord.current_generation()
            if latest is not None and int(latest["generation"]) > gen:
                if self.worker_id in latest.get("union", []) and latest["kind"] == "resize":
                    return latest
                return None  # planned without this worker (from the new state): done here
            time.sleep(0.1)
        log.warning("generation %s was not confirmed within %.0f s; leaving anyway", gen, limit)
        return None

    def _checkpoint_and_leave(self, record: dict[str, Any]) -> None:
        """Nobody survives: save a checkpoint (all ranks of the old world) and leave."""
        from etcslurm.baseline.checkpoint import CheckpointMigrator

        assert self.coord is not None
        directory = self._checkpoint_dir()
        target = directory / f"step{record['step']:08d}"
        # one save under the preemption deadline: write synchronously in this process
        # (the async writer would first start a writer process, seconds on a busy node)
        CheckpointMigrator(async_writer=False).save(self.trainee, target)
        dist.barrier()
        if self.rank == 0:
            (directory / "latest.json").write_text(json.dumps(
                {"path": str(target), "step": record["step"], "layout": record["from"]}))
            self.coord.emit("run.end", reason="preempted: checkpoint written", step=record["step"],
                            checkpoint=str(target))
        dist.barrier()  # latest.json exists before any job is requeued (which ends it)
        self._requeue_own_job()
        self.exit_reason = "checkpointed"
        raise LeftRun("whole run preempted: checkpoint written")

    def _requeue_own_job(self) -> None:
        """Under Slurm, the first task of each job requeues its job.

        A job whose processes exit by themselves inside the preemption grace time ends
        COMPLETED and Slurm does not requeue it; so after the whole-run checkpoint each job
        of the run (one per array task / growth job) asks for its own requeue.  The
        restarted job's workers find the ``checkpoint`` generation and resume.
        """
        from etcslurm.slurm.environment import SlurmEnvironment
        from etcslurm.slurm.submission import requeue

        env = SlurmEnvironment.from_env()
        if not env.is_slurm or env.proc_id != 0:
            return
        assert self.coord is not None
        try:
            requeue(env.job_id)
        except EtcslurmError as exc:
            self.coord.emit("error", worker=self.worker_id, message=f"requeue failed: {exc}")
            log.error("requeue of job %s failed: %s", env.job_id, exc)
            return
        self.coord.emit("job.requeued", worker=self.worker_id, job=env.job_id)

    def _checkpoint_dir(self) -> Path:
        path = Path(self.cfg.checkpoint_dir or Path(self.cfg.run_dir) / "checkpoint")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file, a read-only mount, ...: the user's to fix
            raise UsageError(f"checkpoint directory {path} is not usable: {exc.strerror}") from None
        return path

    def _checkpoint_to_resume(self) -> dict[str, Any] | None:
        """The pointer written by :meth:`_checkpoint_and_leave` (path, step, layout)."""
        latest = self._checkpoint_dir() / "latest.json"
        if not latest.exists():
            return None
        try:
            pointer = json.loads(latest.read_text())
            return {**pointer, "path": str(pointer["path"])}
        except (OSError, ValueError, KeyError) as exc:
            raise StateLostError(f"cannot read checkpoint pointer {latest}: {exc}") from None

    # ------------------------------------------------------------------ failures
    def _recover(self, exc: BaseException, failed: dict[str, Any] | None = None) -> None:
        """A collective failed: a peer probably died.  Rebuild from the survivors.

        ``failed``: the generation whose state exchange broke off.  Its old members still
        hold the previous generation's state intact (nothing was applied), so the next
        generation is planned from that state again, without the dead.
        """
        from etcslurm.groups import lifecycle as groups

        assert self.coord is not None and self.record is not None
        cfg = self.cfg
        current = int((failed or self.record)["generation"])
        log.warning("step failed on %s (%s); recovering", self.worker_id, str(exc)[:200])
        self._change_started = time.perf_counter()
        self._holdings()  # read while this layout's parallel_state is still there
        groups.abort()
        self.coord.emit("error", worker=self.worker_id, message=f"collective failed: {str(exc)[:200]}")
        world = [a["worker"] for a in self.record["assignment"]]
        suspects = list(failed["union"]) if failed else world
        deadline = time.monotonic() + cfg.dead_after * 2 + cfg.collective_timeout
        while time.monotonic() < deadline:
            # beat from here too: a heartbeat thread starved while the groups were torn
            # down must not let a live survivor look dead to the one deciding
            with contextlib.suppress(EtcslurmError):
                self.coord.beat(deadline=0)
            rec = self.coord.current_generation()
            if rec is not None and int(rec["generation"]) > current:
                self._follow(rec)
                return
            members = self.coord.members()
            dead = [w for w in suspects if not members.get(w, {}).get("alive")
                    or members.get(w, {}).get("state") == GONE]
            alive_world = [w for w in world if w not in dead]
            if dead and alive_world and alive_world[0] == self.worker_id:
                for w in dead:
                    self.coord.mark_gone(w, "heartbeat lost")
                self._publish_next(self.step_index, reason=f"recover: {', '.join(dead)} died",
                                   extra_dead=tuple(w for w in dead if w in world))
                continue
            time.sleep(0.2)
        raise WaitTimeout(
            f"worker {self.worker_id}: a step failed ({str(exc)[:120]}) but no peer was found "
            f"dead and no new generation came within {cfg.dead_after * 2 + cfg.collective_timeout:g} s"
        )

    # ------------------------------------------------------------------ data log
    def _log_data(self, step: int, loss: float) -> None:
        if self._data_log is None or self.record is None:
            return
        from megatron.core import parallel_state as ps

        if ps.get_tensor_model_parallel_rank() != 0 or not ps.is_pipeline_first_stage():
            return
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        per = self.cfg.global_batch // dp
        start = step * self.cfg.global_batch + dp_rank * per
        self._data_log.write(json.dumps({
            "step": step, "gen": self.record["generation"], "layout": self.record["to"],
            "dp": dp, "dp_rank": dp_rank, "start": start, "stop": start + per,
            "loss": loss, "worker": self.worker_id,
        }) + "\n")


def _test_delay(variable: str) -> None:
    """Fault tests only: pause where ``variable`` says, to widen the window in which a
    peer can be killed (``ETCSLURM_TEST_MIGRATION_DELAY``: after the first round of the
    state exchange; ``ETCSLURM_TEST_REBUILD_DELAY``: before the new world forms)."""
    delay = float(os.environ.get(variable, "0") or 0)
    if delay > 0:
        time.sleep(delay)


def _test_delay_after_first_round(progress: Callable[[dict[str, Any]], None]
                                  ) -> Callable[[dict[str, Any]], None]:
    def wrapped(info: dict[str, Any]) -> None:
        progress(info)
        if info.get("round_index") == 0:
            _test_delay("ETCSLURM_TEST_MIGRATION_DELAY")

    return wrapped


def run_worker(config: SessionConfig, train_step: Callable[[Any], float] | None = None) -> int:
    """The whole elastic training loop of one worker; returns its exit code."""
    if train_step is None:
        from etcslurm.megatron.train import train_step
    session = ElasticSession(config)
    # fault tests and demos: make each step last at least this long (after the update, so
    # losses and data order are unchanged), to give joiners time to arrive
    pace = float(os.environ.get("ETCSLURM_MIN_STEP_SECONDS", "0") or 0)
    try:
        with session:
            while not session.finished:
                t0 = time.perf_counter()
                with session.step():
                    loss = train_step(session.trainee)
                    if pace > 0:
                        time.sleep(max(0.0, pace - (time.perf_counter() - t0)))
                    session.step_done(loss)
    except LeftRun:
        session.close(GONE)
    except EtcslurmError as exc:
        sys.stderr.write(f"etcslurm worker {session.worker_id}: {exc}\n")
        session.close(GONE)
        return exc.exit_code
    finally:
        _flush()
    return 0


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
