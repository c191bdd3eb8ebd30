"""The validation suite behind `rackcast validate`: train a set of tiny plans on this machine, predict each with the
calibrated topology, and report how far the predictions are from the measurements.

Suite (tiny-moe, sequences of 128 tokens, one torch thread per process, so a process is one core as in the calibrated
topology; one thread also makes the one-process runs steadier than two threads on tiny ops). The plans are chosen by a
coverage rule, fixed before looking at any prediction:

- five layouts: one process (1p), data parallel 2 (dp2), DP2 x EP2 folded (dp2-ep2), pipeline 2 with 1F1B and with
  GPipe (pp2-1f1b, pp2-gpipe);
- each layout at two global batches, 8 and 32 sequences, so that the suite spans a 4x range of work per step and
  true differences between plans exceed this machine's run-to-run noise (5-15% on one plan; at one global batch
  all plans fall within about 80-140 ms and their ranking is mostly noise). Micro-batch 2 at global batch 8 and 8 at
  global batch 32 (4 for the pipeline plans, so both pipeline stages see 8 micro-batches);
- capacity against dropless transport at global batch 8, once without experts split (1p) and once with them
  (dp2-ep2), the pairs differing only in the transport.

That is 12 plans; micro-batch sizes 2, 4 and 8. The fitted profile fits to the first three (`fit_on`), also chosen by
coverage: 1p and dp2-ep2 at global batch 8 (compute and op overhead; expert all-to-all) and 1p at global batch 32
(compute at the larger scale). `--quick` runs eight of them (both batch scales, every layout and both transports).
Each plan is trained `repeats` times for `steps` steps, interleaved (plan 1..n, then again) so slow spells of a
shared machine fall on every plan, each process pinned to its own core (backend.cpu_runtime). A run's figure is the
mean step time and phases of its fastest fifth of steady steps (the first step, warm-up, skipped; rackcast.spread's
`fastest`: interference only adds time, and the predictions are of an undisturbed machine; the calibration's
microbenchmarks keep their fastest samples alike). It is the record's `fastest` figure, computed from the run's
metrics.parquet for runs recorded before the record kept it (backend.record.with_fastest), so they score the same
way. The plan's figure is the median over repeats of its runs' figures, reported with its spread (rackcast.spread):
the range over repeats, and within a run the figure's difference between its even and odd steps (halves_spread). A
plan whose spread exceeds rackcast.spread.SPREAD_LIMIT is flagged too noisy to score, and the summary says whether
the suite could be scored (`noisy_plans`, `scorable`): a MAPE taken over noisy measurements measures the machine,
not the model. Each run also measured the machine's speed (backend.speed_probe, at its figure's steps): a plan whose
median run's probe differs by more than rackcast.spread.MACHINE_MISMATCH_LIMIT, either way, from the calibrated
topology's (`efficiency.speed_probe_s`) ran on another machine than the prediction describes
(`machine_mismatch_plans`); it stays in the MAPE over all plans, and the unfitted figures are given again over the
machine-matched plans.

Predictions: the simulator (simulator.step.simulate) with the calibrated topology less its host per-op overhead
("microbenchmarks"); with the calibrated topology as it is, which includes the overhead (simulator.host_overhead:
op counts of the backend model x the calibrated host times per forward, backward and optimizer op; "+ op
overhead"); and that after fitting the topology's factors, op overhead included (validation.fit), to the measured phase
times of the first `fit_on` plans, each weighted by its measured scatter (PlanResult.scatter) ("fitted"; its
held-out error counts only the other plans). Figures: step-time
MAPE and max |error|, Kendall's tau-b between predicted and measured step times, and peak-memory error: the
trainer's peak live tensor bytes (backend.memprof) against the memory model for what it keeps (fp32, the activations
eager PyTorch saves; validation.compare.predicted_run_memory).

    rackcast validate --quick
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import yaml

from rackcast.atomic import atomic_path, write_text_atomic
from rackcast.backend.launch import torchrun_command, worker_env
from rackcast.backend.record import measured_figure, with_fastest
from rackcast.errors import RackcastError
from rackcast.plan import load_plan
from rackcast.spread import (FASTEST_SHARE, MACHINE_MISMATCH_LIMIT, SPREAD_LIMIT, leave_one_out_error, slowdown,
                             spread_of)

ROOT = Path(__file__).resolve().parent.parent

SUITE = [  # name, parallel, global_batch, micro_batch, schedule, transport (the first `fit_on` = 3 are the fit set)
    ("1p-mb2", {}, 8, 2, "1f1b", "dropless"),
    ("dp2-ep2-mb2", {"data": 2, "expert": 2}, 8, 2, "1f1b", "dropless"),
    ("1p-gb32-mb8", {}, 32, 8, "1f1b", "dropless"),
    ("dp2-mb2", {"data": 2}, 8, 2, "1f1b", "dropless"),
    ("pp2-1f1b-mb2", {"pipeline": 2}, 8, 2, "1f1b", "dropless"),
    ("pp2-gpipe-mb2", {"pipeline": 2}, 8, 2, "gpipe", "dropless"),
    ("1p-mb2-cap", {}, 8, 2, "1f1b", "capacity"),
    ("dp2-ep2-mb2-cap", {"data": 2, "expert": 2}, 8, 2, "1f1b", "capacity"),
    ("dp2-gb32-mb8", {"data": 2}, 32, 8, "1f1b", "dropless"),
    ("dp2-ep2-gb32-mb8", {"data": 2, "expert": 2}, 32, 8, "1f1b", "dropless"),
    ("pp2-1f1b-gb32-mb4", {"pipeline": 2}, 32, 4, "1f1b", "dropless"),
    ("pp2-gpipe-gb32-mb4", {"pipeline": 2}, 32, 4, "gpipe", "dropless"),
]
# Factors the suite fits: the trainer's communication on CPU is blocking (nothing overlaps it), so the slowdown of
# compute under communication is not fitted; attention is a small share of tiny-moe's compute and not separable.
FIT_FACTORS = ["gemm", "memory_bound", "all_to_all", "all_reduce", "send_recv"]
QUICK = ("1p-mb2", "dp2-ep2-mb2", "1p-gb32-mb8", "dp2-mb2", "pp2-1f1b-mb2", "pp2-gpipe-mb2", "dp2-ep2-mb2-cap",
         "dp2-ep2-gb32-mb8")


def write_suite(folder: Path, topology: str, quick: bool) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, par, gb, mb, schedule, transport in SUITE:
        if quick and name not in QUICK:
            continue
        world = par.get("data", 1) * par.get("pipeline", 1)
        plan = {"name": name, "model": "tiny-moe",
                "topology": {"name": topology, "domains": 1, "usable_gpus": world},
                "parallel": par, "batch": {"global_batch": gb, "micro_batch": mb}, "schedule": schedule,
                "optimizer": {"name": "muonh", "lr": 0.01, "adam_lr": 0.003}, "precision": "fp32",
                "expert_transport": {"mode": transport, "capacity_factor": 1.0}}
        path = folder / f"{name}.yaml"
        write_text_atomic(path, yaml.safe_dump(plan, sort_keys=False))
        out.append(path)
    return out


def train(plan_path: Path, out: Path, steps: int, data_dir: str, timeout_s: float = 600) -> dict:
    """One training run (torchrun, gloo on loopback, one thread per process); its record.json."""
    plan = load_plan(str(plan_path))
    args = ["--steps", str(steps), "--out", str(out), "--quiet", "--threads", "1", "--data-dir", data_dir]
    env = worker_env(override=True)
    for attempt in range(2):  # one retry: a crashed run is started again
        if out.exists():
            shutil.rmtree(out)
        proc = subprocess.run(torchrun_command(str(plan_path), plan.parallel.gpus, args), cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout_s)
        record = out / "record.json"
        done = json.loads(record.read_text()) if record.exists() else {}
        if proc.returncode == 0:
            return done
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out / f"train-stderr-{attempt}.txt", proc.stderr)
        if done.get("steps") == steps:  # every step measured and recorded; the crash came at process teardown
            return dict(done, teardown_exit=proc.returncode)
    raise RackcastError(f"training failed twice (exit {proc.returncode}); its output is in "
                        f"{out}/train-stderr-*.txt", where=str(plan_path))


def reused(run_dir: Path, steps: int) -> dict:
    """The record of an earlier run of this suite (for `reuse`); one line naming the run when it is missing or short."""
    path = run_dir / "record.json"
    if not path.exists():
        raise RackcastError("no record.json: run the suite once without reusing runs (same steps and repeats)",
                            where=str(run_dir), option="reuse")
    rec = json.loads(path.read_text())
    if rec.get("steps") != steps:
        raise RackcastError(f"recorded {rec.get('steps')} steps, this suite asks for {steps} (ask for the same "
                            "steps)", where=str(path), option="steps")
    return rec


def kendall_tau(x, y) -> float:
    """Kendall's tau-b of two sequences (ties counted as neither concordant nor discordant)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    i, j = np.triu_indices(len(x), k=1)
    dx, dy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
    n0 = len(i)
    tx, ty = np.sum(dx == 0), np.sum(dy == 0)
    denom = math.sqrt((n0 - tx) * (n0 - ty))
    return float(np.sum(dx * dy) / denom) if denom else math.nan


@dataclass
class PlanResult:
    name: str
    plan_path: str
    measured_step_s: float
    measured_runs_s: list[float]
    measured_phases_s: dict[str, float]
    measured_peak_memory_bytes: float
    predicted: dict[str, dict] = field(default_factory=dict)  # profile label -> figures
    param_dtype: str = ""  # the dtype the trainer kept weights and activations in (its record's param_dtype)
    repeat_spread: dict = field(default_factory=dict)  # rackcast.spread over the repeats' figures
    step_spread: float = math.nan  # the widest halves_spread of one run's figure (rackcast.spread)
    # each run's machine against the calibrated one (rackcast.spread.slowdown of the probe at the figure's steps)
    run_slowdowns: list[float] = field(default_factory=list)

    @property
    def scatter(self) -> float:
        """Half the wider of the repeats' relative range and the widest run's halves_spread: the measurement's +-
        (validation.fit weighs a plan's residuals by it); 0 where neither is known."""
        spreads = [x for x in (self.repeat_spread.get("relative", math.nan), self.step_spread) if x == x]
        return max(spreads) / 2 if spreads else 0.0

    @property
    def too_noisy(self) -> bool:
        """Repeats, or the two halves of one run, disagree by more than rackcast.spread.SPREAD_LIMIT."""
        return bool(self.repeat_spread.get("too_wide")) or self.step_spread > SPREAD_LIMIT

    @property
    def machine_slowdown(self) -> float:
        """The median over repeats of the runs' slowdowns, as the plan's figure is the median of its runs' figures
        (the two medians may come from different runs); NaN where unknown."""
        return spread_of(self.run_slowdowns).centre

    @property
    def machine_mismatch(self) -> bool:
        """Its runs ran on a machine more than rackcast.spread.MACHINE_MISMATCH_LIMIT slower or faster than the
        calibrated one (unknown: not a mismatch)."""
        return abs(self.machine_slowdown) > MACHINE_MISMATCH_LIMIT


def plan_result(name: str, plan_path: str, records: list[dict], calibrated_probe_s: float = 0.0) -> PlanResult:
    """A plan's measurement from its repeats' records (each with its `fastest` figure, backend.record.with_fastest):
    the median over repeats of the runs' figures and of their phases, the range over repeats, the widest
    halves_spread of one run, and each run's machine slowdown against `calibrated_probe_s` (0: not calibrated)."""
    figures = [measured_figure(r) for r in records]
    phases = {k: statistics.median(f["phases_s"].get(k, 0.0) for f in figures) for k in figures[0]["phases_s"]}
    runs = spread_of(f["step_time_s"] for f in figures)
    return PlanResult(name, plan_path, runs.centre, [f["step_time_s"] for f in figures], phases,
                      max(r["peak_memory_bytes"] for r in records), param_dtype=records[0].get("param_dtype", ""),
                      repeat_spread=runs.as_dict(),
                      step_spread=max((x for f in figures if not math.isnan(x := f["halves_spread"])),
                                      default=math.nan),
                      run_slowdowns=[slowdown(f.get("probe_s"), calibrated_probe_s) for f in figures])


def repeat_floor(results: list[PlanResult]) -> dict:
    """How well the suite's measurements reproduce themselves: the mean over plans of one repeat's distance from the
    other repeats' median (rackcast.spread.leave_one_out_error), or, with one run per plan (--quick), of the runs'
    halves_spread (one half of a run against the other). A perfect prediction would show about this MAPE; a target
    below it cannot be checked on these measurements."""
    per_plan = [leave_one_out_error(r.measured_runs_s) for r in results]
    source = "repeats"
    if all(math.isnan(x) for x in per_plan):
        per_plan, source = [r.step_spread for r in results], "run halves"
    finite = [x for x in per_plan if not math.isnan(x)]
    return {"mape": statistics.fmean(finite) if finite else math.nan, "from": source, "plans": len(finite)}


def summarise(results: list[PlanResult], label: str, held_out: set[str] | None = None) -> dict:
    rows = [r for r in results if held_out is None or r.name in held_out]
    meas = np.array([r.measured_step_s for r in rows])
    pred = np.array([r.predicted[label]["step_time_s"] for r in rows])
    err = (pred - meas) / meas
    mem_m = np.array([r.measured_peak_memory_bytes for r in rows])
    mem_p = np.array([r.predicted[label]["peak_memory_bytes"] for r in rows])
    return {"profile": label, "plans": len(rows), "step_mape": float(np.mean(np.abs(err))),
            "step_max_abs_error": float(np.max(np.abs(err))), "kendall_tau": kendall_tau(pred, meas),
            "memory_mape": float(np.mean(np.abs((mem_p - mem_m) / mem_m))),
            "memory_max_abs_error": float(np.max(np.abs((mem_p - mem_m) / mem_m)))}


def machine_check(results: list[PlanResult], calibrated_probe_s: float) -> dict:
    """The summary's speed-probe check: the calibrated probe, the limit, each plan's machine slowdown, and the plans
    whose machine was slower or faster than the calibrated one by more than the limit (`machine_mismatch_plans`)."""
    return {"calibrated_probe_s": calibrated_probe_s or None, "machine_mismatch_limit": MACHINE_MISMATCH_LIMIT,
            "machine_slowdown": {r.name: None if math.isnan(r.machine_slowdown) else r.machine_slowdown
                                 for r in results},
            "machine_mismatch_plans": [r.name for r in results if r.machine_mismatch]}


def matched_summaries(results: list[PlanResult]) -> list[dict]:
    """Each unfitted profile's figures again over the plans whose machine matched the calibrated one, where some plan's
    did not (and some did): the error the model makes on the machine it describes, beside the error over all."""
    matched = {r.name for r in results if not r.machine_mismatch}
    if len(matched) in (0, len(results)):
        return []
    return [dict(summarise(results, label, matched), profile=f"{label} (machine-matched plans)")
            for label in results[0].predicted if label != "fitted"]


def predict_all(results: list[PlanResult], topo_path: str, label: str, overhead: bool = True) -> None:
    """Predict every plan with topology `topo_path`; overhead=False leaves its host per-op times out."""
    from rackcast.validation.compare import predict, predicted_run_memory
    from rackcast.topologies import load_topology

    for r in results:
        plan = load_plan(r.plan_path)
        topo = load_topology(topo_path, plan.topology.domains, plan.topology.usable_gpus or None)
        if not overhead:
            topo = topo.with_efficiency(topo.efficiency.without_host_ops())
        source, res = predict(plan, topo=topo)
        r.predicted[label] = {"source": source, "step_time_s": float(res.step_time_s),
                              "peak_memory_bytes": predicted_run_memory(plan, {"param_dtype": r.param_dtype}, res),
                              "phases_s": {k: float(v) for k, v in res.phases_s.items()}}


def run_suite(topology: str, out_dir: Path, quick: bool = False, steps: int = 0, repeats: int = 0, fit_on: int = 3,
              data_dir: str = "runs/.data", progress=None, reuse: bool = False) -> dict:
    """Train, predict, fit, summarise; writes plans/, runs/, results.parquet, fitted topology and summary.json.
    reuse: take the measurements of an earlier run of the suite in `out_dir` (its runs/*/record.json) instead of
    training again, to predict them with another topology or a changed model."""
    from rackcast.validation.calibration import write_topology
    from rackcast.validation.fit import Measurement, fit
    from rackcast.topologies import load_topology

    load_topology(topology)  # a missing or malformed topology fails here, before any training
    steps = steps or (8 if quick else 20)
    repeats = repeats or (1 if quick else 3)
    plans = write_suite(out_dir / "plans", str(Path(topology).resolve()) if Path(topology).exists() else topology,
                        quick)
    total = len(plans) * repeats + 2
    done = 0
    records: dict[str, list[dict]] = {p.stem: [] for p in plans}
    t0 = time.perf_counter()
    for rep in range(repeats):
        for p in plans:
            if progress:
                progress(f"train {p.stem} ({rep + 1}/{repeats})", done, total)
            run_dir = out_dir / "runs" / f"{p.stem}-r{rep}"
            rec = reused(run_dir, steps) if reuse else train(p, run_dir, steps, data_dir)
            records[p.stem].append(with_fastest(rec, run_dir))
            done += 1
    calibrated_probe = load_topology(topology).efficiency.speed_probe_s
    results = [plan_result(p.stem, str(p), records[p.stem], calibrated_probe) for p in plans]
    if progress:
        progress("simulate (calibrated profile)", done, total)
    predict_all(results, topology, "microbenchmarks", overhead=False)
    counts, eager = None, False
    topo = load_topology(topology)
    if topo.efficiency.host_op_s.measured:
        from rackcast.presets import load_model
        from rackcast.simulator.host_overhead import counted_bytes
        from rackcast.simulator.op_counts import op_counts

        counts = op_counts(load_model("tiny-moe"), "muonh")  # for the summary; the predictions count their own
        # whether the counted eager bytes replace the fused term on every plan (host_overhead.counted_bytes decides)
        eager = all(counted_bytes((p := load_plan(r.plan_path)).model_spec(), p, topo) is not None for r in results)
        predict_all(results, topology, "microbenchmarks + op overhead")
    done += 1
    fit_on = max(1, min(fit_on, len(results) - 1))
    calib = results[:fit_on]
    base = topo
    names = FIT_FACTORS + (["op_overhead"] if counts else [])
    res = fit([Measurement(load_plan(r.plan_path), r.measured_step_s, r.measured_phases_s, label=r.name,
                           scatter=r.scatter) for r in calib], base, names)
    fitted_path = out_dir / "fitted-topology.yaml"
    write_topology(fitted_path, replace(res.topology, name="validate-fitted"),
                   [f"rackcast validate: {topology} with factors fitted to {', '.join(r.name for r in calib)}:",
                    *[f"  {k}: {v:.4g} (se {res.std_error[k]:.2g})" for k, v in res.fitted.items()]])
    if progress:
        progress("simulate (fitted profile)", done, total)
    predict_all(results, str(fitted_path), "fitted")
    held = {r.name for r in results[fit_on:]}
    summary = {"topology": topology, "reused_runs": reuse, "steps": steps, "repeats": repeats,
               "fit_on": [r.name for r in calib], "fitted_factors": res.fitted,
               "fitted_std_error": res.std_error, "wall_s": time.perf_counter() - t0,
               "op_counts": counts, "eager_bytes_counted": eager,
               "runs_with_teardown_crash": sum("teardown_exit" in r for recs in records.values() for r in recs),
               "measured_figure": f"mean of the fastest {FASTEST_SHARE:.0%} of each run's steady steps, median over "
                                  "repeats",
               "spread_limit": SPREAD_LIMIT, "noisy_plans": [r.name for r in results if r.too_noisy],
               "scorable": not any(r.too_noisy for r in results), "repeat_floor": repeat_floor(results),
               **machine_check(results, calibrated_probe),
               "summaries": [summarise(results, label) for label in results[0].predicted if label != "fitted"] + [
                   summarise(results, "fitted"), dict(summarise(results, "fitted", held),
                                                      profile="fitted (held-out plans)")]
               + matched_summaries(results)}
    _write_results(out_dir, results)

    write_text_atomic(out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    summary["results"] = results
    return summary


def _write_results(out_dir: Path, results: list[PlanResult]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols: dict[str, list] = {"plan": [], "profile": [], "prediction": [], "measured_step_s": [],
                             "measured_runs_s": [], "predicted_step_s": [], "step_error": [],
                             "measured_peak_memory_bytes": [], "predicted_peak_memory_bytes": [],
                             "measured_compute_s": [], "predicted_compute_s": [], "repeat_spread": [],
                             "step_spread": [], "too_noisy": [], "machine_slowdown": [], "machine_mismatch": []}
    for r in results:
        for label, p in r.predicted.items():
            cols["plan"].append(r.name)
            cols["profile"].append(label)
            cols["prediction"].append(p["source"])
            cols["measured_step_s"].append(r.measured_step_s)
            cols["measured_runs_s"].append(r.measured_runs_s)
            cols["predicted_step_s"].append(p["step_time_s"])
            cols["step_error"].append((p["step_time_s"] - r.measured_step_s) / r.measured_step_s)
            cols["measured_peak_memory_bytes"].append(r.measured_peak_memory_bytes)
            cols["predicted_peak_memory_bytes"].append(p["peak_memory_bytes"])
            cols["measured_compute_s"].append(r.measured_phases_s.get("compute", 0.0))
            cols["predicted_compute_s"].append(p["phases_s"].get("compute", 0.0))
            cols["repeat_spread"].append(r.repeat_spread.get("relative", math.nan))
            cols["step_spread"].append(r.step_spread)
            cols["too_noisy"].append(r.too_noisy)
            cols["machine_slowdown"].append(r.machine_slowdown)
            cols["machine_mismatch"].append(r.machine_mismatch)
    with atomic_path(out_dir / "results.parquet") as tmp:
        pq.write_table(pa.table(cols), tmp)
