"""``python -m etcslurm.runtime.worker``: one elastic worker process.

Started by ``etcslurm demo`` (local processes), by ``templates/elastic.sbatch`` through
``srun`` (one task per device) and by growth jobs.  It reads the run spec (model,
optimizer, batch, seed, steps) from the coordinator, so every worker of a run — the first
ones and later joiners — trains the same model the same way.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from etcslurm import cpu_threads
from etcslurm.errors import EtcslurmError, UsageError
from etcslurm.hooks import Hooks
from etcslurm.process_start import exit_without_teardown
from etcslurm.runtime import checkpointing
from etcslurm.runtime.config import Builder, RunSettings, WorkerOptions


def parser() -> argparse.ArgumentParser:
    """The runtime worker's flags: a worker's (:func:`worker_arguments`) and the builder."""
    p = argparse.ArgumentParser(prog="python -m etcslurm.runtime.worker",
                                description="Run one elastic etcslurm worker.")
    worker_arguments(p, workers=False)
    p.add_argument("--builder", default=os.environ.get("ETCSLURM_BUILDER"),
                   metavar="MODULE:FUNCTION",
                   help="the model builder to import (default: etcslurm's GPT of the run's "
                        "model; env ETCSLURM_BUILDER)")
    return p


def worker_arguments(p: argparse.ArgumentParser, *,
                     workers: bool = True) -> argparse.ArgumentParser:
    """Add etcslurm's worker flags to a training script's own parser (each defaults to
    the variable the sbatch template and ``etcslurm demo`` set); ``--workers``: the
    workers that start the run (the first job's tasks).  A flag the script defines
    already (``--run-dir``, say) stays the script's: its value is used."""
    env = os.environ.get
    group = p.add_argument_group("etcslurm worker")
    taken = set(p._option_string_actions)

    class _Group:
        def add_argument(self, flag: str, **kw: Any) -> None:
            if flag not in taken:
                group.add_argument(flag, **kw)

    g = _Group()
    g.add_argument("--run", default=env("ETCSLURM_RUN"), help="run id (env ETCSLURM_RUN)")
    g.add_argument("--redis", default=env("ETCSLURM_REDIS_URL"),
                   help="coordinator URL (env ETCSLURM_REDIS_URL)")
    g.add_argument("--password-file", default=env("ETCSLURM_PASSWORD_FILE"),
                   help="file with the coordinator password (env ETCSLURM_PASSWORD_FILE)")
    g.add_argument("--run-dir", default=env("ETCSLURM_RUN_DIR", "."),
                   help="where logs and checkpoints go (env ETCSLURM_RUN_DIR)")
    g.add_argument("--node", default=env("ETCSLURM_NODE") or env("SLURMD_NODENAME"),
                   help="node name (default: Slurm's node name, else the host name)")
    g.add_argument("--dead-after", type=float, default=float(env("ETCSLURM_DEAD_AFTER", "10")))
    g.add_argument("--collective-timeout", type=float,
                   default=float(env("ETCSLURM_COLLECTIVE_TIMEOUT", "10")))
    g.add_argument("--join-timeout", type=float, default=float(env("ETCSLURM_JOIN_TIMEOUT", "600")))
    g.add_argument("--checkpoint-dir", default=env("ETCSLURM_CHECKPOINT_DIR"))
    g.add_argument("--min-step-seconds", type=float,
                   default=float(env("ETCSLURM_MIN_STEP_SECONDS", "0") or 0),
                   help="make each step last at least this long (demos: joiners get time "
                        "to arrive); losses and data order are unchanged")
    if workers:
        g.add_argument("--workers", type=int,
                       default=int(env("ETCSLURM_WORKERS") or env("SLURM_NTASKS") or 1),
                       help="workers that start the run (env ETCSLURM_WORKERS, else the "
                            "job's tasks)")
    return p


def worker_options(args: argparse.Namespace) -> WorkerOptions:
    """This worker's options from the flags :func:`worker_arguments` added."""
    import socket

    if not args.run or not args.redis:
        raise UsageError("a worker needs --run and --redis (or ETCSLURM_RUN, ETCSLURM_REDIS_URL)")
    return WorkerOptions(
        run_id=args.run,
        redis_url=args.redis,
        password_file=args.password_file,
        node=args.node or socket.gethostname(),
        run_dir=args.run_dir,
        dead_after=args.dead_after,
        collective_timeout=args.collective_timeout,
        join_timeout=args.join_timeout,
        checkpoint_dir=args.checkpoint_dir,
        min_step_seconds=args.min_step_seconds,
    )


def config_from_args(args: argparse.Namespace) -> tuple[RunSettings, WorkerOptions]:
    """The run settings stored in the coordinator, and this worker's options."""
    from etcslurm.coord.client import connect
    from etcslurm.coord.coordinator import Coordinator

    options = worker_options(args)
    client = connect(args.redis, args.password_file)
    spec = Coordinator(client, args.run).run_spec()
    client.close()
    if spec is None:
        raise UsageError(f"run {args.run!r} has no spec in the coordinator: start it with "
                         "`etcslurm demo` or `etcslurm submit` first")
    return RunSettings.from_json(spec), options


def gpu_problem() -> str | None:
    """One line when this task was given GPUs that its torch cannot use (a CPU build on
    a GPU node would otherwise train on the CPU unnoticed), else None."""
    import torch

    from etcslurm.groups.devices import cpu_torch_problem

    return cpu_torch_problem(os.environ, torch.cuda.is_available(), torch.version.cuda,
                             torch.__version__)


def import_builder(target: str) -> Builder:
    """``module:function`` → the builder it names (a one-line error otherwise)."""
    import importlib

    module, _, name = target.partition(":")
    if not module or not name:
        raise UsageError(f"--builder expects module:function, got {target!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"cannot import the builder {target!r}: {exc}") from None


def main(argv: list[str] | None = None, hooks: Hooks | None = None,
         build: Builder | None = None,
         train_step: Callable[[Any], float] | None = None) -> int:
    """Run one worker; ``build``: the model builder (default: ``--builder``, else
    etcslurm's GPT of the run's model), ``train_step`` (default: etcslurm's),
    ``hooks``: test injection points (``etcslurm.testing.worker``)."""
    logging.basicConfig(level=os.environ.get("ETCSLURM_LOG", "WARNING"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parser().parse_args(argv)
    cpu_threads.apply()  # before torch's import starts its threads
    problem = gpu_problem()  # before connecting to anything
    if problem:
        sys.stderr.write(f"etcslurm worker: {problem}\n")
        return UsageError.exit_code
    try:
        if build is None and args.builder:
            build = import_builder(args.builder)
        settings, options = config_from_args(args)
        # a checkpoint directory the worker cannot use is the user's to fix: say so before
        # the seconds of megatron-core's import, not after them
        checkpointing.pointer(options)
    except EtcslurmError as exc:
        sys.stderr.write(f"etcslurm worker: {exc}\n")
        return exc.exit_code
    from etcslurm.runtime.session import run_worker

    return run_worker(settings, options, train_step=train_step, build=build, hooks=hooks)


if __name__ == "__main__":
    exit_without_teardown(main())
