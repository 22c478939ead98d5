"""``etcslurm monitor``, ``etcslurm status`` and ``etcslurm runs``: watch runs on a Redis.

All three read only the coordinator's keys and event stream (see docs/monitor.md).  The
coordinator is found from ``--redis URL``, else ``--run-dir``'s ``coordinator.json``,
else ``$ETCSLURM_REDIS_URL``, else ``$ETCSLURM_RUN_DIR`` or the current directory.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _common(p: argparse.ArgumentParser, run: bool = True) -> None:
    if run:
        p.add_argument("--run", metavar="RUN",
                       help="run id (optional when the Redis holds exactly one run)")
    p.add_argument("--redis", metavar="URL",
                   help="coordinator URL redis://[:PASSWORD@]HOST:PORT/DB "
                        "(default: $ETCSLURM_REDIS_URL, else the run directory's coordinator)")
    p.add_argument("--password-file", metavar="FILE",
                   help="file (mode 0600) with the password when the URL has none")
    p.add_argument("--run-dir", metavar="DIR",
                   help="run directory holding coordinator.json (default: $ETCSLURM_RUN_DIR or .)")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "monitor", help="live view of an elastic run (layout, devices, migration, events)",
        description="Live view of a run, refreshed twice a second; one line per event when "
                    "stdout is not a terminal. Ctrl-C leaves.",
    )
    _common(p)
    p.add_argument("--once", action="store_true", help="draw the current state once and exit")
    p.set_defaults(func=_quiet_pipe(_monitor))

    s = subparsers.add_parser("status", help="the state of a run (human summary or --json)")
    _common(s)
    s.add_argument("--json", action="store_true", help="the full view as JSON, for scripts")
    s.set_defaults(func=_quiet_pipe(_status))

    r = subparsers.add_parser("runs", help="list the runs on a coordinator Redis")
    _common(r, run=False)
    r.add_argument("--json", action="store_true", help="as JSON")
    r.set_defaults(func=_quiet_pipe(_runs))


def _quiet_pipe(func: Any) -> Any:
    """``etcslurm status --json | head`` closing the pipe early is not an error."""

    def wrapper(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except BrokenPipeError:
            import os

            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0

    return wrapper


def _open(args: argparse.Namespace) -> Any:
    from etcslurm.monitor.source import open_client

    return open_client(args.redis, args.run_dir, args.password_file)


def _monitor(args: argparse.Namespace) -> int:
    from etcslurm.monitor.live import monitor
    from etcslurm.monitor.source import RunSource, pick_run

    with _open(args) as client:
        run = pick_run(client, args.run)
        return monitor(RunSource(client, run), once=args.once)


def _status(args: argparse.Namespace) -> int:
    from etcslurm.monitor.source import pick_run, snapshot

    with _open(args) as client:
        view = snapshot(client, pick_run(client, args.run))
    if args.json:
        json.dump(view.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(summary(view) + "\n")
    return 0


def summary(view: Any) -> str:
    """A few human lines: what runs where, the last migration, the last events."""
    from etcslurm.monitor.text import fmt_bytes, fmt_rate, fmt_seconds

    states: dict[str, int] = {}
    for node in view.nodes:
        for d in node.devices:
            states[d.state] = states.get(d.state, 0) + 1
    counts = ", ".join(f"{n} {s}" for s, n in sorted(states.items())) or "no workers"
    lines = [
        f"run {view.run}: {view.phase}, gen {view.gen if view.gen is not None else '-'}, "
        f"{view.layout or 'no layout'}"
        + (f" (world {view.world})" if view.world else ""),
        f"step {view.step if view.step is not None else '-'}, "
        f"{fmt_rate(view.tokens_per_s) if view.tokens_per_s is not None else '-'} tokens/s, "
        f"loss {f'{view.loss:.4f}' if view.loss is not None else '-'}"
        + (f" ({view.loss_trend})" if view.loss_trend else ""),
        f"workers: {counts} on {len(view.nodes)} nodes",
    ]
    m = view.migration
    if m is not None:
        arrow = f"{m.from_layout} → {m.to_layout}" if m.from_layout else str(m.to_layout)
        if m.done:
            lines.append(
                f"last migration gen {m.gen}: {arrow}, moved {fmt_bytes(m.moved_bytes)}, "
                f"local {fmt_bytes(m.local_bytes)}, checkpoint {fmt_bytes(m.checkpoint_bytes or 0)}, "
                f"{fmt_seconds(m.seconds)}, pause {fmt_seconds(m.pause_seconds)}"
            )
        else:
            lines.append(
                f"migrating gen {m.gen}: {arrow}, "
                f"{fmt_bytes(m.bytes_done)} of {fmt_bytes(m.bytes_total)} sent"
            )
    for e in view.events[-3:]:
        lines.append(f"  {e.text}")
    return "\n".join(lines)


def _runs(args: argparse.Namespace) -> int:
    import time

    from etcslurm.monitor.model import RunModel
    from etcslurm.monitor.source import RunSource, list_runs

    with _open(args) as client:
        rows = []
        for run in list_runs(client):  # keys only: cheap even when streams are long
            model = RunModel(run)
            model.set_keys(**RunSource(client, run).read_keys())
            v = model.view(time.time())
            workers = sum(1 for n in v.nodes for d in n.devices if d.state != "gone")
            rows.append({"run": run, "phase": v.phase, "gen": v.gen, "layout": v.layout,
                         "workers": workers, "step": v.step})
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    if not rows:
        sys.stdout.write(f"no runs on {client.url}\n")
        return 0
    sys.stdout.write(f"{'RUN':<24} {'PHASE':<10} {'GEN':>4} {'LAYOUT':<14} {'WORKERS':>7} {'STEP':>7}\n")
    for r in rows:
        sys.stdout.write(
            f"{r['run']:<24} {r['phase']:<10} {_dash(r['gen']):>4} {r['layout'] or '-':<14} "
            f"{r['workers']:>7} {_dash(r['step']):>7}\n"
        )
    return 0


def _dash(x: Any) -> str:
    return "-" if x is None else str(x)
