"""How many of a validate suite's plans are too noisy to score under two measured figures, on the same runs: the
median of a run's steady steps (flagged by the range over repeats or a run's interquartile range, as validate did
before) against the mean of its fastest fifth (flagged by the range over repeats or the even/odd halves spread,
rackcast.spread; what validate scores now).

    .venv/bin/python benchmarks/noise_flags.py runs/validate-r1 runs/validate-quick-r1
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import pyarrow.parquet as pq

from rackcast.backend.record import fastest_steps, steady_rows
from rackcast.spread import SPREAD_LIMIT, quartile_spread_of, spread_of


def widest_spreads(run_dirs: list[Path]) -> tuple[float, float]:
    """(median-step spread, fastest-fifth spread) of one plan's runs: the wider of repeats and within-run."""
    steady = [steady_rows(pq.read_table(d / "metrics.parquet").to_pylist()) for d in run_dirs]
    medians = [statistics.median(r["step_time_s"] for r in rows) for rows in steady]
    figures = [fastest_steps(rows) for rows in steady]
    old = max(spread_of(medians).relative if len(medians) > 1 else 0.0,
              max(quartile_spread_of(r["step_time_s"] for r in rows).relative for rows in steady))
    new = max(spread_of(f["step_time_s"] for f in figures).relative if len(figures) > 1 else 0.0,
              max(f["halves_spread"] for f in figures))
    return old, new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("suites", nargs="+", type=Path, help="validate --out folders (their runs/ subfolders are read)")
    for suite in ap.parse_args().suites:
        runs = sorted((suite / "runs").iterdir())
        plans = sorted({d.name.rsplit("-r", 1)[0] for d in runs})
        spreads = [widest_spreads([d for d in runs if d.name.rsplit("-r", 1)[0] == p]) for p in plans]
        old = sum(o > SPREAD_LIMIT for o, _ in spreads)
        new = sum(n > SPREAD_LIMIT for _, n in spreads)
        print(f"{suite}: {len(plans)} plans; too noisy to score (> {SPREAD_LIMIT:.0%}): median step {old}, "
              f"fastest fifth {new}; median of the plans' widest spreads "
              f"{statistics.median(o for o, _ in spreads):.0%} -> {statistics.median(n for _, n in spreads):.0%}")


if __name__ == "__main__":
    main()
