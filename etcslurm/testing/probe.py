"""``python -m etcslurm.testing.probe --out DIR``: a tiny worker that proves the Slurm seams.

It stands in for the training worker in the Slurm tests and for users checking a
cluster: it writes what it sees (``SlurmEnvironment``, whether the coordinator answers)
to ``DIR/<worker_id>.json``, traps the leave signals with the template's configuration
and writes each :class:`SignalEvent` to ``DIR/<worker_id>.signal.json`` the moment it
arrives, then exits ``--linger`` seconds after the first signal (or after ``--duration``).

``python -m etcslurm.testing.probe --store-spec FILE`` instead stores the run spec in
``FILE`` (``RunSettings.to_json()``) in the run's coordinator (``ETCSLURM_REDIS_URL``,
``ETCSLURM_RUN``) and exits: a template ``setup_cmd`` for runs whose coordinator the
job itself starts (the Slurm tests of the replicated coordinator).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from etcslurm.job.environment import SlurmEnvironment
from etcslurm.job.signals import SignalEvent, SignalTrap


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)  # atomic: readers never see half a file


def describe(env: SlurmEnvironment) -> dict[str, Any]:
    """The environment as JSON (no password: the URL's credentials are cut)."""
    fields = {k: v for k, v in vars(env).items() if k != "raw"}
    fields["nodes"] = list(env.nodes)
    fields["tasks_per_node"] = list(env.tasks_per_node)
    fields["signals"] = list(env.signals)
    if env.redis_url:
        fields["redis_url"] = env.redis_url.split("@")[-1]
    fields.update(worker_id=env.worker_id, world_size=env.world_size,
                  local_world_size=env.local_world_size, device=env.device(), pid=os.getpid())
    return fields


def ping(url: str | None) -> bool | str:
    if not url:
        return False
    import os

    from etcslurm.coord.client import connect
    from etcslurm.errors import EtcslurmError

    try:  # etcslurm's client: plain and redis+sentinel:// URLs alike
        client = connect(url, os.environ.get("ETCSLURM_PASSWORD_FILE"), retry_deadline=30)
        try:
            return bool(client.call("ping", lambda r: r.ping()))
        finally:
            client.close()
    except EtcslurmError as exc:
        return f"error: {exc}"


def submitit_report() -> dict[str, Any]:
    """Submitit target: what the task sees (environment + trap configuration)."""
    from etcslurm.job.signals import installed

    env = SlurmEnvironment.from_env()
    info = describe(env)
    trap = installed()
    info["trap_signals"] = [s.name for s in trap.signals] if trap else []
    info["checkpoints"] = int(os.environ.get("ETCSLURM_CHECKPOINTS", "0"))
    return info


def submitit_until_signal(timeout: float = 300.0, ready_file: str | None = None) -> dict[str, Any]:
    """Submitit target for the preemption test: wait for a leave signal, then hand it to
    Submitit (checkpoint + requeue) as the runtime does when nothing survives.

    ``ready_file`` is created once the signal trap is in place: a preemption before it
    would meet the signal's default action (on a loaded host the task's start takes
    seconds after Slurm reports it RUNNING).  On the requeued run
    (``ETCSLURM_CHECKPOINTS`` > 0) it returns at once with what it saw.
    """
    from etcslurm.errors import WaitTimeout
    from etcslurm.job.signals import installed

    info = submitit_report()
    if info["checkpoints"] > 0:
        return info
    trap = installed()
    if trap is None:
        raise RuntimeError("no SignalTrap installed: run under ElasticTask")
    if ready_file:
        Path(ready_file).touch()
    if trap.wait(timeout) is None:
        raise WaitTimeout(f"no leave signal within {timeout:.0f} s")
    trap.fallback()  # Submitit: checkpoint() → requeue → sys.exit
    raise RuntimeError("Submitit's handler did not take over")


def store_spec(path: str) -> None:
    """Store the run spec in ``path`` in the coordinator the job's environment names."""
    from etcslurm.coord.client import connect
    from etcslurm.coord.coordinator import Coordinator

    env = SlurmEnvironment.from_env()
    if not env.redis_url or not env.run_id:
        raise SystemExit("etcslurm probe: --store-spec needs ETCSLURM_REDIS_URL and ETCSLURM_RUN")
    client = connect(env.redis_url, retry_deadline=60)
    try:
        Coordinator(client, env.run_id).ensure_spec(json.loads(Path(path).read_text()))
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m etcslurm.testing.probe")
    p.add_argument("--out", help="directory for the JSON reports")
    p.add_argument("--store-spec", metavar="FILE",
                   help="store this run spec (JSON) in the job's coordinator and exit")
    p.add_argument("--duration", type=float, default=600, help="exit after this many seconds")
    p.add_argument("--linger", type=float, default=1.0, help="seconds to stay after a signal")
    p.add_argument("--requeue-on-signal", action="store_true",
                   help="on a signal, requeue the job (the whole-run fallback) before exiting;"
                   " a restarted job (SLURM_RESTART_COUNT > 0) only reports and exits")
    args = p.parse_args(argv)
    if args.store_spec:
        store_spec(args.store_spec)
        return 0
    if not args.out:
        p.error("--out is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = SlurmEnvironment.from_env()
    name = env.worker_id

    def on_signal(event: SignalEvent) -> None:  # runs in the trap's watcher thread
        events.append(event.to_json())
        _write_json(out / f"{name}.signal.json", {"node": env.node_name, "events": events})

    events: list[dict[str, Any]] = []
    with SignalTrap.from_env(env, callback=on_signal) as trap:
        info = describe(env)
        info["coordinator_ping"] = ping(env.redis_url)
        info["started_at"] = time.time()
        _write_json(out / f"{name}.json", info)
        end = time.monotonic() + args.duration
        if args.requeue_on_signal and env.restart_count > 0:
            return 0
        while time.monotonic() < end:
            if trap.received:
                if args.requeue_on_signal and env.proc_id == 0:
                    from etcslurm.job.environment import requeue

                    requeue(env.job_id)
                time.sleep(args.linger)
                break
            time.sleep(0.05)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
