"""One run file: the run, the workers and the Slurm job in one TOML file.

    run_id = "gpt-small"            # the run's coordinator namespace (default: the file's name)
    run_dir = "runs/gpt-small"      # shared by the run's jobs (default: runs/<run_id>)

    [run]        # RunSettings: the same on every worker, stored in the coordinator
    model = "gpt-tiny"              # a preset, a spec "layers=..,hidden=..", or a table
    steps = 1000
    builder = "mypkg.model:build"   # optional: the model builder, imported by the worker

    [worker]     # this worker's flags (python -m etcslurm.runtime.worker --help)
    collective_timeout = 60

    [slurm]      # the sbatch templates' fields, and `split`
    nodes = 4
    gpus_per_node = 8
    account = "proj"

    [autogrow]   # optional: the first job also runs `etcslurm autogrow` on this file
    max_nodes = 16

``[run]`` takes every field of :class:`~etcslurm.runtime.config.RunSettings`'s run spec
(its ``to_json`` keys), so a new setting needs no change here; ``gpus_per_node`` is not
among them: it follows from ``[slurm]`` (``gpus_per_node``, the count in ``gres``, or
``gpus_per_task`` × ``tasks_per_node``), one source of truth for the job's request, the
tasks per node (one per GPU) and the layout policy.  ``initial_workers`` defaults to the
tasks of the first job.  ``[worker]`` takes the worker's own flags and ``command`` (a
script of the user's that takes the same flags).  ``[slurm]`` takes the fields of
``elastic.sbatch`` that the run file does not set itself.  Relative paths are relative
to the run file's directory.  ``[autogrow]`` takes the limits of ``etcslurm autogrow``
(:data:`AUTOGROW_KEYS`); with it, the first job runs the autogrow loop on this file.

:func:`load` reports every problem, one line each (a misspelt field names the nearest
valid one), as a :class:`RunFileError`; the template stores the spec once its
coordinator answers with ``python -m etcslurm.slurm.in_job store-spec``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import shlex
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from etcslurm.errors import UsageError
from etcslurm.slurm.templates import Template, check_value, load_template

TABLES = ("run", "worker", "slurm", "autogrow")
#: ``[autogrow]`` keys and their types (``etcslurm autogrow`` flags of the same names)
AUTOGROW_KEYS: dict[str, type] = {"max_nodes": int, "partition": str, "min_idle": int,
                                  "max_pending": int, "interval": float,
                                  "start_timeout": float, "backoff": float}
TOP_LEVEL = ("run_id", "run_dir")
#: elastic.sbatch fields the run file sets itself
_DERIVED = {"run_id", "worker_cmd", "run_spec", "run_dir", "array", "autogrow_cmd"}
#: worker flags that the job provides (environment) or that live elsewhere in the file
_WORKER_SKIP = {"help", "run", "redis", "run_dir", "node", "builder"}
_ENTRY_RE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


class RunFileError(UsageError):
    """Problems in a run file, one line each (``problems``)."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


@dataclass
class RunFile:
    """A validated run file: the run spec, the worker command and the Slurm fields."""

    path: Path
    run_id: str
    run_dir: Path
    spec: dict[str, Any]  # RunSettings.to_json()
    builder: str | None
    worker_cmd: str
    split: bool
    nodes: int
    tasks_per_node: int
    slurm: dict[str, object] = field(default_factory=dict)  # the other template fields
    autogrow: dict[str, Any] = field(default_factory=dict)  # [autogrow]; empty: none
    sets: dict[str, str] = field(default_factory=dict)  # the --set overrides it was read with

    def submit_args(self) -> dict[str, Any]:
        """Keyword arguments of :func:`etcslurm.slurm.submission.submit` for this run."""
        fields = {"job_name": self.run_id, **self.slurm}
        fields.update(run_dir=str(self.run_dir), run_spec=json.dumps(self.spec, sort_keys=True))
        if self.autogrow:
            fields["autogrow_cmd"] = self.autogrow_cmd()
        return self._common(fields) | {"run_id": self.run_id, "nodes": self.nodes}

    def autogrow_cmd(self) -> str:
        """``etcslurm autogrow`` on this file (with its ``--set`` overrides), as the first
        job runs it."""
        python = str(self.slurm.get("python") or sys.executable)
        words = [python, "-m", "etcslurm", "autogrow", str(self.path.resolve())]
        for key, value in self.sets.items():
            words += ["--set", f"{key}={value}"]
        return shlex.join(words)

    def grow_args(self, template: Template, nodes: int) -> dict[str, Any]:
        """Keyword arguments of :func:`etcslurm.slurm.submission.grow` (``template``: grow's,
        which takes the site's fields but not the first job's)."""
        known = set(template.field_names)
        fields = {k: v for k, v in {"job_name": f"{self.run_id}-grow", **self.slurm}.items()
                  if k in known}
        fields["run_dir"] = str(self.run_dir)
        return self._common(fields) | {"nodes": nodes}

    def _common(self, fields: dict[str, object]) -> dict[str, Any]:
        args: dict[str, Any] = {"split": self.split, "tasks_per_node": self.tasks_per_node,
                                "folder": self.run_dir}
        for key, arg in (("partition", "partition"), ("time", "time_limit"),
                         ("signal", "signal"), ("signal_lead", "signal_lead"),
                         ("redis_url", "redis_url")):
            if key in fields:
                args[arg] = fields.pop(key)
        args["fields"] = fields
        return args


# ---------------------------------------------------------------------------- vocabulary
def _spec_defaults() -> dict[str, Any]:
    """The run spec of a run that sets nothing but its model: the ``[run]`` vocabulary."""
    from etcslurm.core.models import GPTSpec
    from etcslurm.runtime.config import RunSettings

    return RunSettings(model=GPTSpec.parse("gpt-tiny")).to_json()


def _worker_flags() -> dict[str, Any]:
    """``[worker]`` key → the worker's argparse action."""
    from etcslurm.runtime.worker import parser

    return {a.dest: a for a in parser()._actions
            if a.dest not in _WORKER_SKIP and a.option_strings}


def _slurm_fields(template: Template) -> list[str]:
    return [f for f in template.field_names if f not in _DERIVED] + ["split"]


def _unknown(where: str, key: str, valid: Sequence[str]) -> str:
    near = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    hint = f"did you mean {near[0]}?" if near else f"valid: {', '.join(sorted(valid))}"
    return f"{where} {key}: unknown field; {hint}"


# ---------------------------------------------------------------------------- overrides
def _toml_value(text: str) -> object:
    """``--set`` values: a TOML number, boolean or array when they parse as one, else text."""
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    return value if isinstance(value, int | float | bool | list) else text


def apply_sets(raw: dict[str, Any], sets: Mapping[str, str], template: Template) -> list[str]:
    """Apply ``--set key=value`` (``slurm.nodes=4``, or ``nodes=4`` when only one table has
    it) to the parsed file; returns the problems."""
    vocab = {"run": [k for k in [*_spec_defaults(), "builder"] if k != "gpus_per_node"],
             "worker": [*_worker_flags(), "command"], "slurm": _slurm_fields(template),
             "autogrow": list(AUTOGROW_KEYS)}
    problems = []
    for key, text in sets.items():
        table, _, name = key.rpartition(".")
        if not table:
            if name in TOP_LEVEL:
                raw[name] = _toml_value(text)
                continue
            owners = [t for t in TABLES if name in vocab[t]]
            if len(owners) > 1 and "autogrow" in owners:  # partition: the job's
                owners.remove("autogrow")
            if len(owners) > 1:
                problems.append(f"--set {key}: in {' and '.join(owners)}: write {owners[0]}.{name}")
                continue
            if not owners:
                bare = {k: f"{t}.{k}" for t in reversed(TABLES) for k in vocab[t]}
                near = difflib.get_close_matches(name, [*TOP_LEVEL, *bare], n=1, cutoff=0.6)
                problems.append(f"--set {key}: unknown field; " + (
                    f"did you mean {bare.get(near[0], near[0])}?" if near
                    else "see the run file's tables [run], [worker], [slurm]"))
                continue
            table = owners[0]
        if table not in TABLES:
            problems.append(f"--set {key}: unknown table {table!r}; valid: {', '.join(TABLES)}")
            continue
        raw.setdefault(table, {})[name] = _toml_value(text)
    return problems


# ---------------------------------------------------------------------------- validation
def _gpu_count(gres: str) -> int | None:
    """GPUs per node in a ``--gres`` value (``gpu:h100:8,nvme:1`` → 8, ``gpu`` → 1)."""
    for item in gres.split(","):
        parts = item.strip().split(":")
        if parts[0] == "gpu":
            return int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
    return None


def _check_run(table: dict[str, Any], where: str, problems: list[str]) -> tuple[dict, str | None]:
    from etcslurm.core.models import GPTSpec

    defaults = _spec_defaults()
    spec = dict(defaults)
    builder = table.pop("builder", None)
    if builder is not None and not (isinstance(builder, str) and _ENTRY_RE.fullmatch(builder)):
        problems.append(f"{where} builder: expected module:function, got {builder!r}")
        builder = None
    if "model" not in table:
        problems.append(f"{where} model: missing (a preset such as gpt-tiny, or a spec "
                        "layers=..,hidden=..,heads=..,vocab=..,seq=..)")
    for key, value in table.items():
        if key == "gpus_per_node":
            problems.append(f"{where} gpus_per_node: set it in [slurm] (gpus_per_node, gres or "
                            "gpus_per_task): one source of truth for the job and the layouts")
        elif key not in defaults:
            problems.append(_unknown(where, key, [*defaults, "builder"]))
        elif key == "model":
            try:
                model = GPTSpec.parse(value) if isinstance(value, str) else GPTSpec.from_json(value)
                spec["model"] = model.to_json()
            except (UsageError, TypeError, ValueError) as exc:
                problems.append(f"{where} model: {exc}")
        elif not _same_kind(value, defaults[key]):
            problems.append(f"{where} {key}: expected {_kind(defaults[key])}, got {value!r}")
        else:
            spec[key] = value
    return spec, builder


def _same_kind(value: object, default: object) -> bool:
    if default is None:
        return True
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, float):
        return isinstance(value, int | float)
    return isinstance(value, type(default))


def _kind(default: object) -> str:
    return {bool: "true/false", int: "an integer", float: "a number", str: "text",
            list: "a list", dict: "a table"}.get(type(default), type(default).__name__)


def _worker_cmd(table: dict[str, Any], builder: str | None, python: str, where: str,
                problems: list[str]) -> str:
    flags = _worker_flags()
    command = table.pop("command", None)
    if command is not None and not (isinstance(command, str) and command.strip()):
        problems.append(f"{where} command: expected a command line, got {command!r}")
        command = None
    words = shlex.split(command) if command else [python, "-m", "etcslurm.runtime.worker"]
    for key, value in table.items():
        action = flags.get(key)
        if action is None:
            problems.append(_unknown(where, key, [*flags, "command"]))
            continue
        if isinstance(value, bool | list | dict) or (action.type is float
                                                      and not isinstance(value, int | float)):
            problems.append(f"{where} {key}: expected "
                            f"{'a number' if action.type is float else 'text'}, got {value!r}")
            continue
        words += [action.option_strings[0], str(value)]
    if builder:
        words += ["--builder", builder]
    return shlex.join(words)


def _check_slurm(table: dict[str, Any], template: Template, base: Path, where: str,
                 problems: list[str]) -> tuple[dict[str, object], bool, int, int, int]:
    """(template fields, split, nodes, tasks per node, devices per node)."""
    valid = _slurm_fields(template)
    by_name = {f.name: f for f in template.fields}
    out: dict[str, object] = {}
    split = False
    for key, value in table.items():
        if key not in valid:
            problems.append(_unknown(where, key, valid))
            continue
        if key == "split":
            if not isinstance(value, bool):
                problems.append(f"{where} split: expected true/false, got {value!r}")
            split = value is True
            continue
        if isinstance(value, bool):
            value = int(value)
        elif isinstance(value, list) and by_name[key].type != "lines":
            problems.append(f"{where} {key}: expected one value, got a list")
            continue
        if key == "extra_sbatch":
            items = value if isinstance(value, list) else str(value).splitlines()
            value = [str(v).strip().removeprefix("#SBATCH").strip() for v in items]
            bad = [v for v in value if v and not v.startswith("-")]
            if bad:
                problems.append(f"{where} extra_sbatch: sbatch options start with -, got {bad[0]!r}")
                continue
        if (by_name[key].type == "path" and key != "output" and isinstance(value, str)
                and "/" in value and not value.startswith(("/", "~"))):
            value = str(base / value)  # relative to the run file (output: to run_dir)
        problem = check_value(template, key, value)
        if problem:
            problems.append(f"{where} {problem}")
            continue
        out[key] = value

    def count(key: str) -> int | None:
        value = out.get(key)
        return int(value) if isinstance(value, int) or (isinstance(value, str) and value.isdigit()) else None

    per_node, per_task, tasks = count("gpus_per_node"), count("gpus_per_task"), count("tasks_per_node")
    from_gres = _gpu_count(str(out.get("gres", "")))
    if per_task is not None and per_task > 1:
        problems.append(f"{where} gpus_per_task: one GPU per task (each task is one rank), got {per_task}")
    claims = {k: v for k, v in (("gpus_per_node", per_node), ("gres", from_gres),
                                ("gpus_per_task x tasks_per_node",
                                 per_task * tasks if per_task and tasks else None)) if v}
    devices = max(claims.values(), default=0)
    if len(set(claims.values())) > 1:
        problems.append(f"{where} GPUs per node disagree: "
                        + ", ".join(f"{k} says {v}" for k, v in claims.items()))
    if per_task and not tasks and not devices:
        problems.append(f"{where} gpus_per_task needs tasks_per_node, gpus_per_node or gres")
    if devices and tasks is not None and tasks != devices:
        problems.append(f"{where} tasks_per_node: one task per GPU, so {devices}, got {tasks}")
    tasks = tasks or devices or 1
    if devices:
        out["tasks_per_node"] = tasks
        if per_node is not None and per_node == 0:
            out.pop("gpus_per_node")
    if out.get("mem") not in (None, "") and out.get("mem_per_gpu") not in (None, ""):
        problems.append(f"{where} mem and mem_per_gpu: Slurm takes one of them")
    nodes = count("nodes") or int(by_name["nodes"].default or 1)
    out.pop("nodes", None)
    out.pop("tasks_per_node", None)
    return out, split, nodes, tasks, devices


def load(path: str | Path, sets: Mapping[str, str] | None = None,
         template: str | Template = "elastic") -> RunFile:
    """Read and check a run file (``sets``: ``--set`` overrides); every problem at once."""
    path = Path(path)
    name = path.name
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise RunFileError([f"{path}: no such run file"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RunFileError([f"{path}: cannot read it: {exc}"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise RunFileError([f"{name}: not valid TOML: {exc}"]) from None
    tpl = template if isinstance(template, Template) else load_template(template)
    problems = apply_sets(raw, sets or {}, tpl)
    for key, value in raw.items():
        if key in TABLES:
            if not isinstance(value, dict):
                problems.append(f"{name}: {key} must be a table ([{key}])")
        elif key not in TOP_LEVEL:
            problems.append(_unknown(f"{name}:", key, [*TOP_LEVEL, *(f"[{t}]" for t in TABLES)]))
    tables = {t: dict(raw[t]) if isinstance(raw.get(t), dict) else {} for t in TABLES}
    run_id = raw.get("run_id", path.stem)
    if not isinstance(run_id, str) or not re.fullmatch(r"[A-Za-z0-9._:+-]+", run_id):
        problems.append(f"{name}: run_id: letters, digits and ._:+- only, got {run_id!r}")
        run_id = "run"
    base = path.resolve().parent
    run_dir = base / str(raw.get("run_dir", f"runs/{run_id}"))
    spec, builder = _check_run(tables["run"], f"{name}: [run]", problems)
    slurm, split, nodes, tasks, devices = _check_slurm(tables["slurm"], tpl, base,
                                                       f"{name}: [slurm]", problems)
    python = str(slurm.get("python") or sys.executable)
    worker_cmd = _worker_cmd(tables["worker"], builder, python, f"{name}: [worker]", problems)
    spec["gpus_per_node"] = devices or tasks
    autogrow = _check_autogrow(tables["autogrow"], slurm, f"{name}: [autogrow]", problems)
    if "initial_workers" not in tables["run"]:
        spec["initial_workers"] = nodes * tasks
    if not problems:
        problems += _check_spec(spec, name)
    if problems:
        raise RunFileError(problems)
    return RunFile(path=path, run_id=run_id, run_dir=run_dir, spec=spec, builder=builder,
                   worker_cmd=worker_cmd, split=split, nodes=nodes, tasks_per_node=tasks,
                   slurm=slurm, autogrow=autogrow, sets=dict(sets or {}))


def _check_autogrow(table: dict[str, Any], slurm: dict[str, object], where: str,
                    problems: list[str]) -> dict[str, Any]:
    """The ``[autogrow]`` table, checked (empty: no autogrow)."""
    if not table:
        return {}
    out: dict[str, Any] = {}
    for key, value in table.items():
        kind = AUTOGROW_KEYS.get(key)
        if kind is None:
            problems.append(_unknown(where, key, list(AUTOGROW_KEYS)))
        elif isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else kind):
            problems.append(f"{where} {key}: expected {_kind(kind())}, got {value!r}")
        elif kind is not str and (value <= 0 if kind is float else value < 1):
            problems.append(f"{where} {key}: must be {'> 0' if kind is float else '>= 1'}, "
                            f"got {value!r}")
        else:
            out[key] = value
    if "max_nodes" not in table:
        problems.append(f"{where} max_nodes: missing (the most nodes the run may grow to)")
    out.setdefault("partition", slurm.get("partition") or "")
    if not out["partition"]:
        problems.append(f"{where} partition: missing (here or in [slurm]): the partition "
                        "whose idle nodes it grows into")
    return out


def _check_spec(spec: dict[str, Any], name: str) -> list[str]:
    """What the runtime itself would refuse in the run spec."""
    from etcslurm.runtime.config import RunSettings

    try:
        settings = RunSettings.from_json(spec)
    except UsageError as exc:
        return [f"{name}: [run] {exc}"]
    problems = []
    for field_ in dataclasses.fields(settings):
        value = getattr(settings, field_.name)
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            problems.append(f"{name}: [run] {field_.name}: must not be negative, got {value}")
    if settings.micro_batch < 1 or settings.global_batch % settings.micro_batch:
        problems.append(f"{name}: [run] global_batch {settings.global_batch} must be a multiple "
                        f"of micro_batch {settings.micro_batch}")
    return problems


def coordinator_url(run: RunFile, check: bool = True) -> str:
    """The running run's coordinator: ``[slurm] redis_url``, else the URL its first job
    published in ``<run_dir>/coordinator.url`` (pinged when ``check``)."""
    from etcslurm.errors import CoordinatorError

    url = str(run.slurm.get("redis_url") or "")
    if not url:
        published = run.run_dir / "coordinator.url"
        if not published.is_file():
            raise CoordinatorError(
                f"run {run.run_id} has no coordinator yet: {published} does not exist (its "
                "first job writes it once its coordinator answers: is that job running?)")
        url = published.read_text().strip()
    if check:
        from etcslurm.coord.client import connect

        try:
            connect(url, retry_deadline=5).close()
        except CoordinatorError as exc:
            raise CoordinatorError(f"run {run.run_id}'s coordinator does not answer ({exc}): "
                                   "has the run ended?") from None
    return url
