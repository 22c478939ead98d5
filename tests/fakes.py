"""Test doubles for the session's transitions: a coordinator and a world in memory.

As torchft tests its Manager against mocks, these let every transition of
:mod:`etcslurm.runtime.machine` run alone, fast and deterministically: the fake
coordinator keeps records, members, commits, change requests and events in dicts (with
the real coordinator's generation CAS rule), the fake world builds stand-in models and
"migrates" by returning the plan it was given (or failing, when told to).  The real
parts run in the multi-process tests (tests/test_runtime_elastic.py, test_faults.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from etcslurm.coord.records import ChangeRequest, GenerationRecord
from etcslurm.core.layout import ParallelConfig
from etcslurm.core.models import GPTSpec
from etcslurm.core.plan import MigrationPlan
from etcslurm.errors import WaitTimeout
from etcslurm.megatron_state import rank_pieces
from etcslurm.runtime.boundary import Boundary
from etcslurm.runtime.config import RunSettings, WorkerOptions
from etcslurm.runtime.machine import Context
from etcslurm.runtime.migration import MigrationJob, MigrationResult, PeerLost
from etcslurm.transfer.executor import TransferStats


class FakeCoordinator:
    """The coordinator methods the transitions use, in memory (one run)."""

    def __init__(self, members: dict[str, dict[str, Any]] | None = None,
                 leader: str | None = None) -> None:
        self.records: list[GenerationRecord] = []
        self.committed = -1
        self.workers: dict[str, dict[str, Any]] = dict(members or {})
        self.leader_id = leader
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.changes: list[ChangeRequest] = []
        self.checkpoint: Any = None  # a CheckpointRequest not yet taken
        self.states: list[tuple[str, dict[str, Any]]] = []
        self.held: dict[str, int] = {}  # hold(): worker -> failed generation
        self.gone: list[str] = []
        self.client = SimpleNamespace(sentinel=None)  # a single Redis: no hand-over
        self.last_beat_error: BaseException | None = None
        self.last_beat_ok = time.monotonic()
        #: called when a transition waits for a generation that is not there yet: lets a
        #: test publish "what the others do" at that moment
        self.on_wait: Any = None

    # generations
    def current_generation(self) -> GenerationRecord | None:
        return self.records[-1] if self.records else None

    def publish_generation(self, record: GenerationRecord) -> bool:
        current = self.current_generation()
        expected = 0 if current is None else current.generation + 1
        if record.generation != expected and not (current and record.generation > expected):
            return False
        self.records.append(record)
        return True

    def wait_generation(self, after: int, timeout: float) -> GenerationRecord:
        for rec in self.records:
            if rec.generation > after:
                return rec
        if self.on_wait is not None:
            self.on_wait(self)
            for rec in self.records:
                if rec.generation > after:
                    return rec
        raise WaitTimeout(f"no generation after {after} within {timeout} s")

    def watch(self, generation: int, timeout: float, committed: int | None = None) -> Any:
        """The coordinator's O(1) wait: the head (generation and committed numbers) once
        either moved past what the caller has, else after ``timeout`` (briefly here)."""
        def head() -> Any:
            cur = self.current_generation()
            return SimpleNamespace(generation=-1 if cur is None else cur.generation,
                                   committed=self.committed, cursor="0-0")

        def moved(h: Any) -> bool:
            return h.generation > generation or (committed is not None
                                                 and h.committed > committed)

        h = head()
        if not moved(h) and timeout > 0:
            if self.on_wait is not None:
                self.on_wait(self)
                h = head()
            if not moved(h):
                time.sleep(min(timeout, 0.01))
        return h

    def alive(self, worker: str) -> bool:
        info = self.workers.get(worker, {})
        return bool(info.get("alive")) and info.get("state") in ("joining", "active")

    def leader(self) -> str | None:
        return self.leader_id or self.me

    def commit_generation(self, generation: int) -> None:
        self.committed = max(self.committed, generation)

    def committed_generation(self) -> int:
        return self.committed

    # membership
    def members(self, deadline: float | None = None) -> dict[str, dict[str, Any]]:
        return {w: dict(i) for w, i in self.workers.items()}

    def live_members(self) -> dict[str, dict[str, Any]]:
        return {w: dict(i) for w, i in self.workers.items() if i.get("alive")}

    def is_leader(self) -> bool:
        return True if self.leader_id is None else self.leader_id == self.me

    me = "w1"

    def set_state(self, state: str, **info: Any) -> None:
        self.states.append((state, info))

    def hold(self, generation: int) -> None:
        self.held[self.me] = generation

    def holding(self) -> dict[str, int]:
        return dict(self.held)

    def mark_gone(self, worker: str, reason: str) -> None:
        self.gone.append(worker)
        self.workers.setdefault(worker, {})["state"] = "gone"

    def beat(self, deadline: float | None = 0) -> str:
        return self.me

    def leave(self, within: float, reason: str = "signal") -> None:
        self.workers[self.me]["state"] = "leaving"

    # changes and events
    def pending_changes(self, deadline: float | None = None) -> list[ChangeRequest]:
        return list(self.changes)

    def take_changes(self, count: int) -> None:
        del self.changes[:count]

    def checkpoint_request(self, deadline: float | None = None) -> Any:
        return self.checkpoint

    def take_checkpoint_request(self) -> None:
        self.checkpoint = None

    def emit(self, type: str, **fields: Any) -> None:
        self.events.append((type, fields))

    def event_types(self) -> list[str]:
        return [t for t, _ in self.events]


@dataclass
class FakeTrainee:
    """A stand-in model: just the step counter the session reads."""

    layout: str
    rank: int
    iteration: int = 0


@dataclass
class FakeWorld:
    """The world methods the transitions use; ``fail_migration`` makes the next
    migration fail in that phase (a peer lost)."""

    settings: RunSettings
    fail_migration: str | None = None
    formed: list[tuple[int, str, int]] = field(default_factory=list)
    migrations: list[MigrationJob] = field(default_factory=list)
    aborted: int = 0
    saved: list[str] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)
    votes: list[bool] = field(default_factory=list)
    save_votes: list[bool] = field(default_factory=list)
    started_saves: list[str] = field(default_factory=list)  # save_async's directories
    retired: list[Any] = field(default_factory=list)  # models replaced at a resize
    analytic: bool = False
    notice: float = 0.5  # notice_seconds(): how long a member may take to see a failure

    def notice_seconds(self) -> float:
        return self.notice

    def form_and_build(self, generation: int, layout: ParallelConfig, rank: int) -> FakeTrainee:
        self.formed.append((generation, str(layout), rank))
        return FakeTrainee(str(layout), rank)

    def can_keep(self, trainee: Any, old: Any, new: Any) -> bool:
        """Stand-in models are never kept (the real test is the multi-process one)."""
        return False

    def abort(self) -> None:
        self.aborted += 1

    def stop_checkpoint_writer(self) -> None:
        """No writer: checkpoints are recorded, not written."""

    def check_describable(self, trainee: Any) -> None:
        """Stand-in models are always describable."""

    def vote(self, change: bool, rank: int, candidate: bool,
             save: bool = False) -> tuple[bool, int | None, bool]:
        self.votes.append(change)
        self.save_votes.append(save)
        return change, rank if candidate else None, save

    def retire(self, trainee: Any) -> None:
        self.retired.append(trainee)

    def barrier(self) -> None:
        """Nothing to wait for: one process."""

    def read_state(self, trainee: FakeTrainee) -> tuple[list[Any], dict[str, Any]]:
        return [], {"iteration": trainee.iteration}

    def expected_pieces(self, layout: ParallelConfig, rank: int) -> Any:
        return rank_pieces(self.settings.model, layout, rank, self.settings.optimizer)

    def migrate(self, job: MigrationJob, progress: Any = None) -> MigrationResult:
        self.migrations.append(job)
        plan = MigrationPlan(assignment=[], messages=[], local={}, missing={}, idle=[],
                             stats={"moved_bytes": 0})
        if self.fail_migration is not None:
            phase, self.fail_migration = self.fail_migration, None
            raise PeerLost(phase, RuntimeError("Connection closed by peer"))
        trainee = None
        if job.new_rank is not None:
            trainee = FakeTrainee(str(job.layout), job.new_rank,
                                  int((job.scalars or {}).get("iteration", 0)))
        return MigrationResult(trainee, plan, TransferStats(device=job.me), {"exchange": [0.0]})

    def save_checkpoint(self, trainee: Any, path: Any) -> None:
        """Record the save; its tracker as the real save moves it (no files)."""
        from etcslurm.baseline.megatron_lm import write_tracker

        self.saved.append(str(path))
        write_tracker(path, trainee.iteration)

    def save_async(self, trainee: Any, path: Any) -> None:
        self.started_saves.append(str(path))

    def checkpoint_poll(self, blocking: bool) -> bool:
        return True

    def load_checkpoint(self, trainee: Any, path: str) -> None:
        self.loaded.append(path)

    def data_position(self) -> tuple[int, int] | None:
        return None


def member(state: str = "active", alive: bool = True, node: str = "n0") -> dict[str, Any]:
    return {"state": state, "alive": alive, "node": node}


def context(me: str, coord: FakeCoordinator, *, model: str = "gpt-tiny", initial: int = 2,
            tmp: str = ".", **options: Any) -> Context:
    """A transition context for worker ``me`` on the fakes."""
    settings = RunSettings(model=GPTSpec.parse(model), initial_workers=initial, gpus_per_node=2)
    opts = WorkerOptions(run_id="unit", redis_url="redis://unused", run_dir=tmp,
                         join_timeout=options.pop("join_timeout", 2.0),
                         decide_timeout=1.0, dead_after=options.pop("dead_after", 0.1),
                         collective_timeout=options.pop("collective_timeout", 0.1),
                         **options)
    coord.me = me
    return Context(settings, opts, coord, FakeWorld(settings), Boundary(coord, opts), me)
