"""Benchmark results as files: what ran, on what, when, and the figures.

Why: every figure the README and the docs quote must be traceable to the run that
produced it.  A benchmark given ``--write-results`` writes ``docs/results/NAME.md``:
the command, the commit (and whether the tree had uncommitted changes), the date, the
machine, the table it printed, and its raw figures as JSON.  ``tests/test_readme.py``
fails when the README quotes a figure no results file holds.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

#: where results files live (the repository's docs/results)
RESULTS_DIR = Path(__file__).resolve().parents[2] / "docs" / "results"


def _git(*args: str) -> str | None:
    """``git ARGS``'s output in the repository, or None (no git, not a checkout)."""
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                             cwd=RESULTS_DIR.parent.parent, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def machine() -> str:
    """One line: OS, CPU count, memory, accelerator."""
    memory = "?"
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        memory = f"{pages * size / 2**30:.0f} GiB"
    except (ValueError, OSError):
        pass
    gpu = "no GPU"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return (f"{platform.system()} {platform.release()}, {os.cpu_count()} CPUs, {memory}, "
            f"{gpu}, Python {platform.python_version()}")


def write_results(name: str, table: str, data: Any, *, title: str | None = None,
                  notes: str = "", argv: list[str] | None = None,
                  directory: Path = RESULTS_DIR) -> Path:
    """Write ``directory/NAME.md`` (see the module docstring); returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    commit = _git("rev-parse", "--short=12", "HEAD") or "?"
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    command = shlex.join(argv if argv is not None else [Path(sys.argv[0]).name, *sys.argv[1:]])
    header = [
        f"# {title or name}",
        "",
        f"- command: `{command}`",
        f"- commit: `{commit}`" + (" (with uncommitted changes)" if dirty else ""),
        f"- date: {dt.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- machine: {machine()}",
        "",
    ]
    body = [table.rstrip(), ""]
    if notes:
        body += [notes.rstrip(), ""]
    body += ["```json", json.dumps(data, indent=1, default=str), "```", ""]
    path = directory / f"{name}.md"
    path.write_text("\n".join(header + body))
    return path


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A GitHub-flavoured markdown table."""
    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
