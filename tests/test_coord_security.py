"""Security properties that hold for the code itself (no server needed).

The package must never deserialize code: no pickle (or its relatives) anywhere in
``etcslurm/``.  The check parses the code (``ast``) so docstrings and comments that *say*
"never pickle" do not count, but any import or use does.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "etcslurm"
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "jsonpickle",
                  "marshal", "shelve"}
UNSAFE_CALLS = {"eval", "exec"}


def _unsafe_uses(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    hits = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module.split(".")[0]] + [a.name for a in node.names]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        bad = [n for n in names if n in UNSAFE_MODULES or n in UNSAFE_CALLS]
        if bad:
            hits.append(f"{path.relative_to(root)}:{node.lineno}: {bad[0]}")
    return hits


def test_no_pickle_anywhere_in_package():
    hits = [h for p in sorted(PACKAGE.rglob("*.py")) for h in _unsafe_uses(p)]
    assert hits == [], "pickle/eval used in etcslurm/ (JSON only):\n" + "\n".join(hits)


def test_checker_finds_pickle_but_not_docstrings(tmp_path):
    f = tmp_path / "x.py"
    f.write_text('"""never pickle"""\nimport pickle  # pickle\nobj = pickle.loads(b"")\n')
    assert _unsafe_uses(f, tmp_path) == ["x.py:2: pickle", "x.py:3: pickle"]
