"""Bad input through the real command line: each mistake is one line on stderr (no
traceback) and the exit code documented in ``etcslurm/errors.py``:
2 bad input, 3 coordinator unreachable / refused / bad entry, 5 state would be lost.

Every case runs ``python -m etcslurm ...`` (or the worker entry point) in a subprocess,
exactly as a user would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis

from etcslurm.coord.client import connect
from etcslurm.coord.coordinator import Coordinator, SpecMismatch
from etcslurm.coord.schema import Keys
from etcslurm.errors import CoordinatorError, UsageError
from etcslurm.redis_host.acl import grant_run_user, revoke_run_user, run_user_url

USAGE, COORD, LOST = UsageError.exit_code, CoordinatorError.exit_code, 5


def _cli(args: list[str], cwd: Path, module: str = "etcslurm", timeout: float = 120,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("ETCSLURM_")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=full, stdin=subprocess.DEVNULL)


def _assert_one_line(proc: subprocess.CompletedProcess[str], code: int, needle: str,
                     noisy: bool = False) -> None:
    """Exit ``code`` and one ``etcslurm...`` line naming the problem; ``noisy``: a worker
    process whose libraries may also print warnings (only the etcslurm line counts)."""
    err = proc.stderr.strip()
    assert proc.returncode == code, (proc.returncode, err[-2000:])
    assert "Traceback" not in err, err
    if noisy:
        err = "\n".join(line for line in err.splitlines() if line.startswith("etcslurm"))
    assert err.startswith("etcslurm") and "\n" not in err, err
    assert needle.lower() in err.lower(), err


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bad")
    (d / "afile").write_text("not a directory\n")
    (d / "badjson").mkdir()
    (d / "badjson" / "coordinator.json").write_text("{not json")
    (d / "ok.toml").write_text('[run]\nmodel = "gpt-tiny"\n[slurm]\naccount = "a"\n')
    (d / "typo.toml").write_text('[run]\nmodel = "gpt-tiny"\n[slurm]\nacount = "a"\n')
    return d


TINY = ["--model", "gpt-tiny"]
MOE = ["--model", "moe-tiny"]
DEMO = ["demo", "--no-monitor", "--no-reference", "--steps", "4", "--workers", "2"]

# (id, argv, exit code, a phrase the one-line message must contain)
OFFLINE = [
    ("layout-not-divisible", ["plan", *TINY, "--from", "tp3pp1dp1", "--to", "tp1pp1dp2"],
     USAGE, "heads=4 is not divisible by tp=3"),
    ("layout-malformed", ["plan", *TINY, "--from", "tpxdp", "--to", "tp1pp1dp2"],
     USAGE, "not of the form"),
    ("layout-too-many-stages", ["plan", *TINY, "--from", "tp1pp64dp1", "--to", "tp1pp1dp1"],
     USAGE, "not divisible by pp=64"),
    ("world-size-does-not-add-up", ["plan", *TINY, "--from", "tp1pp1dp4", "--to", "tp1pp1dp8"],
     USAGE, "do not add up"),
    ("leave-out-of-range", ["plan", *TINY, "--from", "tp1pp1dp2", "--to", "tp1pp1dp1",
                            "--leave", "5"], USAGE, "out of range"),
    ("negative-join", ["plan", *TINY, "--from", "tp1pp1dp2", "--to", "tp1pp1dp1", "--leave", "1",
                       "--join", "-2"], USAGE, "--join"),
    ("negative-staging", ["plan", *TINY, "--from", "tp1pp1dp2", "--to", "tp1pp1dp1",
                          "--leave", "1", "--staging-mb", "-3"], USAGE, "--staging-mb"),
    ("unknown-optimizer", ["plan", *TINY, "--from", "tp1pp1dp2", "--to", "tp1pp1dp1",
                           "--leave", "1", "--optimizer", "sgd"], USAGE, "unknown optimizer"),
    ("unknown-model", ["plan", "--model", "gpt-nope", "--from", "tp1pp1dp2", "--to", "tp1pp1dp1",
                       "--leave", "1"], USAGE, "unknown model 'gpt-nope'"),
    ("model-heads-mismatch", ["plan", "--model", "layers=2,hidden=10,heads=3,vocab=100,seq=16",
                              "--from", "tp1pp1dp2", "--to", "tp1pp1dp1", "--leave", "1"],
     USAGE, "not divisible by heads"),
    ("model-unknown-field", ["plan", "--model", "layers=2,hidden=64,heads=4,vocab=100,seq=16,x=3",
                             "--from", "tp1pp1dp2", "--to", "tp1pp1dp1", "--leave", "1"],
     USAGE, "unknown field"),
    ("model-zero-layers", ["plan", "--model", "layers=0,hidden=64,heads=4,vocab=100,seq=16",
                           "--from", "tp1pp1dp2", "--to", "tp1pp1dp1", "--leave", "1"],
     USAGE, "positive integer"),
    # expert parallelism: one line naming the problem (and the valid layouts), exit 2
    ("moe-tp2-without-apex", ["bench", "migrate", *MOE, "--from", "tp2pp1dp2ep2",
                              "--to", "tp1pp1dp4ep2"], USAGE, "needs sequence parallelism"),
    ("ep-does-not-divide-dp", ["plan", *MOE, "--from", "tp1pp1dp3ep2", "--to", "tp1pp1dp3"],
     USAGE, "ep=2 does not divide dp=3"),
    ("ep-does-not-divide-experts", ["plan", *MOE, "--from", "tp1pp1dp3ep3", "--to", "tp1pp1dp3"],
     USAGE, "experts=4 is not divisible by ep=3"),
    ("ep-on-a-dense-model", ["plan", *TINY, "--from", "tp1pp1dp4ep2", "--to", "tp1pp1dp4"],
     USAGE, "needs a mixture-of-experts model"),
    ("ep-zero", ["plan", *MOE, "--from", "tp1pp1dp4ep0", "--to", "tp1pp1dp4"], USAGE,
     "at least 1"),
    ("ep-malformed", ["plan", *MOE, "--from", "tp1pp1dp4ep", "--to", "tp1pp1dp4"], USAGE,
     "tp<N>[cp<N>]pp<N>[vpp<N>]dp<N>[ep<N>]"),
    ("bench-ep-does-not-divide-dp", ["bench", "migrate", *MOE, "--from", "tp1pp1dp4ep4",
                                     "--to", "tp1pp1dp3ep4", "--leave", "3"], USAGE,
     "ep=4 does not divide dp=3"),
    ("model-topk-above-experts", ["plan", "--model", "layers=2,hidden=64,heads=4,vocab=100,"
                                  "seq=16,bias=0,experts=4,topk=5", "--from", "tp1pp1dp1",
                                  "--to", "tp1pp1dp1"], USAGE, "topk must be between 1 and"),
    ("model-moe-with-bias", ["plan", "--model", "layers=2,hidden=64,heads=4,vocab=100,"
                             "seq=16,experts=4", "--from", "tp1pp1dp1", "--to", "tp1pp1dp1"],
     USAGE, "must have bias=0"),
    ("bench-unknown-model", ["bench", "migrate", "--model", "gpt-nope"], USAGE, "unknown model"),
    ("layouts-bad-size", ["layouts", *TINY, "--devices", "8", "--gpu-memory", "80G"], USAGE,
     "size '80G' is not a number of bytes"),
    ("layouts-no-devices", ["layouts", *TINY, "--devices", "0"], USAGE, "--devices"),
    ("layouts-bad-recompute", ["layouts", *TINY, "--devices", "2", "--recompute", "some"],
     USAGE, "unknown recompute 'some'"),
    ("layouts-bad-optimizer", ["layouts", *TINY, "--devices", "2", "--optimizer", "sgd"], USAGE,
     "unknown optimizer"),
    ("layouts-bad-margin", ["layouts", *TINY, "--devices", "2", "--margin", "1.5"], USAGE,
     "--margin"),
    ("layouts-bad-allow", ["layouts", *TINY, "--devices", "2", "--allow", "tp=two"], USAGE,
     "allowed layout 'tp=two'"),
    ("layouts-batch-not-micro-multiple", ["layouts", *TINY, "--devices", "2", "--global-batch",
                                          "5", "--micro-batch", "2"], USAGE, "--global-batch"),
    ("demo-no-workers", [*DEMO[:-1], "0", "--schedule", ""], USAGE, "--workers"),
    ("demo-zero-steps", ["demo", "--no-monitor", "--steps", "0", "--schedule", ""], USAGE, "--steps"),
    ("schedule-bad-action", [*DEMO, "--schedule", "2:explode=1"], USAGE, "bad schedule entry"),
    ("schedule-after-end", [*DEMO, "--schedule", "9:leave=1"], USAGE, "only 4 steps"),
    ("schedule-removes-everyone", [*DEMO, "--schedule", "1:leave=3"], USAGE, "removes more workers"),
    ("demo-unknown-model", [*DEMO, "--schedule", "", "--model", "gpt-nope"], USAGE, "unknown model"),
    ("demo-run-dir-is-a-file", [*DEMO, "--schedule", "", "--run-dir", "afile"], USAGE, "not usable"),
    ("coordinator-run-dir-is-a-file", ["coordinator", "start", "afile"], USAGE, "not usable"),
    ("coordinator-not-running", ["coordinator", "url", "nowhere"], USAGE, "no coordinator running"),
    ("submit-unknown-template", ["submit", "--template", "nope", "--dry-run"], USAGE,
     "unknown template"),
    ("submit-unknown-field", ["submit", "--template", "elastic", "--set", "bogus_field=1",
                              "--dry-run"], USAGE, "unknown field(s) bogus_field"),
    ("submit-set-without-value", ["submit", "--template", "elastic", "--set", "novalue",
                                  "--dry-run"], USAGE, "key=value"),
    ("submit-missing-field", ["submit", "--template", "elastic", "--dry-run"], USAGE,
     "missing field(s) worker_cmd"),
    ("submit-runfile-typo", ["submit", "typo.toml", "--dry-run"], USAGE,
     "[slurm] acount: unknown field; did you mean account?"),
    ("submit-runfile-missing", ["submit", "nope.toml"], USAGE, "no such run file"),
    ("submit-runfile-bad-set", ["submit", "ok.toml", "--set", "slurm.nodes=two", "--dry-run"],
     USAGE, "[slurm] nodes: expected a non-negative integer"),
    ("grow-runfile-not-started", ["grow", "ok.toml"], COORD, "has no coordinator yet"),
    ("grow-bad-run-id", ["grow", "--run", "bad run id!", "--dry-run", "--redis",
                         "redis://127.0.0.1:1/0"], USAGE, "bad run id"),
    ("grow-bad-het", ["grow", "--run", "r1", "--het", "1x", "--dry-run", "--redis",
                      "redis://127.0.0.1:1/0"], USAGE, "--het"),
    ("grow-zero-nodes", ["grow", "--run", "r1", "--nodes", "0", "--dry-run", "--redis",
                         "redis://127.0.0.1:1/0"], USAGE, "--nodes"),
    ("unknown-command", ["nosuchcommand"], USAGE, "invalid choice"),
    ("not-a-redis-url", [*DEMO, "--schedule", "", "--redis", "http://x"], COORD,
     "must start with redis://"),
    ("malformed-coordinator-json", ["monitor", "--once", "--run-dir", "badjson"], COORD,
     "cannot read"),
    ("coordinator-unreachable", ["monitor", "--once", "--run", "x", "--redis",
                                 "redis://127.0.0.1:1/0"], COORD, "unreachable"),
]


@pytest.mark.parametrize(("argv", "code", "needle"), [c[1:] for c in OFFLINE],
                         ids=[c[0] for c in OFFLINE])
def test_offline_bad_input_is_one_line(argv: list[str], code: int, needle: str, work: Path) -> None:
    _assert_one_line(_cli(argv, work), code, needle)


def test_worker_without_run_is_one_line(work: Path) -> None:
    _assert_one_line(_cli(["--redis", "redis://127.0.0.1:1/0"], work, "etcslurm.runtime.worker"),
                     USAGE, "needs --run")


# ---------------------------------------------------------------------- with a Redis
@pytest.fixture(scope="module")
def planted(redis_url: str) -> dict[str, str]:
    """Runs whose coordinator entries are broken on purpose (removed afterwards)."""
    r = redis.Redis.from_url(redis_url)
    tag = uuid.uuid4().hex[:6]
    runs = {k: f"bad-{k}-{tag}" for k in ("malformed", "oversized", "notobj", "notrecord")}
    values = {"malformed": b"\x80\x81 not json", "oversized": b'"' + b"x" * (5 << 20) + b'"',
              "notobj": b"[1, 2, 3]",
              "notrecord": b'{"generation": 0, "kind": "start", "layout": "tp1pp1dp1"}'}
    for kind, run in runs.items():
        keys = Keys(run)
        r.set(keys.spec, b"{}")
        r.set(keys.gen, values[kind])
    yield runs
    for run in runs.values():
        keys = Keys(run)
        r.delete(keys.spec, keys.gen)
    r.close()


def _with_password(url: str, password: str | None) -> str:
    from urllib.parse import urlsplit, urlunsplit

    p = urlsplit(url)
    host = f"{p.hostname}:{p.port}"
    netloc = host if password is None else f":{password}@{host}"
    return urlunsplit((p.scheme, netloc, p.path, "", ""))


@pytest.mark.redis
@pytest.mark.parametrize("password", [None, "not-the-password"], ids=["none", "wrong"])
def test_missing_or_wrong_password_refused(password: str | None, redis_url: str, work: Path) -> None:
    url = _with_password(redis_url, password)
    proc = _cli(["status", "--run", "x", "--redis", url], work)
    _assert_one_line(proc, COORD, "requires a password" if password is None else "refused the password")
    assert "not-the-password" not in proc.stderr
    _assert_one_line(_cli(["runs", "--redis", url], work), COORD, "password")


@pytest.mark.redis
@pytest.mark.parametrize(("kind", "needle"), [("malformed", "not valid JSON"),
                                              ("oversized", "over the"),
                                              ("notobj", "expected an object"),
                                              ("notrecord", "generation record: unknown field 'layout'")])
def test_bad_coordinator_entries_are_named(kind: str, needle: str, planted: dict[str, str],
                                           redis_url: str, work: Path) -> None:
    proc = _cli(["status", "--run", planted[kind], "--redis", redis_url], work)
    _assert_one_line(proc, COORD, needle)
    assert f"{planted[kind]}:gen" in proc.stderr


@pytest.mark.redis
def test_unknown_run_and_bad_run_id(redis_url: str, work: Path) -> None:
    _assert_one_line(_cli(["status", "--run", f"nosuch-{uuid.uuid4().hex[:6]}", "--redis",
                           redis_url], work), USAGE, "no run")
    _assert_one_line(_cli(["status", "--run", "bad id!", "--redis", redis_url], work),
                     USAGE, "invalid run id")


@pytest.mark.redis
def test_worker_of_a_run_without_spec(redis_url: str, work: Path) -> None:
    proc = _cli(["--run", f"nosuch-{uuid.uuid4().hex[:6]}", "--redis", redis_url], work,
                "etcslurm.runtime.worker")
    _assert_one_line(proc, USAGE, "has no spec")


@pytest.mark.redis
def test_worker_with_another_runs_credentials_is_refused(redis_url: str, run_id: str,
                                                         work: Path) -> None:
    """A per-run ACL user (what ``etcslurm coordinator grant`` hands out) cannot enter
    another run: the worker stops with exit 3 and one line."""
    admin = connect(redis_url)
    other = Coordinator(admin, run_id + "-other")
    other.ensure_spec({"model": "gpt-tiny"})
    user, password = grant_run_user(admin, run_id)
    try:
        url = run_user_url(redis_url, user, password)
        proc = _cli(["--run", run_id + "-other", "--redis", url], work, "etcslurm.runtime.worker")
        _assert_one_line(proc, COORD, "denied access")
        assert password not in proc.stderr
    finally:
        revoke_run_user(admin, run_id)
        other.end_run()
        admin.close()


@pytest.mark.redis
def test_joiner_with_a_different_model_spec_is_refused(redis_url: str, run_id: str) -> None:
    """A worker whose run spec (model, batch, ...) differs from the run's is refused before
    it registers: SpecMismatch, exit 3, the differing fields named."""
    from etcslurm.core.models import GPTSpec
    from etcslurm.runtime.config import RunSettings

    base = RunSettings(model=GPTSpec.parse("gpt-tiny"))
    other = RunSettings(model=GPTSpec.parse("gpt-125m"), global_batch=16)
    client = connect(redis_url)
    first = Coordinator(client, run_id, spec=base.to_json())
    try:
        first.register(heartbeat=False)
        joiner = Coordinator(client, run_id, spec=other.to_json())
        with pytest.raises(SpecMismatch) as exc:
            joiner.register(heartbeat=False)
        msg = str(exc.value)
        assert exc.value.exit_code == COORD and "\n" not in msg
        assert "model" in msg and "global_batch" in msg
        assert joiner.worker_id is None and list(first.members()) == [first.worker_id]
    finally:
        first.end_run()
        client.close()


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.parametrize(("case", "code", "needle"), [
    ("dir-is-a-file", USAGE, "checkpoint directory"),
    ("garbage-pointer", LOST, "cannot read checkpoint pointer"),
])
def test_unusable_checkpoint_directory(case: str, code: int, needle: str, redis_url: str,
                                       run_id: str, work: Path, tmp_path: Path) -> None:
    """A worker told to resume from a checkpoint directory it cannot use stops at once."""
    from etcslurm.core.models import GPTSpec
    from etcslurm.runtime.config import RunSettings

    if case == "dir-is-a-file":
        ckpt = work / "afile"
    else:
        ckpt = tmp_path / "ckpt"
        ckpt.mkdir()
        (ckpt / "latest_checkpointed_iteration.txt").write_text("{garbage")
    spec = RunSettings(model=GPTSpec.parse("gpt-tiny"), steps=2).to_json()
    client = connect(redis_url)
    coord = Coordinator(client, run_id)
    coord.ensure_spec(spec)
    try:
        proc = _cli(["--run", run_id, "--redis", redis_url, "--run-dir", str(tmp_path),
                     "--checkpoint-dir", str(ckpt), "--join-timeout", "60"], work,
                    "etcslurm.runtime.worker", timeout=300)
        _assert_one_line(proc, code, needle, noisy=True)
        assert coord.current_generation() is None  # nothing was started
        assert json.dumps(coord.live_members()) == "{}"
    finally:
        coord.end_run()
        client.close()
