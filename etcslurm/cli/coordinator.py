"""``etcslurm coordinator start|stop|url|grant RUN_DIR`` — a bundled Redis for a run directory.

Why a command: operators (and the sbatch templates) need a coordinator that outlives
the workers, on a known port with a private password, without writing a Redis config by
hand.  ``start`` leaves the server running detached and prints its URL; the password stays
in ``RUN_DIR/redis.password`` (0600).

A replicated coordinator is one *site* per node (``start --sentinel``: a Redis primary or
replica plus a Sentinel, one password for all); ``sites URL`` shows it, ``hand-over URL``
moves the primary off a node that is about to go (see docs/coordinator.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "coordinator",
        help="start/stop a bundled Redis coordinator for a run directory, print its URL",
        description=(
            "Run a private, password-protected redis-server for a run directory "
            "(bound to 127.0.0.1 unless --bind). The password is written 0600 to "
            "RUN_DIR/redis.password."
        ),
    )
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    s = sub.add_parser("start", help="start the server (detached) and print its URL")
    s.add_argument("run_dir", metavar="RUN_DIR")
    s.add_argument("--bind", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 for multi-node)")
    s.add_argument("--port", type=int, default=0, help="TCP port (default: a free one)")
    s.add_argument("--persist", action="store_true",
                   help="keep an append-only file so a restarted server keeps the run's keys")
    s.add_argument("--redis-server", default=None, help="redis-server binary to run")
    s.add_argument("--ready-timeout", type=float, default=15.0, help="seconds to wait for it")
    s.add_argument("--foreground", action="store_true",
                   help="stay in the foreground; stop the server on Ctrl-C/SIGTERM")
    s.add_argument("--json", action="store_true", help="print the state as JSON")
    r = s.add_argument_group("replicated coordinator (one site per node)")
    r.add_argument("--password-file", default=None,
                   help="the run's password (0600 file) shared by every site; default: a new one")
    r.add_argument("--replica-of", metavar="HOST:PORT", default=None,
                   help="start a replica of this primary")
    r.add_argument("--join", metavar="URL", nargs="?", const="", default=None,
                   help="start a replica of the primary that the Sentinels of this "
                        "redis+sentinel:// URL name (a growth job adding a site); without "
                        "URL: $ETCSLURM_REDIS_URL (keeps the password off the command line)")
    r.add_argument("--sentinel", action="store_true",
                   help="also start a Sentinel on this host (a site of a replicated coordinator)")
    r.add_argument("--sentinel-port", type=int, default=0, help="Sentinel port (default: a free one)")
    r.add_argument("--service", default="etcslurm", help="Sentinel service name (default etcslurm)")
    r.add_argument("--quorum", type=int, default=2,
                   help="Sentinels that must agree the primary is down (default 2, for 3 sites)")
    r.add_argument("--down-after-ms", type=int, default=5000,
                   help="silence before a Sentinel suspects the primary (default 5000)")
    r.add_argument("--failover-timeout-ms", type=int, default=30000,
                   help="Sentinel failover-timeout (default 30000)")
    r.add_argument("--announce-ip", default=None,
                   help="address other nodes reach this site at (default: this node's, when "
                        "--bind 0.0.0.0)")
    s.set_defaults(func=_start)
    st = sub.add_parser("sites", help="show a replicated coordinator: primary, replicas, Sentinels")
    st.add_argument("url", metavar="URL", nargs="?", default="",
                    help="redis+sentinel://[:PASS@]h1:p1,h2:p2/SERVICE (default $ETCSLURM_REDIS_URL)")
    st.add_argument("--password-file", default=None)
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=_sites)
    h = sub.add_parser(
        "hand-over",
        help="move the primary to a replica now (its node is about to be preempted)")
    h.add_argument("url", metavar="URL", nargs="?", default="",
                   help="redis+sentinel://[:PASS@]h1:p1,h2:p2/SERVICE (default $ETCSLURM_REDIS_URL)")
    h.add_argument("--password-file", default=None)
    h.add_argument("--only-site", metavar="SITE_DIR", default=None,
                   help="only if the primary is this site's Redis (nothing to do otherwise)")
    h.add_argument("--timeout", type=float, default=20.0, help="seconds (default 20)")
    h.set_defaults(func=_hand_over)
    t = sub.add_parser("stop", help="stop the server of RUN_DIR")
    t.add_argument("run_dir", metavar="RUN_DIR")
    t.set_defaults(func=_stop)
    u = sub.add_parser("url", help="print the URL of RUN_DIR's server")
    u.add_argument("run_dir", metavar="RUN_DIR")
    u.add_argument("--with-password", action="store_true",
                   help="include the password in the URL (keep it out of logs)")
    u.set_defaults(func=_url)
    g = sub.add_parser(
        "grant",
        help="create a per-run ACL user that may only touch that run's keys; print its URL",
    )
    g.add_argument("run_dir", metavar="RUN_DIR")
    g.add_argument("run_id", metavar="RUN_ID")
    g.set_defaults(func=_grant)


def _check_port(port: int) -> None:
    from etcslurm.errors import UsageError

    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be 0..65535, got {port}")


def _env_url(url: str | None) -> str:
    import os

    from etcslurm.errors import UsageError

    url = url or os.environ.get("ETCSLURM_REDIS_URL", "")
    if not url:
        raise UsageError("give the coordinator URL (or set ETCSLURM_REDIS_URL)")
    return url


def _address(text: str, what: str) -> tuple[str, int]:
    from etcslurm.errors import UsageError

    host, _, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"{what} expects HOST:PORT, got {text!r}")
    return host, int(port)


def _start_site(args: argparse.Namespace) -> int:
    from etcslurm.coord.client import connect, read_password_file
    from etcslurm.redis_host.sentinel import Site
    from etcslurm.redis_host.server import read_state

    password = read_password_file(args.password_file) if args.password_file else None
    replica_of = _address(args.replica_of, "--replica-of") if args.replica_of else None
    joined = None
    if args.join is not None:
        from etcslurm.redis_host import failover

        joined = connect(_env_url(args.join), args.password_file, retry_deadline=30)
        top = failover.topology(joined)
        replica_of = (str(top["primary"][0]), int(top["primary"][1]))
        password = password or str(joined.redis.connection_pool.connection_kwargs["password"])
        args.service = joined.service or args.service
    site = Site(
        args.run_dir, password=password, replica_of=replica_of, host=args.bind, port=args.port,
        sentinel=args.sentinel, sentinel_port=args.sentinel_port, service=args.service,
        quorum=args.quorum, down_after_ms=args.down_after_ms,
        failover_timeout_ms=args.failover_timeout_ms, announce_ip=args.announce_ip,
        executable=args.redis_server, ready_timeout=args.ready_timeout,
        detached=not args.foreground,
    )
    try:
        site.start()
    except BaseException:
        site.stop()
        raise
    if joined is not None:
        from etcslurm.redis_host import failover

        # departed sites' Sentinels still count against the majority a failover needs:
        # make the Sentinels forget them (they relearn the live ones within 10 s)
        with contextlib.suppress(Exception):
            top = failover.topology(joined)
            if top["sentinels_up"] < len(top["sentinels"]):
                failover.reset_sentinels(joined)
        joined.close()
    if args.json:
        print(json.dumps(read_state(args.run_dir)))
    elif site.sentinel is not None:
        host, port = site.sentinel.address
        print(f"redis+sentinel://{host}:{port}/{args.service}")
    else:
        print(site.redis.url)
    sys.stdout.flush()
    if args.foreground:
        done = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: done.set())
        try:
            procs = [("redis-server", site.redis.proc)]
            if site.sentinel is not None:
                procs.append(("Sentinel", site.sentinel.proc))
            while not done.wait(1.0):
                for what, proc in procs:
                    if proc is None or proc.poll() is not None:
                        sys.stderr.write(f"etcslurm: {what} exited; logs in {site.site_dir}\n")
                        return 1
        finally:
            site.stop()
    return 0


def _start(args: argparse.Namespace) -> int:
    from etcslurm.redis_host.server import BundledRedis, read_state, running_state

    _check_port(args.port)
    _check_port(args.sentinel_port)
    state = running_state(args.run_dir)
    if state is not None:  # else no or stale state file: start a new one
        sys.stderr.write(f"coordinator already running for {args.run_dir}\n")
        print(json.dumps(state) if args.json else state["url"])
        return 0
    if args.sentinel or args.replica_of or args.join is not None:
        return _start_site(args)
    if args.password_file:
        from etcslurm.coord.client import read_password_file

        password: str | None = read_password_file(args.password_file)
    else:
        password = None
    srv = BundledRedis(
        args.run_dir, host=args.bind, port=args.port, persist=args.persist,
        executable=args.redis_server, ready_timeout=args.ready_timeout,
        detached=not args.foreground, password=password,
    ).start()
    if args.json:
        print(json.dumps(read_state(args.run_dir)))
    else:
        print(srv.url)
    sys.stdout.flush()
    if args.foreground:
        done = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: done.set())
        try:
            while not done.wait(1.0):
                if srv.proc is None or srv.proc.poll() is not None:
                    sys.stderr.write(f"etcslurm: redis-server exited; log {srv.log_file}\n")
                    return 1
        finally:
            srv.stop()
    return 0


def _stop(args: argparse.Namespace) -> int:
    from etcslurm.errors import UsageError
    from etcslurm.redis_host.sentinel import stop_sentinel_of
    from etcslurm.redis_host.server import stop_detached

    if stop_sentinel_of(args.run_dir):
        print(f"stopped the Sentinel of {args.run_dir}")
    try:
        stopped = stop_detached(args.run_dir)
    except UsageError:  # no state file: nothing to stop, which is what was asked
        stopped = False
    if stopped:
        print(f"stopped coordinator of {args.run_dir}")
    else:
        print(f"coordinator of {args.run_dir} was not running")
    return 0


def _url(args: argparse.Namespace) -> int:
    from etcslurm.coord.client import read_password_file, with_password
    from etcslurm.redis_host.server import read_state

    state = read_state(args.run_dir)
    url = str(state["url"])
    if args.with_password:
        url = with_password(url, read_password_file(str(state["password_file"])))
    print(url)
    return 0


def _grant(args: argparse.Namespace) -> int:
    from pathlib import Path

    from etcslurm.coord.client import connect, redact, with_password
    from etcslurm.redis_host.acl import grant_run_user
    from etcslurm.redis_host.server import read_state, write_private

    state = read_state(args.run_dir)
    admin = connect(str(state["url"]), str(state["password_file"]))
    user, password = grant_run_user(admin, args.run_id)
    admin.close()
    pw_file = Path(args.run_dir) / f"{user}.password"
    write_private(pw_file, password + "\n")
    sys.stderr.write(f"password of {user} written to {pw_file} (mode 0600)\n")
    print(redact(with_password(str(state["url"]), password, username=user)).replace(":***", ""))
    return 0


def _sites(args: argparse.Namespace) -> int:
    from etcslurm.coord.client import connect
    from etcslurm.redis_host import failover

    client = connect(_env_url(args.url), args.password_file, retry_deadline=10)
    try:
        top = failover.topology(client)
    finally:
        client.close()
    if args.json:
        print(json.dumps(top))
        return 0
    print(f"service {top['service']}: {top['sites']} site(s) up, "
          f"{top['sentinels_up']} Sentinel(s) up, quorum {top['quorum']}")
    p = top["primary"]
    print(f"  primary  {p[0]}:{p[1]}{'' if top['primary_up'] else '  DOWN'}")
    for r in top["replicas"]:
        a = r["address"]
        print(f"  replica  {a[0]}:{a[1]}  {','.join(r['flags'])}")
    for x in top["sentinels"]:
        a = x["address"]
        print(f"  sentinel {a[0]}:{a[1]}  {','.join(x['flags'])}")
    return 0


def _hand_over(args: argparse.Namespace) -> int:
    from etcslurm.coord.client import connect
    from etcslurm.redis_host import failover
    from etcslurm.redis_host.server import read_state

    only = None
    if args.only_site:
        state = read_state(args.only_site)
        addr = state.get("address") or [state["host"], state["port"]]
        only = (str(addr[0]), int(addr[1]))  # type: ignore[index]
    client = connect(_env_url(args.url), args.password_file, retry_deadline=10)
    try:
        done = failover.hand_over(client, timeout=args.timeout, only_if=only)
    finally:
        client.close()
    if done is None:
        print("the primary is not on this site: nothing to hand over")
    else:
        print(f"primary moved {done.old[0]}:{done.old[1]} -> {done.new[0]}:{done.new[1]} "
              f"(writes waited {done.paused_s:.2f} s)")
    return 0
