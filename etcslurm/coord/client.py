"""Connecting to the coordinator's Redis, with bounded timeouts and retries.

Why a wrapper around ``redis.Redis``: every call a worker makes must be bounded (no hang
when Redis is gone) yet survive a short outage (Redis restarted, unreachable for 30 s)
without killing the training job.  :meth:`CoordClient.call` retries transient errors
(connection refused/reset, timeouts, Redis still loading) with exponential backoff until a
deadline, then raises :class:`~etcslurm.errors.CoordinatorError`.  Errors a retry cannot
fix (wrong password, not a Redis server, permission denied) are raised at once, as one
line that says what to do.

A replicated coordinator (a primary, replicas and Sentinels on several nodes) has URLs
``redis+sentinel://[user]:PASSWORD@host1:port1,host2:port2,host3:port3/SERVICE[/DB]``
listing the *Sentinels*: :func:`connect` then follows whichever replica Sentinel promotes
(``redis.sentinel.Sentinel.master_for``), and writes that decide the run are confirmed by
a replica (``WAIT``, see :meth:`CoordClient.decided`).
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit, urlunsplit

import redis
from redis import exceptions as rexc
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel

from etcslurm.errors import CoordinatorError

T = TypeVar("T")

#: Errors that a reconnect may cure; everything else is reported at once.
TRANSIENT = (rexc.ConnectionError, rexc.TimeoutError, rexc.BusyLoadingError, rexc.TryAgainError)


#: URL schemes of a replicated coordinator reached through its Sentinels.
SENTINEL_SCHEMES = ("redis+sentinel", "sentinel")
#: Query parameters of coordinator URLs that etcslurm (not redis-py) reads.
_OUR_PARAMS = ("acks", "ack_timeout", "sentinel_password")


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` names a replicated coordinator through its Sentinels."""
    return url.split("://", 1)[0].lower() in SENTINEL_SCHEMES


def _split_netloc(url: str) -> tuple[str, str, str | None, str, str, str]:
    """(scheme, user, password|None, hosts, path, query) without urlsplit's host checks
    (a Sentinel URL has several comma-separated hosts)."""
    scheme, _, rest = url.partition("://")
    netloc, slash, tail = rest.partition("/")
    path, _, query = (slash + tail).partition("?")
    if "?" in netloc:  # no path: host?query
        netloc, _, query = netloc.partition("?")
    userinfo, at, hosts = netloc.rpartition("@")
    user, password = "", None
    if at:
        user, colon, pw = userinfo.partition(":")
        password = unquote(pw) if colon else None
        user = unquote(user)
    return scheme, user, password, hosts, path, query


def parse_sentinel_url(url: str) -> dict[str, object]:
    """The parts of ``redis+sentinel://[user]:pass@h1:p1,h2:p2/SERVICE[/DB][?opts]``.

    Returns ``user``, ``password``, ``sentinels`` (list of (host, port); port default
    26379), ``service``, ``db`` and the query options.  Raises :class:`CoordinatorError`
    naming what is wrong.
    """
    scheme, user, password, hosts, path, query = _split_netloc(url)
    if scheme.lower() not in SENTINEL_SCHEMES:
        raise CoordinatorError(f"not a Sentinel URL (redis+sentinel://...): {redact(url)}")
    sentinels: list[tuple[str, int]] = []
    for item in filter(None, hosts.split(",")):
        m = re.fullmatch(r"\[([0-9a-fA-F:.]+)\](?::(\d+))?|([^:\[\]]+)(?::(\d+))?", item)
        if not m:
            raise CoordinatorError(f"bad Sentinel address {item!r} in {redact(url)}")
        host = m.group(1) or m.group(3)
        port = int(m.group(2) or m.group(4) or 26379)
        if not 0 < port < 65536:
            raise CoordinatorError(f"bad Sentinel port {port} in {redact(url)}")
        sentinels.append((host, port))
    if not sentinels:
        raise CoordinatorError(f"Sentinel URL has no host: {redact(url)}")
    segs = [unquote(x) for x in path.strip("/").split("/") if x]
    if not segs or len(segs) > 2:
        raise CoordinatorError(
            f"Sentinel URL needs the service name as its path "
            f"(redis+sentinel://:PASS@h1:p1,h2:p2/SERVICE[/DB]): {redact(url)}")
    db = 0
    if len(segs) == 2:
        if not segs[1].isdigit():
            raise CoordinatorError(f"Sentinel URL database must be a number: {redact(url)}")
        db = int(segs[1])
    opts = {k: v[-1] for k, v in parse_qs(query).items()}
    unknown = sorted(set(opts) - set(_OUR_PARAMS))
    if unknown:
        raise CoordinatorError(
            f"unknown option(s) {', '.join(unknown)} in {redact(url)} "
            f"(known: {', '.join(_OUR_PARAMS)})")
    return {"user": user or None, "password": password, "sentinels": sentinels,
            "service": segs[0], "db": db, "options": opts}


def sentinel_url(sentinels: list[tuple[str, int]], service: str, password: str | None = None,
                 *, user: str | None = None, db: int = 0, **options: object) -> str:
    """Build a ``redis+sentinel://`` URL (``password`` ``None``: none in the URL)."""
    hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in sentinels)
    cred = ""
    if password is not None:
        cred = f"{quote(user or '', safe='')}:{quote(password, safe='')}@"
    query = urlencode({k: v for k, v in options.items() if v is not None})
    tail = f"/{quote(service, safe='')}" + (f"/{db}" if db else "")
    return f"redis+sentinel://{cred}{hosts}{tail}" + (f"?{query}" if query else "")


def redact(url: str) -> str:
    """The URL with any password replaced by ``***`` (safe for logs and messages)."""
    if is_sentinel_url(url):
        scheme, user, password, hosts, path, query = _split_netloc(url)
        query = "&".join(x for x in query.split("&") if x and not x.startswith("sentinel_password="))
        cred = "" if password is None else f"{quote(user, safe='')}:***@"
        return f"{scheme}://{cred}{hosts}{path}" + (f"?{query}" if query else "")
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, ""))


def with_password(url: str, password: str, username: str | None = None) -> str:
    """``url`` with ``password`` (and optionally ``username``) put into its netloc."""
    if is_sentinel_url(url):
        scheme, user, _pw, hosts, path, query = _split_netloc(url)
        user = username if username is not None else user
        cred = f"{quote(user, safe='')}:{quote(password, safe='')}@"
        return f"{scheme}://{cred}{hosts}{path}" + (f"?{query}" if query else "")
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    if parts.port:
        host = f"{host}:{parts.port}"
    user = quote(username if username is not None else (parts.username or ""), safe="")
    netloc = f"{user}:{quote(password, safe='')}@{host}"
    return urlunsplit((parts.scheme or "redis", netloc, parts.path or "/0", parts.query, ""))


def read_password_file(path: str | Path) -> str:
    """The first line of a password file; refuses files other users can read."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise CoordinatorError(f"cannot read password file {p}: {exc.strerror}") from None
    if mode & 0o077:
        raise CoordinatorError(
            f"password file {p} is readable by other users (mode {oct(mode & 0o777)}); "
            f"run: chmod 600 {p}"
        )
    password = text.strip().splitlines()[0] if text.strip() else ""
    if not password:
        raise CoordinatorError(f"password file {p} is empty")
    return password


def _describe(exc: BaseException, where: str) -> str:
    """One line for an error a retry cannot fix."""
    text = str(exc).strip() or type(exc).__name__
    if text.startswith("ETCSLURM "):  # our Lua scripts' refusals name the key
        return f"coordinator entry {text[len('ETCSLURM '):]}"
    low = text.lower()
    if isinstance(exc, rexc.AuthenticationError) or "noauth" in low or "wrongpass" in low:
        if "required" in low or "noauth" in low:
            return (
                f"coordinator at {where} requires a password: pass it in the URL "
                "(redis://:PASSWORD@host:port/0) or with a password file"
            )
        return f"coordinator at {where} refused the password (wrong password or user)"
    if isinstance(exc, rexc.NoPermissionError) or "noperm" in low:
        return f"coordinator at {where} denied access: {text}"
    if isinstance(exc, rexc.InvalidResponse) or "protocol error" in low:
        answer = text.split(":", 1)[1].strip() if text.lower().startswith("protocol error") else text
        return f"{where} is not a Redis server (it answered {answer[:80]})"
    return f"coordinator at {where}: {text}"


class CoordClient:
    """A ``redis.Redis`` plus the retry/deadline policy every coordinator call uses.

    ``redis`` is the raw client (bytes in, bytes out); use :meth:`call` for anything that
    must survive an outage.  ``retry_deadline`` is how long a call keeps retrying transient
    errors before giving up; ``url`` is the redacted URL for messages.
    """

    def __init__(
        self,
        client: redis.Redis,
        url: str,
        retry_deadline: float = 60.0,
        *,
        sentinel: Sentinel | None = None,
        service: str | None = None,
        acks: int = 0,
        ack_timeout_ms: int = 2000,
    ) -> None:
        self.redis = client
        self.url = redact(url)
        self.retry_deadline = retry_deadline
        #: the Sentinel manager (replicated coordinator) or ``None`` (one server)
        self.sentinel = sentinel
        self.service = service
        #: replicas that must acknowledge a write that decides the run (``WAIT``); 0: none
        self.acks = acks
        self.ack_timeout_ms = ack_timeout_ms

    def call(
        self, what: str, fn: Callable[[redis.Redis], T], deadline: float | None = None
    ) -> T:
        """Run ``fn(self.redis)``, retrying transient errors for ``deadline`` seconds.

        ``what`` names the operation in the error message.  ``deadline`` defaults to
        ``retry_deadline``; ``0`` means a single try.
        """
        limit = self.retry_deadline if deadline is None else deadline
        end = time.monotonic() + limit
        delay = 0.05
        while True:
            try:
                return fn(self.redis)
            except TRANSIENT as exc:
                if isinstance(exc, rexc.ConnectionError) and _not_redis(exc):
                    raise CoordinatorError(_describe(exc, self.url)) from None
                if isinstance(exc, rexc.AuthenticationError):
                    raise CoordinatorError(_describe(exc, self.url)) from None
                left = end - time.monotonic()
                if left <= 0:
                    span = f"unreachable for {limit:.0f} s" if limit >= 1 else "did not answer"
                    hint = ""
                    if isinstance(exc, MasterNotFoundError):
                        hint = (" (no Sentinel named a reachable primary: a failover did not "
                                "finish, or fewer Sentinels than the quorum are alive; "
                                "see `etcslurm coordinator sites URL`)")
                    raise CoordinatorError(
                        f"coordinator at {self.url} {span} during "
                        f"{what}: {str(exc).strip() or type(exc).__name__}{hint}"
                    ) from None
                time.sleep(min(delay * (1 + random.random() * 0.2), left))
                delay = min(delay * 2, 1.0)
            except rexc.RedisError as exc:
                msg = _describe(exc, self.url)
                if not msg.startswith("coordinator entry"):
                    msg += f" (during {what})"
                raise CoordinatorError(msg) from None

    def decided(
        self,
        what: str,
        fn: Callable[[redis.Redis], T],
        ack_key: str,
        deadline: float | None = None,
    ) -> T:
        """Run ``fn(self.redis)`` — a write that decides the run — and return once
        :attr:`acks` replicas have it (``WAIT``); a plain :meth:`call` when ``acks`` is 0.

        The acknowledgement is a small write of ``ack_key`` (TTL 60 s) followed by
        ``WAIT`` on the same connection: Redis replicates in order, so a replica that has
        the marker has ``fn``'s writes too (they completed before it), whichever pooled
        connection ``fn`` used.  A transient error anywhere (a failover) runs ``fn``
        again on the new primary, so ``fn`` must be idempotent (or check whether its
        own earlier write survived).  No acknowledgement within ``deadline`` (default
        ``retry_deadline``) raises :class:`CoordinatorError`: the write is on the primary
        only, and a failover now could forget it.
        """
        if self.acks <= 0:
            return self.call(what, fn, deadline)
        limit = self.retry_deadline if deadline is None else deadline
        end = time.monotonic() + limit
        got = 0
        while True:
            left = end - time.monotonic()
            wait_ms = max(1, min(self.ack_timeout_ms, int(left * 1000)))

            def _once(r: redis.Redis, wait_ms: int = wait_ms) -> tuple[T, int]:
                out = fn(r)
                p = r.pipeline(transaction=False)
                p.set(ack_key, f"{time.time():.6f}", px=60_000)
                p.execute_command("WAIT", self.acks, wait_ms)
                return out, int(p.execute()[1])

            result, got = self.call(what, _once, max(left, 0.0))
            if got >= self.acks:
                return result
            if time.monotonic() >= end:
                raise CoordinatorError(
                    f"coordinator at {self.url}: no replica acknowledged {what} within "
                    f"{limit:g} s (WAIT {self.acks}: {got} acknowledged); the primary "
                    "has it but a failover now could lose it — check the replica sites "
                    "(`etcslurm coordinator sites URL`)"
                )

    def ping(self, deadline: float | None = None) -> None:
        """Check the server answers and accepts our credentials."""
        self.call("ping", lambda r: r.ping(), deadline)

    def close(self) -> None:
        """Close the pooled connections (idempotent)."""
        self.redis.close()
        if self.sentinel is not None:
            for s in self.sentinel.sentinels:
                s.close()

    def __enter__(self) -> CoordClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _not_redis(exc: BaseException) -> bool:
    """A connection error that means the peer speaks another protocol, not an outage."""
    low = str(exc).lower()
    return "protocol error" in low or "invalid response" in low


class FollowingSentinel(Sentinel):
    """``redis.sentinel.Sentinel`` that also learns the Sentinels it was not told about.

    Each successful master discovery asks that Sentinel for its peers
    (``SENTINEL SENTINELS``) and adds new ones, so a client whose URL lists the first
    three coordinator sites still finds the primary after those sites were replaced by
    sites a growth job added (their Sentinels announce themselves to the others).
    """

    def __init__(self, sentinels: list[tuple[str, int]], **kwargs: object) -> None:
        super().__init__(sentinels, **kwargs)
        self._lock = threading.Lock()
        self._known = {(str(h), int(p)) for h, p in sentinels}

    def discover_master(self, service_name: str) -> tuple[str, int]:
        errors: list[str] = []
        auth = False
        addr: tuple[str, int] | None = None
        for i, s in enumerate(list(self.sentinels)):
            kw = s.connection_pool.connection_kwargs
            where = f"Sentinel {kw.get('host')}:{kw.get('port')}"
            try:
                state = s.sentinel_masters().get(service_name)
            except (rexc.ConnectionError, rexc.TimeoutError) as exc:
                auth = auth or isinstance(exc, rexc.AuthenticationError)
                errors.append(f"{where}: {str(exc).strip() or type(exc).__name__}")
                continue
            if state and self.check_master_state(state, service_name):
                self.sentinels[0], self.sentinels[i] = s, self.sentinels[0]
                addr = (state["ip"], int(state["port"]))
                break
            errors.append(f"{where}: no healthy primary for {service_name!r}" if state
                          else f"{where}: does not monitor {service_name!r}")
        if addr is None:
            if auth and all("auth" in e.lower() or "password" in e.lower() for e in errors):
                raise rexc.AuthenticationError("the Sentinels refused the password")
            raise MasterNotFoundError(
                f"no primary found for {service_name!r} ({'; '.join(errors)})")
        try:
            peers = self.sentinels[0].sentinel_sentinels(service_name)
        except rexc.RedisError:
            return addr
        with self._lock:
            for peer in peers or []:
                key = (str(peer.get("ip")), int(peer.get("port", 0)))
                if key[1] and key not in self._known and not peer.get("is_sdown"):
                    self._known.add(key)
                    self.sentinels.append(redis.Redis(key[0], key[1], **self.sentinel_kwargs))
        return addr


def _int_opt(opts: dict[str, object], name: str, default: int, url: str) -> int:
    raw = opts.get(name)
    if raw is None:
        return default
    try:
        value = int(str(raw))
    except ValueError:
        value = -1
    if value < 0:
        raise CoordinatorError(f"option {name} of {redact(url)} must be a non-negative integer")
    return value


def _strip_our_params(url: str) -> tuple[str, dict[str, str]]:
    parts = urlsplit(url)
    q = parse_qs(parts.query)
    ours = {k: v[-1] for k, v in q.items() if k in _OUR_PARAMS}
    rest = urlencode([(k, x) for k, v in q.items() if k not in _OUR_PARAMS for x in v])
    return urlunsplit((parts.scheme, parts.netloc, parts.path, rest, parts.fragment)), ours


def connect(
    url: str,
    password_file: str | Path | None = None,
    *,
    socket_timeout: float = 5.0,
    connect_timeout: float = 3.0,
    retry_deadline: float = 60.0,
    check: bool = True,
    check_deadline: float | None = None,
    max_connections: int = 2048,
) -> CoordClient:
    """Connect to the coordinator at ``url``.

    ``redis://[user]:pass@host:port/db`` is one server.
    ``redis+sentinel://[user]:pass@h1:p1,h2:p2,h3:p3/SERVICE[/DB]`` is a replicated
    coordinator: the hosts are its Sentinels, the client always talks to the primary
    Sentinel names and follows a failover by itself (the password is used for Redis and
    Sentinel alike; ``?sentinel_password=`` if the Sentinels have another).  Options in
    the query: ``acks=N`` replicas that must acknowledge a write deciding the run
    (default 1 for a Sentinel URL, 0 otherwise), ``ack_timeout=MS`` per ``WAIT``
    (default 2000; the whole wait is bounded by ``retry_deadline``).

    ``password_file`` (mode 0600, e.g. the bundled server's ``redis.password``) supplies
    the password when the URL has none.  Every socket operation is bounded by
    ``socket_timeout`` seconds; transient failures (including a failover in progress)
    are retried for ``retry_deadline`` seconds (per call).  With ``check`` (default) the
    server is pinged now, retrying for ``check_deadline`` seconds (default
    ``min(retry_deadline, 10)``) so a typo fails fast; a missing/wrong password or a
    non-Redis peer raises :class:`CoordinatorError` at once.  ``max_connections`` caps
    the pool (one per thread blocked in a wait or event read; redis-py's default of 100
    is too few for simulations with many threads).
    """
    common: dict[str, object] = dict(
        socket_timeout=socket_timeout,
        socket_connect_timeout=connect_timeout,
        health_check_interval=30,
        retry=Retry(NoBackoff(), 0),  # our own retry-until-deadline in call()
        max_connections=max_connections,
    )
    if is_sentinel_url(url):
        spec = parse_sentinel_url(url)
        password = spec["password"]
        if password is None and password_file is not None:
            password = read_password_file(password_file)
            url = with_password(url, str(password))
        opts: dict[str, object] = spec["options"]  # type: ignore[assignment]
        sentinel_pw = opts.get("sentinel_password", password)
        sentinel = FollowingSentinel(
            spec["sentinels"],  # type: ignore[arg-type]
            sentinel_kwargs=dict(password=sentinel_pw, socket_timeout=min(socket_timeout, 2.0),
                                 socket_connect_timeout=min(connect_timeout, 2.0),
                                 retry=Retry(NoBackoff(), 0)),
        )
        client = sentinel.master_for(
            str(spec["service"]), redis_class=redis.Redis, username=spec["user"],
            password=password, db=spec["db"], **common,
        )
        cc = CoordClient(client, url, retry_deadline=retry_deadline, sentinel=sentinel,
                         service=str(spec["service"]),
                         acks=_int_opt(opts, "acks", 1, url),
                         ack_timeout_ms=_int_opt(opts, "ack_timeout", 2000, url))
    else:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise CoordinatorError(
                f"coordinator URL must start with redis://, rediss:// or redis+sentinel://: "
                f"{redact(url)}")
        if not parts.hostname:
            raise CoordinatorError(f"coordinator URL has no host: {redact(url)}")
        if password_file is not None and parts.password is None:
            url = with_password(url, read_password_file(password_file))
        plain, opts = _strip_our_params(url)
        try:
            client = redis.Redis.from_url(plain, **common)  # type: ignore[arg-type]
        except ValueError as exc:
            raise CoordinatorError(f"bad coordinator URL {redact(url)}: {exc}") from None
        cc = CoordClient(client, url, retry_deadline=retry_deadline,
                         acks=_int_opt(opts, "acks", 0, url),
                         ack_timeout_ms=_int_opt(opts, "ack_timeout", 2000, url))
    if check:
        cc.ping(min(retry_deadline, 10.0) if check_deadline is None else check_deadline)
    return cc
