"""A chaos soak: one long local run through many seeded random faults in a row, each
injected once the previous one has settled, and what the run left behind.

The faults are the ones a preemptible cluster deals out: a worker preempted (SIGUSR2), a
node crashed (SIGKILL, the leader included), new capacity (a joiner), an operator's
resize and drain (the coordinator's change queue, as ``etcslurm resize`` / ``drain``
write it), a coordinator restart (the run's persistent Redis), and a preemption that
lands while the previous change's state is moving.  The judge reads only what the
run published (its events and generation records) and the kernel's view of the worker
processes (``/proc``): the run finished; every step trained once, except the steps a
rollback to a checkpoint re-trained; the losses equal the never-resized reference; no
state piece was lost that a replica or checkpoint held; per-worker RSS, open files and
threads flat across generations; no process or shared-memory segment left behind.

``benchmarks/soak.py`` runs it long and prints the report; ``tests/test_soak.py`` runs
a short one.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from etcslurm.coord.records import ChangeRequest
from etcslurm.errors import EtcslurmError
from etcslurm.local.launcher import DemoOptions, LocalRun, WorkerFailed, WorkerProc, run_demo
from etcslurm.process_start import forking, stop_template
from etcslurm.redis_host.server import BundledRedis
from etcslurm.testing.fault_harness import record, run_events

#: how often each fault is drawn, relative to the others (joins a little more often than
#: departures, so the world keeps its size on average)
WEIGHTS: dict[str, int] = {"leave": 3, "join": 5, "kill": 3, "redis_restart": 1,
                           "resize": 1, "drain": 1, "preempt_in_migration": 1}
#: faults that take a worker away (two for a preemption during a migration)
DEPARTS = {"leave": 1, "kill": 1, "drain": 1, "preempt_in_migration": 2}
_ROLLBACK = re.compile(r"rollback to the checkpoint of step (\d+) \((\d+) steps lost\)")


@dataclass
class SoakOptions:
    events: int = 60
    seed: int = 7
    workers: int = 4
    min_workers: int = 2
    max_workers: int = 6
    #: the run's length (default: 10 steps per event, at least 400)
    steps: int | None = None
    #: steps trained after a fault settled before the next one strikes
    gap_steps: int = 2
    min_step_seconds: float = 0.25
    #: samples per step: 60 splits evenly over every world of 1..6 workers, so a joiner
    #: always finds a layout that takes it in (with 12, a fifth worker waits outside)
    global_batch: int = 60
    checkpoint_every: int = 10
    model: str = "gpt-tiny"
    #: a fault that has not settled after this long stops the injection (reported)
    settle_timeout: float = 240.0
    timeout: float = 3600.0
    run_dir: str = "runs/soak"

    def run_steps(self) -> int:
        return self.steps if self.steps is not None else max(400, 10 * self.events)


@dataclass
class Fault:
    index: int
    kind: str
    step: int
    ts: float
    workers: list[str] = field(default_factory=list)
    detail: str = ""
    settled_s: float | None = None


@dataclass
class Sample:
    generation: int
    worker: str
    rss_mb: float
    fds: int
    threads: int


def _proc_sample(pid: int) -> tuple[float, int, int] | None:
    """(RSS in MiB, open file descriptors, threads) of a live process, from /proc."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, fds, int(fields["Threads"])


class Chaos:
    """The launcher's tick hook: waits for the run to settle, samples the workers, draws
    the next fault and injects it."""

    def __init__(self, opts: SoakOptions, server: BundledRedis,
                 progress: Callable[[str], None] = lambda _m: None) -> None:
        self.opts, self.server, self.say = opts, server, progress
        self.rng = random.Random(opts.seed)
        self.faults: list[Fault] = []
        self.samples: list[Sample] = []
        self.records: dict[int, dict[str, Any]] = {}
        self.stalled: str | None = None
        self._last_step = 0
        #: the step at which each worker not in the world was first seen registered
        self._standby_since: dict[str, int] = {}
        self._then: Callable[[LocalRun], bool] | None = None

    # ---- when to strike ---------------------------------------------------------------
    def _live(self, run: LocalRun) -> list[WorkerProc]:
        return [wp for wp in run.procs if wp.proc.poll() is None and wp.signalled_at is None]

    def _settled(self, run: LocalRun) -> bool:
        rec = run.record
        if rec is None or rec.kind not in ("start", "resize") or self._then is not None:
            return False
        gens = run.result.generations
        if not gens or gens[-1]["generation"] != rec.generation or "first_step_ts" not in gens[-1]:
            return False  # no step trained in this generation yet
        if any(wp.signalled_at is not None and wp.proc.poll() is None for wp in run.procs):
            return False  # a leaver, a drained or killed worker has not exited yet
        placed = set(rec.workers_by_rank()) | set(rec.idle)
        outside = [wp.worker_id for wp in self._live(run) if wp.worker_id not in placed]
        if outside and not self._standbys(run, outside):
            return False  # a joiner is not in yet
        return run.step >= self._last_step + self.opts.gap_steps

    def _standbys(self, run: LocalRun, outside: list[str | None]) -> bool:
        """Whether every worker outside the world is a standby: registered, and left out
        by the leader's boundaries for ``gap_steps`` steps since (no layout takes it in:
        the global batch fits no wider DP, or an operator's layout is in force)."""
        if None in outside:
            return False  # not registered yet
        registered = run.coord.live_members()
        for worker in outside:
            if worker not in registered:
                return False
            self._standby_since.setdefault(str(worker), run.step)
        return all(run.step >= self._standby_since[str(w)] + self.opts.gap_steps
                   for w in outside)

    def __call__(self, run: LocalRun) -> None:
        rec = record(run)
        if rec is not None:
            self.records.setdefault(int(rec["generation"]), rec)
        if self._then is not None and self._then(run):
            self._then = None
        if self.stalled or len(self.faults) >= self.opts.events:
            return
        if run.step >= self.opts.run_steps() - 2 * self.opts.gap_steps:
            return  # too close to the end for a fault to settle
        if not self._settled(run):
            last = self.faults[-1] if self.faults else None
            if last is not None and time.time() - last.ts > self.opts.settle_timeout:
                self.stalled = (f"fault {last.index} ({last.kind} at step {last.step}) had not "
                                f"settled after {self.opts.settle_timeout:g} s")
            return
        if self.faults and self.faults[-1].settled_s is None:
            self.faults[-1].settled_s = round(time.time() - self.faults[-1].ts, 2)
        self._sample(run)
        self._strike(run, self._draw(run))

    # ---- what to strike with ----------------------------------------------------------
    def _draw(self, run: LocalRun) -> str:
        live, in_world = len(self._live(run)), len(self._in_world(run))
        assert run.record is not None
        if run.record.requested and live > in_world:
            # an operator's layout keeps a joiner out until the operator lets go of it:
            # the next change hands the layout back to the policy, before the joiner's
            # wait for a place runs out
            return "resize"
        kinds = [k for k in WEIGHTS
                 if (k != "join" or live < self.opts.max_workers)
                 and in_world - DEPARTS.get(k, 0) >= self.opts.min_workers]
        return self.rng.choices(kinds, weights=[WEIGHTS[k] for k in kinds])[0]

    def _in_world(self, run: LocalRun) -> list[WorkerProc]:
        assert run.record is not None
        world = set(run.record.workers_by_rank())
        return [wp for wp in self._live(run) if wp.worker_id in world]

    def _signal(self, wp: WorkerProc, sig: int) -> str:
        wp.signalled_at = time.time()
        wp.killed = sig == signal.SIGKILL
        wp.proc.send_signal(sig)
        return str(wp.worker_id)

    def _strike(self, run: LocalRun, kind: str) -> None:
        fault = Fault(len(self.faults) + 1, kind, run.step, time.time())
        self.faults.append(fault)
        self._last_step = run.step
        rec = run.record
        assert rec is not None
        if kind == "join":
            run.spawn_joiners(1)
        elif kind in ("leave", "kill"):
            victim = self.rng.choice(self._in_world(run))
            fault.workers = [self._signal(victim, signal.SIGKILL if kind == "kill"
                                          else signal.SIGUSR2)]
        elif kind == "drain":
            victim = self.rng.choice(self._in_world(run))
            victim.signalled_at = time.time()  # it must exit before the run has settled
            fault.workers = [str(victim.worker_id)]
            run.coord.request_change(ChangeRequest(to=None, drain=(str(victim.worker_id),),
                                                   by="operator", ts=time.time(),
                                                   reason="soak: drain"))
        elif kind == "resize":
            fault.detail = "auto" if rec.requested else _other_layout(rec.world)
            run.coord.request_change(ChangeRequest(to=fault.detail, drain=(), by="operator",
                                                   ts=time.time(), reason="soak: resize"))
        elif kind == "redis_restart":
            down = round(self.rng.uniform(0.0, 1.0), 2)
            fault.detail = f"down {down} s"
            self.server.restart(down_s=down)
        elif kind == "preempt_in_migration":
            first, second = self.rng.sample(self._in_world(run), 2)
            fault.workers = [self._signal(first, signal.SIGUSR2)]
            self._then = self._preempt_when_moving(run, fault, first, second)
        self.say(f"fault {fault.index}/{self.opts.events} at step {fault.step} "
                 f"(generation {rec.generation}, world {rec.world}): {kind} "
                 f"{' '.join(fault.workers) or fault.detail}")

    def _preempt_when_moving(self, run: LocalRun, fault: Fault, first: WorkerProc,
                             second: WorkerProc) -> Callable[[LocalRun], bool]:
        """Signal ``second`` as soon as the change that lets ``first`` go is published:
        its state is then moving (the report says whether it was still moving)."""
        generation = run.record.generation if run.record else 0

        def then(run: LocalRun) -> bool:
            rec = run.record
            if rec is None or rec.generation <= generation:
                if first.proc.poll() is None:
                    return False
                fault.detail = "the first leaver was gone before a new generation was seen"
                return True
            moving = not any(int(m.get("gen") or -1) == rec.generation
                             for m in run.result.migrations)
            if second.proc.poll() is None:
                fault.workers.append(self._signal(second, signal.SIGUSR2))
            fault.detail = ("second signal during the migration of generation "
                            f"{rec.generation}" if moving else
                            f"second signal after generation {rec.generation}'s migration")
            return True

        return then

    def _sample(self, run: LocalRun) -> None:
        assert run.record is not None
        for wp in self._live(run):
            got = _proc_sample(wp.proc.pid)
            if got is not None:
                self.samples.append(Sample(run.record.generation, str(wp.worker_id), *got))


def _other_layout(world: int) -> str:
    """A layout an operator might ask for that differs from the automatic DP one: TP 2
    where the world is even, two pipeline stages on the rest where it is odd."""
    if world % 2 == 0:
        return f"tp2pp1dp{world // 2}"
    return f"tp1pp2dp{max(1, (world - 1) // 2)}"


def slopes(samples: list[Sample], warmup: int = 2, least: int = 4) -> dict[str, Any]:
    """Per worker, the least-squares slope per generation of RSS, fds and threads, after
    its first ``warmup`` samples, over the workers with at least ``least`` after it."""
    by_worker: dict[str, list[Sample]] = {}
    for s in samples:
        by_worker.setdefault(s.worker, []).append(s)
    out: dict[str, Any] = {}
    for name in ("rss_mb", "fds", "threads"):
        per = []
        for rows in by_worker.values():
            rows = rows[warmup:]
            gens = [r.generation for r in rows]
            if len(rows) >= least and len(set(gens)) > 1:
                per.append(float(np.polyfit(gens, [getattr(r, name) for r in rows], 1)[0]))
        out[name] = {"median": round(statistics.median(per), 4) if per else None,
                     "max": round(max(per), 4) if per else None, "workers": len(per)}
    return out


def samples_once(events: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Whether every step trained once, the steps a rollback re-trained counted as such."""
    trained = Counter(int(e["data"]["step"]) for e in events if e["type"] == "step")
    retrain: Counter[int] = Counter()
    for e in events:
        if e["type"] == "generation.start":
            m = _ROLLBACK.search(str(e["data"].get("reason") or ""))
            if m:
                start, lost = int(m[1]), int(m[2])
                retrain.update(range(start + 1, start + lost + 1))
    missing = [s for s in range(1, steps + 1) if trained[s] == 0]
    twice = [s for s in range(1, steps + 1) if trained[s] > 1 + retrain[s]]
    return {"ok": not missing and not twice, "missing": missing[:20], "unexplained": twice[:20],
            "retrained": sum(retrain.values()), "rollbacks": sum(
                1 for e in events if e["type"] == "generation.start"
                and _ROLLBACK.search(str(e["data"].get("reason") or "")))}


def _shm() -> set[str]:
    with contextlib.suppress(OSError):
        return set(os.listdir("/dev/shm"))
    return set()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def soak(opts: SoakOptions, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the soak; the report the benchmark prints and the test asserts on."""
    say = progress or (lambda _m: None)
    run_dir = Path(opts.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    shm_before = _shm()
    server = BundledRedis(run_dir / "redis", persist=True).start()
    chaos = Chaos(opts, server, say)
    steps = opts.run_steps()
    demo = DemoOptions(
        workers=opts.workers, model=opts.model, steps=steps, schedule="", redis=server.url,
        password_file=str(server.password_file), run_id=f"soak-{opts.seed}-{os.getpid()}",
        run_dir=str(run_dir), min_step_seconds=opts.min_step_seconds,
        global_batch=opts.global_batch, checkpoint_every=opts.checkpoint_every, timeout=opts.timeout, reference=True,
        keep_keys_s=600.0,
    )
    error, detail, result, events = None, None, None, []
    t0 = time.perf_counter()
    try:
        say(f"soak: {opts.events} faults over {steps} steps, seed {opts.seed}, "
            f"{opts.workers} workers ({opts.min_workers}..{opts.max_workers})")
        try:
            result = run_demo(demo, progress=say, on_tick=chaos)
        except EtcslurmError as exc:
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            detail = str(exc)  # a failed worker's last log lines
            if isinstance(exc, WorkerFailed):
                result = exc.result
        events = run_events(server.url, str(server.password_file), str(demo.run_id))
    finally:
        server.stop()
    wall = time.perf_counter() - t0
    time.sleep(0.5)  # the last exits reaped
    if forking():  # what the killed workers left with the shared resource tracker
        stop_template()
    pids = result.pids if result is not None else []
    records = chaos.records.values()
    missing = [int((r.get("plan_stats") or {}).get("missing_bytes") or 0) for r in records]
    recovered = sum(m for r, m in zip(records, missing, strict=True) if r.get("resume"))
    once = samples_once(events, steps)
    losses = result.losses if result is not None else {}
    return {
        "events": len(chaos.faults),
        "events_asked": opts.events,
        "kinds": dict(Counter(f.kind for f in chaos.faults)),
        "survived": error is None and result is not None and len(losses) == steps,
        "error": error,
        "error_detail": detail,
        "stalled": chaos.stalled,
        "steps": steps,
        "steps_trained": len(losses),
        "generations": len(chaos.records),
        "samples_once": once["ok"],
        "samples_detail": once,
        "max_abs_dloss": result.max_loss_diff if result is not None else None,
        "loss_match": bool(result and result.loss_match),
        "bytes_lost": sum(missing) - recovered,
        "bytes_recovered_from_checkpoint": recovered,
        **{f"{k}_per_generation": v for k, v in slopes(chaos.samples).items()},
        "leftovers": {"processes": [p for p in pids if _alive(p)],
                      "shm_segments": sorted(_shm() - shm_before)},
        "median_settle_s": statistics.median(
            [f.settled_s for f in chaos.faults if f.settled_s is not None] or [0.0]),
        "wall_s": round(wall, 1),
        "faults": [asdict(f) for f in chaos.faults],
        "seed": opts.seed,
    }
