"""Connecting to the coordinator's Redis, with bounded timeouts and retries.

Why a wrapper around ``redis.Redis``: every call a worker makes must be bounded (no hang
when Redis is gone) yet survive a short outage (Redis restarted, unreachable for 30 s)
without killing the training job.  :meth:`CoordClient.call` retries transient errors
(connection refused/reset, timeouts, Redis still loading) with exponential backoff until a
deadline, then raises :class:`~etcslurm.errors.CoordinatorError`.  Errors a retry cannot
fix (wrong password, not a Redis server, permission denied) are raised at once, as one
line that says what to do.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote, urlsplit, urlunsplit

import redis
from redis import exceptions as rexc
from redis.backoff import NoBackoff
from redis.retry import Retry

from etcslurm.errors import CoordinatorError

T = TypeVar("T")

#: Errors that a reconnect may cure; everything else is reported at once.
TRANSIENT = (rexc.ConnectionError, rexc.TimeoutError, rexc.BusyLoadingError, rexc.TryAgainError)


def redact(url: str) -> str:
    """The URL with any password replaced by ``***`` (safe for logs and messages)."""
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

    def __init__(self, client: redis.Redis, url: str, retry_deadline: float = 60.0) -> None:
        self.redis = client
        self.url = redact(url)
        self.retry_deadline = retry_deadline
        self._kwargs: dict[str, object] = {}

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
                    raise CoordinatorError(
                        f"coordinator at {self.url} {span} during "
                        f"{what}: {str(exc).strip() or type(exc).__name__}"
                    ) from None
                time.sleep(min(delay * (1 + random.random() * 0.2), left))
                delay = min(delay * 2, 1.0)
            except rexc.RedisError as exc:
                msg = _describe(exc, self.url)
                if not msg.startswith("coordinator entry"):
                    msg += f" (during {what})"
                raise CoordinatorError(msg) from None

    def ping(self, deadline: float | None = None) -> None:
        """Check the server answers and accepts our credentials."""
        self.call("ping", lambda r: r.ping(), deadline)

    def close(self) -> None:
        """Close the pooled connections (idempotent)."""
        self.redis.close()

    def __enter__(self) -> CoordClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _not_redis(exc: BaseException) -> bool:
    """A connection error that means the peer speaks another protocol, not an outage."""
    low = str(exc).lower()
    return "protocol error" in low or "invalid response" in low


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
    """Connect to the coordinator at ``url`` (``redis://[user]:pass@host:port/db``).

    ``password_file`` (mode 0600, e.g. the bundled server's ``redis.password``) supplies
    the password when the URL has none.  Every socket operation is bounded by
    ``socket_timeout`` seconds; transient failures are retried for ``retry_deadline``
    seconds (per call).  With ``check`` (default) the server is pinged now, retrying for
    ``check_deadline`` seconds (default ``min(retry_deadline, 10)``) so a typo fails fast;
    a missing/wrong password or a non-Redis peer raises :class:`CoordinatorError` at once.
    ``max_connections`` caps the pool (one per thread blocked in a wait or event read;
    redis-py's default of 100 is too few for simulations with many threads).
    """
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise CoordinatorError(f"coordinator URL must start with redis:// or rediss://: {redact(url)}")
    if not parts.hostname:
        raise CoordinatorError(f"coordinator URL has no host: {redact(url)}")
    if password_file is not None and parts.password is None:
        url = with_password(url, read_password_file(password_file))
    try:
        client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            health_check_interval=30,
            retry=Retry(NoBackoff(), 0),  # our own retry-until-deadline in call()
            max_connections=max_connections,
        )
    except ValueError as exc:
        raise CoordinatorError(f"bad coordinator URL {redact(url)}: {exc}") from None
    cc = CoordClient(client, url, retry_deadline=retry_deadline)
    if check:
        cc.ping(min(retry_deadline, 10.0) if check_deadline is None else check_deadline)
    return cc
