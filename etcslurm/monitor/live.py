"""The monitor's refresh loop: a rich Live screen on a terminal, plain lines otherwise.

Low CPU by construction: the loop sleeps inside a blocking ``XREAD`` until an event comes
or the next redraw is due, folds whatever arrived, re-reads the three small keys every
``KEYS_EVERY`` seconds, and redraws every ``REFRESH`` seconds (countdowns and ETAs move
even when no event does) or at once when events arrived — at least twice a second, never
busy-waiting.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import TextIO

from rich.console import Console
from rich.live import Live

from etcslurm.coord.records import Event, Step
from etcslurm.monitor.model import RunModel
from etcslurm.monitor.render import build, render_run
from etcslurm.monitor.source import RunSource
from etcslurm.monitor.text import fmt_bytes, fmt_rate
from etcslurm.monitor.views import Refused

BLOCK_MS = 250
KEYS_EVERY = 0.5
#: how often a replicated coordinator's Sentinels are asked where the primary is
COORD_EVERY = 2.0
REFRESH = 0.4
MIN_REDRAW = 0.1
#: Set by Ctrl-C / SIGTERM: the loops finish their turn and return 0.
STOP = threading.Event()


def plain_line(event: Event | Refused, model: RunModel) -> str | None:
    """Fold ``event`` into ``model``; the line a non-terminal reader should see, if any.

    Every event with a human log line prints it; ``step`` prints its numbers; of the many
    ``migration.progress`` events only a rank's last one (all bytes through) prints.
    """
    line = model.apply(event)
    if line is not None:
        text = line
    elif isinstance(event, Refused):
        return None
    elif isinstance(event.data, Step):
        d = event.data
        text = f"step {d.step} gen {d.gen} loss {d.loss:.4f}"
        if d.tokens_per_s is not None:
            text += f" {fmt_rate(d.tokens_per_s)} tok/s"
    elif event.type == "migration.progress" and model.finished_rank is not None:
        r = model.finished_rank
        who = f"rank {r.rank} ({r.worker})" if r.rank is not None else r.worker
        text = (
            f"gen {getattr(event.data, 'gen', '?')}: {who} migrated, "
            f"{fmt_bytes(r.sent)} sent, {fmt_bytes(r.recv)} received"
        )
    else:
        return None
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event.ts))
    return f"{stamp} {text}"


def follow_plain(source: RunSource, model: RunModel, out: TextIO, stop_at_end: bool = True,
                 max_seconds: float | None = None) -> int:
    """Print one line per event (history first, then as they come); ends at ``run.end``."""
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    block = 0
    last_coord = -COORD_EVERY
    while not STOP.is_set():
        events = source.read_events(model.last_id, block_ms=block)
        for e in events:
            text = plain_line(e, model)
            if text:
                out.write(text + "\n")
        if time.monotonic() - last_coord >= COORD_EVERY:
            last_coord = time.monotonic()
            line = model.set_coordinator(source.read_coordinator(), time.time())
            if line:
                stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                out.write(f"{stamp} {line}\n")
        out.flush()
        if stop_at_end and model.ended:
            return 0
        if deadline is not None and time.monotonic() >= deadline:
            return 0
        block = BLOCK_MS if not events else 0
    return 0


def follow_live(source: RunSource, model: RunModel, console: Console,
                max_seconds: float | None = None) -> int:
    """The full-screen view until Ctrl-C (or ``max_seconds``, for tests)."""
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    source.catch_up(model)
    last_keys = last_draw = last_coord = time.monotonic()

    def screen() -> object:
        return build(model.view(time.time()), console.width, console.height)

    with Live(screen(), console=console, screen=True, auto_refresh=False,
              redirect_stdout=False, redirect_stderr=False) as live:
        while not STOP.is_set() and (deadline is None or time.monotonic() < deadline):
            # sleep in XREAD until an event comes or the next redraw is due
            wait = min(BLOCK_MS / 1000, last_draw + REFRESH - time.monotonic())
            events = source.read_events(model.last_id, block_ms=max(1, int(wait * 1000)))
            for e in events:
                model.apply(e)
            now = time.monotonic()
            new_gen = any(e.type == "generation.start" for e in events)
            # the gen key has the full assignment at once; else it shows ≤ REFRESH later
            if new_gen or now - last_keys >= KEYS_EVERY:
                model.set_keys(**source.read_keys())
                last_keys = now
            if now - last_coord >= COORD_EVERY:
                model.set_coordinator(source.read_coordinator(), time.time())
                last_coord = now
            due = now - last_draw >= REFRESH
            if due or (events and now - last_draw >= MIN_REDRAW):
                live.update(screen(), refresh=True)
                last_draw = now
    return 0


def _stop_on_signals() -> None:
    """Ctrl-C and SIGTERM (``etcslurm demo`` ending its monitor) ask the loop to stop at its
    next turn (≤ ``BLOCK_MS``) rather than raising in the middle of a screen write, so the
    terminal always gets its normal screen and cursor back.  A second Ctrl-C stops at once.
    """
    STOP.clear()
    if threading.current_thread() is not threading.main_thread():
        return

    def stop(signum: int, frame: object) -> None:
        if STOP.is_set():
            raise KeyboardInterrupt
        STOP.set()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


def monitor(source: RunSource, once: bool = False, out: TextIO | None = None,
            tty: bool | None = None, max_seconds: float | None = None) -> int:
    """``etcslurm monitor``: pick the mode from ``--once`` and whether ``out`` is a TTY."""
    out = out or sys.stdout
    tty = out.isatty() if tty is None else tty
    model = RunModel(source.run)
    _stop_on_signals()
    try:
        if once:
            source.catch_up(model)
            if tty:
                console = Console(file=out)
                console.print(build(model.view(time.time()), console.width, console.height))
            else:
                out.write(render_run(model.view(time.time())))
                out.flush()
            return 0
        if not tty:
            return follow_plain(source, model, out, max_seconds=max_seconds)
        return follow_live(source, model, Console(file=out), max_seconds=max_seconds)
    except KeyboardInterrupt:  # Ctrl-C is how one leaves a monitor: not an error
        return 0
