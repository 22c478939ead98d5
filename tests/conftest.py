"""Shared fixtures: real services started by ``sbin/test``.

``sbin/test`` exports ``ETCSLURM_TEST_REDIS_URL`` (a private, password-protected Redis)
and ``ETCSLURM_TEST_SLURM=1`` plus ``SLURM_CONF`` (the local Slurm cluster).  Outside CI a
missing service skips its tests; under ``CI=true`` it fails them, so CI can never pass
by silently skipping.
"""

from __future__ import annotations

import os
import uuid

import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"


def _missing(what: str) -> None:
    if IN_CI:
        pytest.fail(f"{what} is required under CI=true (sbin/test starts it)")
    pytest.skip(f"{what} not available (run the suite with sbin/test)")


@pytest.fixture(scope="session")
def redis_url() -> str:
    url = os.environ.get("ETCSLURM_TEST_REDIS_URL")
    if not url:
        _missing("Redis (ETCSLURM_TEST_REDIS_URL)")
    import redis

    try:
        redis.Redis.from_url(url, socket_timeout=5).ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis at ETCSLURM_TEST_REDIS_URL does not answer: {exc}")
    return url


@pytest.fixture
def run_id() -> str:
    """A fresh run namespace per test, so tests never see each other's keys."""
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def slurm_cluster() -> str:
    """The local Slurm cluster's SLURM_CONF; fails under CI when it is not up."""
    if os.environ.get("ETCSLURM_TEST_SLURM") != "1" or not os.environ.get("SLURM_CONF"):
        _missing("the local Slurm cluster (sbin/slurm-cluster start)")
    return os.environ["SLURM_CONF"]
