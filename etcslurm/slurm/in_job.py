"""What a job's batch shell asks of the coordinator (``python -m etcslurm.slurm.in_job``):
``store-spec`` stores the run spec a run file's job carries, once the coordinator answers;
``linger SECONDS`` keeps a job that hosts the coordinator until the workers of the other
jobs have left an ended run.  Apart from :mod:`etcslurm.slurm.runfile`, which reads run
files on the submitting side."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from etcslurm.errors import UsageError


def store_spec(text: str) -> None:
    """Store the run spec ``text`` (JSON) in the coordinator the job's environment names."""
    import os

    from etcslurm.coord.client import connect
    from etcslurm.coord.coordinator import Coordinator

    url, run = os.environ.get("ETCSLURM_REDIS_URL"), os.environ.get("ETCSLURM_RUN")
    if not url or not run:
        raise UsageError("store-spec needs ETCSLURM_REDIS_URL and ETCSLURM_RUN")
    client = connect(url, retry_deadline=60)
    try:
        Coordinator(client, run).ensure_spec(json.loads(text))
    finally:
        client.close()


def linger(timeout: float, every: float = 0.5) -> list[str]:
    """Once the run has ended, wait (``timeout`` seconds at most) until every live member
    has left; returns those still there.  A job that hosts the run's coordinator runs this
    before it stops its server: workers of other jobs finish the last step at about the
    same time but need the coordinator a moment longer to leave.  Returns at once while
    the run goes on (a preempted job must not hold its node)."""
    import os
    import time

    from etcslurm.coord.client import connect
    from etcslurm.coord.coordinator import GONE, Coordinator

    url, run = os.environ.get("ETCSLURM_REDIS_URL"), os.environ.get("ETCSLURM_RUN")
    if not url or not run:
        raise UsageError("linger needs ETCSLURM_REDIS_URL and ETCSLURM_RUN")
    client = connect(url, retry_deadline=min(timeout, 10.0))
    try:
        coord = Coordinator(client, run)
        record = coord.current_generation()
        if record is None or record.kind != "end":
            return []
        end = time.monotonic() + timeout
        while True:
            staying = sorted(w for w, i in coord.members().items()
                             if i.get("alive") and i.get("state") != GONE)
            if not staying or time.monotonic() > end:
                return staying
            time.sleep(every)
    finally:
        client.close()


USAGE = ("usage: python -m etcslurm.slurm.in_job store-spec < SPEC.json\n"
         "       python -m etcslurm.slurm.in_job linger SECONDS\n")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    from etcslurm.errors import EtcslurmError

    try:
        if args == ["store-spec"]:
            store_spec(sys.stdin.read())
        elif len(args) == 2 and args[0] == "linger":
            try:
                seconds = float(args[1])
            except ValueError:
                raise UsageError(f"linger: SECONDS must be a number, got {args[1]!r}") from None
            staying = linger(seconds)
            if staying:
                sys.stderr.write(f"etcslurm: after {seconds:g} s, still in the run: "
                                 f"{', '.join(staying)}\n")
        else:
            sys.stderr.write(USAGE)
            return 2
    except EtcslurmError as exc:
        sys.stderr.write(f"etcslurm: {exc}\n")
        return exc.exit_code
    return 0



if __name__ == "__main__":
    sys.exit(main())
