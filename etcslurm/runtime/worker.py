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

from etcslurm.errors import EtcslurmError, UsageError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m etcslurm.runtime.worker",
                                description="Run one elastic etcslurm worker.")
    env = os.environ.get
    p.add_argument("--run", default=env("ETCSLURM_RUN"), help="run id (env ETCSLURM_RUN)")
    p.add_argument("--redis", default=env("ETCSLURM_REDIS_URL"),
                   help="coordinator URL (env ETCSLURM_REDIS_URL)")
    p.add_argument("--password-file", default=env("ETCSLURM_PASSWORD_FILE"),
                   help="file with the coordinator password (env ETCSLURM_PASSWORD_FILE)")
    p.add_argument("--run-dir", default=env("ETCSLURM_RUN_DIR", "."),
                   help="where logs and checkpoints go (env ETCSLURM_RUN_DIR)")
    p.add_argument("--node", default=env("ETCSLURM_NODE") or env("SLURMD_NODENAME"),
                   help="node name (default: Slurm's node name, else the host name)")
    p.add_argument("--dead-after", type=float, default=float(env("ETCSLURM_DEAD_AFTER", "10")))
    p.add_argument("--collective-timeout", type=float,
                   default=float(env("ETCSLURM_COLLECTIVE_TIMEOUT", "10")))
    p.add_argument("--join-timeout", type=float, default=float(env("ETCSLURM_JOIN_TIMEOUT", "600")))
    p.add_argument("--staging-mb", type=float, default=float(env("ETCSLURM_STAGING_MB", "512")))
    p.add_argument("--checkpoint-dir", default=env("ETCSLURM_CHECKPOINT_DIR"))
    return p


def config_from_args(args: argparse.Namespace) -> object:
    """Build the SessionConfig from the CLI and the run spec stored in the coordinator."""
    import socket

    from etcslurm.coord.client import connect
    from etcslurm.coord.coordinator import Coordinator
    from etcslurm.core.models import GPTSpec
    from etcslurm.runtime.session import SessionConfig

    if not args.run or not args.redis:
        raise UsageError("a worker needs --run and --redis (or ETCSLURM_RUN, ETCSLURM_REDIS_URL)")
    client = connect(args.redis, args.password_file)
    spec = Coordinator(client, args.run).run_spec()
    client.close()
    if spec is None:
        raise UsageError(f"run {args.run!r} has no spec in the coordinator: start it with "
                         "`etcslurm demo` or `etcslurm submit` first")
    return SessionConfig(
        run_id=args.run,
        redis_url=args.redis,
        password_file=args.password_file,
        spec=GPTSpec.from_json(spec["model"]),
        optimizer=spec["optimizer"],
        global_batch=int(spec["global_batch"]),
        micro_batch=int(spec["micro_batch"]),
        seed=int(spec["seed"]),
        steps=int(spec["steps"]),
        lr=float(spec["lr"]),
        initial_workers=int(spec["initial_workers"]),
        gpus_per_node=int(spec["gpus_per_node"]),
        node=args.node or socket.gethostname(),
        run_dir=args.run_dir,
        staging_bytes=int(args.staging_mb * 2**20),
        dead_after=args.dead_after,
        collective_timeout=args.collective_timeout,
        join_timeout=args.join_timeout,
        checkpoint_dir=args.checkpoint_dir,
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("ETCSLURM_LOG", "WARNING"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = _parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except EtcslurmError as exc:
        sys.stderr.write(f"etcslurm worker: {exc}\n")
        return exc.exit_code
    from etcslurm.runtime.session import run_worker

    return run_worker(config)  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(main())
