"""A replicated coordinator's view and its planned hand-over.

* :func:`topology` — which site holds the primary, its replicas, the Sentinels (what
  ``etcslurm coordinator sites URL`` prints, and what a growth job asks before it adds
  a site).
* :func:`hand_over` — the node hosting the primary got its preemption signal: give the
  primary to a replica *before* the node goes, without losing a write and without a
  time where writes fail (they wait, paused, for tens of milliseconds).

Why neither Sentinel's failover nor Redis's ``FAILOVER`` command: both wait for
something that happens once a second (Sentinel's ``INFO`` polls while it promotes and
reconfigures; the replicas' acks for ``FAILOVER``), and after a ``FAILOVER`` the
Sentinels, which clients ask for the primary, keep naming the old one.  So the
hand-over does what they do itself, in order, each step confirmed directly: pause
writes, promote a replica that has every write, attach the others to it, re-point every
Sentinel, disconnect the old primary's clients so they ask Sentinel again, unpause.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis

from etcslurm.coord.client import CoordClient
from etcslurm.errors import CoordinatorError, UsageError


def _need_sentinel(client: CoordClient) -> Any:
    if client.sentinel is None or not client.service:
        raise UsageError(
            f"{client.url} is a single Redis server: connect with a redis+sentinel:// URL "
            "to a replicated coordinator"
        )
    return client.sentinel


def _flags(entry: dict[str, Any]) -> set[str]:
    raw = entry.get("flags", "")
    if isinstance(raw, (bytes, str)):
        raw = (raw.decode() if isinstance(raw, bytes) else raw).split(",")
    return {str(f) for f in raw}


_DOWN = {"s_down", "o_down", "disconnected"}

T = TypeVar("T")


def _first_answer(client: CoordClient, ask: Callable[[Any], T]) -> tuple[Any, T]:
    """(the Sentinel, ``ask(sentinel)``) of the first of the client's Sentinels that
    answers; that one is asked first next time (as redis-py does), so a gone site is
    skipped.  Raises :class:`CoordinatorError` naming every Sentinel's error."""
    sentinel = _need_sentinel(client)
    errors = []
    for i, s in enumerate(list(sentinel.sentinels)):
        try:
            answer = ask(s)
        except redis.RedisError as exc:
            errors.append(str(exc) or type(exc).__name__)
            continue
        if i:
            sentinel.sentinels[0], sentinel.sentinels[i] = s, sentinel.sentinels[0]
        return s, answer
    raise CoordinatorError(
        f"no Sentinel of {client.url} answered: {'; '.join(errors) or 'none listed'}")


@dataclass(frozen=True)
class PrimaryNow:
    """Where the replicated coordinator's primary is, as a Sentinel names it now."""

    address: tuple[str, int]
    replicas_up: int

    @property
    def text(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"


def primary_now(client: CoordClient) -> PrimaryNow | None:
    """The primary and how many replicas are up, from the first answering Sentinel
    (two small Sentinel calls, no connection to the primary: cheap enough for the
    monitor to ask every few seconds); ``None`` for a single Redis server.  Raises
    :class:`CoordinatorError` when no Sentinel answers or none names a primary."""
    if client.sentinel is None or not client.service:
        return None
    service = client.service
    _, (master, replicas) = _first_answer(
        client, lambda s: (s.sentinel_master(service), s.sentinel_slaves(service)))
    up = sum(1 for r in replicas if not (_flags(r) & _DOWN))
    return PrimaryNow((str(master["ip"]), int(master["port"])), up)


def topology(client: CoordClient) -> dict[str, Any]:
    """The replicated coordinator as the first answering Sentinel sees it.

    ``primary``: ``[ip, port]``; ``replicas``/``sentinels``: ``{"address", "flags",
    "up"}`` each (replicas also ``offset``); ``sites``: the primary plus the replicas that
    are up (as the primary reports them, else as the Sentinels do) — compare it with the
    target number of sites.
    """
    service = client.service
    s, (master, replicas, peers) = _first_answer(client, lambda s: (
        s.sentinel_master(service), s.sentinel_slaves(service), s.sentinel_sentinels(service)))
    conn = s.connection_pool.connection_kwargs
    reps = [{"address": [r["ip"], int(r["port"])], "flags": sorted(_flags(r)),
             "up": not (_flags(r) & _DOWN),
             "offset": int(r.get("slave-repl-offset", 0) or 0)} for r in replicas]
    sens = [{"address": [p["ip"], int(p["port"])], "flags": sorted(_flags(p)),
             "up": not (_flags(p) & _DOWN)} for p in peers]
    sens.insert(0, {"address": [conn.get("host"), conn.get("port")], "flags": ["self"],
                    "up": True})
    primary_up = not (_flags(master) & _DOWN)
    known = int(primary_up) + sum(r["up"] for r in reps)
    sites = known
    try:  # the primary knows its replicas at once; Sentinels only every 10 s
        prim = _direct(client, (master["ip"], int(master["port"])), 2.0)
        try:
            sites = max(sites, 1 + len(_replication(prim)[1]))
        finally:
            prim.close()
    except redis.RedisError:
        pass
    return {
        "service": service,
        "primary": [master["ip"], int(master["port"])],
        "primary_up": primary_up,
        "replicas": reps,
        "sentinels": sens,
        "sites": sites,
        "known_sites": known,  # as the Sentinels see them (they can fail over to these)
        "sentinels_up": sum(x["up"] for x in sens),
        "quorum": int(master.get("quorum", 0) or 0),
    }


@dataclass(frozen=True)
class HandOver:
    """What :func:`hand_over` did: the old and new primary, and how long writes waited."""

    old: tuple[str, int]
    new: tuple[str, int]
    paused_s: float
    total_s: float


def _direct(client: CoordClient, address: tuple[str, int], timeout: float) -> redis.Redis:
    kw = client.redis.connection_pool.connection_kwargs
    return redis.Redis(host=address[0], port=int(address[1]), username=kw.get("username"),
                       password=kw.get("password"), socket_timeout=timeout,
                       socket_connect_timeout=timeout)


def _replication(r: redis.Redis) -> tuple[int, list[tuple[str, int, int]]]:
    info = r.info("replication")
    offset = int(info.get("master_repl_offset", 0))
    reps = []
    for key, val in info.items():
        if key.startswith("slave") and isinstance(val, dict) and val.get("state") == "online":
            reps.append((str(val["ip"]), int(val["port"]), int(val.get("offset", 0))))
    return offset, reps


def _sentinels(client: CoordClient) -> list[redis.Redis]:
    """Every Sentinel of the service: those the client knows plus the peers they name."""
    sentinel = _need_sentinel(client)
    known = list(sentinel.sentinels)
    seen = {(s.connection_pool.connection_kwargs.get("host"),
             int(s.connection_pool.connection_kwargs.get("port", 0))) for s in known}
    for s in known:
        try:
            peers = s.sentinel_sentinels(client.service)
        except redis.RedisError:
            continue
        for peer in peers or []:
            key = (str(peer.get("ip")), int(peer.get("port", 0)))
            if key[1] and key not in seen and not peer.get("is_sdown"):
                seen.add(key)
                known.append(redis.Redis(key[0], key[1], **sentinel.sentinel_kwargs))
        break
    return known


def _each(sentinels: list[redis.Redis], fn: Any) -> list[str]:
    """``fn(s)`` on every Sentinel at once (each rewrites and fsyncs its config file:
    one after the other that is several fsyncs of waiting); returns the errors."""
    errors: list[str] = []

    def one(s: redis.Redis) -> None:
        try:
            fn(s)
        except redis.RedisError as exc:
            kw = s.connection_pool.connection_kwargs
            errors.append(f"Sentinel {kw.get('host')}:{kw.get('port')}: {exc}")

    threads = [threading.Thread(target=one, args=(s,), daemon=True) for s in sentinels]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10.0)
    return errors


def hand_over(client: CoordClient, *, timeout: float = 20.0, pause_ms: int = 15000,
              only_if: tuple[str, int] | list[str] | None = None) -> HandOver | None:
    """Give the primary to a replica now (its node is about to go); returns what moved.

    Steps, all driven from here (milliseconds on a LAN, no polling interval involved):

    1. pause writes on the primary (``CLIENT PAUSE pause_ms WRITE``: clients wait, they
       do not fail); its replication offset is now final;
    2. the first replica whose *own* offset (its ``INFO``, not the primary's view, which
       is refreshed by the replicas' once-a-second acks) has reached it is complete:
       ``REPLICAOF NO ONE`` promotes it;
    3. the other replicas become its replicas (partial resync: they share its history);
    4. every Sentinel is re-pointed at once: ``SENTINEL REMOVE`` on all of them, then
       ``SENTINEL MONITOR`` + ``SENTINEL SET`` (password, ``down-after``,
       ``failover-timeout``, ``parallel-syncs``, read back from the Sentinels) — removing
       everywhere first means no Sentinel still announcing the old primary can talk a
       re-pointed one back;
    5. the old primary's clients are disconnected (every client asks Sentinel again and
       finds the new primary; a paused write is retried there), then it becomes a replica
       of the new primary, and writes are unpaused.

    Why not ``SENTINEL FAILOVER``: Sentinel confirms a promotion and the replicas'
    reconfiguration by polling ``INFO`` once a second, so writes waited 1.2-3.2 s.  Why not
    Redis's ``FAILOVER``: it waits for the replica's periodic ack (up to 1 s) and leaves
    the Sentinels naming the old primary.  Afterwards the Sentinels learn the replicas at
    once (``INFO`` on their first link) and each other within 2 s (hello messages); until
    then a *hard* loss of the new primary cannot be failed over (quorum).

    ``only_if``: do nothing (return ``None``) unless the primary is at that address — the
    caller's own site, e.g. the worker on a node being preempted asks for its node's
    Redis.  Raises :class:`CoordinatorError` if no replica has caught up within
    ``timeout`` s (the writes are unpaused then and the primary stays) or no Sentinel
    accepted the new primary.
    """
    sentinel = _need_sentinel(client)
    service = client.service
    t0 = time.monotonic()
    end = t0 + timeout
    old = tuple(sentinel.discover_master(service))
    old = (str(old[0]), int(old[1]))
    if only_if is not None and (str(only_if[0]), int(only_if[1])) != old:
        return None
    sentinels = _sentinels(client)
    cfg: dict[str, Any] = {}
    for s in sentinels:  # the service's settings, to monitor the new primary alike
        try:
            cfg = s.sentinel_master(service)
            break
        except redis.RedisError:
            continue
    if not cfg:
        raise CoordinatorError(f"hand-over of the primary {old[0]}:{old[1]}: no Sentinel "
                               f"answered for {service!r}")
    kw = client.redis.connection_pool.connection_kwargs
    settings: list[Any] = ["auth-pass", kw.get("password") or ""]
    if kw.get("username"):
        settings += ["auth-user", kw["username"]]
    for name in ("down-after-milliseconds", "failover-timeout", "parallel-syncs"):
        if name in cfg:
            settings += [name, int(cfg[name])]
    quorum = int(cfg.get("quorum", 2) or 2)

    prim = _direct(client, old, 5.0)
    replicas: dict[tuple[str, int], redis.Redis] = {}
    paused_at = time.monotonic()
    try:
        prim.execute_command("CLIENT", "PAUSE", int(pause_ms), "WRITE")
        offset, reps = _replication(prim)  # writes are paused: the offset is final
        replicas = {(h, p): _direct(client, (h, p), 2.0) for h, p, _o in reps}
        new: tuple[str, int] | None = None
        last = f"offset {offset}; replicas {sorted(replicas)}"
        while new is None:
            for addr, r in replicas.items():
                try:
                    info = r.info("replication")
                except redis.RedisError as exc:
                    last = f"{addr[0]}:{addr[1]}: {exc}"
                    continue
                if (info.get("master_link_status") == "up"
                        and int(info.get("slave_repl_offset", -1)) >= offset):
                    new = addr
                    break
            else:
                if time.monotonic() > end:
                    raise CoordinatorError(
                        f"hand-over of the primary {old[0]}:{old[1]}: no replica caught up "
                        f"within {timeout:g} s ({last})")
                time.sleep(0.002)
        replicas[new].execute_command("REPLICAOF", "NO", "ONE")
        for addr, r in replicas.items():
            if addr != new:
                try:
                    r.execute_command("REPLICAOF", new[0], new[1])
                except redis.RedisError:  # a replica going away: Sentinel fixes it later
                    pass
        removed = _each(sentinels, lambda s: s.execute_command("SENTINEL", "REMOVE", service))

        def monitor(s: redis.Redis) -> None:
            p = s.pipeline(transaction=False)  # one packet: set before the first link
            p.execute_command("SENTINEL", "MONITOR", service, new[0], new[1], quorum)
            p.execute_command("SENTINEL", "SET", service, *settings)
            p.execute()

        failed = _each(sentinels, monitor)
        if len(failed) >= len(sentinels):
            raise CoordinatorError(
                f"hand-over of the primary {old[0]}:{old[1]} -> {new[0]}:{new[1]}: no "
                f"Sentinel accepted the new primary ({'; '.join(removed + failed)})")
        # the old primary's clients reconnect through Sentinel, now naming the new one.
        # Before it becomes a replica: Redis answers a client blocked there (XREAD,
        # BLPOP: event readers, generation waits) "UNBLOCKED ... master -> replica", an
        # error no client retries, where a dropped connection is retried.  Their paused
        # writes were never run: they are retried on the new primary.
        prim.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        prim.execute_command("REPLICAOF", new[0], new[1])
        paused_s = time.monotonic() - paused_at
    finally:
        try:
            prim.execute_command("CLIENT", "UNPAUSE")
        except redis.RedisError:
            pass
        prim.close()
        for r in replicas.values():
            r.close()
    return HandOver(old=old, new=new, paused_s=paused_s, total_s=time.monotonic() - t0)


def reset_sentinels(client: CoordClient) -> int:
    """``SENTINEL RESET`` on every Sentinel the client knows: they forget departed
    Sentinels (which would otherwise still count against the majority a failover needs)
    and replicas, and rediscover the live ones: Sentinels within 2 s (hello messages),
    replicas at the next ``INFO`` of the primary (up to 10 s, a window in which they
    cannot fail over).  Returns how many answered."""
    sentinel = _need_sentinel(client)
    done = 0
    for s in list(sentinel.sentinels):
        try:
            s.execute_command("SENTINEL", "RESET", client.service)
            done += 1
        except redis.RedisError:
            continue
    return done


def settle(client: CoordClient, sites: int, *, sentinels: int | None = None,
           timeout: float = 30.0) -> dict[str, Any]:
    """Wait until the Sentinels know ``sites`` live sites (primary + replicas) and
    ``sentinels`` (default ``sites``) live Sentinels; returns :func:`topology`.

    Sentinels learn of a new replica from the primary's ``INFO``, every 10 s (fixed in
    Redis 6.2), and of each other from hello messages every 2 s: a fresh coordinator can
    fail over about 10 s after its last replica started.
    """
    want_sentinels = sites if sentinels is None else sentinels
    end = time.monotonic() + timeout
    top: dict[str, Any] = {}
    while True:
        try:
            top = topology(client)
            if top["known_sites"] >= sites and top["sentinels_up"] >= want_sentinels:
                return top
        except (redis.RedisError, CoordinatorError):
            pass
        if time.monotonic() > end:
            raise CoordinatorError(
                f"coordinator {client.url}: the Sentinels know {top.get('known_sites')} of "
                f"{sites} sites and {top.get('sentinels_up')} of {want_sentinels} Sentinels "
                f"are up after {timeout:g} s")
        time.sleep(0.1)


#: Set by the sbatch templates on a node that hosts a coordinator site: its Redis
#: address (``IP:PORT``) and the node's name.
SITE_ENV = "ETCSLURM_COORD_SITE"
SITE_NODE_ENV = "ETCSLURM_COORD_SITE_NODE"


def local_site(env: dict[str, str] | None = None) -> tuple[str, int] | None:
    """The address of the coordinator site on *this* node, from the environment the
    templates set (``None``: no site here)."""
    import os
    import socket

    env = dict(os.environ) if env is None else env
    site, node = env.get(SITE_ENV, ""), env.get(SITE_NODE_ENV, "")
    if not site or ":" not in site:
        return None
    here = {socket.gethostname(), env.get("SLURMD_NODENAME", "")}
    if node and node not in here:
        return None
    host, _, port = site.rpartition(":")
    return (host, int(port)) if port.isdigit() else None


def hand_over_local(client: CoordClient, *, timeout: float = 20.0,
                    env: dict[str, str] | None = None) -> HandOver | None:
    """:func:`hand_over` if this node hosts the primary (the runtime calls it when the
    node got its preemption signal); ``None`` when there is nothing to do: a single
    Redis (no Sentinel), no site on this node, or the primary is elsewhere."""
    if client.sentinel is None:
        return None
    site = local_site(env)
    if site is None:
        return None
    return hand_over(client, timeout=timeout, only_if=site)
