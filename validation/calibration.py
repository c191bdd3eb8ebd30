"""Turn `rackcast calibrate` microbenchmark results (backend.calibrate.measure) into a topology YAML: the measured
peak, memory and link figures and the efficiency profile, on top of a base preset for what cannot be measured here.

Conventions (they are the simulator's, topologies/spec.py):
- efficiencies are rates achieved in the dtype the trainer computes in (fp32 on CPU, where the trainer runs without
  autocast; bf16 on CUDA) as fractions of that dtype's `accelerator.peak_flops` entry, the peak the simulator
  divides a plan of that precision by (simulator.costs.compute_peak). On CPU the peaks are the best measured matmuls
  (there is no datasheet figure); on CUDA the base preset's vendor peak is kept.
- GEMM and grouped-GEMM surfaces hold every measured shape of the grids (m x n x k; a grouped GEMM's m its mean
  rows per expert) at its efficiency; the FLOPs curves beside them (what older calibrated files hold, and what a
  topology without a surface is priced by) are indexed by FLOPs of one GEMM (one expert's GEMM) over the
  square-weight shapes (n = k); points within a factor 1.6 of FLOPs are merged (median). Attention is the median
  over shapes of forward + backward at 3 x causal forward FLOPs; the attention surface holds every measured call
  (causal and banded, as the trainer makes them) at 3 x the forward FLOPs its kernel executes
  (simulator.attention_cost.executed_flops), the efficiency of that kind and shape.
- hbm_bandwidth_Bps is the best out-of-cache copy/add (bytes read + written); memory_bound the median over sizes of
  the trainer's elementwise mix (RMSNorm, SiLU gate, residual add) over that bandwidth.
- collectives: nccl-tests bus bandwidth over the link bandwidth, where the link bandwidth is the best one-way
  send/recv bandwidth measured and the latency the one-way time of the smallest send/recv. The curves come from the
  largest group measured; without a fabric (one machine) scale_out repeats scale_up, as the presets do.
This module does not import torch.

    python -m rackcast.validation.calibration measurements.json out.yaml      # build a topology from saved measurements
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from rackcast.atomic import write_text_atomic
from rackcast.strict import dump_yaml, to_data
from rackcast.topologies import load_topology
from rackcast.topologies.spec import (COLLECTIVE_KINDS, AttentionPoint, CollectiveCurves, CurvePoint,
                                      EfficiencyProfile, HostOpTimes, SurfacePoint, Topology)
from rackcast.units import KIB, MIB

MERGE_RATIO = 1.6
PEAK_KEYS = {"bfloat16": "bf16", "float32": "fp32"}  # torch dtype name measured -> its accelerator.peak_flops entry
MIN_EFF = 1e-4
SURFACE_DIGITS = 6

CALIBRATED_SOURCE = "measured by rackcast calibrate"  # starts efficiency.source of a calibrated topology


def is_calibrated(topo) -> bool:
    """Whether `topo`'s efficiency figures were measured by `rackcast calibrate` (and maybe fitted to runs since)."""
    return topo.efficiency.source.startswith(CALIBRATED_SOURCE)


def _clamp(v: float) -> float:
    return min(1.0, max(MIN_EFF, v))


def _curve(points: list[tuple[float, float]]) -> list[CurvePoint]:
    """Sorted, merged (sizes within MERGE_RATIO), strictly increasing curve of (size, efficiency)."""
    points = sorted(points)
    groups: list[list[tuple[float, float]]] = []
    for size, value in points:
        if groups and size <= groups[-1][0][0] * MERGE_RATIO:
            groups[-1].append((size, value))
        else:
            groups.append([(size, value)])
    out = []
    for g in groups:
        size = statistics.geometric_mean([s for s, _ in g])
        out.append(CurvePoint(size=float(f"{size:.6g}"), value=round(_clamp(statistics.median(v for _, v in g)), 4)))
    return out


def _surface_value(efficiency: float) -> float:
    """A surface point's efficiency, clamped and kept to SURFACE_DIGITS significant digits (a measured shape is
    priced at its measured time to that precision)."""
    return float(f"{_clamp(efficiency):.{SURFACE_DIGITS}g}")


def bus_factor(kind: str, n: int) -> float:
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind == "send_recv":
        return 1.0
    return (n - 1) / n


def one_way_seconds(entry: dict) -> float:
    """backend.calibrate times send_recv as a ping-pong; one way is half."""
    return entry["seconds"] / 2 if entry["kind"] == "send_recv" else entry["seconds"]


def build_topology(meas: dict, base: Topology, name: str) -> tuple[Topology, list[str]]:
    """The calibrated topology and the comment lines that describe what was measured."""
    comp = meas["compute"]
    cuda = meas["device"] == "cuda"
    notes: list[str] = []
    rate = lambda e, key="flops": e[key] / e["seconds"]  # noqa: E731
    best = {}
    for e in comp["peak"] + [dict(g, dtype=comp["dtype"]) for g in comp["gemm"]]:
        best[e["dtype"]] = max(best.get(e["dtype"], 0.0), rate(e))
    if cuda:
        peaks = dict(base.accelerator.peak_flops)
        notes.append(f"peak_flops: the base preset's vendor figures; best measured bf16 matmul "
                     f"{best.get('bfloat16', 0) / 1e12:.1f} TFLOP/s")
    else:
        peaks = {"bf16": float(f"{best['bfloat16']:.4g}"), "fp32": float(f"{best['float32']:.4g}")}
        notes.append(f"peak_flops: best measured matmul, bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s, fp32 "
                     f"{peaks['fp32'] / 1e9:.1f} GFLOP/s (square {', '.join(str(p['n']) for p in comp['peak'][:3])}..)")
    peak_key = PEAK_KEYS[comp["dtype"]]
    peak = peaks[peak_key]
    notes.append(f"efficiencies below are achieved {comp['dtype']} rates (the trainer's compute dtype here) / "
                 f"{peak_key} peak")
    square = [e for e in comp["gemm"] if e["n"] == e["k"]]
    gemm = _curve([(e["flops"], rate(e) / peak) for e in square])
    gemm_surface = [SurfacePoint(e["m"], e["n"], e["k"], _surface_value(rate(e) / peak)) for e in comp["gemm"]]
    notes.append("gemm (M x N x K: GFLOP/s): " + ", ".join(f"{e['m']}x{e['n']}x{e['k']}: {rate(e) / 1e9:.3g}"
                                                           for e in comp["gemm"]))
    groups = comp["grouped_gemm"][0]["experts"]
    grouped = _curve([(e["flops_per_group"], rate(e, "flops_per_group") / peak) for e in comp["grouped_gemm"]
                      if e["n"] == e["k"]])
    grouped_surface = [SurfacePoint(e["rows"], e["n"], e["k"], _surface_value(rate(e, "flops_per_group") / peak),
                                    groups=e["experts"]) for e in comp["grouped_gemm"]]
    notes.append(f"grouped_gemm (one grouped_mm over {groups} experts, uneven groups of mean rows x N x K: GFLOP/s "
                 "per expert): " + ", ".join(f"{e['rows']}x{e['n']}x{e['k']}: {rate(e, 'flops_per_group') / 1e9:.3g}"
                                             for e in comp["grouped_gemm"]))
    attn_rates = [rate(e, "train_flops") for e in comp["attention"]]
    attention = _clamp(statistics.median(attn_rates) / peak)
    notes.append("attention (SDPA causal fwd+bwd, batch x heads x seq x head_dim: GFLOP/s): " + ", ".join(
        f"{e['batch']}x{e['heads']}x{e['seq']}x{e['head_dim']}: {r / 1e9:.3g}"
        for e, r in zip(comp["attention"], attn_rates)))
    # calibrations from before the attention surface have none (the `attention` figure prices every core)
    surface_calls = comp.get("attention_surface", [])
    attention_surface = [AttentionPoint(e["kind"], e["rows"], e["queries"], e["keys"], e["head_dim"],
                                        _surface_value(rate(e, "train_flops") / peak)) for e in surface_calls]
    if surface_calls:
        notes.append("attention_surface (fwd+bwd as the trainer calls it, kind rows x queries x keys x head_dim: "
                     "GFLOP/s executed): " + ", ".join(
                         f"{e['kind']} {e['rows']}x{e['queries']}x{e['keys']}x{e['head_dim']}: "
                         f"{rate(e, 'train_flops') / 1e9:.3g}" for e in surface_calls))
    stream = comp["memory_stream"]
    hbm_bw = max(stream["copy_Bps"], stream["add_Bps"])
    mix = statistics.median(e["mix_Bps"] for e in comp["memory"])
    memory_bound = _clamp(mix / hbm_bw)
    notes.append(f"memory: copy {stream['copy_Bps'] / 1e9:.3g} / add {stream['add_Bps'] / 1e9:.3g} GB/s on "
                 f"{stream['bytes'] / MIB:.0f} MiB; elementwise mix " + ", ".join(
                     f"{e['bytes'] / MIB:.3g} MiB: {e['mix_Bps'] / 1e9:.3g} GB/s" for e in comp["memory"]))
    op = comp.get("op_overhead", {})
    if op:
        notes.append(f"per-op host time (a training step of {op['model']} on {op['tokens']} tokens, kernels "
                     "negligible): " + ", ".join(f"{part} {op['host_op_s'][part] * 1e6:.2f} us ({op['ops'][part]} "
                                                 f"aten calls in {op['seconds'][part] * 1e3:.3g} ms)"
                                                 for part in ("forward", "backward", "optimizer")))
    probe = comp.get("speed_probe", {})
    if probe:
        notes.append(f"speed probe (backend.speed_probe, all ranks at once): median {probe['median_s'] * 1e3:.3g} ms "
                     f"of {len(probe['samples_s'])}, {min(probe['samples_s']) * 1e3:.3g}-"
                     f"{max(probe['samples_s']) * 1e3:.3g} ms")
    host_bw = comp["host_link_Bps"]
    notes.append(f"host link: {'pinned host-to-GPU copy' if cuda else 'memcpy'} {host_bw / 1e9:.3g} GB/s one way")
    accel = replace(base.accelerator, name=meas["machine"].get("device_name", base.accelerator.name),
                    peak_flops=peaks, hbm_bandwidth_Bps=float(f"{hbm_bw:.4g}"))
    if cuda and meas["machine"].get("device_memory_bytes"):
        accel = replace(accel, hbm_bytes=float(meas["machine"]["device_memory_bytes"]))
    elif meas["machine"].get("host_memory_bytes"):
        accel = replace(accel, hbm_bytes=float(meas["machine"]["host_memory_bytes"] // base.scale_up.domain_size))
    host = replace(base.host, link_bandwidth_Bps=float(f"{host_bw:.4g}"))
    scale_up, collectives = base.scale_up, base.efficiency.collectives
    coll = meas["collectives"]
    if coll:
        n = max(e["group"] for e in coll)
        rows = [e for e in coll if e["group"] == n]
        sr = [e for e in rows if e["kind"] == "send_recv"]
        link_bw = max(e["bytes"] / one_way_seconds(e) for e in sr)
        latency = one_way_seconds(min(sr, key=lambda e: e["bytes"]))
        scale_up = replace(scale_up, bandwidth_Bps=float(f"{link_bw:.4g}"), latency_s=float(f"{latency:.3g}"),
                           usable_gpus=min(max(n, base.scale_up.usable_gpus), base.scale_up.domain_size)
                           if n <= base.scale_up.domain_size else n, domain_size=max(n, base.scale_up.domain_size))
        collectives = {}
        for kind in COLLECTIVE_KINDS:
            pts = [(e["bytes"], bus_factor(kind, n) * e["bytes"] / one_way_seconds(e) / link_bw)
                   for e in rows if e["kind"] == kind]
            up = _curve(pts)
            out = up if base.scale_out.nics_per_gpu == 0 else base.efficiency.collectives[kind].scale_out
            collectives[kind] = CollectiveCurves(scale_up=up, scale_out=out)
        notes.append(f"collectives: {'NCCL' if cuda else 'gloo'}, group of {n}, link = best one-way send/recv "
                     f"{link_bw / 1e9:.3g} GB/s, latency = one-way {latency * 1e6:.0f} us at "
                     f"{min(e['bytes'] for e in sr)} B; busbw GB/s by size:")
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_uneven", "send_recv"):
            for g in sorted({e["group"] for e in coll}):
                pts = [e for e in coll if e["kind"] == kind and e["group"] == g]
                factor = bus_factor(kind.replace("_uneven", ""), g)
                notes.append(f"  {kind} n={g}: " + ", ".join(
                    f"{e['bytes'] / KIB:.0f}K {factor * e['bytes'] / one_way_seconds(e) / 1e9:.3g}" for e in pts))
    else:
        notes.append("collectives: not measured (one process); the base preset's curves and link figures are kept")
    m = meas["machine"]
    source = (f"{CALIBRATED_SOURCE}{' --quick' if meas.get('quick') else ''} at {meas['started_utc']} "
              f"(torch {m['torch']}, {m.get('device_name', '')}, {meas['world']} processes, "
              f"{m.get('cpu_count')} CPUs); base preset {base.name} for what was not measured")
    eff = EfficiencyProfile(gemm=gemm, grouped_gemm=grouped, gemm_surface=gemm_surface,
                            grouped_gemm_surface=grouped_surface, attention=round(attention, 4),
                            attention_surface=attention_surface,
                            memory_bound=round(memory_bound, 4), host_link=1.0, collectives=collectives,
                            comm_compute_slowdown=base.efficiency.comm_compute_slowdown, source=source,
                            host_op_s=HostOpTimes(*(float(f"{op['host_op_s'][part]:.3g}")
                                                    for part in ("forward", "backward", "optimizer")))
                            if op else HostOpTimes(),
                            speed_probe_s=float(f"{probe['median_s']:.4g}") if probe else 0.0)
    topo = replace(base, name=name, accelerator=accel, host=host, scale_up=scale_up, efficiency=eff,
                   description=f"{base.description} -- calibrated {meas['started_utc']}")
    return topo, notes


def topology_yaml(topo: Topology, header: list[str]) -> str:
    lines = [f"# {h}" if h else "#" for h in header]
    return "\n".join(lines) + "\n" + dump_yaml(to_data(topo))


def write_topology(path: str | Path, topo: Topology, header: list[str]) -> None:
    """Write atomically, then load it back through the strict loader (what the simulator will read)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, topology_yaml(topo, header))
    load_topology(str(path))


def header_for(meas: dict, notes: list[str], command: str) -> list[str]:
    m = meas["machine"]
    return [f"{command}: this machine ({m.get('processor', '')}, {m.get('cpu_count')} CPUs, "
            f"{m.get('device_name', '')}), measured at {meas['started_utc']} in {meas['wall_s']:.0f} s",
            f"torch {m['torch']}, python {m['python']}, {m['platform']}",
            f"{meas['world']} processes measured together (one per GPU on CUDA; on CPU with "
            f"{meas.get('threads', 1)} torch thread(s) each); each figure is the fastest of several timed samples",
            *notes]


if __name__ == "__main__":
    data = json.loads(Path(sys.argv[1]).read_text())
    base = load_topology("h200-hgx" if data["device"] == "cuda" else "local-cpu")
    t, n = build_topology(data, base, Path(sys.argv[2]).stem)
    write_topology(sys.argv[2], t, header_for(data, n, "python -m rackcast.validation.calibration"))
    print(Path(sys.argv[2]).read_text())
