"""Key names and the JSON rules for everything the coordinator stores.

Why a module of its own: the monitor and the tests read the same keys, and every value
that comes back from Redis is untrusted (another buggy process, a different run, a
hand-edited key).  So reads are size-bounded and decoded as JSON into plain dicts — never
pickle, never code — and a bad entry raises :class:`CoordinatorError` naming the key.
"""

from __future__ import annotations

import json
import re
from typing import Any

from etcslurm.errors import CoordinatorError, UsageError

PREFIX = "etcslurm"
#: Run ids are used inside key names: no glob characters, separators or spaces.
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
WORKER_STATES = ("joining", "active", "leaving", "gone")

#: Default bound on one stored JSON value (a generation record with plan inputs for a
#: few thousand ranks fits comfortably).
MAX_VALUE_BYTES = 4 * 1024 * 1024


def check_run_id(run_id: str) -> str:
    """``run_id`` if it is safe inside a key name, else :class:`UsageError`."""
    if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id):
        raise UsageError(
            f"invalid run id {run_id!r}: use 1-64 characters from A-Z a-z 0-9 _ . - "
            "(starting with a letter or digit)"
        )
    return run_id


def run_prefix(run_id: str) -> str:
    """``etcslurm:{run}:`` — every key of the run starts with this."""
    return f"{PREFIX}:{check_run_id(run_id)}:"


class Keys:
    """The key names of one run (see "Coordinator keys" in docs/architecture.md)."""

    def __init__(self, run_id: str) -> None:
        self.prefix = run_prefix(run_id)
        p = self.prefix
        self.spec = p + "spec"  # run spec, set once (SET NX)
        self.shapes = p + "shapes"  # the user's model's shapes, read from it (SET NX)
        self.workers = p + "workers"  # hash worker id -> JSON info + state
        self.worker_seq = p + "worker_seq"  # counter for worker ids
        self.gen = p + "gen"  # current generation JSON
        self.gen_no = p + "gen_no"  # its number, written with it: what waiters read (O(1))
        self.news = p + "news"  # stream of 'gen'/'committed' notices that waiters block on
        self.committed = p + "committed"  # number of the last generation every member entered
        self.events = p + "events"  # stream: type, ts, data (JSON), worker
        self.changes = p + "changes"  # list of JSON change requests (coord/records/change.py)
        self.checkpoint = p + "checkpoint"  # a JSON checkpoint request, until taken
        self.stores = p + "stores"  # set of store generations used (for end_run)
        self.ended = p + "ended"  # tombstone (with TTL) written by end_run
        # hash worker id -> the failed generation after which it stands by on its old state
        self.holding = p + "holding"

    def hb(self, worker_id: str) -> str:
        return f"{self.prefix}hb:{worker_id}"

    def store(self, generation: int | str) -> str:
        """The hash holding the torch.distributed store of one generation."""
        return f"{self.prefix}store:{generation}"

    def store_news(self, generation: int | str) -> str:
        """The stream a store's writes notify on, that its ``get``/``wait`` block on."""
        return f"{self.prefix}store:{generation}:news"

    def fixed(self) -> list[str]:
        """The keys whose names do not depend on workers or generations."""
        return [self.spec, self.shapes, self.workers, self.worker_seq, self.gen, self.gen_no,
                self.news, self.committed, self.events, self.changes, self.checkpoint,
                self.stores, self.holding]


def dumps(value: Any, what: str, max_bytes: int = MAX_VALUE_BYTES) -> bytes:
    """Canonical JSON bytes of ``value``; refuses non-JSON values and oversized ones."""
    try:
        data = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{what}: value is not plain JSON ({exc})") from None
    raw = data.encode("utf-8")
    if len(raw) > max_bytes:
        raise UsageError(f"{what}: {len(raw)} bytes of JSON exceeds the {max_bytes}-byte limit")
    return raw


def loads(raw: bytes | str | None, key: str, max_bytes: int = MAX_VALUE_BYTES) -> Any:
    """Decode one stored JSON value; a bad entry raises :class:`CoordinatorError` naming ``key``."""
    if raw is None:
        return None
    if len(raw) > max_bytes:
        raise CoordinatorError(
            f"coordinator entry {key} is {len(raw)} bytes, over the {max_bytes}-byte limit"
        )
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CoordinatorError(f"coordinator entry {key} is not valid JSON ({exc})") from None


def loads_dict(raw: bytes | str | None, key: str, max_bytes: int = MAX_VALUE_BYTES) -> dict | None:
    """Like :func:`loads` but the entry must be a JSON object."""
    value = loads(raw, key, max_bytes)
    if value is not None and not isinstance(value, dict):
        raise CoordinatorError(
            f"coordinator entry {key} is a JSON {type(value).__name__}, expected an object"
        )
    return value


def text(raw: bytes | str) -> str:
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
