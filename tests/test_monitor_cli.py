"""``etcslurm monitor/status/runs`` as a user runs them: real processes, a real Redis, a run
whose events the scripted scenario emits through the coordinator API."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from etcslurm.coord.client import connect
from etcslurm.testing.scenario import Scenario

pytestmark = pytest.mark.redis


def etcslurm(*args: str, env: dict | None = None, cwd: str | None = None,
             timeout: float = 60) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("ETCSLURM_REDIS_URL", "ETCSLURM_RUN_DIR")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "etcslurm", *args], capture_output=True, text=True,
        timeout=timeout, env=full_env, cwd=cwd or os.getcwd(),
    )


def one_line_error(proc: subprocess.CompletedProcess, code: int) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("etcslurm: "), proc.stderr
    return lines[0]


@pytest.fixture
def played(redis_url: str, run_id: str) -> str:
    """A run that went tp2pp2dp3 → tp2pp2dp2 and ended (played fast)."""
    with connect(redis_url) as client:
        Scenario(client, run_id, speed=20, steps_before=3, steps_after=3, rounds=3,
                 dead_after=300).play()  # workers stay "alive" for the whole test
    return run_id


def test_plain_output_follows_a_live_run(redis_url: str, run_id: str) -> None:
    """Not a TTY: one line per event, history then live, exits at run.end."""
    client = connect(redis_url)
    scenario = Scenario(client, run_id, speed=4, steps_before=4, steps_after=3, rounds=4)
    player = threading.Thread(target=scenario.play, daemon=True)
    player.start()
    deadline = time.monotonic() + 20
    while not client.redis.exists(f"etcslurm:{run_id}:gen"):
        assert time.monotonic() < deadline, "scenario did not start"
        time.sleep(0.05)
    proc = etcslurm("monitor", "--redis", redis_url, "--run", run_id, timeout=60)
    player.join(30)
    client.close()
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    text = "\n".join(out)
    assert "n3 preempted: USR2, 88 s budget" in text
    assert "gen 1: tp2pp2dp3 → tp2pp2dp2 (8 ranks, 4 leaving)" in text
    assert sum("migrated" in line for line in out) == 8  # one line per rank that finished
    assert any(line.endswith("run ended: finished") for line in out)
    assert out[-1].endswith("run ended: finished")
    assert "\x1b[" not in proc.stdout  # no escape codes when piped


def test_once_and_status_json(played: str, redis_url: str) -> None:
    proc = etcslurm("monitor", "--redis", redis_url, "--run", played, "--once")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) <= 24 and max(map(len, lines)) <= 80
    assert "gen 1  tp2pp2dp2 (world 8)" in lines[0]
    assert "Migration gen 1 tp2pp2dp3 → tp2pp2dp2 · done" in proc.stdout

    proc = etcslurm("status", "--redis", redis_url, "--run", played, "--json")
    assert proc.returncode == 0, proc.stderr
    view = json.loads(proc.stdout)
    assert (view["gen"], view["layout"], view["world"], view["phase"]) == (1, "tp2pp2dp2", 8, "ended")
    devices = [d for n in view["nodes"] for d in n["devices"]]
    assert sorted(d["rank"] for d in devices if d["state"] == "active") == list(range(8))
    assert [d["state"] for d in view["nodes"][2]["devices"]] == ["gone"] * 4
    assert view["migration"]["done"] and view["migration"]["moved_bytes"] > 0

    proc = etcslurm("status", "--redis", redis_url, "--run", played)
    assert proc.returncode == 0 and "tp2pp2dp3 → tp2pp2dp2" in proc.stdout

    proc = etcslurm("runs", "--redis", redis_url, "--json")
    rows = {r["run"]: r for r in json.loads(proc.stdout)}
    assert rows[played]["layout"] == "tp2pp2dp2" and rows[played]["workers"] == 8


def test_no_such_run(played: str, redis_url: str) -> None:
    line = one_line_error(etcslurm("status", "--redis", redis_url, "--run", "nope-x"), 2)
    assert "no run 'nope-x'" in line and "runs there:" in line
    assert urlsplit(redis_url).password not in line  # never print the password


def test_sigterm_restores_the_terminal(played: str, redis_url: str) -> None:
    """`etcslurm demo` ends its monitor with SIGTERM: exit 0, alternate screen left."""
    import pty

    main, sub = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen([sys.executable, "-m", "etcslurm", "monitor", "--redis", redis_url,
                             "--run", played], stdout=sub, stderr=sub, stdin=sub, env=env)
    os.close(sub)
    out = b""
    try:
        end = time.monotonic() + 20
        while b"Events" not in out and time.monotonic() < end:
            if select.select([main], [], [], 0.5)[0]:
                out += os.read(main, 65536)
        assert b"\x1b[?1049h" in out  # it entered the alternate screen
        proc.terminate()
        assert proc.wait(10) == 0
        try:
            while select.select([main], [], [], 2)[0] and (chunk := os.read(main, 65536)):
                out += chunk
        except OSError:  # EIO: the other side closed
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(main)
    assert b"\x1b[?1049l" in out.split(b"\x1b[?1049h", 1)[1]  # and left it again
    assert b"Traceback" not in out


def test_unreachable_redis() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    t0 = time.monotonic()
    line = one_line_error(etcslurm("monitor", "--redis", f"redis://:pw@127.0.0.1:{port}/0"), 3)
    assert "unreachable" in line and time.monotonic() - t0 < 60


def test_wrong_and_missing_password(redis_url: str) -> None:
    parts = urlsplit(redis_url)
    wrong = f"redis://:not-the-password@{parts.hostname}:{parts.port}/0"
    assert "refused the password" in one_line_error(etcslurm("runs", "--redis", wrong), 3)
    bare = f"redis://{parts.hostname}:{parts.port}/0"
    assert "requires a password" in one_line_error(etcslurm("monitor", "--redis", bare), 3)


def test_url_from_env_and_run_dir(played: str, redis_url: str, tmp_path: Path) -> None:
    proc = etcslurm("status", "--run", played, env={"ETCSLURM_REDIS_URL": redis_url})
    assert proc.returncode == 0 and f"run {played}" in proc.stdout
    # the run directory convention of `etcslurm coordinator start`: coordinator.json
    parts = urlsplit(redis_url)
    pw = tmp_path / "redis.password"
    pw.write_text(parts.password + "\n")
    pw.chmod(0o600)
    (tmp_path / "coordinator.json").write_text(json.dumps({
        "url": f"redis://{parts.hostname}:{parts.port}/0", "pid": 1,
        "password_file": str(pw)}))
    proc = etcslurm("status", "--run", played, cwd=str(tmp_path))
    assert proc.returncode == 0 and f"run {played}" in proc.stdout, proc.stderr
    # an explicit --run-dir beats a stale $ETCSLURM_REDIS_URL
    stale = {"ETCSLURM_REDIS_URL": "redis://:x@127.0.0.1:1/0"}
    proc = etcslurm("status", "--run", played, "--run-dir", str(tmp_path), env=stale)
    assert proc.returncode == 0, proc.stderr
    proc = etcslurm("status", "--run", played, "--redis",
                    f"redis://{parts.hostname}:{parts.port}/0", "--password-file", str(pw))
    assert proc.returncode == 0, proc.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    line = one_line_error(etcslurm("status", cwd=str(empty)), 2)
    assert "--redis URL" in line and "ETCSLURM_REDIS_URL" in line
