"""sbatch templates with declared, typed fields: ``elastic.sbatch``, ``grow.sbatch``.

The templates are package data (``etcslurm/slurm/templates/``, read with
``importlib.resources``, so a wheel install can submit; the checkout's top-level
``templates/`` is a link to that directory).  ``$ETCSLURM_TEMPLATES`` points elsewhere.

Types: ``int``, ``bool`` (1/0), ``name`` (``[A-Za-z0-9._:+%,/-]``), ``word`` (one token
without spaces, quotes, ``$`` or backslashes: ``#SBATCH`` values such as ``h100&ib``),
``url``/``path`` (no spaces, quotes, ``$``), ``signal`` (checked by :func:`parse_signal`:
never USR1), ``text`` (one line, no single quote: used inside ``'...'``), ``cmd`` (one
line, inserted as shell words: the worker command) and ``lines`` (a list, or text with one
item per line: the line holding the placeholder is repeated once per item, and dropped
when there is none).  A template declares its fields in header lines
``##@ name:type=default  help`` (no ``=``: required) and uses them as ``{{name}}``.
Rendering checks every value against its type (so nothing unexpected reaches the shell or
an ``#SBATCH`` line) and reports unknown or missing fields in one line listing the valid
ones.  An ``#SBATCH`` line whose field is empty (or a false bool) is dropped, so optional
options (GPUs, partition, array) need no conditionals in the template.  Why not Jinja: one
more dependency for three features.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from etcslurm.errors import UsageError
from etcslurm.job.signals import parse_signal

_FIELD_RE = re.compile(r"^##@\s+(\w+):(\w+)(?:=(\S*))?(?:\s+(.*))?$")
_PLACEHOLDER_RE = re.compile(r"\{\{\s*(\w+)\s*\}\}")
_TYPES = ("name", "word", "int", "cmd", "text", "url", "path", "signal", "bool", "lines")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def templates_dir() -> Traversable:
    """Where named templates live: ``$ETCSLURM_TEMPLATES`` or the package's ``templates/``."""
    env = os.environ.get("ETCSLURM_TEMPLATES")
    if env:
        return Path(env)
    return resources.files("etcslurm.slurm") / "templates"


def available_templates() -> list[str]:
    d = templates_dir()
    if not d.is_dir():
        return []
    return sorted(p.name.removesuffix(".sbatch") for p in d.iterdir() if p.name.endswith(".sbatch"))


@dataclass(frozen=True)
class Field:
    name: str
    type: str
    default: str | None  # None: required
    help: str

    @property
    def required(self) -> bool:
        return self.default is None


@dataclass(frozen=True)
class Template:
    """A parsed template: its name, source text and declared fields (in order)."""

    name: str
    text: str
    fields: tuple[Field, ...]

    @property
    def field_names(self) -> list[str]:
        return [f.name for f in self.fields]

    def describe(self) -> str:
        """``name (required), nodes=2, ...`` — the valid fields for error messages."""
        return ", ".join(f.name if f.required else f"{f.name}={f.default}" for f in self.fields)


def load_template(name_or_path: str) -> Template:
    """A named template (``elastic``) from :func:`templates_dir`, or a path to a file."""
    path: Traversable = Path(name_or_path)
    if not (name_or_path.endswith(".sbatch") or os.sep in name_or_path) or not path.is_file():
        path = templates_dir() / f"{name_or_path}.sbatch"
    if not path.is_file():
        raise UsageError(
            f"unknown template {name_or_path!r}; available: {', '.join(available_templates()) or 'none'}"
            f" (in {templates_dir()}), or give a path to a .sbatch file"
        )
    text = path.read_text()
    fields = []
    for line in text.splitlines():
        m = _FIELD_RE.match(line)
        if not m:
            continue
        name, ftype, default, help_ = m.groups()
        help_ = help_ or ""
        if ftype not in _TYPES:
            raise UsageError(f"template {path}: field {name} has unknown type {ftype!r}")
        fields.append(Field(name, ftype, default, help_.strip()))
    declared = {f.name for f in fields}
    used = set(_PLACEHOLDER_RE.findall(text))
    if used - declared:
        raise UsageError(f"template {path}: undeclared fields {', '.join(sorted(used - declared))}")
    return Template(path.name.removesuffix(".sbatch"), text, tuple(fields))


def _check(template: Template, field: Field, value: object) -> tuple[str, bool]:
    """Validate one value; returns (text to insert, present?)."""
    bad = f"field {field.name} of template {template.name!r}"
    if field.type == "lines":
        items = [str(v) for v in value] if isinstance(value, list | tuple) else (
            str(value or "").splitlines())
        items = [item.rstrip() for item in items if item.strip()]
        for item in items:
            if "\n" in item or "\r" in item or item.strip().startswith("ETCSLURM_"):
                raise UsageError(f"{bad}: one line per item (not starting with ETCSLURM_), got {item!r}")
        return "\n".join(items), bool(items)
    text = str(value).strip() if value is not None else ""
    if field.type == "bool":
        low = text.lower()
        if low not in _TRUE | _FALSE:
            raise UsageError(f"{bad}: expected 1/0, got {text!r}")
        return "", low in _TRUE
    if text == "":
        return "", False
    if field.type == "int":
        if not text.isdigit():
            raise UsageError(f"{bad}: expected a non-negative integer, got {text!r}")
    elif field.type == "name":
        if not re.fullmatch(r"[A-Za-z0-9._:+%,/-]+", text):
            raise UsageError(f"{bad}: only letters, digits and ._:+%,/- allowed, got {text!r}")
    elif field.type == "word":
        if re.search(r"[\s'\"`$\\]", text):
            raise UsageError(f"{bad}: one word without spaces, quotes, $ or backslashes, got {text!r}")
    elif field.type in ("url", "path"):
        if re.search(r"[\s'\"`$\\]", text):
            raise UsageError(f"{bad}: no spaces, quotes, $ or backslashes allowed, got {text!r}")
    elif field.type == "signal":
        text = parse_signal(text).name[3:]
    elif field.type == "cmd" and ("\n" in text or "\r" in text):
        raise UsageError(f"{bad}: one line expected, got {text!r}")
    elif field.type == "text" and re.search(r"[\n\r']", text):
        raise UsageError(f"{bad}: one line without single quotes expected, got {text!r}")
    return text, True


def check_value(template: Template, name: str, value: object) -> str | None:
    """``name: what is wrong`` when ``value`` does not fit field ``name``, else None."""
    field = next(f for f in template.fields if f.name == name)
    try:
        _check(template, field, value)
    except UsageError as exc:
        return f"{name}: {str(exc).split(': ', 1)[1]}"
    return None


def resolve_fields(template: Template, values: Mapping[str, object]) -> dict[str, tuple[str, bool]]:
    """Check names (unknown/missing → one-line UsageError) and types of all values."""
    unknown = sorted(set(values) - set(template.field_names))
    if unknown:
        raise UsageError(
            f"unknown field(s) {', '.join(unknown)} for template {template.name!r}; valid: {template.describe()}"
        )
    missing = [f.name for f in template.fields if f.required and str(values.get(f.name, "")).strip() == ""]
    if missing:
        raise UsageError(
            f"missing field(s) {', '.join(missing)} for template {template.name!r} "
            f"(--set {missing[0]}=...); valid: {template.describe()}"
        )
    out = {}
    for f in template.fields:
        value: object = values.get(f.name, f.default)
        if value == "@python":
            value = sys.executable
        out[f.name] = _check(template, f, value)
    return out


def _substitute(template: Template, resolved: Mapping[str, tuple[str, bool]]) -> str:
    multi = {f.name for f in template.fields if f.type == "lines"}
    lines = []
    for line in template.text.splitlines():
        if line.startswith("##@"):
            continue
        names = _PLACEHOLDER_RE.findall(line)
        if line.startswith("#SBATCH") and any(not resolved[n][1] for n in names):
            continue  # optional option not set (or a false bool)
        listed = [n for n in names if n in multi]
        items = resolved[listed[0]][0].splitlines() if listed else [None]
        for item in items:  # a `lines` field: the line once per item
            lines.append(_PLACEHOLDER_RE.sub(
                lambda m, item=item: item if m.group(1) in multi else resolved[m.group(1)][0], line))
    return "\n".join(lines) + "\n"


def render(template: str | Template, values: Mapping[str, object] | None = None) -> str:
    """Render a template with ``values`` (strings or numbers) into an sbatch script."""
    tpl = template if isinstance(template, Template) else load_template(template)
    return _substitute(tpl, resolve_fields(tpl, dict(values or {})))


def render_het(
    template: str | Template,
    components: Sequence[Mapping[str, object]],
    values: Mapping[str, object] | None = None,
) -> str:
    """A heterogeneous job: one ``#SBATCH`` block per component, ``hetjob`` between them.

    ``components`` holds the per-component fields (``nodes``, ``tasks_per_node``,
    ``cpus_per_task``, ``gpus_per_node``, ...); ``values`` the shared ones.  The step runs
    in all components (``srun --het-group=0-K``), so every node's workers join.
    """
    tpl = template if isinstance(template, Template) else load_template(template)
    if len(components) < 2:
        raise UsageError("a heterogeneous job needs at least 2 components")
    base = dict(values or {})
    if str(base.get("array", "")).strip():
        raise UsageError("array and heterogeneous components cannot be combined")
    base["srun_args"] = f"{base.get('srun_args', '')} --het-group=0-{len(components) - 1}".strip()
    rendered = [render(tpl, {**base, **comp}) for comp in components]
    first = rendered[0].splitlines()
    last_sbatch = max(i for i, line in enumerate(first) if line.startswith("#SBATCH"))
    extra: list[str] = []
    for script in rendered[1:]:
        extra.append("#SBATCH hetjob")
        extra.extend(line for line in script.splitlines() if line.startswith("#SBATCH"))
    return "\n".join(first[: last_sbatch + 1] + extra + first[last_sbatch + 1 :]) + "\n"


def parse_sets(items: Sequence[str] | None) -> dict[str, str]:
    """``["nodes=4", "worker_cmd=python -m x"]`` → dict; a bad item is a UsageError."""
    out: dict[str, str] = {}
    for item in items or ():
        if "=" not in item:
            raise UsageError(f"--set expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = value
    return out
