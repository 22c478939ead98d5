"""``etcslurm submit``: start a run from its run file, or render a template, or use Submitit.

    etcslurm submit run.toml [--set slurm.nodes=8] [--dry-run]
    etcslurm submit --template elastic --set run_id=r1 --set worker_cmd='python -m ...' --dry-run
    etcslurm submit --via submitit --worker mypkg.train:main --set nodes=2
"""

from __future__ import annotations

import argparse
import sys

_SUBMITIT_KEYS = {"run_id", "nodes", "tasks_per_node", "redis_url", "partition", "time",
                  "signal", "signal_lead"}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "submit",
        help="start an elastic run on Slurm (a run file, an sbatch template or Submitit)",
        description="Check a run file (TOML: [run], [worker], [slurm]), render the job "
        "that starts its coordinator, stores its run spec and runs its workers, and submit "
        "it (--dry-run: print it).  Without a run file: render --template with --set fields, "
        "or submit a Python worker through Submitit.",
    )
    p.add_argument("runfile", nargs="?", metavar="RUN.toml", help="the run file")
    p.add_argument("--template", default=None,
                   help="without a run file: template name (elastic, grow) or path to a .sbatch file")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a field (repeatable): of the run file (slurm.nodes=8, or nodes=8 "
                        "where only one table has it), else of the template")
    p.add_argument("--dry-run", action="store_true", help="print the rendered script, submit nothing")
    p.add_argument("--via", choices=("sbatch", "submitit"), default="sbatch")
    p.add_argument("--worker", help="--via submitit: the worker as module:function")
    p.add_argument("--cluster", choices=("slurm", "local"), default=None,
                   help="--via submitit: Submitit executor (default: auto)")
    p.add_argument("--workdir", default=".",
                   help="without a run file: where the script / Submitit logs go")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from etcslurm.errors import UsageError
    from etcslurm.slurm.templates import parse_sets

    values = parse_sets(args.sets)
    if args.runfile:
        if args.template or args.via != "sbatch":
            raise UsageError("a run file sets its own job: drop --template / --via")
        return _run_file(args, values)
    if args.via == "submitit":
        return _submitit(args, values)
    from etcslurm.slurm.submission import new_run_id, sbatch
    from etcslurm.slurm.templates import load_template, render

    tpl = load_template(args.template or "elastic")
    if "run_id" in tpl.field_names and not values.get("run_id"):
        values["run_id"] = new_run_id()
    script = render(tpl, values)
    if args.dry_run:
        sys.stdout.write(script)
        return 0
    job_id, path = sbatch(script, args.workdir, name=f"{tpl.name}-{values.get('run_id', 'job')}")
    print(f"submitted run {values.get('run_id', '-')} as job {job_id} ({path})")
    return 0


def report(problems: list[str]) -> int:
    """Each problem of a run file on a line of its own; exit code 2."""
    for line in problems:
        sys.stderr.write(f"etcslurm: {line}\n")
    return 2


def _run_file(args: argparse.Namespace, values: dict[str, str]) -> int:
    from etcslurm.slurm import runfile
    from etcslurm.slurm.submission import submit

    try:
        rf = runfile.load(args.runfile, values)
    except runfile.RunFileError as exc:
        return report(exc.problems)
    res = submit(rf.worker_cmd, dry_run=args.dry_run, **rf.submit_args())
    if args.dry_run:
        sys.stdout.write(res.script or "")
        return 0
    print(f"submitted run {rf.run_id} as job {res.job_id} ({res.script_path}); "
          f"run directory {rf.run_dir}")
    return 0


def _submitit(args: argparse.Namespace, values: dict[str, str]) -> int:
    from etcslurm.errors import UsageError
    from etcslurm.slurm.submission import submit

    if not args.worker:
        raise UsageError("--via submitit needs --worker module:function")
    unknown = sorted(set(values) - _SUBMITIT_KEYS)
    if unknown:
        raise UsageError(f"unknown field(s) {', '.join(unknown)} for --via submitit; "
                         f"valid: {', '.join(sorted(_SUBMITIT_KEYS))}")
    if args.dry_run:
        raise UsageError("--dry-run applies to --via sbatch only")
    res = submit(args.worker, via="submitit", run_id=values.get("run_id"),
                 nodes=int(values.get("nodes", 1)),
                 tasks_per_node=int(values.get("tasks_per_node", 1)),
                 redis_url=values.get("redis_url"), partition=values.get("partition"),
                 time_limit=values.get("time", "01:00:00"),
                 signal=values.get("signal", "USR2"),
                 signal_lead=int(values.get("signal_lead", 90)),
                 folder=args.workdir, cluster=args.cluster)
    print(f"submitted run {res.run_id} as Submitit job {res.job_id}")
    return 0
