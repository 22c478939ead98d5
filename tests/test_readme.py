"""The README is the front page: short, undated, and every figure it quotes stands in a
results file a benchmark wrote (``docs/results/``, with its command, commit and date)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RESULTS = ROOT / "docs" / "results"

#: a figure: a number with a unit or a ratio sign ("0.11 s", "161×", "99.2 %", "1.5 GB")
FIGURE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)\s?(s|ms|×|x|%|GB|GiB|MB|MiB|GB/s)(?![\w])")


def _performance() -> str:
    return README.split("## Performance", 1)[1].split("\n## ", 1)[0]


def test_the_readme_is_a_front_page() -> None:
    assert len(README.splitlines()) <= 200
    assert README.startswith("# etcslurm")
    assert "./sbin/demo" in README.split("\n## ", 2)[1] and "./sbin/test" in README
    for heading in ("## Install", "## Adopt it in your loop", "## On Slurm",
                    "## What is supported", "## Performance"):
        assert heading in README, heading
    assert not re.search(r"20\d\d-\d\d-\d\d|issue [0-9]+|\b\d\d-\d\d\)", README)


def test_every_figure_the_readme_quotes_is_in_a_results_file() -> None:
    section = _performance()
    files = {p.name: p.read_text() for p in RESULTS.glob("*.md")} if RESULTS.is_dir() else {}
    for link in re.findall(r"\(docs/results/([\w.-]+\.md)\)", section):
        assert link in files, f"the README links docs/results/{link}, which does not exist"
    everything = "\n".join(files.values())
    quoted = [m.group(0) for m in FIGURE.finditer(section)]
    missing = [q for q in quoted if q not in everything]
    assert not missing, f"figures quoted in the README that no results file holds: {missing}"


def test_every_link_of_the_readme_exists() -> None:
    for target in re.findall(r"\]\(((?:docs|examples)/[^)#]+)\)", README):
        assert (ROOT / target).exists(), target
