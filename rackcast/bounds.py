"""The bounds an input field may declare beside its type, and the short quoting of bad values in error lines.

    layers: Annotated[int, Range(1, 1024)]               # inclusive; Range(0, 1e15, above=True) excludes 0
    name: Annotated[str, Text()]                         # at most NAME_CHARS characters
    dense_layers: Annotated[list[int], Items(1024)]      # at most 1,024 items
    start: Annotated[str, IsoDate()]                     # '' or YYYY-MM-DD

rackcast.strict applies them when it converts a file (and `check_value` when a command-line option stands for a
field); every string is at most MAX_TEXT_CHARS characters whatever its bounds. The README's "Input bounds" table is
generated from the fields (strict.bounds_markdown).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import re
from typing import Any

from rackcast.errors import RackcastError

MAX_TEXT_CHARS = 4096  # any string field (PATH_MAX on Linux); names are shorter (NAME_CHARS)
NAME_CHARS = 128  # plan, model and topology names
SHOWN_CHARS = 60  # a value quoted in an error message is cut to this many characters


@dataclasses.dataclass(frozen=True)
class Range:
    """Bounds of a numeric field, written beside it: `layers: Annotated[int, Range(1, 1024)]`.

    `minimum` and `maximum` are inclusive unless `above` (the minimum itself is excluded, as for a bandwidth that must
    be positive); `allow_nan` admits NaN (a prediction that has no value). Infinity is never admitted."""

    minimum: float
    maximum: float
    above: bool = False
    allow_nan: bool = False

    def describe(self) -> str:
        low = "(" if self.above else "["
        return f"{low}{_number_text(self.minimum)}, {_number_text(self.maximum)}]" + (" or NaN" if self.allow_nan
                                                                                      else "")

    def refusal(self, value: float) -> str:
        """'' when `value` lies in the range, else why not."""
        if isinstance(value, float) and math.isnan(value):
            return "" if self.allow_nan else "must be a number, got NaN"
        low_ok = value > self.minimum if self.above else value >= self.minimum
        if low_ok and value <= self.maximum:
            return ""
        return f"{shown(value)} is outside {self.describe()}"


@dataclasses.dataclass(frozen=True)
class Text:
    """Bounds of a string field: at most `max_chars` characters (every string has MAX_TEXT_CHARS at most)."""

    max_chars: int = NAME_CHARS

    def describe(self) -> str:
        return f"at most {self.max_chars} characters"

    def refusal(self, value: str) -> str:
        return "" if len(value) <= self.max_chars else f"{len(value)} characters, at most {self.max_chars} allowed"


@dataclasses.dataclass(frozen=True)
class Items:
    """Bounds of a list field: at most `max_items` entries."""

    max_items: int

    def describe(self) -> str:
        return f"at most {self.max_items:,} items"

    def refusal(self, value: list) -> str:
        return "" if len(value) <= self.max_items else f"{len(value):,} items, at most {self.max_items:,} allowed"


@dataclasses.dataclass(frozen=True)
class IsoDate:
    """A date field: '' (not set) or an ISO date YYYY-MM-DD between MIN_YEAR and MAX_YEAR."""

    min_year: int = 1970
    max_year: int = 2200  # far enough for any forecast, near enough that date arithmetic cannot overflow

    def describe(self) -> str:
        return f"'' or YYYY-MM-DD, years {self.min_year}..{self.max_year}"

    def refusal(self, value: str) -> str:
        if value == "":
            return ""
        try:
            parse_date(value, "")
        except RackcastError as exc:
            return str(exc).removeprefix(": ")
        return ""


def parse_date(text: str, field: str, where: str = "", option: str = "") -> dt.date:
    """An ISO date YYYY-MM-DD within IsoDate's years; anything else is a RackcastError naming `field` (and the
    request input `option`, where the date is one)."""
    bounds = IsoDate()
    try:
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(text)):
            raise ValueError
        day = dt.date.fromisoformat(str(text))
    except ValueError:
        raise RackcastError(f"{field}: expected an ISO date YYYY-MM-DD, got {shown(text)}", where=where,
                            option=option) from None
    if not bounds.min_year <= day.year <= bounds.max_year:
        raise RackcastError(f"{field}: year {day.year} is outside {bounds.min_year}..{bounds.max_year}", where=where,
                            option=option)
    return day


def _number_text(x: float) -> str:
    if float(x).is_integer() and abs(x) < 1e12 and (isinstance(x, int) or abs(x) < 1e7):
        return f"{int(x):,}"
    return f"{x:g}"


def shown(value: Any) -> str:
    """repr(value) cut to SHOWN_CHARS characters, so an error stays one short line whatever the input."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**SHOWN_CHARS:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value) if not isinstance(value, (dict, list, tuple)) else reprlib_short(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def reprlib_short(value: Any) -> str:
    """A bounded repr of a container (the reprlib limits: a few items, a few levels), safe on aliased trees."""
    import reprlib

    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxdict, short.maxstring, short.maxother = 2, 4, 4, 20, 20
    return short.repr(value)
