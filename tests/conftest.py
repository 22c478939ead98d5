"""Shared fixtures: real services started by ``sbin/test``.

``sbin/test`` exports ``ETCSLURM_TEST_REDIS_URL`` (a private, password-protected Redis)
and ``ETCSLURM_TEST_SLURM=1`` plus ``SLURM_CONF`` (the local Slurm cluster).  Outside CI a
missing service skips its tests; under ``CI=true`` it fails them, so CI can never pass
by silently skipping.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from tests.helpers import Background

IN_CI = os.environ.get("CI", "").lower() == "true"


def pytest_configure(config: pytest.Config) -> None:
    """This pytest's own torch ops share the host's cores with the other pytest that
    ``sbin/test`` runs beside it (and with the workers its tests start): torch's
    default, a spinning OpenMP thread per core in each, takes them from everyone."""
    import torch

    from etcslurm import cpu_threads

    torch.set_num_threads(cpu_threads.share(1 if os.environ.get("ETCSLURM_SERIAL_TESTS") == "1"
                                            else 2))


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
def own_redis_client(tmp_path: Path):
    """A client of a Redis server of this test's own, for tests that count the server's
    commands: sbin/test runs the ``waits`` tests beside the others on the shared one."""
    from etcslurm.coord.client import connect
    from etcslurm.redis_host.server import BundledRedis

    with BundledRedis(tmp_path / "own-redis") as srv:
        client = connect(srv.url, srv.password_file, retry_deadline=5)
        yield client
        client.close()


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


#: the shared reference covers the longest scenario that compares with it (12 steps)
REFERENCE_STEPS = 12


class Reference:
    """The one-worker run of gpt-tiny (global batch 12) that never resizes: what every
    elastic or faulty run of the same model and batch must train like.  Started in a
    thread on first use, so it trains while the first test using it runs; :meth:`get`
    waits for it (bounded).  One per session: tests share it instead of each training
    their own."""

    def __init__(self, redis_url: str, run_dir: Path) -> None:
        from etcslurm.testing import fault_scenarios as fm

        self.run = Background(
            lambda: fm.reference_losses(redis_url, None, run_dir, REFERENCE_STEPS),
            "the shared gpt-tiny reference run")

    def get(self, timeout: float = 900) -> dict[int, float]:
        losses = self.run.get(timeout)
        assert sorted(losses) == list(range(1, REFERENCE_STEPS + 1))
        return losses

    def max_diff(self, losses: dict[int, float]) -> float:
        """The largest |loss − reference| over the steps both have."""
        ref = self.get()
        common = sorted(set(losses) & set(ref))
        assert common, "no step in common with the reference"
        return max(abs(losses[s] - ref[s]) for s in common)


@pytest.fixture(scope="session")
def reference(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return Reference(redis_url, tmp_path_factory.mktemp("ref"))
