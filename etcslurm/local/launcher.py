"""Local launcher behind ``etcslurm demo``: a bundled Redis, CPU worker processes, a
resize schedule applied with real signals and real new processes, and the summary.

Everything a Slurm run does happens here on one machine: workers are separate processes
that register with the coordinator; "preemption" is SIGUSR2 sent to a worker process (what
Slurm sends with ``--signal=USR2@..``); "new capacity" is new worker processes that join;
"kill" is SIGKILL (a crashed node).  The launcher never talks to workers directly: it
reads the coordinator's event stream, like the monitor.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from etcslurm import cpu_threads
from etcslurm.coord.client import connect
from etcslurm.coord.coordinator import Coordinator
from etcslurm.coord.records import GenerationRecord
from etcslurm.core.models import GPTSpec
from etcslurm.errors import EtcslurmError, UsageError, WaitTimeout
from etcslurm.groups.bounds import rendezvous_fails_within
from etcslurm.local.schedule import ScheduledEvent, active_after, parse_schedule
from etcslurm.process_start import WorkerProcess, start_worker
from etcslurm.redis_host.server import BundledRedis
from etcslurm.runtime.config import RunSettings, settled_within

#: |elastic − reference| loss tolerance: across a DP change the gradient sum runs in a
#: different order (float32), which moves losses by ~1e-6 relative; see docs/runtime.md
LOSS_TOLERANCE = 1e-4


@dataclass
class DemoOptions:
    workers: int = 4
    model: str = "gpt-tiny"
    dtype: str | None = None  # params dtype, bf16 or fp32 (None: the model's own)
    steps: int = 60
    schedule: str = "15:leave=1;30:join=2;45:leave=2"
    redis: str | None = None
    password_file: str | None = None
    run_id: str | None = None
    run_dir: str | None = None
    optimizer: str = "adam"
    global_batch: int = 12
    micro_batch: int = 1
    gpus_per_node: int = 2
    seed: int = 1234
    reference: bool = True
    dead_after: float = 10.0
    collective_timeout: float = 10.0
    timeout: float = 600.0
    keep_keys_s: float = 60.0
    staging_mb: float | None = None  # the run's staging cap (default: 512 MiB)
    min_step_seconds: float = 0.0  # pace the steps so joiners arrive in time
    checkpoint_every: int = 0  # periodic checkpoints (a lost piece rolls back to the last)
    tensorboard_dir: str | None = None  # the run's TensorBoard scalars (rank 0 writes)
    first_layout: str | None = None  # generation 0's layout (default: the policy's)
    vpp: int = 1  # model chunks per pipeline stage where pp > 1 (RunSettings.vpp)
    load: str | None = None  # a Megatron-LM checkpoint to start from (RunSettings.load)
    #: the worker program: fault tests use ``etcslurm.testing.worker`` with its arguments
    worker_module: str = "etcslurm.runtime.worker"
    worker_args: tuple[str, ...] = ()


@dataclass
class WorkerProc:
    index: int
    node: str
    proc: WorkerProcess
    log: Path
    worker_id: str | None = None
    signalled_at: float | None = None
    killed: bool = False


@dataclass
class DemoResult:
    run_id: str
    run_dir: str
    steps: int
    losses: dict[int, float] = field(default_factory=dict)
    reference_losses: dict[int, float] = field(default_factory=dict)
    generations: list[dict[str, Any]] = field(default_factory=list)
    migrations: list[dict[str, Any]] = field(default_factory=list)
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    seconds: float = 0.0
    leftover_processes: int = 0
    keys_left: int = 0
    pids: list[int] = field(default_factory=list)
    dtype: str = "float32"

    @property
    def max_loss_diff(self) -> float | None:
        common = sorted(set(self.losses) & set(self.reference_losses))
        if not common:
            return None
        return max(abs(self.losses[s] - self.reference_losses[s]) for s in common)

    @property
    def loss_match(self) -> bool | None:
        diff = self.max_loss_diff
        if diff is None:
            return None
        return diff <= LOSS_TOLERANCE and len(self.losses) == self.steps

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "run_dir": self.run_dir,
            "steps": self.steps,
            "dtype": self.dtype,
            "steps_done": len(self.losses),
            "final_loss": self.losses.get(max(self.losses)) if self.losses else None,
            "generations": self.generations,
            "migrations": self.migrations,
            "loss_match": self.loss_match,
            "max_loss_diff": self.max_loss_diff,
            "loss_tolerance": LOSS_TOLERANCE,
            "losses": [self.losses.get(s) for s in range(1, self.steps + 1)],
            "reference_losses": [self.reference_losses.get(s) for s in range(1, self.steps + 1)]
            if self.reference_losses else None,
            "exit_codes": self.exit_codes,
            "seconds": round(self.seconds, 3),
            "leftover_processes": self.leftover_processes,
        }


class LocalRun:
    """Worker processes of one run on this machine, driven by the coordinator's events."""

    def __init__(self, opts: DemoOptions, run_id: str, run_dir: Path, url: str,
                 password_file: str | None, spec: GPTSpec | None, initial: int) -> None:
        self.opts, self.run_id, self.run_dir = opts, run_id, run_dir
        self.url, self.password_file, self.spec = url, password_file, spec
        self.procs: list[WorkerProc] = []
        self.by_worker: dict[str, WorkerProc] = {}
        staging = {"staging_bytes": int(opts.staging_mb * 2**20)} if opts.staging_mb else {}
        # a run of the workers' own model: its optimizer is read from it, as its shapes are
        optimizer = {"optimizer": opts.optimizer} if spec is not None else {}
        self.settings = RunSettings(
            model=spec, **optimizer, global_batch=opts.global_batch,
            micro_batch=opts.micro_batch, seed=opts.seed, steps=opts.steps,
            initial_workers=initial, gpus_per_node=opts.gpus_per_node,
            checkpoint_every=opts.checkpoint_every, tensorboard_dir=opts.tensorboard_dir,
            first_layout=opts.first_layout, load=opts.load, vpp=opts.vpp, **staging,
        )
        self.coord = Coordinator(connect(url, password_file), run_id)
        self.coord.ensure_spec(self.settings.to_json())
        self.last_id = "0"
        self.step = 0
        self.record: GenerationRecord | None = None
        self.result = DemoResult(run_id, str(run_dir), opts.steps)
        self._joined_nodes = 0
        #: migration.progress / migration.rebuild events, for fault hooks that must strike
        #: at a given point of a migration
        self.migration_events: list[dict[str, Any]] = []

    def spawn(self, node: str) -> WorkerProc:
        index = len(self.procs)
        log = self.run_dir / f"worker-{index}.log"
        env = dict(os.environ)
        env.update(ETCSLURM_NODE=node, PYTHONUNBUFFERED="1")
        # the run's workers share this host's cores (a user's OMP_NUM_THREADS wins)
        env.setdefault("OMP_NUM_THREADS", str(cpu_threads.share(self.opts.workers)))
        argv = [
            *self.opts.worker_args,
            "--run", self.run_id, "--redis", self.url, "--run-dir", str(self.run_dir),
            "--dead-after", str(self.opts.dead_after),
            "--collective-timeout", str(self.opts.collective_timeout),
            "--min-step-seconds", str(self.opts.min_step_seconds),
        ]
        if self.password_file:
            argv += ["--password-file", str(self.password_file)]
        proc = start_worker(self.opts.worker_module, argv, env=env, stdout=log, stderr=log)
        wp = WorkerProc(index, node, proc, log)
        self.procs.append(wp)
        self.result.pids.append(proc.pid)
        return wp

    def spawn_initial(self, count: int) -> None:
        for i in range(count):
            self.spawn(f"n{i // self.opts.gpus_per_node}")

    def spawn_joiners(self, count: int) -> None:
        for k in range(count):
            self.spawn(f"j{(self._joined_nodes + k) // self.opts.gpus_per_node}")
        self._joined_nodes += count

    def _victims(self, count: int) -> list[WorkerProc]:
        """The highest-ranked workers of the current world not yet signalled."""
        if self.record is None:
            return []
        out = []
        for worker in reversed(self.record.workers_by_rank()):
            wp = self.by_worker.get(worker)
            if wp is not None and wp.signalled_at is None and wp.proc.poll() is None:
                out.append(wp)
            if len(out) == count:
                break
        return out

    def apply(self, event: ScheduledEvent) -> None:
        if event.action == "join":
            self.spawn_joiners(event.count)
            return
        victims = self._victims(event.count)
        if len(victims) < event.count:
            raise UsageError(
                f"schedule step {event.step}: {event.action}={event.count} but only "
                f"{len(victims)} workers can be picked"
            )
        for wp in victims:
            wp.signalled_at = time.time()
            if event.action == "kill":
                wp.killed = True
                wp.proc.send_signal(signal.SIGKILL)
            else:
                wp.proc.send_signal(signal.SIGUSR2)

    def poll_events(self, block_ms: int = 200) -> None:
        for ev in self.coord.read_events(self.last_id, block_ms=block_ms):
            self.last_id = ev["id"]
            data, kind = ev["data"], ev["type"]
            if kind == "worker.registered":
                pid = data.get("pid")
                for wp in self.procs:
                    if wp.proc.pid == pid:
                        wp.worker_id = ev["worker"] or data.get("worker")
                        if wp.worker_id:
                            self.by_worker[wp.worker_id] = wp
            elif kind == "step":
                self.step = max(self.step, int(data.get("step", 0)))
                self.result.losses[int(data["step"])] = float(data["loss"])
                if self.result.generations and "first_step_ts" not in self.result.generations[-1]:
                    self.result.generations[-1]["first_step_ts"] = ev["ts"]
            elif kind == "generation.start":
                latest = self.coord.current_generation()
                if latest is None or latest.kind == "end":
                    continue  # the closing record that sends waiting joiners home
                self.record = rec = latest
                self.result.generations.append({
                    "generation": rec.generation, "kind": rec.kind,
                    "from": rec.from_layout, "to": rec.to_layout, "world": rec.world,
                    "leaving": list(rec.leaving), "joining": list(rec.joining),
                    "dead": list(rec.dead), "idle": list(rec.idle),
                    "step": rec.step, "ts": ev["ts"],
                    "moved_bytes": (rec.plan_stats or {}).get("moved_bytes"),
                    "reason": rec.reason, "layout_reason": rec.layout_reason,
                })
            elif kind in ("migration.progress", "migration.rebuild"):
                self.migration_events.append(ev)
            elif kind == "migration.done":
                self.result.migrations.append({
                    k: data.get(k) for k in ("gen", "from", "to", "seconds", "moved_bytes",
                                             "local_bytes", "pause_seconds", "transfer_seconds",
                                             "rebuild_seconds", "phases")
                })
            elif kind == "worker.signal":
                for g in reversed(self.result.generations):
                    g.setdefault("signal_ts", ev["ts"])
                    break

    def alive(self) -> list[WorkerProc]:
        return [wp for wp in self.procs if wp.proc.poll() is None]

    def stop_all(self) -> None:
        for wp in self.alive():
            wp.proc.terminate()
        end = time.monotonic() + 5
        while self.alive() and time.monotonic() < end:
            time.sleep(0.05)
        for wp in self.alive():
            wp.proc.kill()
            wp.proc.wait(timeout=5)



def _tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class WorkerFailed(EtcslurmError):
    """A worker of the run exited with an error (its peers finished, stopped, or were
    stopped after the time a failure takes to settle); ``result``: what the run did."""

    def __init__(self, message: str, result: DemoResult) -> None:
        super().__init__(message)
        self.result = result


def drive(run: LocalRun, events: tuple[ScheduledEvent, ...], timeout: float,
          on_tick: Callable[[LocalRun], None] | None = None) -> None:
    """Apply the schedule as the run reaches each step; return when every worker exited."""
    pending = list(events)
    end = time.monotonic() + timeout
    # a worker that failed (not one the schedule killed): the others get the time a failure
    # takes to settle (they recover, or stop too; the launcher does not know their model
    # builds, so the notice is the rendezvous bound at the collective timeout); then the
    # run is stopped, not waited out
    ct = run.opts.collective_timeout
    grace = settled_within(run.opts.dead_after, ct, rendezvous_fails_within(ct))
    failed_at: float | None = None
    while run.alive():
        now = time.monotonic()
        if now > end:
            raise WaitTimeout(f"demo run {run.run_id} did not finish within {timeout:g} s "
                              f"(at step {run.step})")
        if failed_at is None and any(wp.proc.poll() not in (0, None) and not wp.killed
                                     for wp in run.procs):
            failed_at = now
        if failed_at is not None and now - failed_at > grace:
            run.stop_all()
            break
        run.poll_events()
        while pending and run.step >= pending[0].step and run.record is not None:
            run.apply(pending.pop(0))
        if on_tick is not None:
            on_tick(run)
    run.poll_events(block_ms=0)
    for wp in run.procs:
        code = wp.proc.returncode
        run.result.exit_codes[wp.worker_id or f"proc{wp.index}"] = code
        if code not in (0, None) and not wp.killed:
            raise WorkerFailed(
                f"worker {wp.worker_id or wp.index} exited with code {code}; last lines of "
                f"{wp.log}:\n{_tail(wp.log)}", run.result)


def reference_workers(spec: GPTSpec | None, workers: int, vpp: int = 1) -> int:
    """Workers of the never-resized reference run.

    A dense model's initial state does not depend on its TP and DP (megatron builds every
    weight from its full-size master on the CPU and keeps this rank's slice), so one
    worker trains the same curve.  A mixture-of-experts model's does: megatron seeds the
    experts per expert-parallel rank; so does a pipelined one's (a stage draws only its
    own layers' weights), and a run with ``vpp`` > 1 starts pipelined.  Those references
    start with the elastic run's own initial workers, in the same first layout, and never
    resize.
    """
    return workers if spec is None or spec.moe or vpp > 1 else 1


def _reference_run(opts: DemoOptions, run_id: str, run_dir: Path, url: str,
                   password_file: str | None, spec: GPTSpec | None, workers: int) -> LocalRun:
    """The never-resized reference of a run: its first workers, no schedule, unpaced
    (pacing only gives an elastic run's joiners time to arrive; it changes no loss)."""
    ref_dir = run_dir / "reference"
    ref_dir.mkdir(exist_ok=True)
    ref_opts = replace(opts, workers=workers, schedule="", min_step_seconds=0.0,
                       run_id=f"{run_id}-ref", run_dir=str(ref_dir))
    return LocalRun(ref_opts, f"{run_id}-ref", ref_dir, url, password_file, spec, workers)


def run_demo(opts: DemoOptions, progress: Callable[[str], None] | None = None,
             on_tick: Callable[[LocalRun], None] | None = None) -> DemoResult:
    """Run the elastic demo (and its no-resize reference) end to end."""
    say = progress or (lambda _msg: None)
    # no model: the workers' own builder names it (its shapes are read from it)
    spec = GPTSpec.parse(opts.model) if opts.model else None
    if opts.dtype is not None and spec is not None:
        spec = replace(spec, dtype=opts.dtype)
    events = parse_schedule(opts.schedule, steps=opts.steps)
    active_after(opts.workers, events)
    if opts.workers < 1:
        raise UsageError("--workers must be at least 1")
    if opts.steps < 1 or opts.global_batch < 1:
        raise UsageError(f"--steps and --global-batch must be at least 1 (got {opts.steps}, "
                         f"{opts.global_batch})")
    run_id = opts.run_id or f"demo-{int(time.time())}-{os.getpid()}"
    run_dir = Path(opts.run_dir or Path("runs") / run_id).resolve()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"run directory {run_dir} is not usable: {exc.strerror}") from None
    t0 = time.perf_counter()
    server = None
    url, pw = opts.redis, opts.password_file
    if url is None:
        server = BundledRedis(run_dir).start()
        url, pw = server.url, str(server.password_file)
        say(f"bundled Redis on {server.url} (password in {server.password_file})")
    run = ref = None
    try:
        run = LocalRun(opts, run_id, run_dir, url, pw, spec, opts.workers)
        with contextlib.suppress(OSError):
            (run_dir / "coordinator.url").write_text(url + "\n")
        run.spawn_initial(opts.workers)
        say(f"run {run_id}: {opts.workers} workers training {spec or 'their model'} for "
            f"{opts.steps} steps")
        n_ref = reference_workers(spec, opts.workers, opts.vpp)
        if opts.reference:
            ref = _reference_run(opts, run_id, run_dir, url, pw, spec, n_ref)
            # a one-worker reference trains beside the run, which mostly waits (paced
            # steps, joiners importing); a wider one after it, not to crowd the cores
            if n_ref == 1:
                ref.spawn_initial(n_ref)
        drive(run, events, opts.timeout, on_tick)
        result = run.result
        result.dtype = spec.dtype if spec is not None else "the model's"
        if ref is not None:
            say(f"reference run without resizes ({n_ref} worker{'s' if n_ref > 1 else ''})")
            if not ref.procs:
                ref.spawn_initial(n_ref)
            drive(ref, (), opts.timeout)
            result.reference_losses = ref.result.losses
            ref.coord.end_run(keep_s=opts.keep_keys_s)
        run.coord.end_run(keep_s=opts.keep_keys_s)
        result.keys_left = len(run.coord.run_keys())
        result.seconds = time.perf_counter() - t0
        (run_dir / "summary.json").write_text(json.dumps(result.to_json(), indent=1))
        return result
    finally:
        for started in (run, ref):
            if started is not None:
                started.stop_all()
        if server is not None:
            server.stop()
