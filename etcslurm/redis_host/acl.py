"""Per-run Redis ACL users: hard isolation between runs that share one Redis server.

Why: key prefixes keep honest runs apart, but with one shared password any client could
read or change another run's keys.  A run user may only touch ``etcslurm:{run}:*`` keys
(Redis itself answers ``NOPERM`` otherwise), cannot list key names (``SCAN``, ``KEYS``,
``RANDOMKEY`` are denied), cannot switch databases and has no admin or dangerous commands.
The coordinator therefore never needs ``SCAN``: it tracks its own keys.
"""

from __future__ import annotations

import secrets

from etcslurm.coord.client import CoordClient, with_password
from etcslurm.coord.schema import check_run_id, run_prefix


def run_user(run_id: str) -> str:
    """The ACL user name of a run."""
    return f"etcslurm-{check_run_id(run_id)}"


def grant_run_user(admin: CoordClient, run_id: str, password: str | None = None) -> tuple[str, str]:
    """Create (or reset) the run's ACL user on the server ``admin`` is connected to.

    ``admin`` must be allowed ``ACL SETUSER`` (e.g. the bundled server's default user).
    Returns ``(user, password)``; pass them as ``redis://user:password@host:port/0``.
    """
    user = run_user(run_id)
    password = password or secrets.token_urlsafe(24)
    rules = [
        "reset", "on", f">{password}", f"~{run_prefix(run_id)}*", "resetchannels",
        "+@all", "-@dangerous", "-@admin", "-scan", "-keys", "-randomkey", "-select",
        "-swapdb", "-move", "-migrate", "-@pubsub",
    ]
    admin.call(f"ACL SETUSER {user}", lambda r: r.execute_command("ACL", "SETUSER", user, *rules))
    return user, password


def run_user_url(admin_url: str, user: str, password: str) -> str:
    """``admin_url`` with the run user's credentials instead of the admin's."""
    return with_password(admin_url, password, username=user)


def revoke_run_user(admin: CoordClient, run_id: str) -> None:
    """Delete the run's ACL user (its open connections are closed by Redis)."""
    user = run_user(run_id)
    admin.call(f"ACL DELUSER {user}", lambda r: r.execute_command("ACL", "DELUSER", user))
