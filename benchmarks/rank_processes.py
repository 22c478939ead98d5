"""Start one benchmark process per rank and collect what each one reports.

The multi-process benchmarks (``checkpoint_cost.py``, ``step_overhead.py``) run their own
script again as ``--child RANK``; each child writes ``rank<RANK>.json`` into the result
folder.  This is the one implementation of starting them, waiting (bounded) and
cleaning up, so a benchmark that fails names why instead of hanging.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def add_child_arguments(ap: argparse.ArgumentParser) -> None:
    """The hidden flags :func:`run_rank_processes` and the parent pass to each child: its
    rank, the run's coordinator URL, run id and result folder."""
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--redis", help=argparse.SUPPRESS)
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)


def run_rank_processes(argv: Sequence[str], world: int, result_dir: str | Path,
                       timeout: float, preexec_fn: Callable[[], None] | None = None,
                       ) -> list[dict[str, Any]]:
    """Run ``argv + ["--child", r]`` for every rank ``r`` (one thread each, warnings off)
    and return each rank's ``rank<r>.json``.  A process that exits non-zero, or a run
    longer than ``timeout`` seconds, ends the benchmark with a one-line message; every
    process still running then is killed."""
    import time

    env = dict(os.environ, OMP_NUM_THREADS="1", ETCSLURM_LOG="ERROR", PYTHONWARNINGS="ignore")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(world):
            procs.append(subprocess.Popen([*argv, "--child", str(rank)], env=env,
                                          preexec_fn=preexec_fn))
        end = time.monotonic() + timeout
        for p in procs:
            try:
                rc = p.wait(timeout=max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise SystemExit(f"the workers did not finish within {timeout:.0f} s "
                                 "(--timeout)") from None
            if rc != 0:
                raise SystemExit(f"a worker process failed (exit {rc})")
        return [json.loads(Path(result_dir, f"rank{r}.json").read_text()) for r in range(world)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
