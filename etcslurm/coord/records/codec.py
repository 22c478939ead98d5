"""The one codec of the coordinator's records: msgspec Structs to and from plain JSON data.

Why msgspec: a record is a frozen, typed Struct; decoding checks every field against its
annotation (unknown, missing, wrong type, a float that is not finite) in C, which a
1024-worker generation record needs, and JSON is all it speaks — nothing is ever
unpickled.  This module only turns msgspec's refusals into :class:`RecordError`\\s that
name the record and the field (``generation record: field 'world' must be integer, got
'1'``); checks across fields are each record's ``__post_init__``.
"""

from __future__ import annotations

import re
import sys
import types
import typing
from typing import Annotated, Any, ClassVar, TypeVar, Union

import msgspec

from etcslurm.errors import RecordError

T = TypeVar("T", bound="Record")

#: a JSON number: finite (NaN and the infinities are not JSON)
Number = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]

#: ``record`` with some fields changed, checked again (``__post_init__`` runs: msgspec
#: 0.21 and later)
replace = msgspec.structs.replace


class Record(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of every record: ``to_json`` (plain JSON data) and ``from_json`` (checked)."""

    #: What error messages call this record.
    WHAT: ClassVar[str] = "record"

    def to_json(self) -> dict[str, Any]:
        """Plain JSON data: dicts, lists, strings, numbers, booleans, ``None``."""
        return _lists(msgspec.to_builtins(self))

    @classmethod
    def from_json(cls: type[T], data: Any) -> T:
        """The record in ``data``; anything unknown, missing or mistyped raises
        :class:`RecordError` naming the field."""
        return decode(cls, data, cls.WHAT)


def decode(cls: type[T], data: Any, what: str) -> T:
    """``data`` (a JSON object) as a ``cls``; refusals name ``what`` and the field."""
    if not isinstance(data, dict):
        raise RecordError(f"{what}: expected a JSON object, got {type(data).__name__}")
    try:
        return msgspec.convert(data, cls)
    except msgspec.ValidationError as exc:
        raise RecordError(f"{what}: {_explain(str(exc), cls, data)}") from None


def check(value: Any, tp: Any, where: str) -> Any:
    """``value`` checked against (and converted to) the annotation ``tp``."""
    try:
        return msgspec.convert(value, tp)
    except msgspec.ValidationError:
        raise RecordError(f"{where} must be {type_name(tp)}, got {show(value)}") from None


def _lists(value: Any) -> Any:
    """``to_builtins`` keeps tuples: JSON data has lists."""
    if isinstance(value, tuple | list):
        return [_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------- msgspec's refusals, named

_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")
_MISSING = object()


def _explain(text: str, cls: type, data: Any) -> str:
    """One line for msgspec's ``text``: the field (JSON key, index, object key) and why."""
    m = _AT.match(text)
    assert m is not None
    msg, path = m["msg"], m["path"] or ""
    steps: list[str | int] = []
    for name, index in _STEP.findall(path):
        steps.append(name if name else ("..." if index == "..." else int(index)))
    tp, value, steps = _locate(cls, data, steps)
    where = "".join(f"field {s!r}" if i == 0 else f"[{s!r}]" for i, s in enumerate(steps))
    quoted = re.search(r"field `([^`]*)`", msg)
    if msg.startswith("Object contains unknown field") and quoted:
        struct = _container(tp, "")
        known = {f.encode_name for f in msgspec.structs.fields(struct)} if _is_struct(struct) \
            else set()
        more = sum(1 for k in value if k not in known) - 1 if isinstance(value, dict) else 0
        return (f"{where + ': ' if where else ''}unknown field {quoted[1]!r}"
                + (f" (and {more} more)" if more > 0 else ""))
    if msg.startswith("Object missing required field") and quoted:
        return f"{where + ': ' if where else ''}missing field {quoted[1]!r}"
    got = "" if value is _MISSING else f", got {show(value)}"
    return f"{where or 'value'} must be {type_name(tp)}{got}"


def _locate(cls: type, data: Any, steps: list[str | int]) -> tuple[Any, Any, list[Any]]:
    """The annotation and the value at ``steps`` below ``cls``/``data``, and the steps
    with an object's unnamed key (msgspec's ``[...]``) replaced by the key refused."""
    tp: Any = cls
    value: Any = data
    named: list[Any] = []
    for step in steps:
        container = _container(tp, step)
        if _is_struct(container):
            tp = _field_type(container, str(step))
        else:
            tp = _item_type(container)
            if step == "..." and isinstance(value, dict):
                step = next((k for k, v in value.items() if not _fits(v, tp)), step)
        value = _child(value, step)
        named.append(step)
    return tp, value, named


def _fits(value: Any, tp: Any) -> bool:
    try:
        msgspec.convert(value, tp)
    except msgspec.ValidationError:
        return False
    return True


def _child(value: Any, step: Any) -> Any:
    if isinstance(value, dict):
        return value.get(step, _MISSING)
    if isinstance(value, list | tuple) and isinstance(step, int) and step < len(value):
        return value[step]
    return _MISSING


def _members(tp: Any) -> tuple[Any, ...]:
    if typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) in (Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def _container(tp: Any, step: Any) -> Any:
    """The member of union ``tp`` that ``step`` goes into: a Struct for a field name, a
    list for an index, an object for msgspec's ``[...]``."""
    want = tuple if isinstance(step, int) else dict if step == "..." else None
    for member in _members(tp):
        if (want is None and _is_struct(member)) or (
                want is not None and typing.get_origin(member) is want):
            return member
    return Any


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _field_type(cls: Any, name: str) -> Any:
    for f in msgspec.structs.fields(cls):
        if f.encode_name == name:
            return f.type
    return Any


def _item_type(tp: Any) -> Any:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple and args:
        return args[0]
    if typing.get_origin(tp) is dict and len(args) == 2:
        return args[1]
    return Any


def type_name(tp: Any) -> str:
    """The annotation ``tp`` in words, as refusals say it."""
    members = _members(tp)
    if len(members) > 1:
        return " or ".join(type_name(a) for a in members)
    tp = members[0]
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any JSON value"
    origin = typing.get_origin(tp)
    if origin is tuple:
        return f"a list of {type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"an object of {type_name(typing.get_args(tp)[1])}"
    if _is_struct(tp):
        return f"{getattr(tp, 'WHAT', tp.__name__)} object"
    return {int: "integer", float: "number", str: "string", bool: "boolean"}.get(tp, str(tp))


def show(value: Any) -> str:
    """``value`` for a message: its repr, cut at 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ---------------------------------------------------------------- the fields, for the docs


def field_summary(cls: type[Record]) -> str:
    """The JSON fields of record class ``cls`` as one Markdown line (``?``: optional), as
    docs/coordinator.md and docs/monitor.md list them (a test keeps them equal)."""
    parts = []
    for f in msgspec.structs.fields(cls):
        optional = f.default is not msgspec.NODEFAULT or f.default_factory is not msgspec.NODEFAULT
        parts.append(f"`{f.encode_name}`{'?' if optional else ''}: {_doc_type(f.type)}")
    return ", ".join(parts)


def _doc_type(tp: Any) -> str:
    members = _members(tp)
    if len(members) > 1:
        return " \\| ".join(_doc_type(a) for a in members)
    tp = members[0]
    origin = typing.get_origin(tp)
    if origin is tuple:
        return f"[{_doc_type(typing.get_args(tp)[0])}]"
    if origin is dict:
        return f"{{str: {_doc_type(typing.get_args(tp)[1])}}}"
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    return tp.__name__
