"""Strict conversion between typed dataclasses and plain YAML/JSON data, with every input bounded at the door.

`from_data(cls, data, where)` builds a dataclass from a dict, refusing unknown keys, missing required keys, wrong
types and out-of-range numbers with a RackcastError that names the file and the dotted field path. `to_data(obj)` is
its inverse, so every config round-trips: `from_data(cls, to_data(x)) == x`. `load_yaml(path)` reads a YAML file
with the safe loader only.

Supported field types: int, float, str, bool, Optional[...], Literal[...], list[...], tuple[...], dict[str, ...],
nested dataclasses, and `Annotated[int | float | str | list, Range(...) | Text(...) | Items(...) | IsoDate()]`
(rackcast.bounds), which puts a field's bounds next to its definition (one home; the README's "Input bounds" table is
generated from them, `bounds_markdown`). Numbers must be real YAML numbers: an int field takes an int (or a whole float such as 1.0e6), a
float field an int or a float, never a string that looks like one; every float must be finite. The loader reads
numbers the YAML 1.2 way, so `1e7` and `1.0e300` are floats (PyYAML's YAML 1.1 rules read them as strings), and
leaves dates as strings (a plan's dates are checked by `IsoDate`).

Bounds on the file itself: at most MAX_FILE_BYTES, UTF-8, nested at most MAX_YAML_DEPTH deep, aliases expanding to
at most MAX_YAML_NODES nodes (an alias bomb is refused before it is expanded), every string at most MAX_TEXT_CHARS
characters.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml

from rackcast.bounds import MAX_TEXT_CHARS, SHOWN_CHARS, Range, shown
from rackcast.units import MIB
from rackcast.errors import RackcastError

MAX_FILE_BYTES = 16 * MIB  # the largest YAML input read (a preset is a few KiB; a routing histogram a few MiB)
MAX_YAML_NODES = 1_000_000  # scalars + collections after alias expansion
MAX_YAML_DEPTH = 64  # nesting of collections (a plan nests 4 deep)
PRESET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # what a preset name may look like (no path separator)
YAML_SUFFIXES = (".yaml", ".yml")


_HINTS_CACHE: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS_CACHE:
        _HINTS_CACHE[cls] = typing.get_type_hints(cls, include_extras=True)
    return _HINTS_CACHE[cls]


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return _type_name(typing.get_args(tp)[0])
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


def _expected(tp: Any, value: Any, where: str, field: str) -> RackcastError:
    return RackcastError(f"{field}: expected {_type_name(tp)}, got {shown(value)}", where=where)


def _convert(tp: Any, value: Any, where: str, field: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Annotated:
        base, *bounds = typing.get_args(tp)
        converted = _convert(base, value, where, field)
        for bound in bounds:  # a number is bounded (and shown) as written: 1e+300, not 301 digits; -1, not -1.0
            as_written = value if isinstance(value, (int, float)) and not isinstance(value, bool) else converted
            why = bound.refusal(as_written) if hasattr(bound, "refusal") else ""
            if why:
                raise RackcastError(f"{field}: {why}", where=where)
        return converted
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
        if isinstance(value, str):  # a string was meant for the str member: its error (e.g. too long) is the one
            for arg, exc in zip([a for a in args if a is not type(None)], errors):
                if _base_type(arg) is str:
                    raise exc
        raise _expected(tp, value, where, field)
    if origin is Literal:
        for allowed in typing.get_args(tp):
            if value == allowed and type(value) is type(allowed):
                return allowed
        raise _expected(tp, value, where, field)
    if dataclasses.is_dataclass(tp):
        return from_data(tp, value, where, prefix=field)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _expected(tp, value, where, field)
        args = typing.get_args(tp)
        item_tp = args[0] if args else Any
        items = [_convert(item_tp, v, where, f"{field}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise _expected(tp, value, where, field)
        key_tp, val_tp = typing.get_args(tp) or (str, Any)
        return {_convert(key_tp, k, where, field): _convert(val_tp, v, where, f"{field}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, float) and math.isinf(value):
            raise RackcastError(f"{field}: must be finite, got {value}", where=where)
        if isinstance(value, float):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:
                raise RackcastError(f"{field}: {shown(value)} is too large", where=where) from None
    elif tp is str:
        if isinstance(value, str):
            if len(value) > MAX_TEXT_CHARS:
                raise RackcastError(f"{field}: {len(value)} characters, at most {MAX_TEXT_CHARS} allowed",
                                    where=where)
            return value
    else:
        if isinstance(value, tp):
            return value
    raise _expected(tp, value, where, field)


def _base_type(tp: Any) -> Any:
    return typing.get_args(tp)[0] if typing.get_origin(tp) is Annotated else tp


def from_data(cls: type, data: Any, where: str = "", prefix: str = "") -> Any:
    """Build dataclass `cls` from `data`, strictly; errors name `where` (the file) and the field path."""
    label = prefix or cls.__name__
    if not isinstance(data, dict):
        raise RackcastError(f"{label}: expected a mapping, got {type(data).__name__}", where=where)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(map(str, data)) - set(fields))
    if unknown:
        path = f"{prefix}.{shown(unknown[0])[1:-1]}" if prefix else shown(unknown[0])[1:-1]
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


def check_value(cls: type, field_name: str, value: Any, label: str = "") -> Any:
    """`value` converted and bounded as `cls.field_name` is (for a command-line option that overrides a file's
    field: one home for the bounds); errors name `label` (default the field)."""
    return _convert(_hints(cls)[field_name], value, "", label or field_name)


def field_bounds(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted field, type, bounds) for every bounded field of `cls` and its nested dataclasses, in field order."""
    rows: list[tuple[str, str, str]] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        rows.extend(_bounds_rows(_hints(cls)[f.name], f"{prefix}{f.name}"))
    return rows


def _bounds_rows(tp: Any, path: str) -> list[tuple[str, str, str]]:
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *bounds = typing.get_args(tp)
        described = "; ".join(b.describe() for b in bounds if hasattr(b, "describe"))
        return [(path, _type_name(base), described)] if described else []
    if origin in (Union, types.UnionType):
        return [row for arg in typing.get_args(tp) for row in _bounds_rows(arg, path)]
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return _bounds_rows(args[0], f"{path}[]") if args else []
    if origin is dict:
        return _bounds_rows(typing.get_args(tp)[1], f"{path}.*")
    if dataclasses.is_dataclass(tp):
        return field_bounds(tp, f"{path}.")
    return []


def unbounded_numbers(cls: type, prefix: str = "") -> list[str]:
    """Dotted paths of int/float fields of `cls` (nested dataclasses, lists, dicts included) without a Range."""
    out: list[str] = []

    def walk(tp: Any, path: str) -> None:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            base, *bounds = typing.get_args(tp)
            if base in (int, float) and not any(isinstance(b, Range) for b in bounds):
                out.append(path)
            elif base not in (int, float):
                walk(base, path)
        elif tp in (int, float):
            out.append(path)
        elif origin in (Union, types.UnionType):
            for arg in typing.get_args(tp):
                walk(arg, path)
        elif origin in (list, tuple) and typing.get_args(tp):
            walk(typing.get_args(tp)[0], f"{path}[]")
        elif origin is dict:
            walk(typing.get_args(tp)[1], f"{path}.*")
        elif dataclasses.is_dataclass(tp):
            for f in dataclasses.fields(tp):
                if f.init:
                    walk(_hints(tp)[f.name], f"{path}.{f.name}" if path else f.name)

    walk(cls, prefix)
    return out


def to_data(obj: Any) -> Any:
    """The plain-data form of a dataclass tree (dicts, lists, scalars), in field order."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_data(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (list, tuple)):
        return [to_data(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_data(v) for k, v in obj.items()}
    return obj


# ---------------------------------------------------------------- YAML
FLOAT_TAG = "tag:yaml.org,2002:float"
TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"
# YAML 1.2 core-schema floats (an exponent needs no dot and no sign: 1e7, 1.0e300), plus YAML 1.1's underscores.
_FLOAT_1_2 = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
    |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)


def _resolvers(timestamps: bool) -> dict:
    """SafeLoader's implicit resolvers with YAML 1.2 floats; without timestamps for reading (dates stay strings),
    with them for writing (so a date string is quoted, and other YAML readers see a string too)."""
    dropped = (FLOAT_TAG,) if timestamps else (FLOAT_TAG, TIMESTAMP_TAG)
    table = {first: [(tag, rx) for tag, rx in entries if tag not in dropped]
             for first, entries in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    for first in "-+0123456789.":
        table.setdefault(first, []).insert(0, (FLOAT_TAG, _FLOAT_1_2))
    return table


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """libyaml's parser where available. Its composer recurses (in C), so parse_yaml first checks the nesting depth
    on the event stream, which libyaml produces without recursion, and stops as soon as it is too deep."""

    yaml_implicit_resolvers = _resolvers(timestamps=False)


class _Dumper(yaml.SafeDumper):
    yaml_implicit_resolvers = _resolvers(timestamps=True)  # so a string like "1e7" is quoted, and reads back as a string


def _check_depth(text: str, where: str) -> None:
    """Refuse a document nested deeper than MAX_YAML_DEPTH, reading its events only up to that depth."""
    loader = _Loader(text)
    depth = 0
    try:
        while loader.check_event():
            event = loader.get_event()
            if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                depth += 1
                if depth > MAX_YAML_DEPTH:
                    raise RackcastError(f"nested more than {MAX_YAML_DEPTH} levels deep", where=where)
            elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                depth -= 1
    finally:
        loader.dispose()


def _expanded_nodes(root: yaml.Node) -> int:
    """Nodes of the document once every alias is expanded, counted without expanding (memoised on shared nodes),
    stopping early past MAX_YAML_NODES."""
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        if isinstance(node, yaml.ScalarNode):
            sizes[id(node)] = 1
            continue
        children = [c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) else node.value
        if children_done:
            sizes[id(node)] = min(1 + sum(sizes[id(c)] for c in children), MAX_YAML_NODES + 1)
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in sizes)
    return sizes[id(root)]


def parse_yaml(text: str, where: str = "") -> Any:
    """One YAML document from `text` (safe loader, YAML 1.2 floats, bounded alias expansion)."""
    loader = _Loader(text)
    try:
        _check_depth(text, where)
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_nodes(node) > MAX_YAML_NODES:
            raise RackcastError(f"more than {MAX_YAML_NODES:,} values once aliases are expanded (an alias bomb?)",
                                where=where)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or "malformed YAML"
        raise RackcastError(f"{line}{problem}", where=where) from None
    except RecursionError:
        raise RackcastError("the YAML is nested too deeply", where=where) from None
    except (ValueError, OverflowError) as exc:  # a scalar the constructor cannot build (a 5,000-digit integer)
        raise RackcastError(f"cannot read a value: {shown(str(exc))}", where=where) from None
    finally:
        loader.dispose()


def load_yaml(path: str | Path) -> Any:
    """Read one YAML document (see parse_yaml); a missing, unreadable, oversized or non-UTF-8 file is a
    RackcastError naming it."""
    where = _shown_path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise RackcastError("file not found", where=where) from None
    except OSError as exc:
        raise RackcastError(f"cannot read: {exc.strerror or exc}", where=where) from None
    except ValueError as exc:  # a NUL byte in the path
        raise RackcastError(f"cannot read: {exc}", where=where) from None
    if len(raw) > MAX_FILE_BYTES:
        raise RackcastError(f"larger than {MAX_FILE_BYTES // MIB} MiB", where=where)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RackcastError(f"not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start})",
                            where=where) from None
    return parse_yaml(text, where)


def _shown_path(path: str | Path) -> str:
    text = str(path)
    return text if len(text) <= 2 * SHOWN_CHARS else text[:SHOWN_CHARS] + "..." + text[-SHOWN_CHARS:]


def dump_yaml(data: Any) -> str:
    """YAML text for plain data, keys in the order given (stable output, byte for byte)."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120,
                     allow_unicode=False)


def preset_names(directory: Path) -> list[str]:
    """Names of the YAML presets in `directory` (file stems), sorted."""
    return sorted(p.stem for p in Path(directory).glob("*.yaml"))


@functools.lru_cache(maxsize=None)
def _load_typed(cls: type, path: str) -> Any:
    return from_data(cls, load_yaml(path), where=_shown_path(path))


def is_file_reference(name_or_path: str) -> bool:
    """The rule for a model or topology reference: a path when it holds a path separator ('/') or ends in .yaml or
    .yml (`./my-model.yaml`, `my-model.yaml`, `/data/topo.yml`), else a preset name, looked up only inside the
    presets' folder."""
    return "/" in name_or_path or "\\" in name_or_path or name_or_path.endswith(YAML_SUFFIXES)


def load_preset(cls: type, directory: Path, name_or_path: str, kind: str) -> Any:
    """A typed preset by name (a YAML file in `directory`) or by path (see is_file_reference); an unknown name lists
    the known ones.

    Loaded objects are cached by path (they are frozen dataclasses, so sharing them is safe)."""
    if len(name_or_path) > MAX_TEXT_CHARS:
        raise RackcastError(f"{kind} reference: {len(name_or_path)} characters, at most {MAX_TEXT_CHARS} allowed")
    if is_file_reference(name_or_path):
        return _load_typed(cls, name_or_path)
    known = preset_names(directory)
    if not PRESET_NAME.fullmatch(name_or_path) or name_or_path not in known:
        raise RackcastError(f"unknown {kind} {shown(name_or_path)} (known: {', '.join(known)}, "
                            "or a YAML path such as ./my-file.yaml)")
    return _load_typed(cls, str(Path(directory) / f"{name_or_path}.yaml"))


def bounds_markdown(files: dict[str, type], skip: tuple[str, ...] = ()) -> str:
    """The README's "Input bounds" table: one row per bounded field of each file type (`files`: label -> class),
    leaving out the fields whose path starts with one of `skip` (a plan's inline model, documented as a model)."""
    rows = ["| file | field | type | bounds |", "|---|---|---|---|"]
    for label, cls in files.items():
        rows += [f"| {label} | `{path}` | {tp} | {bounds} |" for path, tp, bounds in field_bounds(cls)
                 if not path.startswith(skip)]
    return "\n".join(rows)
