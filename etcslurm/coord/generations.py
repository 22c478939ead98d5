"""Generations: publish one (compare-and-set), wait for the next, commit it.

A generation is one world of the run (:class:`~etcslurm.coord.records.GenerationRecord`,
the ``gen`` key).  Exactly one of several would-be publishers wins the compare-and-set;
the script writes the record, its number (``gen_no``) and a notice on the ``news``
stream in one step, so waiters block on the stream (O(1) each) and read the record once.
With a replicated coordinator a publish or commit returns only once a replica has it,
and :meth:`Generations.wait` hands out a record only once a replica has it: a failover
never forgets a decision anyone acted on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from etcslurm.coord import schema, scripts
from etcslurm.coord.events import EventLog
from etcslurm.coord.records import GenerationRecord, GenerationStart, replace
from etcslurm.coord.run import RunHandle
from etcslurm.coord.schema import loads_dict
from etcslurm.errors import RecordError, UsageError, WaitTimeout

#: notices kept on the ``news`` stream (waiters only need the newest)
NEWS_CAP = 100
#: longest single XREAD BLOCK of a wait: a wait re-reads the head this often, so a record
#: written behind the scripts' back (a hand-edited key) is still seen within this time
NEWS_BLOCK_S = 2.0


@dataclass(frozen=True)
class GenerationHead:
    """What a waiting worker needs, read in one O(1) call (:meth:`Generations.head`):
    the current generation's number (``-1``: none), the last committed one (``-1``:
    none) and ``cursor``, the id of the newest notice on the ``news`` stream (block after
    it to hear of the next publish or commit)."""

    generation: int
    committed: int
    cursor: str


class Generations:
    """The generation record, its number, the commit and the ``news`` stream of one run.

    ``leader`` names the current leader for a wait's timeout message.
    """

    def __init__(self, run: RunHandle, events: EventLog,
                 leader: Callable[[], str | None]) -> None:
        self.run = run
        self.events = events
        self.leader = leader
        r = run.client.redis
        self._gen_cas = r.register_script(scripts.GEN_CAS)
        self._gen_head = r.register_script(scripts.GEN_HEAD)
        self._commit = r.register_script(scripts.COMMIT)

    def publish(self, record: GenerationRecord) -> bool:
        """Publish ``record`` if the current generation is ``record.generation - 1``.

        Atomic compare-and-set: among concurrent publishers of the same number exactly one
        gets ``True``; the others get ``False`` and should :meth:`wait`.  The stored
        record gets ``published_by`` / ``published_at``.  Emits ``generation.start`` on
        success.
        """
        if not isinstance(record, GenerationRecord):
            raise UsageError(f"publish_generation needs a GenerationRecord, got "
                             f"{type(record).__name__}")
        run, k = self.run, self.run.keys
        n = record.generation
        doc = replace(record, published_by=run.who, published_at=time.time()).to_json()
        raw = run.dumps(doc, k.gen)

        def _cas(r: Any) -> tuple[int, int]:
            won, prev = self._gen_cas(keys=[k.gen, k.gen_no, k.news],
                                      args=[n - 1, raw, n, NEWS_CAP])
            if not int(won) and int(prev) == n and r.get(k.gen) == raw:
                return 1, n - 1  # our own write, done before a failover, survived
            return int(won), int(prev)

        won, _prev = run.decided("publish generation", _cas)
        if int(won):
            self.events.emit("generation.start", **GenerationStart.of(record).to_json())
        return bool(int(won))

    def commit(self, generation: int) -> None:
        """Record that every member of ``generation`` has entered it (its state is complete
        everywhere): workers that left the world may go.  One small key, so waiting
        workers read it cheaply; it only moves forward, and a move wakes the workers
        blocked in :meth:`watch` (a ``committed`` notice on the ``news`` stream)."""
        k = self.run.keys
        self.run.decided("commit generation", lambda r: self._commit(
            keys=[k.committed, k.ended, k.news], args=[int(generation), NEWS_CAP]))

    def committed(self) -> int:
        """The last committed generation (``-1`` before the first)."""
        key = self.run.keys.committed
        raw = self.run.client.call("read commit", lambda r: r.get(key))
        return -1 if raw is None else int(schema.text(raw))

    def current(self) -> GenerationRecord | None:
        """The current generation record, or ``None`` before the first.

        A record this version cannot read raises :class:`RecordError` naming the field.
        """
        key = self.run.keys.gen
        return _parse_record(self.run.read_raw(key, None), key, self.run.max_value_bytes)

    def head(self) -> GenerationHead:
        """The current and committed generation numbers and the news cursor: one O(1)
        call, whatever the size of the run or of its record."""
        k = self.run.keys
        gen, committed, cursor = self.run.client.call(
            "read generation head",
            lambda r: self._gen_head(keys=[k.gen, k.gen_no, k.committed, k.news]))
        return GenerationHead(int(gen), int(committed), schema.text(cursor))

    def watch(self, generation: int, timeout: float,
              committed: int | None = None) -> GenerationHead:
        """Block until a generation numbered above ``generation`` is published (or, with
        ``committed``, one above it is committed), at most ``timeout`` seconds; return
        the head then (the caller sees which, or that neither happened: no exception).

        Why a stream and not a poll of the record: a waiter costs Redis O(1) per
        ``NEWS_BLOCK_S`` instead of reading (and parsing) the whole O(N) record every
        0.1 s, and wakes as soon as the publish or the commit happens, not at its next
        poll.  The record itself is read once, by :meth:`wait`.
        """
        end = time.monotonic() + timeout
        head = self.head()
        news = self.run.keys.news
        cap = max(0.001, min(NEWS_BLOCK_S, self.run.socket_timeout() - 0.5))
        while not (head.generation > generation
                   or (committed is not None and head.committed > committed)):
            left = end - time.monotonic()
            if left <= 0:
                break
            block_ms = max(1, int(min(left, cap) * 1000))
            cursor = head.cursor
            resp = self.run.client.call(
                "wait for generation news",
                lambda r, c=cursor, b=block_ms: r.xread({news: c}, count=NEWS_CAP, block=b))
            head = _advance(head, resp) if resp else self.head()
        return head

    def wait(self, after: int, timeout: float) -> GenerationRecord:
        """Wait until a generation numbered above ``after`` is published; return it.

        The wait blocks on the ``news`` stream (:meth:`watch`, O(1) per waiter); the
        record is read once, when its number says it is there.  With a replicated
        coordinator the record is returned only once a replica has it (read again
        behind a ``WAIT``), so no worker acts on a record a failover could still forget.
        """
        end = time.monotonic() + timeout
        while True:
            head = self.watch(after, max(0.0, end - time.monotonic()))
            if head.generation > after:
                rec = self._confirmed() if self.run.client.acks > 0 else self.current()
                if rec is not None and rec.generation > after:
                    return rec
                # the number ran ahead of the record (a key deleted by hand): look again
            left = end - time.monotonic()
            if left <= 0:
                raise WaitTimeout(
                    f"run {self.run.run_id}: no generation after {after} published within "
                    f"{timeout:g} s (current: {head.generation if head.generation >= 0 else None}, "
                    f"committed: {head.committed}, leader: {self.leader()})"
                )
            time.sleep(min(0.05, left))

    def _confirmed(self) -> GenerationRecord | None:
        """The current generation record, read again and acknowledged by a replica."""
        key = self.run.keys.gen
        raw = self.run.confirmed_raw(key, "confirm generation")
        return _parse_record(raw, key, self.run.max_value_bytes)


def _advance(head: GenerationHead, resp: Any) -> GenerationHead:
    """``head`` moved past the notices of an XREAD answer (no further round trip)."""
    gen, committed, cursor = head.generation, head.committed, head.cursor
    for _stream, entries in resp:
        for eid, fields in entries:
            cursor = schema.text(eid)
            for name, value in fields.items():
                try:
                    number = int(schema.text(value))
                except ValueError:
                    continue  # not ours to judge: the head re-read will say
                if schema.text(name) == "gen":
                    gen = max(gen, number)
                elif schema.text(name) == "committed":
                    committed = max(committed, number)
    return GenerationHead(gen, committed, cursor)


#: the last generation record parsed in this process: (key, stored bytes, record)
_last_record: tuple[str, bytes, GenerationRecord] | None = None


def _parse_record(raw: bytes | None, key: str, max_bytes: int) -> GenerationRecord | None:
    """The record stored as ``raw`` under ``key`` (``None``: no record).

    Records are immutable and a worker reads the same one several times (the wait, the
    follower's checks, the leaver's), as do the threads of one process (several handles,
    the benchmark's simulated workers): the same bytes are parsed once (O(N) at N
    workers: some milliseconds at 1024) and the same record is handed out again.
    """
    global _last_record
    if raw is None:
        return None
    raw = bytes(raw)
    last = _last_record
    if last is not None and last[0] == key and last[1] == raw:
        return last[2]
    doc = loads_dict(raw, key, max_bytes)
    if doc is None:
        return None
    try:
        record = GenerationRecord.from_json(doc)
    except RecordError as exc:
        raise RecordError(f"coordinator entry {key}: {exc}") from None
    _last_record = (key, raw, record)  # one tuple: threads see an old entry or a new one
    return record
