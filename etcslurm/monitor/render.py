"""Rich renderables for a :class:`~etcslurm.monitor.views.RunView`, sized to the terminal.

The screen is built line by line so it can be budgeted to the terminal's height (80×24
is the design size): header, devices by node, the current/last migration with a bar per
rank, and the event log filling what is left.  Bars are drawn with ``█``/``░`` rather
than rich's colour-only progress bar so they read the same without colour (ssh, tmux
``capture-pane``, ``NO_COLOR``).
"""

from __future__ import annotations

import io
import time

from rich.console import Console, Group
from rich.text import Text

from etcslurm.monitor.text import fmt_bytes, fmt_rate, fmt_seconds
from etcslurm.monitor.views import DeviceView, MigrationView, RankProgress, RunView

SPARK = "▁▂▃▄▅▆▇█"
TREND = {"down": ("↓", "green"), "up": ("↑", "red"), "flat": ("→", "yellow"), "": ("", "")}
STATE_STYLE = {
    "active": ("●", "green"),
    "joining": ("+", "cyan"),
    "leaving": ("◐", "yellow"),
    "gone": ("✗", "red dim"),
}
PHASE_STYLE = {
    "training": "green",
    "migrating": "yellow",
    "ended": "blue",
    "waiting": "dim",
}
MIN_EVENT_LINES = 3


def sparkline(values: list[float], width: int = 12) -> str:
    """The last ``width`` values as block characters, scaled to their own min..max."""
    xs = values[-width:]
    if not xs:
        return ""
    lo, hi = min(xs), max(xs)
    span = hi - lo
    if span <= 0:
        return SPARK[3] * len(xs)
    return "".join(SPARK[min(7, int((x - lo) / span * 7.999))] for x in xs)


def bar(fraction: float, width: int) -> str:
    """A monochrome-readable bar: ``█████░░░░░``."""
    fraction = min(1.0, max(0.0, fraction))
    full = int(fraction * width)  # a bar is full only when the work is
    return "█" * full + "░" * (width - full)


def _line(*parts: tuple[str, str] | str) -> Text:
    text = Text(no_wrap=True, overflow="ellipsis")
    for part in parts:
        if isinstance(part, tuple):
            text.append(*part)
        else:
            text.append(part)
    return text


def _rule(title: str, width: int, extra: str = "") -> Text:
    head = f"─ {title} "
    if extra:
        head += f"{extra} "
    return _line((head, "bold"), ("─" * max(0, width - len(head)), "dim"))


def header(view: RunView) -> list[Text]:
    """Two lines: what runs (run, phase, generation, layout) and how it trains."""
    phase_style = PHASE_STYLE.get(view.phase, "")
    first = _line(
        (" etcslurm ", "bold reverse"),
        " run ",
        (view.run, "bold"),
        "  ",
        (view.phase, phase_style),
        "  gen ",
        (str(view.gen) if view.gen is not None else "-", "bold"),
        "  ",
        (view.layout or "no layout yet", "bold magenta"),
        f" (world {view.world})" if view.world else "",
        ("  coordinator " if view.coordinator else "", "dim"),
        (view.coordinator or "", "red" if (view.coordinator or "").startswith("no ") else ""),
    )
    arrow, style = TREND.get(view.loss_trend, ("", ""))
    second = _line(
        " step ",
        (str(view.step) if view.step is not None else "-", "bold"),
        "   tokens/s ",
        (fmt_rate(view.tokens_per_s) if view.tokens_per_s is not None else "-", "bold"),
        "   loss ",
        (f"{view.loss:.4f}" if view.loss is not None else "-", "bold"),
        " ",
        (arrow, style),
        " ",
        (sparkline(view.loss_history), "cyan"),
    )
    return [first, second]


def _device_cell(d: DeviceView, compact: bool = False) -> Text:
    """``r3(1,0,1)●``; compact (many devices): ``r3●``, states as marks only."""
    glyph, style = STATE_STYLE.get(d.state, ("?", "magenta"))
    text = Text()
    if d.rank is not None:
        text.append(f"r{d.rank}", "bold")
        if not compact:
            text.append(f"({d.tp},{d.pp},{d.dp})", "dim" if d.state == "gone" else "")
    else:
        text.append(d.worker, "dim" if d.state == "gone" else "bold")
    text.append(glyph, style)
    if d.state == "leaving":
        text.append(f"{d.seconds_left:.0f}s" if d.seconds_left is not None else "leaving", style)
    elif d.state != "active" and not compact:
        text.append(d.state, style)
    return text


def _device_lines(view: RunView, width: int, compact: bool) -> list[Text]:
    label_w = max([len(n.name) for n in view.nodes] + [2]) + 1
    lines: list[Text] = []
    for node in view.nodes:
        line = _line((node.name.ljust(label_w), "bold blue"))
        for d in node.devices:
            cell = _device_cell(d, compact)
            if line.cell_len + 1 + cell.cell_len > width and line.cell_len > label_w:
                lines.append(line)
                line = _line(" " * label_w)
            line.append(" ")
            line.append_text(cell)
        lines.append(line)
    return lines


def devices(view: RunView, width: int, max_lines: int) -> list[Text]:
    """One line per node (wrapped when a node has many devices; compact cells when the
    full ones do not fit; then truncated)."""
    lines = _device_lines(view, width, compact=False)
    if len(lines) > max_lines:
        lines = _device_lines(view, width, compact=True)
    if len(lines) > max_lines:
        hidden = len(lines) - max_lines + 1
        lines = [*lines[: max_lines - 1], _line((f"… {hidden} more lines of devices", "dim"))]
    return lines


def _rank_tail(r: RankProgress, done: bool) -> str:
    rate = f"{r.gbps:.2f} GB/s" if r.gbps is not None else "- GB/s"
    if r.fraction >= 1.0 or done:
        eta = "done"
    elif r.eta_s is not None:
        eta = f"eta {fmt_seconds(r.eta_s)}"
    else:
        eta = "eta ?"
    return (
        f" ↑{fmt_bytes(r.sent)}/{fmt_bytes(r.total_send)}"
        f" ↓{fmt_bytes(r.recv)}/{fmt_bytes(r.total_recv)} {rate} {eta}"
    )


def _rank_line(r: RankProgress, tail: str, bar_w: int) -> Text:
    label = f"r{r.rank}" if r.rank is not None else r.worker
    return _line(
        (f"{label:<4}", "bold"),
        (bar(r.fraction, bar_w), "green" if r.fraction >= 1.0 else "yellow"),
        f"{r.fraction * 100:4.0f}%",
        tail,
    )


def _rank_cell(r: RankProgress, width: int, done: bool) -> Text:
    """The compact form used in two columns when the ranks do not fit one per line."""
    label = f"r{r.rank}" if r.rank is not None else r.worker
    if r.gbps is None:
        rate = "-"
    elif r.gbps < 1:
        rate = f"{r.gbps * 1000:.0f}MB/s"
    else:
        rate = f"{r.gbps:.1f}GB/s"
    return _line(
        (f"{label:<4}", "bold"),
        (bar(r.fraction, max(4, width - 22)), "green" if r.fraction >= 1.0 else "yellow"),
        f"{r.fraction * 100:4.0f}% {rate:>7}",
    )


def migration(m: MigrationView, width: int, max_lines: int) -> list[Text]:
    """Title, totals, one bar per rank (two columns or truncated when short of room)."""
    arrow = f"{m.from_layout} → {m.to_layout}" if m.from_layout else f"to {m.to_layout}"
    state = f"done in {fmt_seconds(m.seconds)}" if m.done else "running"
    lines = [_rule(f"Migration gen {m.gen}", width, f"{arrow} · {state}")]
    if m.done:
        totals = _line(
            " moved ",
            (fmt_bytes(m.moved_bytes if m.moved_bytes is not None else m.bytes_done), "bold"),
            "  local ",
            (fmt_bytes(m.local_bytes), "bold"),
            "  checkpoint ",
            (fmt_bytes(m.checkpoint_bytes or 0), "bold"),
            "  pause ",
            (fmt_seconds(m.pause_seconds), "bold"),
        )
    else:
        totals = _line(
            " sent ",
            (f"{fmt_bytes(m.bytes_done)} of {fmt_bytes(m.bytes_total)}", "bold"),
            f" by {len(m.ranks)} ranks",
        )
    lines.append(totals)
    room = max_lines - len(lines)
    ranks = [r for r in m.ranks if r.total_send + r.total_recv > 0] or m.ranks
    if room <= 0 or not ranks:
        return lines[:max_lines]
    if len(ranks) <= room:
        tails = [_rank_tail(r, m.done) for r in ranks]
        # one bar width for all ranks, so the bars line up
        bar_w = max(6, min(20, width - 4 - 5 - max(len(t) for t in tails)))
        lines += [_rank_line(r, t, bar_w) for r, t in zip(ranks, tails, strict=True)]
        return lines
    # two columns; unfinished ranks first when even that does not fit
    col = (width - 1) // 2
    if (len(ranks) + 1) // 2 > room:
        ranks = sorted(ranks, key=lambda r: r.fraction >= 1.0)
        keep = max(0, (room - 1) * 2)
        hidden = len(ranks) - keep
        ranks = ranks[:keep]
    else:
        hidden = 0
    for i in range(0, len(ranks), 2):
        left = _rank_cell(ranks[i], col, m.done)
        left.truncate(col, pad=True)
        line = _line()
        line.append_text(left)
        if i + 1 < len(ranks):
            line.append(" ")
            line.append_text(_rank_cell(ranks[i + 1], col, m.done))
        lines.append(line)
    if hidden:
        lines.append(_line((f" … {hidden} more ranks", "dim")))
    return lines


def event_lines(view: RunView, count: int) -> list[Text]:
    out = []
    for e in view.events[-count:] if count > 0 else []:
        stamp = time.strftime("%H:%M:%S", time.localtime(e.ts))
        style = "red" if e.type == "error" else "yellow" if e.type in (
            "worker.signal", "node.released") else ""
        times = f" (×{e.count})" if e.count > 1 else ""
        out.append(_line((stamp + " ", "dim"), (e.text + times, style)))
    return out


def build(view: RunView, width: int = 80, height: int = 24) -> Group:
    """The whole screen for a terminal of ``width`` × ``height``."""
    top = header(view)
    budget = height - len(top) - 2 - MIN_EVENT_LINES  # 2 = devices and events rules
    dev = devices(view, width, max(1, budget // 3 if view.migration else budget))
    lines = [*top, _rule("Devices", width, f"{sum(len(n.devices) for n in view.nodes)} workers")]
    lines += dev or [_line(("  (no workers registered yet)", "dim"))]
    budget = height - len(lines) - 1 - MIN_EVENT_LINES
    if view.migration is not None and budget >= 2:
        lines += migration(view.migration, width, budget)
    lines.append(_rule("Events", width))
    lines += event_lines(view, height - len(lines))
    return Group(*lines[:height])


def render_run(view: RunView, width: int = 80, height: int = 24) -> str:
    """The screen as plain text (no colour), e.g. for tests and the README screenshot."""
    console = Console(
        file=io.StringIO(), width=width, height=height, color_system=None,
        force_terminal=False, record=True, legacy_windows=False,
    )
    console.print(build(view, width, height))
    return console.export_text(styles=False)
