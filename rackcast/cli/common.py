"""Helpers shared by the CLI modules: JSON output, rich tables, human number formats."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from rackcast.units import GIB


def print_json(data: Any) -> None:
    """Deterministic JSON on stdout (sorted keys are not used: field order is meaningful)."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


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
