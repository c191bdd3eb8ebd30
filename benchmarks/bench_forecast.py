"""Benchmark of the run forecast: 10,000 Monte Carlo runs of the Marin 535B hero run (704 GPUs on 11 GB200 NVL72
racks, 18T tokens) with the default reliability figures, through the numba model; also the checkpoint-interval
search (21 intervals x 2,000 runs, common random numbers) and, for scale, the SimPy reference on 20 runs.

    .venv/bin/python benchmarks/bench_forecast.py

Prints seconds for: preparing the inputs (estimate of the full and shrunk layouts); the first 10,000 runs (includes
loading or compiling the numba kernel); the same 10,000 runs again (warm); the interval search; and the whole
`forecast()` call the CLI makes. The target is at most 30 s for the 10,000 runs.
"""

from __future__ import annotations

import time
from pathlib import Path

from rackcast.planner.forecast import best_interval, forecast, prepare, run_many
from rackcast.planner.forecast_sim import simulate_reference
from rackcast.plan import load_plan
from rackcast.units import SECONDS_PER_DAY

PLAN = Path(__file__).resolve().parent.parent / "examples" / "plans" / "marin-535b-hero.yaml"
RUNS = 10_000


def _timed(label: str, fn):
    t0 = time.perf_counter()
    value = fn()
    print(f"{label:58s} {time.perf_counter() - t0:8.3f} s")
    return value


def main() -> None:
    plan = load_plan(str(PLAN))
    setup = _timed("prepare (estimate, shrunk layouts, checkpoint size)", lambda: prepare(plan, 18e12))
    _timed(f"{RUNS:,} runs, first call (numba load or compile)", lambda: run_many(setup.inputs, 0, RUNS))
    times, _, _ = _timed(f"{RUNS:,} runs, warm", lambda: run_many(setup.inputs, 0, RUNS))
    _timed("interval search: 21 intervals x 2,000 runs", lambda: best_interval(setup, 0, 2000))
    _timed("SimPy reference, 20 runs", lambda: simulate_reference(setup.inputs, 0, 20))
    result = _timed(f"forecast() as the CLI calls it ({RUNS:,} runs + search)",
                    lambda: forecast(plan, 18e12, "2026-09-01", "2026-11-20", runs=RUNS))
    print(f"mean {times[:, 0].mean() / SECONDS_PER_DAY:.2f} days over {RUNS:,} runs; P50 {result.p50_days:.2f} days; "
          f"steady state {setup.steady_days:.2f} days")


if __name__ == "__main__":
    main()
