"""How far repeated measurements of one figure disagree, and when they disagree too much to score a prediction.

A shared machine makes timings noisy in bursts (another job takes a core for seconds), so rackcast reports a robust
centre with the spread beside it rather than one run: the median (robust to one slow run or step), the lowest and
highest values, and the relative spread (high - low) / median. Within one run the spread of its steady steps is the
interquartile range over the median, so one slow step does not count; across repeats of a run it is the full range
of the runs' medians, since there are few of them. A measurement whose relative spread is above SPREAD_LIMIT is
flagged as too noisy to score: its error against a prediction could be noise as easily as model error.

    s = spread_of([0.101, 0.098, 0.131])     # Spread(centre=0.101, low=0.098, high=0.131, n=3)
    s.relative, s.too_wide                   # 0.327, True
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

# The validation target for unfitted predictions is 15% mean absolute error (issue 15): a measurement that moves by
# more than that between repeats cannot tell a prediction within the target from one outside it.
SPREAD_LIMIT = 0.15
# A CPU run whose steps got less than this share of a core per process (process CPU time / wall time, record.json's
# core_share) spent the rest waiting for a core: its wall times measure the machine's other load as much as the run.
CORE_SHARE_FLOOR = 0.8


@dataclass(frozen=True)
class Spread:
    centre: float  # the median
    low: float
    high: float
    n: int

    @property
    def relative(self) -> float:
        """(high - low) / centre: 0 for identical values, NaN without values."""
        return (self.high - self.low) / self.centre if self.n and self.centre else math.nan

    @property
    def too_wide(self) -> bool:
        return self.relative > SPREAD_LIMIT

    def as_dict(self) -> dict:
        return {"median": self.centre, "low": self.low, "high": self.high, "n": self.n, "relative": self.relative,
                "too_wide": self.too_wide}


def _finite(values) -> list[float]:
    return sorted(float(v) for v in values if v is not None and not math.isnan(v))


def spread_of(values) -> Spread:
    """Median, minimum and maximum of the finite values (the full range: for a handful of repeats)."""
    v = _finite(values)
    if not v:
        return Spread(math.nan, math.nan, math.nan, 0)
    return Spread(statistics.median(v), v[0], v[-1], len(v))


def quartile_spread_of(values) -> Spread:
    """Median with the first and third quartiles as low and high (for the many steps of one run)."""
    v = _finite(values)
    if len(v) < 4:
        return spread_of(v)
    q1, _, q3 = statistics.quantiles(v, n=4, method="inclusive")
    return Spread(statistics.median(v), q1, q3, len(v))
