"""``etcslurm monitor`` in a real terminal: tmux at 80×24, a run resizing tp2pp2dp3 →
tp2pp2dp2 while we watch, screens captured with ``capture-pane`` and checked.

SKELETON FOR THE DEMO: the events come from :class:`etcslurm.testing.scenario.Scenario`
(real coordinator API, scripted numbers) so the test can pause the run at each phase
(``gates``) and look at the screen.  To point it at the real ``etcslurm demo``, replace
:func:`start_run` with one that launches the demo on ``redis_url``/``run_id`` and drop
the gate waits (poll the screen instead: :meth:`Tmux.wait_for` already does).

Every screen is written to ``$ETCSLURM_SCREENS_DIR`` (when set) for the docs.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from etcslurm.coord.client import connect
from etcslurm.testing.scenario import Scenario

TMUX = shutil.which("tmux")
pytestmark = [
    pytest.mark.redis,  # ~10 s: below the "slow" bar, and it is the test a person would do
    pytest.mark.skipif(TMUX is None, reason="tmux is not installed"),
]
ROOT = Path(__file__).resolve().parents[1]


class Tmux:
    """One private tmux server (own socket in ``directory``) running one command."""

    def __init__(self, directory: Path) -> None:
        self.socket = str(directory / f"tmux-{uuid.uuid4().hex[:6]}.sock")

    def tmux(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([TMUX, "-S", self.socket, *args], capture_output=True,
                              text=True, timeout=10, check=check)

    def start(self, command: str, width: int = 80, height: int = 24) -> None:
        self.tmux("new-session", "-d", "-x", str(width), "-y", str(height), command)

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p").stdout

    def alive(self) -> bool:
        return self.tmux("has-session", check=False).returncode == 0

    def wait_for(self, ok: Callable[[str], bool], what: str, timeout: float = 20.0) -> str:
        end = time.monotonic() + timeout
        screen = ""
        while time.monotonic() < end:
            if not self.alive():
                pytest.fail(f"the monitor exited while waiting for {what}; last screen:\n{screen}")
            screen = self.screen()
            if ok(screen):
                return screen
            time.sleep(0.2)
        pytest.fail(f"screen never showed {what} within {timeout} s; last screen:\n{screen}")

    def close(self) -> None:
        self.tmux("kill-server", check=False)
        Path(self.socket).unlink(missing_ok=True)


def expect(screen: str, *needles: str) -> None:
    """Each needle is on the screen; else fail showing the screen."""
    missing = [n for n in needles if n not in screen]
    if missing:
        pytest.fail(f"not on the screen: {missing}\n{screen}")


def save(name: str, screen: str) -> None:
    out = os.environ.get("ETCSLURM_SCREENS_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.txt").write_text(screen)


def start_run(redis_url: str, run_id: str, gates: dict[str, threading.Event]) -> threading.Thread:
    """Emit a resizing run in real time (LEAD: swap for `etcslurm demo` here)."""
    client = connect(redis_url)
    scenario = Scenario(client, run_id, speed=2, steps_before=3, steps_after=3, rounds=8,
                        gates=gates, gate_timeout=60)

    def play() -> None:
        try:
            scenario.play()
        finally:
            client.close()

    thread = threading.Thread(target=play, name="scenario", daemon=True)
    thread.start()
    end = time.monotonic() + 20
    with connect(redis_url) as c:
        while not c.redis.exists(f"etcslurm:{run_id}:gen"):
            assert time.monotonic() < end, "the run never published a generation"
            time.sleep(0.05)
    return thread


def test_monitor_in_tmux_through_a_resize(redis_url: str, run_id: str, tmp_path: Path) -> None:
    gates = {name: threading.Event() for name in ("preempt", "mid_migration", "end")}
    player = start_run(redis_url, run_id, gates)
    term = Tmux(tmp_path)
    # COLUMNS/LINES (pytest exports them) would pin rich to one size: drop them
    env = f"-u COLUMNS -u LINES PYTHONPATH={shlex.quote(str(ROOT))} TERM=xterm-256color"
    command = (f"env {env} {shlex.quote(sys.executable)} -m etcslurm monitor "
               f"--redis {shlex.quote(redis_url)} --run {run_id}")
    try:
        term.start(command)
        # 1. before: 12 ranks in tp2pp2dp3, all active
        s = term.wait_for(lambda s: "tp2pp2dp3 (world 12)" in s and "r11(1,1,2)●" in s
                          and "step 3" in s, "the first layout")
        save("1-before", s)
        assert all(len(line) <= 80 for line in s.splitlines()), s
        assert "Migration" not in s, s  # nothing migrated yet
        gates["preempt"].set()

        # 2. n3 preempted, the new generation migrating: leaving countdowns and rank bars
        s = term.wait_for(lambda s: "running" in s and "%" in s and "eta" in s
                          and "↑" in s, "a running migration with bars")
        s = term.wait_for(lambda s: s.count("░") > 0 and "50%" in s, "half-way bars")
        save("2-migrating", s)
        expect(s, "gen 1  tp2pp2dp2 (world 8)", "Migration gen 1 tp2pp2dp3 → tp2pp2dp2 · running",
               "n3 preempted: USR2, 88 s budget (×4)", "w9◐8")  # leaving, 8x s left
        bars = [ln for ln in s.splitlines() if ln.startswith("r") and "%" in ln]
        assert len(bars) == 8 and all("░" in b for b in bars), s

        # 3. the terminal is resized while migrating: the screen follows
        term.tmux("resize-window", "-x", "100", "-y", "30")
        s = term.wait_for(lambda s: any(ln.startswith("─ Events") and len(ln) == 100
                                        for ln in s.splitlines()), "a 100-column redraw")
        save("3-resized", s)
        gates["mid_migration"].set()

        # 4. after: done, totals, the new grid, the event log
        s = term.wait_for(lambda s: "done in" in s and "w9–w12 on n3: gone" in s
                          and "step 6" in s, "the finished migration")
        save("4-after", s)
        expect(s, "moved 1.5 GB", "checkpoint 0 B", "r7(1,1,1)●", "w9✗gone",
               "gen 1: tp2pp2dp3 → tp2pp2dp2, 1.5 GB in")
        assert "r8(" not in s, s
        assert all("100%" in ln for ln in s.splitlines() if ln.startswith("r") and "%" in ln), s
        gates["end"].set()

        # 5. Ctrl-C leaves cleanly
        term.wait_for(lambda s: "ended" in s, "run ended")
        term.tmux("send-keys", "C-c")
        end = time.monotonic() + 10
        while term.alive() and time.monotonic() < end:
            time.sleep(0.1)
        assert not term.alive(), "monitor did not exit on Ctrl-C"
    finally:
        for g in gates.values():
            g.set()
        term.close()
        player.join(30)


@pytest.mark.slow
def test_monitor_in_tmux_during_a_real_demo_resize(redis_url: str, run_id: str,
                                                   tmp_path: Path) -> None:
    """`etcslurm demo` (which shows the monitor) in tmux: real workers, a real leave."""
    term = Tmux(tmp_path)
    env = f"-u COLUMNS -u LINES PYTHONPATH={shlex.quote(str(ROOT))} TERM=xterm-256color"
    command = (f"env {env} PYTHONWARNINGS=ignore {shlex.quote(sys.executable)} -m etcslurm demo "
               f"--redis {shlex.quote(redis_url)} --run {run_id} --run-dir {tmp_path / 'run'} "
               f"--workers 3 --steps 14 --schedule '5:leave=1' --no-reference; sleep 60")
    try:
        term.start(command)
        s = term.wait_for(lambda s: "tp1pp1dp3 (world 3)" in s and "r2(0,0,2)" in s,
                          "the first layout", timeout=300)
        save("demo-1-before", s)
        s = term.wait_for(lambda s: "tp1pp1dp2 (world 2)" in s and "preempted: USR2" in s,
                          "the layout after the leave", timeout=300)
        save("demo-2-after", s)
        expect(s, "gen 1", "tp1pp1dp3 → tp1pp1dp2")
        s = term.wait_for(lambda s: "loss curve" in s or "steps in" in s, "the demo summary",
                          timeout=300)
        save("demo-3-summary", s)
    finally:
        term.close()
