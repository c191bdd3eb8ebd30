"""`rackcast validate [--quick] [--json]`: train the validation suite (validation.validate) on this machine, predict each
plan with the calibrated topology, fit and re-predict, and print the error table (step-time MAPE, max error,
Kendall tau, peak-memory error). Results go to OUT/results.parquet and OUT/summary.json.

    rackcast calibrate && rackcast validate            # topology runs/calibrated.yaml, results in runs/validate
"""

from __future__ import annotations

import math
from pathlib import Path

from rackcast.cli.common import console, print_json, table
from rackcast.errors import RackcastError
from rackcast.spread import FASTEST_SHARE
from rackcast.units import MIB


def register(sub) -> None:
    p = sub.add_parser("validate", help="train a suite of tiny plans here, predict them, report the errors")
    p.add_argument("--topology", default="", help="topology to predict with (default runs/calibrated.yaml from "
                                                  "`rackcast calibrate`, else the local-cpu preset)")
    p.add_argument("--out", default="runs/validate", help="results folder (default runs/validate)")
    p.add_argument("--quick", action="store_true", help="8 plans, 1 repeat, 8 steps each")
    p.add_argument("--reuse", action="store_true", help="predict the runs an earlier `validate` left in --out "
                                                        "instead of training again (same --steps, --repeats)")
    p.add_argument("--steps", type=int, default=0, help="steps per run (default 20; --quick 8)")
    p.add_argument("--repeats", type=int, default=0,
                   help="runs per plan, the median of their figures taken (default 3; --quick 1)")
    p.add_argument("--fit-on", type=int, default=3, help="plans whose phase times the fitted profile uses "
                                                         "(the first N of the suite; default 3)")
    p.add_argument("--data-dir", default="runs/.data", help="token cache folder (default runs/.data)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_run)


def _pct(v: float) -> str:
    return "-" if v is None or math.isnan(v) else f"{100 * v:.1f}%"


def _run(args) -> int:
    import sys

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from rackcast.validation.validate import run_suite

    topology = args.topology or ("runs/calibrated.yaml" if Path("runs/calibrated.yaml").exists() else "local-cpu")
    if args.steps < 0 or args.repeats < 0:
        raise RackcastError("--steps and --repeats must be positive")
    if not args.json:
        print(f"validate: predicting with topology {topology}"
              + ("" if args.topology or topology != "local-cpu" else " (run `rackcast calibrate` first to measure "
                                                                      "this machine)"), file=sys.stderr)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TimeElapsedColumn(), console=console().__class__(stderr=True))
    with progress:
        task = progress.add_task("validate", total=None)
        s = run_suite(topology, Path(args.out), quick=args.quick, steps=args.steps, repeats=args.repeats,
                      fit_on=args.fit_on, data_dir=args.data_dir, reuse=args.reuse,
                      progress=lambda label, d, t: progress.update(task, completed=d, total=t,
                                                                   description=f"validate: {label:<36}"))
    results = s.pop("results")
    if args.json:
        print_json({**s, "plans": [{"plan": r.name, "measured_step_s": r.measured_step_s,
                                    "measured_runs_s": r.measured_runs_s, "repeat_spread": r.repeat_spread,
                                    "step_spread": r.step_spread, "too_noisy": r.too_noisy,
                                    "measured_peak_memory_bytes": r.measured_peak_memory_bytes,
                                    "predicted": {k: {"step_time_s": v["step_time_s"], "source": v["source"],
                                                      "peak_memory_bytes": v["peak_memory_bytes"]}
                                                  for k, v in r.predicted.items()}} for r in results]})
        return 0
    out = console()
    labels = list(results[0].predicted)
    rows = []
    for r in results:
        row = [r.name + (" (fit)" if r.name in s["fit_on"] else ""), f"{r.measured_step_s * 1e3:.1f}",
               " ".join(f"{x * 1e3:.0f}" for x in r.measured_runs_s),
               f"{_pct(r.repeat_spread.get('relative'))} / {_pct(r.step_spread)}" + (" NOISY" if r.too_noisy else "")]
        for label in labels:
            p = r.predicted[label]["step_time_s"]
            row += [f"{p * 1e3:.1f}", _pct((p - r.measured_step_s) / r.measured_step_s)]
        pred_mem = r.predicted[labels[0]]["peak_memory_bytes"]
        row += [f"{r.measured_peak_memory_bytes / MIB:.0f}", f"{pred_mem / MIB:.1f}"]
        rows.append(row)
    short = {"microbenchmarks": "sim", "microbenchmarks + op overhead": "sim+ovh", "fitted": "fitted"}
    cols = ["plan", "measured", "runs", "spread runs / halves"]
    for label in labels:
        cols += [short.get(label, label), "err"]
    out.print(table(f"Step time per plan (ms; {s['repeats']} runs x {s['steps']} steps; measured = each run's fastest "
                    f"{FASTEST_SHARE:.0%} of steps, median over runs; sim = "
                    f"{results[0].predicted[labels[0]]['source']} with the calibrated topology, +ovh = plus the "
                    "measured per-op host overhead, fitted = factors fitted to the (fit) plans)",
                    cols + ["mem MiB", "mem MiB pred"], rows))
    rows = [[x["profile"], str(x["plans"]), _pct(x["step_mape"]), _pct(x["step_max_abs_error"]),
             f"{x['kendall_tau']:.2f}", _pct(x["memory_mape"]), _pct(x["memory_max_abs_error"])]
            for x in s["summaries"]]
    out.print(table("Validation summary (targets: step MAPE <= 15% unfitted, <= 5% fitted on held-out plans, "
                    "Kendall tau >= 0.9)",
                    ["profile", "plans", "step MAPE", "max |error|", "Kendall tau", "memory MAPE",
                     "memory max |error|"], rows))
    if s.get("op_counts"):
        out.print("eager memory traffic (+ovh): " + ("counted bytes per framework op (simulator/op_bytes) on every plan"
                  if s.get("eager_bytes_counted") else "not on every plan (not counted, or a plan not run as they "
                  "were counted: host_overhead.COUNTED_AS); the fused elementwise term stands there"))
    out.print("fitted factors (" + ", ".join(s["fit_on"]) + "): "
              + ", ".join(f"{k} {v:.3g}" for k, v in s["fitted_factors"].items()))
    if s["scorable"]:
        out.print(f"spread: every plan's runs and run halves agree within {_pct(s['spread_limit'])} (rackcast.spread): "
                  "the suite can be scored")
    else:
        out.print(f"spread: {', '.join(s['noisy_plans'])} varied by more than {_pct(s['spread_limit'])} between "
                  "runs or run halves: too noisy to score; the errors above may be the machine's, not the model's "
                  "(rerun on a quieter machine or with more --repeats)")
    floor = s.get("repeat_floor")
    if floor and floor["plans"]:
        gap = ("one repeat lands {} from the other repeats' median" if floor["from"] == "repeats"
               else "the two halves of a run differ by {}").format(_pct(floor["mape"]))
        out.print(f"repeat floor: {gap} on average ({floor['plans']} plans; validate.repeat_floor): a MAPE below "
                  "that is within the measurements' own noise")
    out.print(machine_line(s))
    out.print(f"results: {args.out}/results.parquet, {args.out}/summary.json ({s['wall_s']:.0f} s)")
    return 0


def machine_line(s: dict) -> str:
    """The summary's line on the speed-probe check (validation.validate.machine_check)."""
    if not s.get("calibrated_probe_s"):
        return "machine speed: not checked (the topology holds no speed probe: calibrate again to measure one)"
    known = {k: v for k, v in s["machine_slowdown"].items() if v is not None}
    if not known:
        return "machine speed: not checked (the runs recorded no speed probe)"
    furthest = max(known, key=lambda k: abs(known[k]))
    limit, probe = _pct(s["machine_mismatch_limit"]), f"{s['calibrated_probe_s'] * 1e3:.3g} ms"
    if not s["machine_mismatch_plans"]:
        return (f"machine speed: every plan ran within {limit} of the calibrated speed probe ({probe}; furthest "
                f"{furthest} {known[furthest]:+.1%})")
    plans = s["machine_mismatch_plans"]
    slower = sum(known.get(p, 0.0) > 0 for p in plans)
    way = "slower" if slower == len(plans) else "faster" if not slower else "slower or faster"
    return (f"machine speed: {', '.join(plans)} ran on a machine more than {limit} {way} than calibrated (speed "
            f"probe {probe}; furthest {furthest} {known[furthest]:+.1%}): their errors include the machine's (a "
            "calibration taken in a slower spell over-predicts, in a faster one under-predicts); the (machine-matched "
            "plans) rows score the others")
