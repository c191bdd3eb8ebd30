"""Strict conversion between typed dataclasses and plain YAML/JSON data.

`from_data(cls, data, where)` builds a dataclass from a dict, refusing unknown keys, missing required keys and wrong
types with a RackcastError that names the file and the dotted field path. `to_data(obj)` is its inverse, so every
config round-trips: `from_data(cls, to_data(x)) == x`. `load_yaml(path)` reads a YAML file with the safe loader only.

Supported field types: int, float, str, bool, Optional[...], Literal[...], list[...], tuple[...], dict[str, ...]
and nested dataclasses. Floats accept ints and YAML strings like "18e12" (PyYAML reads "1e12" as a string).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from rackcast.errors import RackcastError

_HINTS_CACHE: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS_CACHE:
        _HINTS_CACHE[cls] = typing.get_type_hints(cls)
    return _HINTS_CACHE[cls]


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin in (list, tuple):
        return "a list"
    if origin is dict:
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, where: str, field: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, where, field)
            except RackcastError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        if isinstance(value, dict):  # a mapping was meant for the dataclass member: its error is the useful one
            for arg, exc in zip([a for a in args if a is not type(None)], errors):
                if dataclasses.is_dataclass(arg):
                    raise exc
        raise RackcastError(f"{field}: expected {_type_name(tp)}, got {value!r}", where=where)
    if origin is Literal:
        for allowed in typing.get_args(tp):
            if value == allowed and type(value) is type(allowed):
                return allowed
        raise RackcastError(f"{field}: expected {_type_name(tp)}, got {value!r}", where=where)
    if dataclasses.is_dataclass(tp):
        return from_data(tp, value, where, prefix=field)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise RackcastError(f"{field}: expected a list, got {value!r}", where=where)
        args = typing.get_args(tp)
        item_tp = args[0] if args else Any
        items = [_convert(item_tp, v, where, f"{field}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise RackcastError(f"{field}: expected a mapping, got {value!r}", where=where)
        key_tp, val_tp = typing.get_args(tp) or (str, Any)
        return {_convert(key_tp, k, where, field): _convert(val_tp, v, where, f"{field}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            return int(value)
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
            else:
                if number.is_integer():
                    return int(number)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        if isinstance(value, tp):
            return value
    raise RackcastError(f"{field}: expected {_type_name(tp)}, got {value!r}", where=where)


def from_data(cls: type, data: Any, where: str = "", prefix: str = "") -> Any:
    """Build dataclass `cls` from `data`, strictly; errors name `where` (the file) and the field path."""
    label = prefix or cls.__name__
    if not isinstance(data, dict):
        raise RackcastError(f"{label}: expected a mapping, got {type(data).__name__}", where=where)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(map(str, data)) - set(fields))
    if unknown:
        path = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise RackcastError(f"{path}: unknown key (allowed: {', '.join(fields)})", where=where)
    hints = _hints(cls)
    kwargs = {}
    for name, field in fields.items():
        path = f"{prefix}.{name}" if prefix else name
        if name not in data:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                raise RackcastError(f"{path}: required key is missing", where=where)
            continue
        kwargs[name] = _convert(hints[name], data[name], where, path)
    try:
        obj = cls(**kwargs)
    except RackcastError as exc:
        if exc.where or not where:
            raise
        raise RackcastError(str(exc), where=where) from None
    except (ValueError, TypeError) as exc:
        raise RackcastError(f"{label}: {exc}", where=where) from None
    return obj


def to_data(obj: Any) -> Any:
    """The plain-data form of a dataclass tree (dicts, lists, scalars), in field order."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_data(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (list, tuple)):
        return [to_data(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_data(v) for k, v in obj.items()}
    return obj


def load_yaml(path: str | Path) -> Any:
    """Read one YAML document with the safe loader; a missing file or a syntax error is a RackcastError."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise RackcastError("file not found", where=str(path)) from None
    except OSError as exc:
        raise RackcastError(f"cannot read: {exc.strerror}", where=str(path)) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or "malformed YAML"
        raise RackcastError(f"{line}{problem}", where=str(path)) from None


def dump_yaml(data: Any) -> str:
    """YAML text for plain data, keys in the order given (stable output, byte for byte)."""
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=120)


def preset_names(directory: Path) -> list[str]:
    """Names of the YAML presets in `directory` (file stems), sorted."""
    return sorted(p.stem for p in Path(directory).glob("*.yaml"))


@functools.lru_cache(maxsize=None)
def _load_typed(cls: type, path: str) -> Any:
    return from_data(cls, load_yaml(path), where=path)


def load_preset(cls: type, directory: Path, name_or_path: str, kind: str) -> Any:
    """A typed preset by name (a YAML file in `directory`) or by path; an unknown name lists the known ones.

    Loaded objects are cached by path (they are frozen dataclasses, so sharing them is safe)."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or candidate.exists():
        return _load_typed(cls, str(candidate))
    preset = Path(directory) / f"{name_or_path}.yaml"
    if not preset.exists():
        raise RackcastError(f"unknown {kind} {name_or_path!r} (known: {', '.join(preset_names(directory))}, "
                            "or a YAML path)")
    return _load_typed(cls, str(preset))
