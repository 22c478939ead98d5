"""``etcslurm grow``: submit a further job whose workers join a running elastic run.

    etcslurm grow run.toml --nodes 2                    # the run file's run, site and workers
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
        "workers register with the run's coordinator and join at the next step boundary.  "
        "With a run file: its run, its site's fields and its workers, and the coordinator "
        "its first job published in the run directory.",
    )
    p.add_argument("runfile", nargs="?", metavar="RUN.toml", help="the run file of the run")
    p.add_argument("--run", help="without a run file: the run id to join")
    p.add_argument("--nodes", type=int, default=1, help="nodes to add (default 1)")
    p.add_argument("--redis", default=None,
                   help="the run's coordinator URL (default: the run file's, else "
                        "$ETCSLURM_REDIS_URL)")
    p.add_argument("--tasks-per-node", type=int, default=None,
                   help="tasks (devices) per node (default 1; a run file: its own)")
    p.add_argument("--split", action="store_true",
                   help="one single-node job per node (array): Slurm can take each back alone")
    p.add_argument("--het", metavar="NxT,...",
                   help="heterogeneous job: NODESxTASKS per component, e.g. 1x4,2x2")
    p.add_argument("--worker-cmd", default=None, help="without a run file: the joining workers' command")
    p.add_argument("--partition", default=None)
    p.add_argument("--time", default=None, help="time limit (default 01:00:00)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a field (repeatable): of the run file, else of grow.sbatch")
    p.add_argument("--via", choices=("sbatch", "submitit"), default="sbatch")
    p.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    p.add_argument("--workdir", default=".", help="without a run file: where the script goes")
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
    from etcslurm.errors import UsageError
    from etcslurm.slurm.submission import DEFAULT_WORKER_CMD, grow
    from etcslurm.slurm.templates import parse_sets

    components = parse_het(args.het) if args.het else None
    if args.runfile:
        return _run_file(args, components)
    if not args.run:
        raise UsageError("give the run file (etcslurm grow RUN.toml) or --run RUN")
    res = grow(args.run, args.nodes, args.worker_cmd or DEFAULT_WORKER_CMD,
               redis_url=args.redis, via=args.via, tasks_per_node=args.tasks_per_node or 1,
               split=args.split, components=components, partition=args.partition,
               time_limit=args.time or "01:00:00", folder=args.workdir,
               fields=parse_sets(args.sets) or None, dry_run=args.dry_run)
    if args.dry_run:
        sys.stdout.write(res.script or "")
        return 0
    print(f"submitted job {res.job_id} joining run {res.run_id}")
    return 0


def _run_file(args: argparse.Namespace, components: list[dict[str, object]] | None) -> int:
    from etcslurm.cli.submit import report
    from etcslurm.errors import UsageError
    from etcslurm.slurm import runfile
    from etcslurm.slurm.submission import grow
    from etcslurm.slurm.templates import load_template, parse_sets

    given = [f for f, v in (("--run", args.run), ("--worker-cmd", args.worker_cmd),
                            ("--partition", args.partition), ("--time", args.time),
                            ("--tasks-per-node", args.tasks_per_node)) if v]
    if given or args.via != "sbatch":
        raise UsageError(f"the run file sets {', '.join(given) or '--via'}: use --set instead")
    try:
        rf = runfile.load(args.runfile, parse_sets(args.sets))
    except runfile.RunFileError as exc:
        return report(exc.problems)
    if args.redis:
        url = args.redis
    elif args.dry_run:
        url = runfile.coordinator_url(rf, check=False) if (rf.run_dir / "coordinator.url").is_file() \
            else "redis://:PASSWORD@HOST:PORT/0"
    else:
        url = runfile.coordinator_url(rf)
    kwargs = rf.grow_args(load_template("grow"), args.nodes)
    kwargs["split"] = (kwargs["split"] or args.split) and not components
    kwargs.pop("redis_url", None)
    res = grow(rf.run_id, worker=rf.worker_cmd, redis_url=url, components=components,
               dry_run=args.dry_run, **kwargs)
    if args.dry_run:
        sys.stdout.write(res.script or "")
        return 0
    print(f"submitted job {res.job_id} joining run {res.run_id}")
    return 0
