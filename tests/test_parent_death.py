"""A process's forked children die with it once it is armed (real processes, no fakes).

megatron's checkpoint writer forks its file-writing workers; ``PR_SET_PDEATHSIG`` does
not survive a fork, so without :func:`forked_children_die_with_us` a killed writer left
its workers behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

MIDDLE = """
import os, sys, time
from etcslurm.parent_death import forked_children_die_with_us
if sys.argv[1] == "armed":
    forked_children_die_with_us()
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
print(child, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for its new parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _grandchild_after_kill(mode: str, wait: float) -> tuple[int, bool]:
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE, mode], stdout=subprocess.PIPE,
                              text=True)
    try:
        grandchild = int(middle.stdout.readline())
        assert _alive(grandchild)
        middle.send_signal(signal.SIGKILL)
        middle.wait(timeout=10)
        deadline = time.monotonic() + wait
        while _alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        return grandchild, _alive(grandchild)
    finally:
        middle.kill()
        middle.wait(timeout=10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_forked_children_die_with_an_armed_process():
    _, alive = _grandchild_after_kill("armed", wait=10)
    assert not alive


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_without_arming_a_forked_child_outlives_its_parent():
    # the control: what the writer's workers did before
    grandchild, alive = _grandchild_after_kill("plain", wait=1)
    try:
        assert alive
    finally:
        if alive:
            os.kill(grandchild, signal.SIGKILL)
