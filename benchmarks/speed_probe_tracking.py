"""Does the in-run machine-speed probe (backend.speed_probe) rise and fall with the step times?

Trains validation plans (validation.validate's suite, written to OUT/plans) in interleaved rounds, each round once
on the machine as it is and once beside a CPU burner (one spinning process, unpinned, so the scheduler puts it on
either core), and reads every run's metrics.parquet: per step, the probe time (mean over ranks, probe_s) beside the
step time; per run, the run's figure (mean of its fastest fifth of steady steps, backend.record.fastest_steps)
beside the median probe. Prints per-run rows, the within-run Pearson correlation of probe and step time, and the
across-run correlation of figure and median probe, per plan, with the load average at the start and the end.

    .venv/bin/python benchmarks/speed_probe_tracking.py --rounds 3 --out runs/probe-tracking

Findings (two sessions of 18 runs x 20 steps, load 1.7-4.9; README, "Machine-speed probe"): where the process had its
core (core_share >= 0.95) the probe at the figure's steps follows the run's figure, r +0.82 over five runs of
1p-gb32-mb8 (270.8-283.8 ms against 2.17-2.32 ms) and +0.99 over three of 1p-mb2, and per step r +0.54 and +0.74;
descheduled runs (core_share 0.50-0.82) took up to 2.1x longer while the probe, the fastest of its passes, did not
move; two-process plans follow loosely across runs (r +0.48, +0.50) and hardly per step (+0.37, +0.05).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from rackcast.backend.record import fastest_steps, steady_rows
from rackcast.spread import CORE_SHARE_FLOOR
from rackcast.validation.validate import train, write_suite

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_PLANS = ("1p-gb32-mb8", "dp2-mb2", "dp2-gb32-mb8")
BURN = "while True: pass"


def load() -> str:
    return Path("/proc/loadavg").read_text().split(" ")[0]


def pearson(x, y) -> float:
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 3 or x.std() == 0 or y.std() == 0:
        return math.nan
    return float(np.corrcoef(x, y)[0, 1])


def run_once(plan: Path, out: Path, steps: int, data_dir: str, burn: bool) -> dict:
    burner = subprocess.Popen([sys.executable, "-c", BURN]) if burn else None
    try:
        train(plan, out, steps, data_dir)
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()
    rows = steady_rows(pq.read_table(out / "metrics.parquet").to_pylist())
    times = [r["step_time_s"] for r in rows]
    probes = [r["probe_s"] for r in rows]
    fast = fastest_steps(rows)
    return {"figure_ms": 1e3 * fast["step_time_s"], "median_step_ms": 1e3 * statistics.median(times),
            "probe_median_ms": 1e3 * statistics.median(probes), "probe_min_ms": 1e3 * min(probes),
            "probe_at_figure_ms": 1e3 * fast["probe_s"], "core_share": statistics.median(r["core_share"] for r in rows),
            "r_within": pearson(probes, times),
            "steps": [(1e3 * r["step_time_s"], 1e3 * r["probe_s"], r["core_share"]) for r in rows]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--plans", nargs="+", default=list(DEFAULT_PLANS))
    ap.add_argument("--topology", default="local-cpu")
    ap.add_argument("--data-dir", default="runs/.data")
    ap.add_argument("--out", default="runs/probe-tracking")
    args = ap.parse_args(argv)
    out = ROOT / args.out
    paths = {p.stem: p for p in write_suite(out / "plans", args.topology, quick=False)}
    results = []
    print(f"load at start {load()}", flush=True)
    for rnd in range(args.rounds):
        for burn in (False, True):
            for name in args.plans:
                res = run_once(paths[name], out / "runs" / f"{name}-r{rnd}-{'burn' if burn else 'as-is'}",
                               args.steps, args.data_dir, burn)
                res.update(plan=name, round=rnd, burn=burn, load=load())
                results.append(res)
                print(f"{name:16s} r{rnd} {'burn ' if burn else 'as-is'} figure {res['figure_ms']:7.1f} ms  "
                      f"median {res['median_step_ms']:7.1f} ms  probe med {res['probe_median_ms']:5.2f} ms  "
                      f"at figure {res['probe_at_figure_ms']:5.2f} ms  core_share {res['core_share']:.2f}  "
                      f"r(step,probe) {res['r_within']:+.2f}  load {res['load']}", flush=True)
    print(f"load at end {load()}")
    (out / "tracking.json").write_text(json.dumps(results, indent=1))
    for name in args.plans:
        runs = [r for r in results if r["plan"] == name]
        figs = [r["figure_ms"] for r in runs]
        probes = [r["probe_at_figure_ms"] for r in runs]
        steps = [s for r in runs for s in r["steps"]]
        on_core = [s for s in steps if s[2] >= CORE_SHARE_FLOOR]  # steps the process was not descheduled in
        print(f"{name}: across runs r(figure, probe at its steps) {pearson(figs, probes):+.2f} (n={len(runs)}); "
              f"figure {min(figs):.1f}-{max(figs):.1f} ms ({(max(figs) - min(figs)) / min(figs):.0%}), "
              f"probe {min(probes):.2f}-{max(probes):.2f} ms ({(max(probes) - min(probes)) / min(probes):.0%}); "
              f"pooled steps r(step, probe) {pearson(*list(zip(*steps))[:2]):+.2f} (n={len(steps)}), "
              f"core_share >= {CORE_SHARE_FLOOR}: "
              f"{pearson(*list(zip(*on_core))[:2]) if on_core else math.nan:+.2f} (n={len(on_core)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
