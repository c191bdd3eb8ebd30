"""Predicted against measured for one plan and one run folder (`rackcast compare PLAN RUN_DIR`), and the side-by-side
Chrome trace. The prediction is the discrete-event simulator's (simulator.step.simulate), or the closed-form
estimate's when asked for (prefer="estimate"); the result says which.

Metric conventions (both sides use them, so the comparison is a join on names):
- step_time_s, tokens_per_s and the phases: the run's figure, the mean of its fastest fifth of steps after the
  first (backend.record.measured_figure; rackcast.spread says why: the prediction is of an undisturbed machine),
  or the medians in a record from before it kept that figure;
- mfu: model FLOPs / (step time x ranks x bf16 peak of the topology predicted with); the measured MFU is recomputed
  on that same peak from the run's model FLOPs and step time (the run's own figure divides by the peak of the
  topology it ran with, and on CPU by the fp32 peak it computes in), else the run's `mfu_vs_bf16_peak`;
- phases: rackcast.vocab.PHASES, with pipeline_p2p and pipeline_bubble summed (the trainer counts p2p inside the
  bubble); the trainer's `other` (time in no phase) has no prediction;
- peak_memory_bytes: the run's peak tensor bytes (CPU: live tensor bytes of a profiled step, backend.memprof; CUDA:
  max_memory_allocated), largest over ranks, against the memory model for what that trainer keeps: weights and
  activations in the dtype the run records (param_dtype), the activations eager PyTorch saves for backward
  (simulator.memory, activations="eager"), on the busiest pipeline rank (`predicted_run_memory`). A record without
  param_dtype (older runs) is compared with the simulator's peak;
- drop_fraction: assignments dropped by capacity transport (0 when dropless).
Error = (predicted - measured) / measured.

    rackcast compare examples/plans/tiny-2proc-ep.yaml runs/tiny-2proc-ep
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from rackcast.backend.record import measured_figure, with_fastest
from rackcast.errors import RackcastError
from rackcast.plan import Plan
from rackcast.spread import CORE_SHARE_FLOOR

PHASE_ROWS = (("compute", ("compute",)), ("exposed_expert_a2a", ("exposed_expert_a2a",)),
              ("exposed_tensor_comm", ("exposed_tensor_comm",)), ("exposed_fsdp_gather", ("exposed_fsdp_gather",)),
              ("pipeline (bubble + p2p)", ("pipeline_bubble", "pipeline_p2p")),
              ("exposed_dp_comm", ("exposed_dp_comm",)), ("optimizer", ("optimizer",)),
              ("host_transfer", ("host_transfer",)))
MEASURED_PID = 1000  # measured processes in the combined trace start here, after the simulated ones


def load_record(run_dir: str | Path) -> dict:
    path = Path(run_dir) / "record.json"
    if not path.exists():
        raise RackcastError("no record.json here (is this a run folder written by `rackcast train`?)",
                            where=str(run_dir))
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise RackcastError(f"malformed JSON: {exc}", where=str(path)) from None
    return with_fastest(record, Path(run_dir))


def check_same_plan(plan: Plan, rec: dict, run_dir: str | Path) -> None:
    """Refuse a run of another plan: its record's plan_hash (rackcast.plan.inputs_hash of the plan it trained) must
    be this plan's. The hash covers the plan as written out by the code of its day, so a run recorded before a new
    plan field was added has another hash: it passes when the plan file it trained (the run folder's plan.yaml, or
    the record's plan_path) still reads as this plan. Runs recorded before plan hashes were kept pass."""
    from rackcast.plan import inputs_hash, load_plan

    recorded, current = rec.get("plan_hash"), inputs_hash(plan)
    if not recorded or recorded == current:
        return
    for trained in (Path(run_dir) / "plan.yaml", Path(str(rec.get("plan_path") or ""))):
        if trained.is_file():
            try:
                if inputs_hash(load_plan(str(trained), check=False)) == current:
                    return
            except RackcastError:
                continue
    raise RackcastError(f"record.json: this run trained another plan ({rec.get('plan', '?')}, plan_hash "
                        f"{recorded[:12]}, not {current[:12]})", where=str(run_dir))


def calibration_note(topo) -> str:
    """'' for a topology measured by `rackcast calibrate`, else the hint to calibrate (an uncalibrated preset's
    figures can be far from this machine's: a local run's step time is then badly predicted)."""
    from rackcast.validation.calibration import is_calibrated

    if is_calibrated(topo):
        return ""
    return (f"topology {topo.name} is not calibrated (its efficiency figures are the preset's, not measured here): "
            "run `rackcast calibrate`, then compare with --topology runs/calibrated.yaml")


def core_wait_note(rec: dict) -> str:
    """A line when a CPU run's processes waited for cores (record.json's core_share below CORE_SHARE_FLOOR), else ''."""
    share = rec.get("core_share")
    if rec.get("device", "cpu") != "cpu" or share is None or share >= CORE_SHARE_FLOOR:
        return ""
    return (f"the measured steps ran {share:.2f} of a core per process (CPU time {rec['step_cpu_s']:.3g} s against "
            f"{rec['step_time_s']:.3g} s wall, record.json): the processes waited for cores, so the wall times "
            "include the machine's other load")


def predict(plan: Plan, topo=None, record: bool = False, prefer: str = "simulate"):
    """(source, result): the simulator's SimResult (prefer="simulate") or the estimate's Estimate ("estimate").
    Both include the host per-op overhead where the topology has measured host_op_s."""
    topo = topo or plan.topology_spec()
    if prefer == "simulate":
        from rackcast.simulator.step import simulate

        return "simulate", simulate(plan, topo=topo, record=record)
    from rackcast.simulator.estimate import estimate

    return "estimate", estimate(plan, topo=topo)


def _peak_memory(result) -> float:
    if hasattr(result, "peak_memory_bytes"):
        return float(result.peak_memory_bytes)
    return float(result.memory.total)


def predicted_run_memory(plan: Plan | None, rec: dict, result) -> float:
    """The prediction a run's peak memory is compared with (see the module docstring)."""
    dtype = rec.get("param_dtype")
    if plan is None or not dtype:
        return _peak_memory(result)
    from rackcast.simulator.memory import memory_breakdown

    spec = plan.model_spec()
    return max(memory_breakdown(spec, plan, dtype=dtype, activations="eager", rank=r).total
               for r in range(plan.parallel.pipeline))


def _err(pred: float, meas: float) -> float:
    if meas is None or pred is None or (isinstance(meas, float) and math.isnan(meas)):
        return math.nan
    if meas == 0:
        return 0.0 if pred == 0 else math.nan
    return (pred - meas) / meas


def compare_rows(result, rec: dict, plan: Plan | None = None) -> list[dict]:
    """One row per metric: name, unit, predicted, measured, error (memory as predicted_run_memory(plan, ...))."""
    rows = []

    def add(name, unit, pred, meas):
        rows.append({"metric": name, "unit": unit, "predicted": pred, "measured": meas, "error": _err(pred, meas)})

    figure = measured_figure(rec)
    step, phases = figure["step_time_s"], figure["phases_s"]
    add("step_time_s", "s", result.step_time_s, step)
    tokens = rec.get("tokens_per_step")
    add("tokens_per_s", "tokens/s", result.tokens_per_s, tokens / step if tokens and step else rec.get("tokens_per_s"))
    meas_mfu = rec.get("mfu_vs_bf16_peak", rec.get("mfu"))
    if meas_mfu is not None and step:
        meas_mfu *= rec["step_time_s"] / step  # the record's MFU is at its median step
    if rec.get("model_flops_per_step") and math.isclose(rec["model_flops_per_step"], result.model_flops_per_step,
                                                        rel_tol=1e-6) and step:
        meas_mfu = result.mfu * result.step_time_s / step  # on the prediction's peak and GPU count
    add("mfu", "fraction of bf16 peak", result.mfu, meas_mfu)
    for name, keys in PHASE_ROWS:
        pred = sum(result.phases_s.get(k, 0.0) for k in keys)
        meas = sum(phases.get(k, 0.0) or 0.0 for k in keys)
        add(f"phase {name}", "s", pred, meas)
    if "other" in phases:
        rows.append({"metric": "phase other (not modelled)", "unit": "s", "predicted": None,
                     "measured": phases["other"], "error": math.nan})
    add("peak_memory_bytes", "bytes", predicted_run_memory(plan, rec, result), rec.get("peak_memory_bytes"))
    add("drop_fraction", "fraction", float(result.drop_fraction), rec.get("drop_fraction"))
    return rows


def measured_events(run_dir: Path, rec: dict) -> tuple[list[dict], str]:
    """The run's own Chrome trace (torch.profiler, `rackcast train --profile`) moved to the measured pids, or, when
    the run has none, one step drawn from the record's measured phase times (said so in the process name)."""
    trace = run_dir / "trace.json"
    if trace.exists():
        data = json.loads(trace.read_text())
        events = data["traceEvents"] if isinstance(data, dict) else data
        pids = sorted({str(e.get("pid")) for e in events if "pid" in e})
        remap = {p: MEASURED_PID + i for i, p in enumerate(pids)}
        t0 = min((e["ts"] for e in events if isinstance(e.get("ts"), (int, float))), default=0.0)
        out = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                "args": {"name": f"measured: torch.profiler process {orig}"}} for orig, pid in remap.items()]
        for e in events:
            if "pid" not in e or (e.get("ph") == "M" and e.get("name") == "process_name"):
                continue
            e = dict(e, pid=remap[str(e["pid"])])
            if isinstance(e.get("ts"), (int, float)):
                e["ts"] = round(e["ts"] - t0, 3)
            out.append(e)
        return out, "torch.profiler trace of the run"
    phases = measured_figure(rec)["phases_s"]
    out = [{"ph": "M", "name": "process_name", "pid": MEASURED_PID, "tid": 0,
            "args": {"name": "measured: one step from the run's measured phase times (no trace.json in the run)"}},
           {"ph": "M", "name": "thread_name", "pid": MEASURED_PID, "tid": 0, "args": {"name": "phases"}}]
    t = 0.0
    for name, value in phases.items():
        if value and value == value:
            out.append({"ph": "X", "name": name, "cat": "measured", "pid": MEASURED_PID, "tid": 0,
                        "ts": round(t * 1e6, 3), "dur": round(value * 1e6, 3)})
            t += value
    return out, "measured phase times (record.json, backend.record.measured_figure)"


def combined_trace(result, source: str, run_dir: Path, rec: dict) -> dict:
    """Simulated (or estimated) and measured timelines in one trace-event file, as separate processes."""
    if source == "simulate":
        from rackcast.simulator.trace import trace_events

        sim = trace_events(result)
        for e in sim:
            if e.get("ph") == "M" and e.get("name") == "process_name":
                e["args"] = {"name": f"simulated: {e['args']['name']}"}
    else:
        sim = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "estimated phases"}}]
        t = 0.0
        for name, value in result.phases_s.items():
            if value:
                sim.append({"ph": "X", "name": name, "cat": "estimate", "pid": 0, "tid": 0, "ts": round(t * 1e6, 3),
                            "dur": round(value * 1e6, 3)})
                t += value
    meas, how = measured_events(run_dir, rec)
    return {"traceEvents": sim + meas, "displayTimeUnit": "ms",
            "otherData": {"plan": rec.get("plan"), "prediction": source, "measured": how}}
