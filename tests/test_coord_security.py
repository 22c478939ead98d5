"""Security properties that hold for the code itself (no server needed).

The package must never deserialize code: no pickle (or its relatives) anywhere in
``etcslurm/``.  The check parses the code (``ast``) so docstrings and comments that *say*
"never pickle" do not count, but any import or use does.

The bundled Redis listens on loopback unless asked otherwise (checked in the kernel's
socket table, with a private server this file starts).  Password and run isolation are
checked against a live server in test_coord_server.py, test_coord_coordinator.py and
test_bad_input.py.
"""

from __future__ import annotations

import ast
import socket
from pathlib import Path

import pytest

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


def _listening(port: int) -> list[str]:
    """Local addresses (dotted IPv4 / ``v6:<hex>``) of the sockets listening on ``port``."""
    found = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr, hexport = fields[1].split(":")
            if fields[3] != "0A" or int(hexport, 16) != port:  # 0A: LISTEN
                continue
            if v6:
                found.append(f"v6:{addr}")
            else:
                found.append(".".join(str(b) for b in reversed(bytes.fromhex(addr))))
    return found


def _first_non_loopback_ipv4() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: only picks a route
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def test_bundled_redis_listens_on_loopback_unless_asked(tmp_path):
    """The kernel's socket table, not the config file: only 127.0.0.1 listens by default;
    a non-loopback address of this host cannot reach it; ``host=`` opens it on request."""
    from etcslurm.redis_host.server import BundledRedis

    with BundledRedis(tmp_path / "a") as srv:
        assert _listening(srv.port) == ["127.0.0.1"]
        ip = _first_non_loopback_ipv4()
        if ip is not None:
            with socket.socket() as s, pytest.raises(OSError):
                s.settimeout(2)
                s.connect((ip, srv.port))
    with BundledRedis(tmp_path / "b", host="0.0.0.0") as srv:
        assert _listening(srv.port) == ["0.0.0.0"]


def test_coordinator_cli_binds_loopback_by_default():
    from etcslurm.cli import build_parser

    args = build_parser().parse_args(["coordinator", "start", "somewhere"])
    assert args.bind == "127.0.0.1"
