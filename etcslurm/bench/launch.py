"""Start N local worker processes around one long-lived TCPStore; collect JSON results.

Why a launcher of our own rather than ``torchrun``: the migrate benchmark needs a set of
processes that outlives several worlds (old layout, the union that exchanges state, the
new layout) and a store that survives any of them leaving -- the same shape the runtime
gets from the coordinator.  The launcher hosts the store (workers connect as clients and
use one ``PrefixStore`` per generation), passes the configuration as a JSON file and reads
each worker's result back as JSON (never pickle).  Every wait is bounded; on timeout or a
failed worker the remaining workers are terminated by PID and the error names the worker
and the tail of its stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from etcslurm.errors import MigrationError, WaitTimeout
from etcslurm.process_start import WorkerProcess, start_worker


def launch(
    target: str,
    nprocs: int,
    config: dict[str, Any],
    *,
    timeout: float = 600.0,
    poll: Callable[[dist.Store], None] | None = None,
    env: dict[str, str] | None = None,
    threads_per_proc: int = 1,
) -> list[dict[str, Any]]:
    """Run ``target`` (``"module:function"``, called as ``fn(ctx)``) in ``nprocs`` processes.

    Returns the workers' JSON results in process order.  ``poll(store)`` is called about
    every 0.2 s while they run (the CLI shows progress from store keys).
    """
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size=nprocs + 1, is_master=True,
        timeout=timedelta(seconds=timeout), wait_for_workers=False,
    )
    with tempfile.TemporaryDirectory(prefix="etcslurm-launch-") as tmp:
        cfg_path = Path(tmp) / "config.json"
        cfg_path.write_text(json.dumps(config))
        procs: list[WorkerProcess] = []
        errs: list[Path] = []
        child_env = dict(os.environ)
        child_env.update(
            OMP_NUM_THREADS=str(threads_per_proc),
            MKL_NUM_THREADS=str(threads_per_proc),
            PYTHONWARNINGS="ignore",
            **(env or {}),
        )
        try:
            for index in range(nprocs):
                err = Path(tmp) / f"stderr{index}.txt"
                errs.append(err)
                procs.append(start_worker(
                    "etcslurm.bench.worker",
                    ["--target", target, "--index", str(index), "--nprocs", str(nprocs),
                     "--store", f"127.0.0.1:{store.port}", "--config", str(cfg_path),
                     "--result", str(Path(tmp) / f"result{index}.json")],
                    env=child_env, stdout=None, stderr=err,
                ))
            deadline = time.monotonic() + timeout
            while True:
                codes = [p.poll() for p in procs]
                failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    i = failed[0]
                    # the others are often waiting for it, or it for one of them: each
                    # stopped worker prints where it was (faulthandler on SIGTERM)
                    running = [j for j, c in enumerate(codes) if c is None]
                    _stop(procs)
                    others = "".join(f"\n--- worker {j} was at:\n{_tail(errs[j], 1200)}"
                                     for j in running)
                    raise MigrationError(
                        f"worker {i} exited with {codes[i]}: {_tail(errs[i])}{others}"
                    )
                if all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    waiting = [i for i, c in enumerate(codes) if c is None]
                    _stop(procs)  # SIGTERM: each worker prints where it was stuck
                    raise WaitTimeout(
                        f"workers {waiting} still running after {timeout:.0f} s; worker "
                        f"{waiting[0]} was at: {_tail(errs[waiting[0]])}"
                    )
                if poll is not None:
                    poll(store)
                time.sleep(0.2)
            if poll is not None:
                poll(store)
            results = []
            for index in range(nprocs):
                path = Path(tmp) / f"result{index}.json"
                results.append(json.loads(path.read_text()) if path.exists() else {})
            return results
        finally:
            _stop(procs)


def _stop(procs: list[WorkerProcess]) -> None:
    """Terminate (then kill) the workers still running, by PID."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


def _tail(path: Path, n: int = 3000) -> str:
    try:
        text = path.read_bytes().decode(errors="replace").strip()
    except OSError:
        text = ""
    lines = [_shorten(ln) for ln in text.splitlines()
             if "Warning" not in ln and "warnings.warn" not in ln]
    text = "\n".join(lines)
    return text[-n:] if text else "(no stderr)"


def _shorten(line: str, keep: int = 400) -> str:
    """A very long line (an exception listing thousands of keys) keeps its start, where
    the exception names itself, and its end: else the tail shows only the list."""
    if len(line) <= 2 * keep:
        return line
    return f"{line[:keep]} … ({len(line) - keep - keep // 2} characters) … {line[-keep // 2:]}"
