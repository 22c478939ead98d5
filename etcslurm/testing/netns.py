"""Test hosts on a private network: one Linux network namespace per node, joined by a
bridge in the test's own namespace, so a test can cut and slow links between them.

The layout (``k``: a per-test number, so tests and their leftovers never collide)::

    host namespace:  bridge etcbr<k>  10.<k>.0.1/24   (Redis listens here)
    node n0:         namespace etcns<k>-n0, eth0 10.<k>.0.10/24
    node n1:         namespace etcns<k>-n1, eth0 10.<k>.0.11/24   ...

A partition is a set of blackhole routes inside the namespaces (a packet to a cut-off
address is dropped by the sender's kernel; no netfilter needed), healed by deleting
them.  A slow, lossy link is a token-bucket qdisc (``tbf``) on a node's interface: its
rate bounds the bandwidth and its small queue drops what overflows, so TCP sees loss
and retransmits.  Only addresses of this test's bridge are ever touched; ``close``
removes every namespace, link and route it made, and runs at exit too.

Workers enter their node's namespace at start (:func:`enter`), through
``python -m etcslurm.testing.worker --netns PREFIX``; gloo then binds to the node's
``eth0`` (``GLOO_SOCKET_IFNAME``).  Needs root and ``ip``/``tc`` (iproute2).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import subprocess
from collections.abc import Iterable

#: ``CLONE_NEWNET`` from <sched.h>: setns() into a network namespace
_CLONE_NEWNET = 0x40000000
IFNAME = "eth0"


def available() -> str | None:
    """Why this host cannot make test networks (``None``: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30,
                          check=check)


def enter(name: str) -> None:
    """Move this process (its calling thread: call it before any other thread starts)
    into network namespace ``name`` and bind gloo to that namespace's interface."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)
    os.environ["GLOO_SOCKET_IFNAME"] = IFNAME


class TestNetwork:
    """Namespaces for ``nodes`` on one bridge; cut, heal and shape their links."""

    def __init__(self, nodes: Iterable[str], number: int | None = None) -> None:
        self.number = number if number is not None else 100 + os.getpid() % 150
        self.prefix = f"etcns{self.number}-"
        self.bridge = f"etcbr{self.number}"
        self.host_ip = f"10.{self.number}.0.1"
        self.nodes = list(nodes)
        self.ips = {n: f"10.{self.number}.0.{10 + i}" for i, n in enumerate(self.nodes)}
        self._cuts: set[tuple[str, str]] = set()
        self._made: list[str] = []
        self._closed = False

    # ---- lifetime ---------------------------------------------------------------------
    def __enter__(self) -> TestNetwork:
        self.close(quiet=True)  # what an earlier, killed test of this number left
        self._closed = False
        atexit.register(self.close, quiet=True)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, node in enumerate(self.nodes):
            ns, veth = self.namespace(node), f"etcv{self.number}-{i}"
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", IFNAME, "netns", ns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.ips[node]}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, quiet: bool = False) -> None:
        """Remove every namespace (and with it its veth end) and the bridge."""
        if self._closed:
            return
        for node in self.nodes:
            _ip("netns", "del", self.namespace(node), check=False)
        _ip("link", "del", self.bridge, check=False)
        self._made.clear()
        self._cuts.clear()
        self._closed = True

    def leftovers(self) -> list[str]:
        """Namespaces or links of this network still present (``[]`` after ``close``)."""
        names = _ip("netns", "list", check=False).stdout
        links = _ip("-o", "link", "show", check=False).stdout
        return ([n for n in self.nodes if self.namespace(n) in names]
                + ([self.bridge] if f" {self.bridge}:" in links else []))

    # ---- names ------------------------------------------------------------------------
    def namespace(self, node: str) -> str:
        return f"{self.prefix}{node}"

    # ---- partitions -------------------------------------------------------------------
    def _route(self, op: str, node: str, address: str) -> None:
        _ip("-n", self.namespace(node), "route", op, "blackhole", f"{address}/32",
            check=op == "add")

    def cut(self, node: str, *, peers: bool = False, coordinator: bool = False) -> None:
        """Cut ``node`` off from the other nodes (both ways) and/or from the host's
        address (the coordinator)."""
        if coordinator:
            self._route("add", node, self.host_ip)
            self._cuts.add((node, self.host_ip))
        if peers:
            for other in self.nodes:
                if other != node:
                    self._route("add", node, self.ips[other])
                    self._route("add", other, self.ips[node])
                    self._cuts |= {(node, self.ips[other]), (other, self.ips[node])}

    def heal(self) -> None:
        """Remove every cut."""
        for node, address in sorted(self._cuts):
            self._route("del", node, address)
        self._cuts.clear()

    # ---- a slow, lossy link -----------------------------------------------------------
    def shape(self, node: str, *, rate: str = "4mbit", queue: str = "16kb") -> None:
        """Slow ``node``'s link to ``rate``; packets beyond a ``queue`` of backlog drop."""
        subprocess.run(["ip", "netns", "exec", self.namespace(node), "tc", "qdisc", "add",
                        "dev", IFNAME, "root", "tbf", "rate", rate, "burst", "8kb",
                        "limit", queue], capture_output=True, text=True, timeout=30,
                       check=True)

    def unshape(self, node: str) -> None:
        subprocess.run(["ip", "netns", "exec", self.namespace(node), "tc", "qdisc", "del",
                        "dev", IFNAME, "root"], capture_output=True, text=True, timeout=30,
                       check=False)

    def drops(self, node: str) -> int:
        """Packets the node's qdisc dropped (its ``tc -s`` counter)."""
        out = subprocess.run(["ip", "netns", "exec", self.namespace(node), "tc", "-s",
                              "qdisc", "show", "dev", IFNAME], capture_output=True,
                             text=True, timeout=30, check=False).stdout
        words = out.replace(",", " ").split()
        return int(words[words.index("dropped") + 1]) if "dropped" in words else 0
