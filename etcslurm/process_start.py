"""Worker processes forked from a template that has already imported torch and
megatron-core, instead of each starting a fresh interpreter.

Why: a worker spends its first ~6 s of a core importing torch and megatron-core (megatron's
fused kernels import torch's inductor) before it does anything of its own.  A demo, a
benchmark or the test suite starts tens to hundreds of workers on a few cores, and those
imports were most of their CPU time.  multiprocessing's ``forkserver`` imports them once,
in a clean single-threaded process, and forks every worker from it in ~20 ms.  Each worker
is still a new process of its own: its own PID, environment, log, signals and exit code,
and it builds its process groups (gloo, NCCL) after the fork, as a fresh process would.
CUDA is never touched in the template (importing torch does not initialise it).

``ETCSLURM_WORKER_START=exec`` starts workers as fresh interpreters
(``python -m module``) instead, e.g. to rule the template out when chasing a problem.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import runpy
import subprocess
import sys
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from etcslurm import cpu_threads
from etcslurm.parent_death import die_with_parent

#: imported once by the template: torch, megatron-core and the worker's own runtime (the
#: entry modules themselves are not, so that each runs as ``__main__`` as with ``-m``)
PRELOAD = (
    "torch",
    "torch.distributed",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.dist_checkpointing",
    "etcslurm.runtime.session",
    "etcslurm.bench.migrate_worker",
    "etcslurm.baseline.checkpoint",
)

_started: list[ForkedProcess] = []


class WorkerProcess(Protocol):
    """What a launcher uses of a worker process (``subprocess.Popen``'s names)."""

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


class ForkedProcess:
    """A worker forked from the template, with ``subprocess.Popen``'s interface; the exit
    code is the process's own (negative: the signal that ended it)."""

    def __init__(self, proc: multiprocessing.process.BaseProcess, args: list[str]) -> None:
        self._proc, self.args = proc, args

    @property
    def pid(self) -> int:
        assert self._proc.pid is not None
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        code = self._proc.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)


def forking() -> bool:
    """Whether workers are forked from the template (the default) or exec'd."""
    return os.environ.get("ETCSLURM_WORKER_START", "fork") != "exec"


def start_worker(module: str, argv: Sequence[str], *, env: Mapping[str, str],
                 stdout: Path | None, stderr: Path | None,
                 new_session: bool = False) -> WorkerProcess:
    """Start ``python -m module *argv`` with ``env`` (the whole environment), its output
    to ``stdout`` / ``stderr`` (files, truncated; ``None``: discarded; the same path: one
    file for both).  The worker gets SIGKILL when its starter dies."""
    args = [sys.executable, "-m", module, *argv]
    if not forking():
        out = stdout.open("wb") if stdout is not None else subprocess.DEVNULL
        err = (subprocess.STDOUT if stderr == stdout and stdout is not None
               else stderr.open("wb") if stderr is not None else subprocess.DEVNULL)
        try:
            return subprocess.Popen(args, stdout=out, stderr=err, env=dict(env),
                                    stdin=subprocess.DEVNULL, start_new_session=new_session,
                                    preexec_fn=die_with_parent)
        finally:
            for fh in (out, err):
                if hasattr(fh, "close"):
                    fh.close()
    for path in {p for p in (stdout, stderr) if p is not None}:
        path.open("wb").close()  # here, as Popen's caller would: a bad path fails here
    ctx = multiprocessing.get_context("forkserver")
    if not _started:
        ctx.set_forkserver_preload(list(PRELOAD))
        atexit.register(_kill_leftovers)
    proc = ctx.Process(
        target=_run_as_main, name=f"worker:{module}",
        args=(module, list(argv), dict(env), os.getcwd(),
              str(stdout) if stdout else None, str(stderr) if stderr else None, new_session),
    )
    proc.start()
    started = ForkedProcess(proc, args)
    _started.append(started)
    return started


def stop_template() -> None:
    """Stop the template process and the resource tracker its workers share (a later
    start makes new ones).  Why: a worker that was SIGKILLed leaves its named semaphores
    (``/dev/shm/sem.mp-*``, from the queues of megatron's checkpoint writer) registered
    with that tracker, which unlinks them when it stops; call this when no forked worker
    is alive any more, e.g. before counting what a run left behind."""
    from multiprocessing import forkserver, resource_tracker

    if any(p.poll() is None for p in _started):
        raise RuntimeError("stop_template: forked workers are still running")
    forkserver._forkserver._stop()  # type: ignore[attr-defined]
    resource_tracker._resource_tracker._stop()  # type: ignore[attr-defined]
    _started.clear()


def _kill_leftovers() -> None:
    """At the starter's exit, what a worker started with ``exec`` gets from its parent's
    death (SIGKILL), before multiprocessing would wait for it."""
    for proc in _started:
        proc.kill()


def _redirect(stdout: str | None, stderr: str | None) -> None:
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    opened: dict[str, int] = {}
    for fd, path in ((1, stdout), (2, stderr)):
        if path is None:
            os.dup2(null, fd)
            continue
        if path not in opened:
            opened[path] = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(opened[path], fd)
    for target in (null, *opened.values()):
        os.close(target)
    # line-buffered, as the launchers asked of a fresh interpreter (PYTHONUNBUFFERED)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def _run_as_main(module: str, argv: list[str], env: dict[str, str], cwd: str,
                 stdout: str | None, stderr: str | None, new_session: bool) -> None:
    """The forked worker: become what ``python -m module *argv`` would have been."""
    if new_session:
        os.setsid()
    die_with_parent()  # the template is the parent; it ends with the starter
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    _redirect(stdout, stderr)
    # OpenMP read its variable when the template loaded torch, not this worker's value
    cpu_threads.apply()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)  # ``-m`` puts the working directory first
    sys.argv = [module, *argv]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            sys.stderr.write(f"{exc.code}\n")
            code = 1
    except BaseException:  # what the interpreter prints for an uncaught exception
        traceback.print_exc()
        code = 1
    exit_without_teardown(code)


def exit_without_teardown(code: int) -> None:
    """End the worker process with ``code`` once its work is done: atexit handlers run and
    the streams are flushed, but the interpreter's final teardown is skipped.

    Why: that teardown destroys what is still referenced at exit -- process groups that
    megatron's or the optimizer's objects hold, their C++ threads -- and a gloo thread
    destroyed while joinable aborts the process (``terminate called without an active
    exception``, exit -6) after a run that ended well, which the launcher and Slurm then
    take for a failed worker."""
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
