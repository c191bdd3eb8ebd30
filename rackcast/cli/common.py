"""Helpers shared by the CLI modules: JSON output, rich tables, human number formats, bounded number options."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from rackcast.units import GIB


def bounded(cls: type, field_name: str, kind: type = float):
    """argparse `type=` for an option that stands for the field `cls.field_name` (a plan's seed, tokens, domains):
    the number is read and bounded exactly as that field is in a file (rackcast.strict, one home for the bounds), so
    a bad value is argparse's one line and exit code 2."""
    from rackcast.errors import RackcastError
    from rackcast.strict import check_value

    def parse(text: str):
        try:
            number: float = int(text) if kind is int and text.strip().lstrip("+-").isdigit() else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        try:
            return check_value(cls, field_name, number, "value")
        except RackcastError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("value: ")) from None

    parse.__name__ = kind.__name__
    return parse


def _finite(data: Any) -> Any:
    """`data` with NaN and infinities as None (null): JSON has no such numbers, and strict parsers refuse them."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(v) for v in data]
    return data


def json_text(data: Any) -> str:
    """Deterministic, strict JSON (field order kept: it is meaningful; NaN and infinities written as null)."""
    return json.dumps(_finite(data), indent=2, allow_nan=False) + "\n"


def print_json(data: Any) -> None:
    """json_text on stdout."""
    sys.stdout.write(json_text(data))


def console() -> Console:
    return Console(width=max(100, Console().width), highlight=False)


def table(title: str, columns: list[str], rows: list[list[str]]) -> Table:
    out = Table(title=title, title_justify="left", show_lines=False)
    for i, col in enumerate(columns):
        out.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        out.add_row(*row)
    return out


def human(n: float, unit: str = "") -> str:
    """1.23e12 -> '1.23 T' (SI prefixes)."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= factor:
            return f"{n / factor:.3g} {prefix}{unit}"
    return f"{n:.3g} {unit}".rstrip()


def gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.1f} GiB"


def refuse_unless_fits(plan_path: str, fits: bool, memory_bytes: float, hbm_bytes: float) -> None:
    """A plan that does not fit is bad input: one line naming the file, exit code 2 (after any report printed)."""
    from rackcast.errors import RackcastError

    if fits:
        return
    if memory_bytes > hbm_bytes:
        raise RackcastError(f"parallel: the layout does not fit memory: {gib(memory_bytes)} per GPU > "
                            f"{gib(hbm_bytes)} HBM", where=plan_path)
    raise RackcastError("optimizer.state_location: the offloaded optimizer state does not fit host memory",
                        where=plan_path)
