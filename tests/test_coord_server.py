"""The bundled redis-server and the client's error/retry behaviour against it.

These tests start their own servers (BundledRedis), so they need no ``redis_url``.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from etcslurm.coord.client import connect, with_password
from etcslurm.coord.coordinator import Coordinator
from etcslurm.errors import CoordinatorError
from etcslurm.redis_host.server import BundledRedis, _alive
from tests.helpers import generation_record

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def server(tmp_path):
    with BundledRedis(tmp_path / "run") as srv:
        yield srv


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_bundled_defaults_loopback_password_no_persistence(server):
    assert _mode(server.password_file) == 0o600
    assert _mode(server.run_dir / "redis.conf") == 0o600
    assert server.password not in " ".join(Path(f"/proc/{server.pid}/cmdline").read_text().split("\0"))
    c = connect(server.url, server.password_file)
    cfg = c.redis.config_get("*")
    assert cfg["bind"] == "127.0.0.1"
    assert cfg["save"] == "" and cfg["appendonly"] == "no"
    assert cfg["protected-mode"] == "yes"
    c.close()


def test_client_without_or_with_wrong_password_is_refused(server):
    with pytest.raises(CoordinatorError) as exc:
        connect(server.url)
    assert "requires a password" in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(CoordinatorError) as exc:
        connect(with_password(server.url, "not-the-password"))
    msg = str(exc.value)
    assert "refused the password" in msg and "not-the-password" not in msg and "\n" not in msg


def test_password_file_must_be_private(server, tmp_path):
    f = tmp_path / "pw"
    f.write_text(server.password)
    f.chmod(0o644)
    with pytest.raises(CoordinatorError, match="readable by other users"):
        connect(server.url, f)
    f.chmod(0o600)
    connect(server.url, f).close()


def test_unreachable_and_not_redis_are_one_line_errors(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(CoordinatorError, match=r"unreachable for 1 s during ping: .*refused"):
        connect(f"redis://:x@127.0.0.1:{port}/0", retry_deadline=1)
    assert time.monotonic() - t0 < 30, "the 1-s retry deadline was not kept"
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def answer() -> None:
        conn, _ = srv.accept()
        conn.recv(1000)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    with pytest.raises(CoordinatorError, match=r"is not a Redis server \(it answered .*HTTP/1.1"):
        connect(f"redis://:x@127.0.0.1:{srv.getsockname()[1]}/0", retry_deadline=5)
    srv.close()
    with pytest.raises(CoordinatorError, match="must start with redis://"):
        connect("http://127.0.0.1:1/")


def test_start_failure_reports_log_tail(server, tmp_path):
    with pytest.raises(CoordinatorError, match=r"exited with code .*log .*(Address already in use|bind)"):
        BundledRedis(tmp_path / "other", port=server.port, ready_timeout=20).start()


def test_restart_clients_reconnect_and_membership_heals(server):
    client = connect(server.url, server.password_file, retry_deadline=20)
    co = Coordinator(client, "restart", heartbeat_interval=0.1, dead_after=1.0,
                     spec={"model": "gpt-tiny"})
    wid = co.register({"device": "cpu"})
    co.set_state("active", rank=0)
    watcher = Coordinator(connect(server.url, server.password_file), "restart")
    server.restart()  # no persistence: every key is gone
    # a call issued right after the restart retries until Redis answers again
    assert watcher.current_generation() is None
    t0 = time.monotonic()
    while wid not in watcher.members():
        assert time.monotonic() - t0 < 10, "worker entry not healed by its heartbeat"
        time.sleep(0.05)
    info = watcher.members()[wid]
    assert info["state"] == "active" and info["rank"] == 0 and info["alive"]
    assert watcher.run_spec() == {"model": "gpt-tiny"}
    co2 = Coordinator(watcher.client, "restart")
    assert co2.register(heartbeat=False) != wid  # the id counter was healed too
    co.stop_heartbeat()


def test_call_survives_short_outage(server):
    client = connect(server.url, server.password_file, retry_deadline=20)
    co = Coordinator(client, "outage", heartbeat_interval=0.2, dead_after=5.0)
    co.register()
    pub = Coordinator(connect(server.url, server.password_file, retry_deadline=20), "outage")
    server._kill()  # Redis down
    got: list[dict] = []
    t = threading.Thread(target=lambda: got.append(co.wait_generation(-1, timeout=20)))
    t.start()
    time.sleep(2.0)
    assert co.last_beat_error is not None  # heartbeats failing meanwhile, thread alive
    server._spawn()  # same port, same password
    server._wait_ready()
    assert pub.publish_generation(generation_record(0, "tp1pp1dp1", [co.worker_id]))
    t.join(20)
    assert got and got[0].generation == 0
    t0 = time.monotonic()
    while co.last_beat_error is not None:  # the heartbeat thread recovers by itself
        assert time.monotonic() - t0 < 30, "the heartbeat thread did not recover"
        time.sleep(0.05)
    assert co.membership._thread is not None and co.membership._thread.is_alive()
    co.stop_heartbeat()


@pytest.mark.slow
def test_redis_unreachable_30s_is_survivable(server):
    client = connect(server.url, server.password_file, retry_deadline=60)
    co = Coordinator(client, "long", heartbeat_interval=1.0, dead_after=10.0)
    co.register()
    server._kill()
    t0 = time.monotonic()
    got: list = []
    t = threading.Thread(target=lambda: got.append(co.wait_generation(-1, timeout=60)))
    t.start()
    time.sleep(30)
    server._spawn()
    server._wait_ready()
    pub = Coordinator(connect(server.url, server.password_file, retry_deadline=20), "long")
    assert pub.publish_generation(generation_record(0, "tp1pp1dp1", [co.worker_id]))
    t.join(40)
    assert got, "wait_generation did not complete after the outage"
    assert time.monotonic() - t0 >= 30
    t1 = time.monotonic()
    while co.last_beat_error is not None:
        assert time.monotonic() - t1 < 30, "the heartbeat did not recover after the outage"
        time.sleep(0.1)
    assert co.worker_id in co.members() and co.members()[co.worker_id]["alive"]
    co.stop_heartbeat()


def test_server_stops_when_owner_exits(tmp_path):
    code = (
        "import sys; from etcslurm.redis_host.server import BundledRedis;"
        "s = BundledRedis(sys.argv[1]).start(); print(s.pid, flush=True)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[0])
    t0 = time.monotonic()
    while _alive(pid):
        assert time.monotonic() - t0 < 30, f"redis-server {pid} left behind"
        time.sleep(0.05)


def test_server_stops_when_owner_is_killed(tmp_path):
    code = (
        "import sys, time; from etcslurm.redis_host.server import BundledRedis;"
        "s = BundledRedis(sys.argv[1]).start(); print(s.pid, flush=True); time.sleep(60)"
    )
    owner = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        pid = int(owner.stdout.readline())
        assert _alive(pid)
    finally:
        owner.kill()  # SIGKILL: no atexit
        owner.wait()
    t0 = time.monotonic()
    while _alive(pid):
        assert time.monotonic() - t0 < 30, f"redis-server {pid} outlived its killed owner"
        time.sleep(0.05)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(ROOT / "sbin" / "coordinator"), *args], capture_output=True,
                          text=True, timeout=60)


def test_cli_start_url_stop(tmp_path):
    run = tmp_path / "r"
    out = _cli("start", str(run))
    assert out.returncode == 0, out.stderr
    url = out.stdout.strip()
    assert url.startswith("redis://127.0.0.1:") and "@" not in url
    state = json.loads((run / "coordinator.json").read_text())
    try:
        assert _cli("url", str(run)).stdout.strip() == url
        full = _cli("url", str(run), "--with-password").stdout.strip()
        connect(full).close()
        again = _cli("start", str(run))  # idempotent: same server
        assert again.returncode == 0 and again.stdout.strip() == url
        granted = _cli("grant", str(run), "clirun")
        assert granted.returncode == 0, granted.stderr
        user_url = granted.stdout.strip()
        assert user_url.startswith("redis://etcslurm-clirun@127.0.0.1:")
        pw = run / "etcslurm-clirun.password"
        assert _mode(pw) == 0o600
        uc = connect(user_url, pw)
        assert Coordinator(uc, "clirun").register(heartbeat=False) == "w1"
        with pytest.raises(CoordinatorError, match="denied access"):
            Coordinator(uc, "another").register()
        uc.close()
    finally:
        assert _cli("stop", str(run)).returncode == 0
    assert not _alive(int(state["pid"]))
    gone = _cli("url", str(run))
    assert gone.returncode == 2 and gone.stderr.count("\n") == 1
    assert "no coordinator running" in gone.stderr
    bad = _cli("start", str(run), "--port", "70000")
    assert bad.returncode == 2 and "--port must be" in bad.stderr
