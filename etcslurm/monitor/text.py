"""How the monitor prints its numbers and names (bytes, seconds, rates, signals, ranks)."""

from __future__ import annotations

import re
import signal as _signal
from typing import Any


def fmt_bytes(n: float | None) -> str:
    """Decimal units, as network rates are quoted: ``1.2 GB``."""
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            if unit == "B":
                return f"{int(value)} B"
            return f"{value:.1f} {unit}" if abs(value) < 100 else f"{value:.0f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"  # pragma: no cover


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "?"
    if s < 10:
        return f"{s:.1f} s"
    if s < 600:
        return f"{s:.0f} s"
    return f"{s / 60:.0f} min"


def fmt_rate(x: float | None) -> str:
    """Tokens/s as ``3.1k``."""
    if x is None:
        return "?"
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def signal_name(sig: Any) -> str:
    """``USR2`` from ``"SIGUSR2"``, ``"USR2"`` or ``12``."""
    if isinstance(sig, int) or (isinstance(sig, str) and sig.isdigit()):
        try:
            return _signal.Signals(int(sig)).name.removeprefix("SIG")
        except ValueError:
            return str(sig)
    return str(sig).upper().removeprefix("SIG") if sig else "?"


def rank_coord(rank: int, layout: str | None) -> tuple[int, int, int] | None:
    """(tp, pp, dp) of ``rank`` in megatron-core's order ``rank = tp + TP*(dp + DP*pp)``."""
    m = re.fullmatch(r"tp(\d+)pp(\d+)dp(\d+)", layout or "")
    if not m:
        return None
    tp, pp, dp = int(m[1]), int(m[2]), int(m[3])
    if not 0 <= rank < tp * pp * dp:
        return None
    return rank % tp, rank // (tp * dp), (rank // tp) % dp


def compact_ids(ids: list[str]) -> str:
    """``w9–w12`` for a consecutive run of ``w<n>`` ids, else ``a, b, c +2``."""
    nums = [int(m[1]) for i in ids if (m := re.fullmatch(r"w(\d+)", i))]
    if len(nums) == len(ids) > 2 and sorted(nums) == list(range(min(nums), max(nums) + 1)):
        return f"w{min(nums)}–w{max(nums)}"
    shown = ", ".join(ids[:4])
    return shown + (f" +{len(ids) - 4}" if len(ids) > 4 else "")


def natural_key(text: str) -> list[Any]:
    """``n2`` before ``n10``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text)]


def as_float(value: Any, default: float | None = None) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return default
