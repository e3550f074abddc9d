"""Typed construction of dataclasses from parsed JSON, with readable errors.

Generic: checks a value against a dataclass field's annotation (str, int, float,
bool, optionals, lists, dicts, nested dataclasses) and says where it went wrong
(``enrol.devices[0].memory_bytes must be an integer, got str``).
"""

from __future__ import annotations

import types
import typing
from dataclasses import MISSING, fields, is_dataclass
from typing import Any, Union


class SchemaError(ValueError):
    """A value does not fit its schema; the text gives the path and the reason."""


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


_JSON_NAMES = {type(None): "null", bool: "boolean", int: "integer", float: "number",
               str: "string", list: "list", dict: "object"}


def _kind(value: Any) -> str:
    """The JSON name of a parsed value's type."""
    return _JSON_NAMES.get(type(value), type(value).__name__)


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` (parsed JSON) against annotation ``tp``; return the typed value."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            raise SchemaError(f"{path} must not be null")
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(value, option, path)
            except SchemaError as exc:
                errors.append(str(exc))
        raise SchemaError(errors[0] if len(errors) == 1 else f"{path}: {'; '.join(errors)}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise SchemaError(f"{path} must be a list, got {_kind(value)}")
        return [_convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise SchemaError(f"{path} must be an object, got {_kind(value)}")
        return {_convert(k, key_tp, f"{path} key"): _convert(v, val_tp, f"{path}[{k!r}]")
                for k, v in value.items()}
    if is_dataclass(tp) and isinstance(tp, type):
        return build(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise SchemaError(f"{path} must be true or false, got {_kind(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SchemaError(f"{path} must be an integer, got {_kind(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SchemaError(f"{path} must be a number, got {_kind(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise SchemaError(f"{path} must be a string, got {_kind(value)}")
        return value
    raise SchemaError(f"{path}: unsupported schema type {_type_name(tp)}")


def build(cls: type, raw: Any, path: str) -> Any:
    if not isinstance(raw, dict):
        raise SchemaError(f"{path} must be an object, got {_kind(raw)}")
    hints = _hints(cls)
    known = {f.name: f for f in fields(cls)}
    extra = sorted(set(raw) - set(known))
    if extra:
        raise SchemaError(f"{path} has unknown field(s) {', '.join(map(repr, extra))}")
    kwargs = {}
    for name, spec in known.items():
        if name not in raw:
            if spec.default is MISSING and spec.default_factory is MISSING:
                raise SchemaError(f"{path} is missing required field {name!r}")
            continue
        kwargs[name] = _convert(raw[name], hints[name], f"{path}.{name}")
    return cls(**kwargs)


def describe(cls: type) -> str:
    """A canonical text of a dataclass's wire schema: each field's name, annotation and
    whether it may be omitted, then each nested dataclass's own, in a fixed order. Two
    sides whose descriptions differ may refuse each other's messages."""
    seen: dict[str, str] = {}
    _describe(cls, seen)
    return "\n".join(seen[name] for name in sorted(seen))


def _describe(cls: type, seen: dict[str, str]) -> None:
    name = cls.__qualname__
    if name in seen:
        return
    seen[name] = ""  # claimed before recursing, for records that nest themselves
    hints = _hints(cls)
    parts = []
    for spec in fields(cls):
        optional = spec.default is not MISSING or spec.default_factory is not MISSING
        parts.append(f"{spec.name}:{_annotation(hints[spec.name], seen)}{'?' if optional else ''}")
    seen[name] = f"{name}({', '.join(parts)})"


def _annotation(tp: Any, seen: dict[str, str]) -> str:
    """An annotation's canonical name; nested dataclasses are described beside it."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (Union, types.UnionType):
        return "|".join(sorted(_annotation(a, seen) for a in args))
    if args:
        origin = typing.get_origin(tp)
        return f"{origin.__name__}[{','.join(_annotation(a, seen) for a in args)}]"
    if is_dataclass(tp) and isinstance(tp, type):
        _describe(tp, seen)
    return "null" if tp is type(None) else _type_name(tp)
