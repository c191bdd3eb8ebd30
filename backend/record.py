"""RunRecord: what a training run measured, in the simulator's metric names so `compare` is a join.

Files in the run folder:
- metrics.parquet: one row per optimizer step: step, loss, ce, z_loss, eval_loss (NaN except at eval steps), lr,
  step_time_s, tokens_per_s, mfu, step_cpu_s (the step's process CPU time, time.process_time, all threads) and
  core_share (step_cpu_s / step_time_s: below 1 the process waited for a core on a shared machine, above 1 it ran
  more than one thread), probe_s (backend.speed_probe: the reference kernel's seconds, timed by every rank just
  before the step, outside its timing; mean over ranks; NaN off the CPU) and probe_slowest_s (the slowest rank's),
  phase_<name>_s for every simulator phase (rackcast.vocab.MEASURED_PHASES: the simulator's phases plus "other"),
  peak_memory_bytes (largest over ranks so far; NaN on CPU until the measured step), peak_rss_bytes, memory_profiled
  (the step whose memory the profiler measured, slowed down by it), drop_fraction, plan_hash
  (rackcast.plan.inputs_hash). step_time_s and the phases are means over ranks; slowest_rank is the rank whose step
  took longest, step_time_slowest_s its step time and phase_<name>_slowest_s its phases (the critical path).
- record.json: the summary: plan, plan_hash, layout, device, steps, tokens_per_step, and the medians over steps after
  the first (warm-up), the memory-profiled step left out, of step_time_s, tokens_per_s, mfu, step_cpu_s,
  core_share, probe_s, phases_s, and
  critical_path: the same medians of the slowest rank's step time and phases, and the rank slowest most often;
  step_time_spread: those steps' median, quartiles and relative spread (rackcast.spread: flagged too_wide when the
  interquartile range exceeds the scoring limit);
  fastest: the run's figure on a shared machine (rackcast.spread.fastest): the mean step time and phases of the
  fastest FASTEST_SHARE of those steps, how many they are, halves_spread (the figure on even against odd steps) and
  probe_s (the mean speed probe at those steps: how fast the machine was while it measured the figure);
  validate and `calibrate --from-run` score and fit this figure (`measured_figure`);
  peak_memory_bytes with memory_measure (how it was measured) and param_dtype / activation_dtype (what the trainer
  kept weights and activations in), peak_rss_bytes, drop_fraction, first/last loss, flops_convention, peak_flops
  with its dtype, and mfu_vs_bf16_peak (the simulator's convention).
- routing.parquet: tokens routed per (layer, expert) over the run, columns layer, expert, count (the format
  simulator.routing replays with `expert_transport: {routing: histogram, histogram: <path>}`).
Phase meanings: compute = forward + backward work (timed around the real calls) less the communication timed inside
it; exposed_expert_a2a = the expert all_to_all calls (dispatch and combine, forward and backward, and the per-expert
counts' exchange before each forward dispatch);
exposed_dp_comm = the gradient reductions (all-reduces; under ZeRO-2 the reduces to each parameter's owner,
backend.zero); pipeline_bubble = pipeline wait (schedule time not spent in stage work,
point-to-point transfers included, so pipeline_p2p stays 0); optimizer = optimizer step + quantile balancing.
MFU = model FLOPs (ModelSpec.flops_per_token_train, default convention) / (step time x ranks x peak), the peak being
the topology's for the dtype the model computes in (fp32 on CPU: local-cpu's calibrated fp32 matmul peak).
Peak memory, per rank (record.json keeps the largest, and the list as peak_memory_per_rank_bytes): on CUDA
torch.cuda.max_memory_allocated (bytes of live tensors, torch's own count); on CPU the peak bytes of live tensors
during one step, measured with the profiler (backend.memprof), comparable with the simulator's tensor bytes
(simulator.memory, with dtype="fp32"); peak_rss_bytes is the process's peak resident set, which also holds the
Python and torch runtime (about 220 MiB) and allocator slack.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from rackcast.atomic import atomic_path
from rackcast.spread import FASTEST_SHARE, fastest, halves_spread, quartile_spread_of
from rackcast.units import KIB
from rackcast.vocab import MEASURED_PHASES


def write_parquet_atomic(path: Path, columns: dict[str, list]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with atomic_path(path) as tmp:
        pq.write_table(pa.table(columns), tmp)


def write_metrics(run_dir: Path, rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(rows[0])
    write_parquet_atomic(run_dir / "metrics.parquet", {k: [r.get(k) for r in rows] for k in keys})


def write_routing(run_dir: Path, counts: dict[int, list[int]]) -> None:
    layer, expert, count = [], [], []
    for li in sorted(counts):
        for e, c in enumerate(counts[li]):
            layer.append(li)
            expert.append(e)
            count.append(int(c))
    if layer:
        write_parquet_atomic(run_dir / "routing.parquet", {"layer": layer, "expert": expert, "count": count})


def _median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None and not math.isnan(r[key])]
    return statistics.median(values) if values else math.nan


def _max(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None and not math.isnan(r[key])]
    return max(values) if values else math.nan


def steady_rows(rows: list[dict]) -> list[dict]:
    """The rows the medians use: after the first (warm-up), without the memory-profiled step (when others remain)."""
    steady = rows[1:] if len(rows) > 1 else rows
    unprofiled = [r for r in steady if not r.get("memory_profiled")]
    return unprofiled or steady


def _critical_path(steady: list[dict]) -> dict:
    """Medians of the slowest rank's step time and phases, and the rank that was slowest most often."""
    ranks = [r["slowest_rank"] for r in steady if r.get("slowest_rank") is not None]
    return {"step_time_s": _median(steady, "step_time_slowest_s"),
            "phases_s": {p: _median(steady, f"phase_{p}_slowest_s") for p in MEASURED_PHASES},
            "slowest_rank": statistics.mode(ranks) if ranks else None}


def fastest_steps(steady: list[dict]) -> dict:
    """The mean step time and phases of the fastest FASTEST_SHARE of the steady steps (rackcast.spread.fastest),
    with their count and the figure's halves_spread."""
    times = [r["step_time_s"] for r in steady]
    idx = fastest(times)
    if not idx:
        return {"share": FASTEST_SHARE, "steps": 0, "step_time_s": math.nan, "phases_s": {}, "halves_spread": math.nan}
    chosen = [steady[i] for i in idx]
    out = {"share": FASTEST_SHARE, "steps": len(idx),
           "step_time_s": statistics.fmean(r["step_time_s"] for r in chosen),
           "phases_s": {p: statistics.fmean(r.get(f"phase_{p}_s") or 0.0 for r in chosen) for p in MEASURED_PHASES},
           "halves_spread": halves_spread(times)}
    probes = [r.get("probe_s") for r in chosen]
    if all(p is not None and not math.isnan(p) for p in probes):  # runs recorded before the probe have none
        out["probe_s"] = statistics.fmean(probes)
    return out


def with_fastest(record: dict, run_dir: Path) -> dict:
    """The record with its `fastest` figure: as recorded, or, for a run recorded before the record kept it, computed
    from the run's metrics.parquet (one row per step) where the run folder has one, with the speed probe (its median
    probe_s, and the figure's) where those rows have it."""
    metrics = Path(run_dir) / "metrics.parquet"
    if record.get("fastest") or not metrics.exists():
        return record
    import pyarrow.parquet as pq

    steady = steady_rows(pq.read_table(metrics).to_pylist())
    out = dict(record, fastest=fastest_steps(steady))
    if "probe_s" not in record and not math.isnan(probe := _median(steady, "probe_s")):
        out["probe_s"] = probe
    return out


def measured_figure(record: dict) -> dict:
    """What a run is scored and fitted on: its `fastest` figure (step_time_s, phases_s, halves_spread, steps;
    `with_fastest` fills it in for older runs), or, without one, its medians (steps 0, halves_spread NaN); a record
    without a step time (no steady step) gives step_time_s None and the record's phases."""
    fast = record.get("fastest") or {}
    if fast.get("steps"):
        return fast
    step = record.get("step_time_s")
    return {"share": FASTEST_SHARE, "steps": 0, "step_time_s": float(step) if step else None,
            "phases_s": dict(record.get("phases_s", {})), "halves_spread": math.nan}


def summary(rows: list[dict], **info) -> dict:
    """record.json's content from the metric rows (medians skip the first step, which includes warm-up, and the
    memory-profiled step)."""
    steady = steady_rows(rows)
    phases = {p: _median(steady, f"phase_{p}_s") for p in MEASURED_PHASES}
    evals = [r for r in rows if not math.isnan(r["eval_loss"])]
    out = {
        **info,
        "steps": len(rows),
        "step_time_s": _median(steady, "step_time_s"),
        "step_time_spread": quartile_spread_of(r["step_time_s"] for r in steady).as_dict(),
        "fastest": fastest_steps(steady),
        "tokens_per_s": _median(steady, "tokens_per_s"),
        "mfu": _median(steady, "mfu"),
        "step_cpu_s": _median(steady, "step_cpu_s"),
        "core_share": _median(steady, "core_share"),
        "probe_s": _median(steady, "probe_s"),
        "phases_s": phases,
        "critical_path": _critical_path(steady),
        "peak_memory_bytes": _max(rows, "peak_memory_bytes"),
        "peak_rss_bytes": _max(rows, "peak_rss_bytes"),
        "drop_fraction": statistics.fmean(r["drop_fraction"] for r in rows),
        "first_loss": rows[0]["loss"],
        "last_loss": rows[-1]["loss"],
        "eval_loss": evals[-1]["eval_loss"] if evals else math.nan,
    }
    peak_bf16 = info.get("peak_flops_bf16")
    if peak_bf16:
        out["mfu_vs_bf16_peak"] = out["mfu"] * info["peak_flops"] / peak_bf16
    return out


# Communication timed inside the forward/backward span (backend.parallel.PhaseTimer), not compute.
COMM_INSIDE_COMPUTE = ("exposed_expert_a2a", "exposed_dp_comm", "exposed_tensor_comm")


def step_phases(timed: dict[str, float], step_time: float) -> dict[str, float]:
    """One rank's phases of a step from its timer's spans (see the phase meanings above): compute is the fwd_bwd span
    less the communication timed inside it, other the step time no phase covers."""
    phases = {k: v for k, v in timed.items() if k != "fwd_bwd"}
    phases["compute"] = max(0.0, timed.get("fwd_bwd", 0.0) - sum(timed.get(n, 0.0) for n in COMM_INSIDE_COMPUTE))
    phases["other"] = max(0.0, step_time - sum(phases.values()))
    return phases


def progress_line(row: dict, steps: int) -> str:
    """The line `rackcast train` prints for a step row."""
    ev = f"  eval {row['eval_loss']:.4f}" if not math.isnan(row["eval_loss"]) else ""
    return (f"step {row['step']:>5}/{steps}  loss {row['loss']:.4f}{ev}  tok/s {row['tokens_per_s']:,.0f}  "
            f"mfu {100 * row['mfu']:.2f}%  step {row['step_time_s']:.3f}s")


# step_row's per-rank figures in column order (loss, ce and z_loss sums, micro-batches, dropped and assigned rows,
# step wall and process CPU seconds), then each phase's seconds from PHASE_COLUMN on.
STEP_COLUMNS = ("loss", "ce", "z_loss", "micro_batches", "dropped", "assigned", "step_s", "step_cpu_s", "probe_s")
COLUMN = {name: i for i, name in enumerate(STEP_COLUMNS)}
PHASE_COLUMN = len(STEP_COLUMNS)


def step_row(per_rank, mem, names: list[str], *, tokens_per_step: float, model_flops: float, peak_flops: float,
             pipeline: bool) -> dict:
    """One metrics.parquet row from backend.train's figures, reduced over the ranks: `per_rank` [world, PHASE_COLUMN +
    phases] (STEP_COLUMNS, then each of `names`' phase seconds; a rank's row is zero on the others before the sum),
    `mem` [peak live bytes, peak RSS] (maxima over ranks). Means over ranks, the slowest rank's step and phases (the critical
    path), loss means per micro-batch (ce and z_loss NaN under pipeline parallelism, whose schedule returns the loss
    only)."""
    world = per_rank.shape[0]
    vec = per_rank.sum(0)
    total = {name: vec[i].item() for name, i in COLUMN.items()}
    slowest = int(per_rank[:, COLUMN["step_s"]].argmax())
    n = max(total["micro_batches"], 1.0)
    step_time, step_cpu = total["step_s"] / world, total["step_cpu_s"] / world
    out = {"loss": total["loss"] / n, "ce": total["ce"] / n if not pipeline else math.nan,
           "z_loss": total["z_loss"] / n if not pipeline else math.nan,
           "step_time_s": step_time, "tokens_per_s": tokens_per_step / step_time,
           "mfu": model_flops / (step_time * world * peak_flops),
           "step_cpu_s": step_cpu, "core_share": step_cpu / step_time, "probe_s": total["probe_s"] / world,
           "probe_slowest_s": per_rank[:, COLUMN["probe_s"]].max().item()}
    for i, name in enumerate(names):
        out[f"phase_{name}_s"] = vec[PHASE_COLUMN + i].item() / world
    out["slowest_rank"] = slowest
    out["step_time_slowest_s"] = per_rank[slowest, COLUMN["step_s"]].item()
    for i, name in enumerate(names):
        out[f"phase_{name}_slowest_s"] = per_rank[slowest, PHASE_COLUMN + i].item()
    out["peak_memory_bytes"] = int(mem[0].item()) if mem[0].item() >= 0 else math.nan
    out["peak_rss_bytes"] = int(mem[1].item())
    out["drop_fraction"] = total["dropped"] / total["assigned"] if total["assigned"] else 0.0
    return out


def peak_memory_bytes(device) -> int:
    """CUDA: max allocated by torch; CPU: the process's peak resident set (backend.memprof measures live tensors)."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """The process's peak resident set (includes the Python and torch runtime)."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * KIB  # ru_maxrss is in KiB on Linux
