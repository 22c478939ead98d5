"""Reading one run's coordinator keys and event stream for the monitor.

Read-only and built on the coordinator's own API (:class:`Coordinator` for events and
keys, :func:`connect` for bounded timeouts and one-line errors, :mod:`schema` for key
names), so the monitor and the runtime can never disagree on where things live.  The live loop blocks in
``XREAD`` for a short time instead of polling, which keeps an idle monitor near 0 % CPU.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from etcslurm.coord import schema
from etcslurm.coord.client import CoordClient, connect, redact
from etcslurm.coord.coordinator import Coordinator
from etcslurm.coord.records import Event, parse_event
from etcslurm.errors import EtcslurmError, RecordError, UsageError
from etcslurm.monitor.model import RunModel
from etcslurm.monitor.views import Refused
from etcslurm.redis_host import failover

ENV_URL = "ETCSLURM_REDIS_URL"
ENV_RUN_DIR = "ETCSLURM_RUN_DIR"
#: Keys whose presence means "this run exists".
_MARKERS = ("spec", "gen", "events", "workers")
#: Events read per XREAD call.
BATCH = 1000


def resolve_url(
    url: str | None, run_dir: str | None = None, password_file: str | None = None
) -> tuple[str, str | None]:
    """Where the coordinator is: ``(url, password_file)``.

    Order: ``--redis URL`` (with ``--password-file`` when the URL has no password);
    ``--run-dir DIR``; ``$ETCSLURM_REDIS_URL``; ``$ETCSLURM_RUN_DIR``; the current
    directory.  A run directory is found by the ``coordinator.json`` that
    ``etcslurm coordinator start`` (and :class:`BundledRedis`) leave there.
    """
    if url:
        return url, password_file
    if not run_dir and os.environ.get(ENV_URL):
        return os.environ[ENV_URL], password_file
    from etcslurm.redis_host.server import STATE_FILE, read_state

    directory = Path(run_dir or os.environ.get(ENV_RUN_DIR) or ".")
    if not (directory / STATE_FILE).exists():
        raise UsageError(
            f"no coordinator given: pass --redis URL, set {ENV_URL}, or point --run-dir "
            f"at a run directory with {STATE_FILE} (looked in {directory.resolve()})"
        )
    state = read_state(directory)
    pw = password_file or state.get("password_file")
    return str(state["url"]), str(pw) if pw else None


def open_client(
    url: str | None, run_dir: str | None = None, password_file: str | None = None
) -> CoordClient:
    """Connect, failing fast (a monitor should not retry for a minute before saying so)."""
    where, pw_file = resolve_url(url, run_dir, password_file)
    return connect(where, pw_file, retry_deadline=5.0, check_deadline=2.0)


def _text(raw: Any) -> str:
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


def list_runs(client: CoordClient) -> list[str]:
    """Run ids that have any coordinator key on this Redis, sorted."""
    runs: set[str] = set()

    def scan(r: Any) -> None:
        for marker in _MARKERS:
            for key in r.scan_iter(match=f"{schema.PREFIX}:*:{marker}", count=1000):
                parts = _text(key).split(":")
                if len(parts) == 3 and schema.RUN_ID_RE.match(parts[1]):
                    runs.add(parts[1])

    client.call("list runs", scan)
    return sorted(runs)


def pick_run(client: CoordClient, run: str | None) -> str:
    """``run`` if it exists; the only run when ``run`` is None; else a one-line error."""
    if run is not None:
        keys = schema.Keys(run)
        names = [getattr(keys, m) for m in _MARKERS]
        if client.call("find run", lambda r: r.exists(*names)):
            return run
        others = list_runs(client)
        hint = f"; runs there: {', '.join(others[:10])}" if others else "; it holds no runs"
        raise UsageError(f"no run {run!r} on {client.url}{hint}")
    runs = list_runs(client)
    if len(runs) == 1:
        return runs[0]
    if not runs:
        raise UsageError(f"no runs on {client.url}")
    raise UsageError(f"{len(runs)} runs on {client.url}: pick one with --run ({', '.join(runs[:10])})")


def to_event(entry: dict[str, Any]) -> Event | Refused:
    """A :meth:`Coordinator.read_events` entry as a typed :class:`Event`, or a
    :class:`Refused` saying why :func:`parse_event` refused it."""
    try:
        return parse_event(entry)
    except RecordError as exc:
        ms = str(entry.get("id", "")).split("-")[0]
        ts = entry.get("ts") or (int(ms) / 1000 if ms.isdigit() else time.time())
        return Refused(str(entry.get("id", "")), float(ts), str(entry.get("type", "?")), str(exc))


@dataclass
class RunSource:
    """Feeds one :class:`RunModel` from the coordinator of one run (read only)."""

    client: CoordClient
    run: str

    def __post_init__(self) -> None:
        self.coord = Coordinator(self.client, self.run)

    def read_events(self, last_id: str, block_ms: int | None = None) -> list[Event | Refused]:
        """Events after ``last_id``; waits up to ``block_ms`` for the first one."""
        entries = self.coord.read_events(last_id, block_ms=block_ms, count=BATCH)
        return [to_event(e) for e in entries]

    def read_keys(self) -> dict[str, Any]:
        """The ``workers`` hash (with heartbeat liveness) and the ``gen`` record (a bad
        one raises :class:`~etcslurm.errors.RecordError` naming the key and field)."""
        gen = self.coord.current_generation()
        return {
            "workers": self.coord.members(),
            "gen": gen,
        }

    def read_coordinator(self) -> dict[str, Any] | None:
        """Where a replicated coordinator's primary is now (``{"primary": "ip:port",
        "replicas": n}``, or ``{"error": ...}`` when no Sentinel names one); ``None`` for
        a single Redis server.  Fed to :meth:`RunModel.set_coordinator`."""
        try:
            now = failover.primary_now(self.client)
        except EtcslurmError as exc:
            return {"error": str(exc).splitlines()[0]}
        if now is None:
            return None
        return {"primary": now.text, "replicas": now.replicas_up}

    def catch_up(self, model: RunModel) -> int:
        """Fold everything already in the stream, then the keys; returns events read."""
        n = 0
        while True:
            batch = self.read_events(model.last_id)
            for e in batch:
                model.apply(e)
            n += len(batch)
            if len(batch) < BATCH:
                break
        model.set_keys(**self.read_keys())
        model.set_coordinator(self.read_coordinator(), time.time())
        return n


def snapshot(client: CoordClient, run: str, now: float | None = None) -> Any:
    """The current :class:`RunView` of ``run`` (``etcslurm status``)."""
    model = RunModel(run)
    RunSource(client, run).catch_up(model)
    return model.view(time.time() if now is None else now)


__all__ = [
    "ENV_URL",
    "RunSource",
    "list_runs",
    "open_client",
    "pick_run",
    "redact",
    "resolve_url",
    "snapshot",
    "to_event",
]
