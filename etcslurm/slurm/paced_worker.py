"""``python -m etcslurm.slurm.paced_worker``: the real elastic worker, each step lasting at
least ``--min-step-seconds``.

Cluster tests (and demos on a real cluster) act on a *running* run: preempt a node at
step 2, add a job that joins later.  A tiny model on idle CPUs trains a step in ~0.1 s, so
the whole run would be over before Slurm (30 s timer) or a new job's imports (~10 s)
could take part.  Pacing keeps the run alive without changing what it computes: the
pause is taken inside the step, after the optimizer update, so losses, data order and
every resize path are those of ``python -m etcslurm.runtime.worker``; a leave signal
that arrives during the pause is handled at the boundary that follows.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from etcslurm.errors import EtcslurmError


def main(argv: list[str] | None = None) -> int:
    """Parse the worker's own options plus ``--min-step-seconds``; run the worker."""
    from etcslurm.megatron.train import train_step
    from etcslurm.runtime.session import run_worker
    from etcslurm.runtime.worker import _parser, config_from_args

    logging.basicConfig(level=os.environ.get("ETCSLURM_LOG", "WARNING"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parser = _parser()
    parser.prog = "python -m etcslurm.slurm.paced_worker"
    parser.add_argument("--min-step-seconds", type=float,
                        default=float(os.environ.get("ETCSLURM_MIN_STEP_SECONDS", "0")),
                        help="each training step lasts at least this long (env ETCSLURM_MIN_STEP_SECONDS)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = config_from_args(args)
    except EtcslurmError as exc:
        sys.stderr.write(f"etcslurm worker: {exc}\n")
        return exc.exit_code
    pace = max(0.0, args.min_step_seconds)

    def paced_step(trainee: Any) -> float:
        started = time.monotonic()
        loss = train_step(trainee)
        time.sleep(max(0.0, pace - (time.monotonic() - started)))
        return loss

    return run_worker(config, train_step=paced_step)  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(main())
