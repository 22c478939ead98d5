"""etcslurm vs torchft, side by side in one run: a DP shrink and a DP grow of the same job.

The job: N data-parallel replicas (default 4), one CPU process each, gloo; N → N−1 → N.
Both frameworks train the same shapes with the same optimizer (AdamW, lr 1e-3, betas
0.9/0.95, weight decay 0.01, grad clip 1.0), steps paced to the same length:

* **etcslurm** (``etcslurm demo``'s launcher): a megatron-core GPT; at step ``--leave-at``
  the highest rank gets SIGUSR2 (Slurm's preemption signal) and leaves at the step
  boundary; at step ``--join-at`` a new worker process starts and joins at a boundary,
  its state sent peer to peer.
* **torchft** 0.2.0 (``pip install -e '.[peers]'``): a plain torch GPT with exactly the
  same tensors (``peers_torchft.py``), each replica its own replica group under torchft's
  ``Manager`` (lighthouse process, ``ProcessGroupGloo``, torchft's DDP and optimizer
  wrapper, the default HTTP checkpoint transport for a joiner's state).  The same
  SIGUSR2 at the same step makes a replica finish its step, shut its Manager down and
  exit; at the same step a new replica process starts and heals from a peer.

Measured on both, from step completion times (a survivor's: etcslurm's rank 0, torchft's
replica 0):

* **pause** of the survivors at a shrink and at a grow: the longest gap between two
  consecutive step completions from the event (the leave signal; the joiner's arrival)
  until one step after the first step in the new world, minus the run's median step gap (``excess`` in the JSON: the sum of every
  gap of that window beyond the median and its jitter);
* **joiner**: from its process start (and from its arrival: etcslurm's
  ``worker.registered``, torchft's Manager built and heartbeating) to its first
  completed step, and the bytes of state it received.

The torchft lighthouse notices a replica that left only when its heartbeats stop for
``heartbeat_timeout_ms`` (it has no leave message): the torchft side runs once per value of
``--tf-heartbeat-ms`` (default: torchft's own 5000 and a tuned 1000).

    python benchmarks/peers.py [--model gpt-tiny] [--workers 4] [--repeat 1]
                               [--json [FILE]] [--write-results]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

from etcslurm.coord.client import connect
from etcslurm.coord.coordinator import Coordinator
from etcslurm.core.models import GPTSpec
from etcslurm.errors import UsageError
from etcslurm.local.launcher import DemoOptions, LocalRun, run_demo
from etcslurm.redis_host.server import BundledRedis

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: megatron pads the vocabulary to a multiple of 128 × this (etcslurm.megatron.model)
VOCAB_TP_MULTIPLE = 8
#: gaps this much above the median still count as jitter, not a pause
MIN_JITTER_S = 0.02


# ---------------------------------------------------------------------------- measures
@dataclass
class Timeline:
    """What one framework's run produced, in unix seconds."""

    framework: str
    steps: list[float]  # a survivor's step completions, in order
    leave_t: float  # the leave signal was sent
    shrunk_t: float  # first step completed in the smaller world
    join_t: float  # the joiner's process started
    arrival_t: float  # the joiner registered / built its Manager
    joined_t: float  # the joiner's first completed step
    joiner_bytes: int | None
    extra: dict[str, Any] = field(default_factory=dict)


def _window(times: list[float], start: float, end: float) -> list[int]:
    """Indices j of the gaps (times[j-1], times[j]) that end after ``start`` and begin no
    later than ``end`` (so the gap right after ``end`` counts too)."""
    return [j for j in range(1, len(times)) if times[j] > start and times[j - 1] <= end]


def measure(tl: Timeline, skip: int = 2) -> dict[str, Any]:
    """Pauses and joiner times of one run (see the module docstring)."""
    t = tl.steps
    shrink = _window(t, tl.leave_t, tl.shrunk_t)
    # from the arrival: before it the joiner is only importing (its CPU use shows in the
    # steps of both frameworks alike, it is no pause of theirs)
    grow = _window(t, tl.arrival_t, tl.joined_t)
    # the pauses are one or two gaps among dozens: the median of them all is the step
    steady = [t[j] - t[j - 1] for j in range(1 + skip, len(t))]
    if len(steady) < 5 or not shrink or not grow:
        raise RuntimeError(f"{tl.framework}: too few steps around the events to measure "
                           f"({len(t)} steps)")
    med = statistics.median(steady)
    mad = statistics.median(abs(g - med) for g in steady)
    jitter = max(MIN_JITTER_S, 3 * 1.4826 * mad)

    def pause(js: list[int]) -> dict[str, float]:
        gaps = [t[j] - t[j - 1] for j in js]
        return {"pause_s": max(gaps) - med,
                "excess_s": sum(g - med for g in gaps if g - med > jitter),
                "gaps_s": gaps}

    return {
        "step_s": med,
        "jitter_s": jitter,
        "shrink": pause(shrink),
        "grow": pause(grow),
        "joiner_start_s": tl.joined_t - tl.join_t,
        "joiner_arrival_s": tl.joined_t - tl.arrival_t,
        "joiner_start_to_arrival_s": tl.arrival_t - tl.join_t,
        "joiner_bytes": tl.joiner_bytes,
        **tl.extra,
    }


# ---------------------------------------------------------------------------- model
def model_shape(spec: GPTSpec) -> tuple[int, int, int, int, int, int]:
    """(layers, hidden, heads, ffn, vocab rows, seq) of a GPT-family spec that the plain
    torch model of ``peers_torchft.py`` reproduces tensor for tensor."""
    plain = GPTSpec(layers=spec.layers, hidden=spec.hidden, heads=spec.heads, ffn=spec.ffn,
                    vocab=spec.vocab, seq=spec.seq)
    if spec != plain or spec.moe:
        raise UsageError(f"--model {spec}: the torchft side builds a GPT-2 style model only "
                         "(learned positions, LayerNorm, GELU, biases, tied output, fp32, "
                         "dense); give such a spec, e.g. gpt-tiny or layers=..,hidden=..")
    return (spec.layers, spec.hidden, spec.heads, spec.ffn,
            spec.padded_vocab(VOCAB_TP_MULTIPLE), spec.seq)


# ---------------------------------------------------------------------------- etcslurm
class EventLog(threading.Thread):
    """Every event of one run, read beside the launcher (as the monitor reads them)."""

    def __init__(self, url: str, password_file: str | None, run_id: str) -> None:
        super().__init__(daemon=True)
        self.coord = Coordinator(connect(url, password_file), run_id)
        self.events: list[dict[str, Any]] = []
        self.done = threading.Event()

    def run(self) -> None:
        last = "0"
        while True:
            stopping = self.done.is_set()
            for ev in self.coord.read_events(last, block_ms=200):
                last = ev["id"]
                self.events.append(ev)
            if stopping:
                return


def etcslurm_run(args: argparse.Namespace, url: str, pw: str | None, run_dir: Path) -> Timeline:
    run_id = f"peers-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
    n = args.workers
    started: dict[int, float] = {}
    signalled: dict[int, float] = {}
    events = EventLog(url, pw, run_id)
    stop = {"at": None}

    def on_tick(run: LocalRun) -> None:
        for wp in run.procs:
            pid = wp.proc.pid
            if pid not in started:
                try:
                    started[pid] = psutil.Process(pid).create_time()
                except psutil.Error:
                    started[pid] = time.time()
            if wp.signalled_at is not None and not wp.killed:
                signalled.setdefault(pid, wp.signalled_at)
        # the run's step budget is only a cap: once the joiner has trained its steps the
        # bench has its numbers and stops the workers
        grown = [g["generation"] for g in run.result.generations if g.get("joining")
                 and g["kind"] == "resize"]
        if grown and stop["at"] is None:
            after = [ev for ev in list(events.events) if ev["type"] == "step"
                     and ev["data"].get("gen") == grown[-1]]
            if len(after) >= args.after:
                stop["at"] = time.time()
                for wp in run.alive():
                    wp.killed = True
                    wp.proc.kill()

    opts = DemoOptions(model=args.model, workers=n, steps=args.join_at + args.cap_steps,
                       schedule=f"{args.leave_at}:leave=1;{args.join_at}:join=1",
                       redis=url, password_file=pw, run_id=run_id, run_dir=str(run_dir),
                       reference=False, global_batch=args.global_batch,
                       min_step_seconds=args.min_step, keep_keys_s=5, timeout=args.timeout)
    events.start()
    try:
        result = run_demo(opts, on_tick=on_tick)
    finally:
        events.done.set()
        events.join(timeout=10)
    evs = events.events
    gens = result.generations
    shrink_gen = next(g for g in gens if g.get("leaving"))["generation"]
    grow = next(g for g in gens if g.get("joining") and g["kind"] == "resize")
    steps = [ev for ev in evs if ev["type"] == "step"]
    first_in = {}
    for ev in steps:
        first_in.setdefault(ev["data"].get("gen"), float(ev["ts"]))
    joiner_pid = result.pids[n]
    registered = next(float(ev["ts"]) for ev in evs if ev["type"] == "worker.registered"
                      and ev["data"].get("pid") == joiner_pid)
    done = {m["gen"]: m for m in result.migrations}
    leaver = next(iter(signalled.values()))
    return Timeline(
        framework="etcslurm",
        steps=[float(ev["ts"]) for ev in steps],
        leave_t=leaver,
        shrunk_t=first_in[shrink_gen],
        join_t=started[joiner_pid],
        arrival_t=registered,
        joined_t=first_in[grow["generation"]],
        joiner_bytes=done.get(grow["generation"], {}).get("moved_bytes"),
        extra={"own_pause_s": {"shrink": done.get(shrink_gen, {}).get("pause_seconds"),
                               "grow": done.get(grow["generation"], {}).get("pause_seconds")},
               "phases": {"shrink": done.get(shrink_gen, {}).get("phases"),
                          "grow": done.get(grow["generation"], {}).get("phases")},
               "run_dir": str(run_dir)},
    )


# ---------------------------------------------------------------------------- torchft
def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return out


def _tail(path: Path, lines: int = 10) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def lighthouse_command() -> list[str]:
    exe = Path(sys.executable).parent / "torchft_lighthouse"
    found = str(exe) if exe.exists() else shutil.which("torchft_lighthouse")
    if found is None:
        raise UsageError("torchft_lighthouse not found: pip install -e '.[peers]'")
    return [found]


class TorchftJob:
    """A lighthouse and one process per replica, driven by the replicas' step logs."""

    def __init__(self, args: argparse.Namespace, shape: tuple[int, ...], hb_ms: int,
                 run_dir: Path) -> None:
        self.args, self.shape, self.hb_ms, self.dir = args, shape, hb_ms, run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.stop_file = run_dir / "stop"
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.started: dict[int, float] = {}
        self.lighthouse: subprocess.Popen[bytes] | None = None
        self.killed: set[int] = set()
        self.address = ""

    def start_lighthouse(self) -> None:
        log = self.dir / "lighthouse.log"
        cmd = [*lighthouse_command(), "--bind", "[::]:0",
               "--min_replicas", str(max(1, self.args.workers - 1)),
               "--heartbeat_timeout_ms", str(self.hb_ms)]
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "info")}
        with log.open("wb") as fh:
            self.lighthouse = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, env=env)
        end = time.monotonic() + 30
        while time.monotonic() < end:
            m = re.search(r"Lighthouse listening on: (\S+)", log.read_text(errors="replace"))
            if m:
                self.address = m.group(1)
                return
            if self.lighthouse.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"the torchft lighthouse did not start:\n{_tail(log)}")

    def spawn(self, replica: int) -> None:
        a = self.args
        cmd = [sys.executable, str(HERE / "peers_torchft.py"), "--replica", str(replica),
               "--lighthouse", self.address, "--log", str(self.log(replica)),
               "--stop-file", str(self.stop_file), "--shape", ",".join(map(str, self.shape)),
               "--batch", str(max(1, a.global_batch // a.workers)),
               "--min-step-seconds", str(a.min_step), "--min-replicas", "1",
               "--grads", a.tf_grads]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with (self.dir / f"replica-{replica}.out").open("wb") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env)
        try:
            self.started[replica] = psutil.Process(proc.pid).create_time()
        except psutil.Error:
            self.started[replica] = time.time()
        self.procs[replica] = proc

    def log(self, replica: int) -> Path:
        return self.dir / f"replica-{replica}.jsonl"

    def steps(self, replica: int) -> list[dict[str, Any]]:
        return [e for e in _read_jsonl(self.log(replica)) if e["ev"] == "step" and e["committed"]]

    def wait(self, what: str, cond: Any, deadline: float) -> Any:
        while True:
            got = cond()
            if got:
                return got
            for i, p in self.procs.items():
                if p.poll() not in (None, 0) and i not in self.killed:
                    raise RuntimeError(f"torchft replica {i} exited with {p.returncode} "
                                       f"waiting for {what}:\n{_tail(self.dir / f'replica-{i}.out')}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"torchft run: timed out waiting for {what}")
            time.sleep(0.05)

    def run(self) -> Timeline:
        a, n = self.args, self.args.workers
        deadline = time.monotonic() + a.timeout
        self.start_lighthouse()
        for i in range(n):
            self.spawn(i)

        def full_since() -> int | None:  # replica 0's step when all n first took part
            return next((s["step"] for s in self.steps(0) if s["participants"] == n), None)

        base = self.wait(f"{n} replicas in the quorum", full_since, deadline)
        self.wait(f"step {a.leave_at}", lambda: any(
            s["step"] >= base + a.leave_at for s in self.steps(0)), deadline)
        leave_t = time.time()
        if a.tf_leave == "kill":
            self.killed.add(n - 1)
        self.procs[n - 1].send_signal(
            signal.SIGKILL if a.tf_leave == "kill" else signal.SIGUSR2)
        shrunk = self.wait("the smaller quorum", lambda: next(
            (s for s in self.steps(0) if s["t"] > leave_t and s["participants"] == n - 1), None),
            deadline)
        self.wait(f"step {a.join_at}", lambda: any(
            s["step"] >= base + a.join_at for s in self.steps(0)), deadline)
        self.spawn(n)
        self.wait(f"{a.after} steps of the joiner",
                  lambda: len(self.steps(n)) >= a.after, deadline)
        self.stop_file.write_text(str(max(s["step"] for s in self.steps(0)) + 2))
        for i, p in self.procs.items():
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as exc:
                raise RuntimeError(f"torchft replica {i} did not stop") from exc
        joiner = _read_jsonl(self.log(n))
        arrival = next(e["t"] for e in joiner if e["ev"] == "manager")
        heal = next((e for e in joiner if e["ev"] == "heal"), {})
        first = self.steps(n)[0]
        return Timeline(
            framework=f"torchft hb {self.hb_ms} ms"
                      + (", SIGKILL" if a.tf_leave == "kill" else "")
                      + (", allreduce" if a.tf_grads == "allreduce" else ""),
            steps=[s["t"] for s in self.steps(0) if s["step"] >= base],
            leave_t=leave_t,
            shrunk_t=shrunk["t"],
            join_t=self.started[n],
            arrival_t=arrival,
            joined_t=first["t"],
            joiner_bytes=heal.get("bytes"),
            extra={"heartbeat_timeout_ms": self.hb_ms, "run_dir": str(self.dir),
                   "params": next((e.get("params") for e in joiner if e["ev"] == "manager"),
                                  None),
                   "joiner_healed_at_step": first["step"]},
        )

    def close(self) -> None:
        for p in self.procs.values():
            _stop(p)
        if self.lighthouse is not None:
            _stop(self.lighthouse)


def torchft_run(args: argparse.Namespace, shape: tuple[int, ...], hb_ms: int,
                run_dir: Path) -> Timeline:
    job = TorchftJob(args, shape, hb_ms, run_dir)
    try:
        return job.run()
    finally:
        job.close()


# ---------------------------------------------------------------------------- report
METRICS = (  # (row title, key path in measure()'s dict)
    ("shrink pause (s)", ("shrink", "pause_s")),
    ("grow pause (s)", ("grow", "pause_s")),
    ("joiner: start → first step (s)", ("joiner_start_s",)),
    ("joiner: arrival → first step (s)", ("joiner_arrival_s",)),
    ("joiner: start → arrival (s)", ("joiner_start_to_arrival_s",)),
    ("state sent to the joiner (MiB)", ("joiner_bytes",)),
    ("median step (s)", ("step_s",)),
    ("etcslurm's own shrink pause (s)", ("own_pause_s", "shrink")),
    ("etcslurm's own grow pause (s)", ("own_pause_s", "grow")),
    ("load average (1 min) at its start", ("load_start",)),
    ("load average (1 min) at its end", ("load_end",)),
)
#: rows that get a torchft ÷ etcslurm ratio
RATIO_ROWS = {"shrink pause (s)", "grow pause (s)", "joiner: start → first step (s)",
              "joiner: arrival → first step (s)"}


def _get(m: dict[str, Any], path: tuple[str, ...]) -> float | None:
    v: Any = m
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    if v is None:
        return None
    return float(v) / 2**20 if path == ("joiner_bytes",) else float(v)


def summarize(measures: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per framework and metric: the median over repeats, with min and max."""
    out: dict[str, dict[str, Any]] = {}
    for fw, ms in measures.items():
        out[fw] = {}
        for title, path in METRICS:
            vals = [v for v in (_get(m, path) for m in ms) if v is not None]
            out[fw][title] = ({"median": statistics.median(vals), "min": min(vals),
                               "max": max(vals), "n": len(vals)} if vals else None)
    return out


def _fmt(cell: dict[str, Any] | None, title: str) -> str:
    if cell is None:
        return "–"
    digits = 2 if "MiB" in title else 1 if "load" in title else 3
    text = f"{cell['median']:.{digits}f}"
    if cell["n"] > 1:
        text += f" ({cell['min']:.{digits}f}–{cell['max']:.{digits}f})"
    return text


def _ratio(r: float) -> str:
    return f"{r:.2f}×" if r < 1 else f"{r:.1f}×"


def table(summary: dict[str, dict[str, Any]], caption: str) -> Table:
    fws = list(summary)
    base = fws[0]
    t = Table(title=caption)
    t.add_column("metric")
    t.add_column(base, justify="right")
    for fw in fws[1:]:
        t.add_column(fw, justify="right")
        t.add_column(f"÷ {base}", justify="right")
    for title, _ in METRICS:
        row = [title, _fmt(summary[base][title], title)]
        for fw in fws[1:]:
            row.append(_fmt(summary[fw][title], title))
            a, b = summary[fw][title], summary[base][title]
            ok = title in RATIO_ROWS and a and b and b["median"] > 0
            row.append(_ratio(a["median"] / b["median"]) if ok else "")
        t.add_row(*row)
    return t


def markdown(summary: dict[str, dict[str, Any]]) -> str:
    fws = list(summary)
    base = fws[0]
    head = ["metric", base]
    for fw in fws[1:]:
        head += [fw, f"÷ {base}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for title, _ in METRICS:
        row = [title, _fmt(summary[base][title], title)]
        for fw in fws[1:]:
            row.append(_fmt(summary[fw][title], title))
            a, b = summary[fw][title], summary[base][title]
            ok = title in RATIO_ROWS and a and b and b["median"] > 0
            row.append(_ratio(a["median"] / b["median"]) if ok else "")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    mem = 0
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    return {"uname": " ".join(platform.uname()), "cpus": os.cpu_count(),
            "ram_gib": round(mem / 2**30, 1)}


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "megatron-core", "torchft"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_results(report: dict[str, Any], md_table: str, caption: str) -> Path:
    out = ROOT / "docs" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_text(json.dumps(report, indent=1) + "\n")
    m, load = report["machine"], report["load_avg"]
    text = "\n".join([
        "# etcslurm vs torchft: DP shrink and grow, side by side",
        "",
        "Written by `benchmarks/peers.py --write-results`; what is measured and how the two "
        "setups differ: [docs/peers.md](../peers.md).  Raw numbers: [peers.json](peers.json).",
        "",
        f"- command: `{report['command']}`",
        f"- commit: `{report['commit']}`",
        f"- date: {report['date']}",
        f"- machine: `{m['uname']}`, {m['cpus']} CPUs, {m['ram_gib']} GiB RAM; load average "
        f"{load['before'][0]:.1f} before, {load['after'][0]:.1f} after (1 min)",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
        "",
        f"{caption}.  Medians over {report['repeat']} repeat(s) (min–max when more than one); "
        "ratios are torchft ÷ etcslurm of the medians.",
        "",
        md_table,
        "",
    ])
    (out / "peers.md").write_text(text)
    return out / "peers.md"


# ---------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-tiny", help="a GPT-2 style preset or spec")
    ap.add_argument("--workers", type=int, default=4, help="DP replicas at the start")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--min-step", type=float, default=0.3,
                    help="pace every step to at least this long (s), both frameworks")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads per process (OMP_NUM_THREADS), both frameworks: "
                         "more than cores ÷ processes oversubscribes the CPUs")
    ap.add_argument("--global-batch", type=int, default=12,
                    help="etcslurm's global batch; torchft replicas take this ÷ workers each")
    ap.add_argument("--leave-at", type=int, default=6, help="step of the leave signal")
    ap.add_argument("--join-at", type=int, default=14, help="step the joiner starts at")
    ap.add_argument("--after", type=int, default=5, help="steps the joiner trains, then stop")
    ap.add_argument("--cap-steps", type=int, default=600,
                    help="etcslurm's step budget after --join-at (a cap: the bench stops "
                         "the run once the joiner has trained --after steps)")
    ap.add_argument("--tf-heartbeat-ms", default="5000,1000",
                    help="torchft lighthouse heartbeat timeouts, one torchft run each")
    ap.add_argument("--tf-leave", choices=("exit", "kill"), default="exit",
                    help="how a torchft replica leaves: SIGUSR2, it exits at the step "
                         "boundary (as etcslurm's) or SIGKILL mid-step")
    ap.add_argument("--tf-grads", choices=("ddp", "allreduce"), default="ddp",
                    help="torchft's DDP wrapper (as its train_ddp.py) or one Manager.allreduce "
                         "of the flattened gradients (with --tf-leave kill: torchft 0.2.0's "
                         "DDP comm hook fails an assertion on the survivors when a peer dies "
                         "mid all-reduce)")
    ap.add_argument("--only", choices=("etcslurm", "torchft"),
                    help="run one side only (no ratios)")
    ap.add_argument("--timeout", type=float, default=600, help="per run (s)")
    ap.add_argument("--run-dir", help="keep every run's logs here")
    ap.add_argument("--redis", metavar="URL",
                    help="etcslurm's coordinator (default: a bundled Redis of its own)")
    ap.add_argument("--json", nargs="?", const="-", metavar="FILE",
                    help="write the raw numbers as JSON (to stdout without FILE)")
    ap.add_argument("--write-results", action="store_true",
                    help="write docs/results/peers.md and peers.json")
    args = ap.parse_args(argv)
    if args.workers < 2:
        raise UsageError("--workers must be at least 2 (one leaves)")
    if not 0 < args.leave_at < args.join_at:
        raise UsageError("need 0 < --leave-at < --join-at")
    args.hb = [int(x) for x in str(args.tf_heartbeat_ms).split(",") if x.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(stderr=args.json == "-", width=160)
    spec = GPTSpec.parse(args.model)
    shape = model_shape(spec)
    params = spec.num_params(VOCAB_TP_MULTIPLE)
    if args.only != "etcslurm":
        lighthouse_command()  # fail early without the extra
    # the workers of both sides inherit it (etcslurm's launcher copies this environment)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    load_before = os.getloadavg()
    measures: dict[str, list[dict[str, Any]]] = {}
    timelines: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        runs = Path(args.run_dir).resolve() if args.run_dir else Path(tmp)
        with contextlib.ExitStack() as stack:
            url, pw = args.redis, None
            if url is None:
                server = stack.enter_context(BundledRedis(Path(tmp) / "redis"))
                url, pw = server.url, str(server.password_file)
            for r in range(args.repeat):
                todo: list[tuple[str, Any]] = []
                if args.only != "torchft":
                    todo.append(("etcslurm", lambda d: etcslurm_run(args, url, pw, d)))
                if args.only != "etcslurm":
                    for hb in args.hb:
                        todo.append((f"torchft-hb{hb}", lambda d, hb=hb: torchft_run(
                            args, shape, hb, d)))
                for name, fn in todo:
                    console.print(f"[dim]repeat {r + 1}/{args.repeat}: {name}[/dim]")
                    load = os.getloadavg()[0]
                    tl = fn(runs / f"{name}-{r}")
                    tl.extra.update(load_start=load, load_end=os.getloadavg()[0])
                    m = measure(tl)
                    measures.setdefault(tl.framework, []).append(m)
                    timelines.append({"repeat": r, **asdict(tl)})
                    console.print(f"[dim]  shrink pause {m['shrink']['pause_s']:.3f} s, grow "
                                  f"pause {m['grow']['pause_s']:.3f} s, joiner "
                                  f"{m['joiner_start_s']:.2f} s from start; load "
                                  f"{load:.1f} → {os.getloadavg()[0]:.1f}[/dim]")
    load_after = os.getloadavg()
    summary = summarize(measures)
    n = args.workers
    caption = (f"{spec} ({params:,} params, fp32, AdamW), {n} → {n - 1} → {n} DP replicas, "
               f"1 CPU process each, gloo, steps paced to ≥ {args.min_step:g} s")
    console.print(table(summary, caption))
    tf_params = {m.get("params") for fw, ms in measures.items() if fw != "etcslurm" for m in ms}
    if tf_params - {params, None}:
        console.print(f"[red]torchft model has {tf_params} params, etcslurm {params}[/red]")
    report = {
        "command": "python " + " ".join([os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
        "commit": git_commit(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "versions": versions(),
        "load_avg": {"before": load_before, "after": load_after},
        "repeat": args.repeat,
        "model": str(spec),
        "params": params,
        "torchft_params": sorted(p for p in tf_params if p is not None),
        # not the Redis URL: it carries the coordinator's password
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "redis")},
        "summary": summary,
        "measures": measures,
        "timelines": timelines,
    }
    if args.json:
        text = json.dumps(report, indent=1, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    if args.write_results:
        path = write_results(report, markdown(summary), caption)
        console.print(f"wrote {path.relative_to(ROOT)}")
    bad = [v for ms in measures.values() for m in ms
           for v in (m["shrink"]["pause_s"], m["grow"]["pause_s"]) if not math.isfinite(v)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
