"""``etcslurm grow``: submit a further job whose workers join a running elastic run.

    etcslurm grow --run r1 --nodes 2 --redis redis://:pw@host:port/0
    etcslurm grow --run r1 --nodes 4 --split            # 4 single-node jobs (array)
    etcslurm grow --run r1 --het 1x4,2x2                # het job: 1 node x 4 tasks + 2 x 2
"""

from __future__ import annotations

import argparse
import re
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "grow",
        help="add capacity to a running run (a further Slurm job whose workers join)",
        description="Submit templates/grow.sbatch (plain, array or heterogeneous job); its "
        "workers register with the run's coordinator and join at the next step boundary.",
    )
    p.add_argument("--run", required=True, help="the run id to join")
    p.add_argument("--nodes", type=int, default=1, help="nodes to add (default 1)")
    p.add_argument("--redis", default=None,
                   help="the run's coordinator URL (default: $ETCSLURM_REDIS_URL)")
    p.add_argument("--tasks-per-node", type=int, default=1, help="tasks (devices) per node")
    p.add_argument("--split", action="store_true",
                   help="one single-node job per node (array): Slurm can take each back alone")
    p.add_argument("--het", metavar="NxT,...",
                   help="heterogeneous job: NODESxTASKS per component, e.g. 1x4,2x2")
    p.add_argument("--worker-cmd", default=None, help="the joining workers' command")
    p.add_argument("--partition", default=None)
    p.add_argument("--time", default="01:00:00", help="time limit (default 01:00:00)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="any other grow.sbatch field (repeatable)")
    p.add_argument("--via", choices=("sbatch", "submitit"), default="sbatch")
    p.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    p.add_argument("--workdir", default=".", help="where the script / Submitit logs go")
    p.set_defaults(func=run)


def parse_het(spec: str) -> list[dict[str, object]]:
    from etcslurm.errors import UsageError

    comps = []
    for item in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)x(\d+)\s*", item)
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise UsageError(f"--het expects NODESxTASKS,... (e.g. 1x4,2x2), got {spec!r}")
        comps.append({"nodes": int(m.group(1)), "tasks_per_node": int(m.group(2))})
    if len(comps) < 2:
        raise UsageError("--het needs at least two components (one shape: use --nodes/--tasks-per-node)")
    return comps


def run(args: argparse.Namespace) -> int:
    from etcslurm.slurm.submission import DEFAULT_WORKER_CMD, grow
    from etcslurm.slurm.templates import parse_sets

    components = parse_het(args.het) if args.het else None
    res = grow(args.run, args.nodes, args.worker_cmd or DEFAULT_WORKER_CMD,
               redis_url=args.redis, via=args.via, tasks_per_node=args.tasks_per_node,
               split=args.split, components=components, partition=args.partition,
               time_limit=args.time, folder=args.workdir, fields=parse_sets(args.sets) or None,
               dry_run=args.dry_run)
    if args.dry_run:
        sys.stdout.write(res.script or "")
        return 0
    print(f"submitted job {res.job_id} joining run {res.run_id}")
    return 0
