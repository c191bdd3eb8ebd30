"""A CPU training step split into the simulator's terms, measured beside predicted (issue 15).

    .venv/bin/python benchmarks/step_terms.py runs/validate-r5/plans/1p-mb2.yaml --topology runs/calibrated-r5.yaml
    .venv/bin/python benchmarks/step_terms.py runs/validate-r5/plans/dp2-mb2.yaml --topology runs/calibrated-r5.yaml

Predicted (rank 0, the calibrated topology): the step (simulator.step), its host-op term (host_op_features x
host_op_s), its eager-bytes term (counted bytes at costs.eager_bytes_time), communication phases, and the rest
(GEMM, attention, optimizer kernels). Measured: the real trainer (backend.train.Trainer, one torch thread per
process, under torchrun where the plan has several ranks) runs warm-up and timed steps, then rank 0 profiles one step
(torch.profiler, record_shapes) and splits its wall time into: (a) GEMM and attention ops' self time, (b)+(c) the
other aten ops' self time, (d) collectives' self time, and the framework time outside aten ops (Python module code,
autograd engine, optimizer loop: host time). (b) and (c) are split by a least-squares fit over the other aten ops of
self time per call = host_per_op + bytes / bandwidth (bytes: inputs + one output of the largest input's size, fp32;
views 0), so host_per_op is the per-op host time at the plan's real shapes, to set beside the calibration's figure,
which is also measured here again (backend.opcount.host_seconds_per_op, 8 tokens) for the load of this run.
The profiler adds its own per-op cost, so the profiled step is longer than the unprofiled one; both are printed.
Every dense aten::mm shape of the step is also timed alone (unprofiled, four operand layouts) beside
costs.gemm_time, and the simulator's own charge for the step's dense GEMMs, routed experts and Newton-Schulz
products is printed (benchmarks/gemm_in_step.simulator_prices). On CPU aten::_grouped_mm runs one aten::mm per
expert: those calls are reported apart, as "aten::mm (experts)".

Findings (2026-12-02, 2-core CPU, nothing else running, load average 0.3-0.8, steal ~0; 5-7 runs per plan,
calibrated-r5 topology), figures as ranges over the runs:
- 1p-mb2: predicted 112.9 ms = kernels 24.1 (attention core 3.8, optimizer 2.9) + eager bytes 32.5 + host ops 56.3
  (11942 ops, mix 4.71 us/op). Measured unprofiled median 104-144 ms (the machine drifts that much between runs a
  minute apart). (a) GEMM+attention self 37-42 ms: aten::mm 22-24 ms (simulator 14.3), attention core fwd+bwd
  9.5-11 ms (simulator 3.8: the topology's one attention efficiency comes from the 2x8x512x64 shape, 31 GFLOP/s;
  tiny-moe's 2x4x128x16 runs at about 10; F.scaled_dot_product_attention at 2x4x128x16, causal, fwd+bwd, timed
  alone unprofiled: 683 us a call, 10.9 ms for the step's 16), grouped_mm 2.0-2.5, optimizer bmm/baddbmm 3.4-4.5.
  (b) 34-43 ms (fit;
  the simulator's 32.5 agrees within the crude byte estimate). (c) residual host 2.4-4.3 us/op over 12516 ops
  actually run (the counted model step has 11942: +4.8%). So the per-op host time at real shapes is NOT larger
  than the 8-token figure; the underpriced term is (a), attention first, then the GEMMs in the step.
- dp2-mb2: predicted 66.4 ms = kernels 14.8 (attention 1.9) + eager 16.9 + host 32.1 + comm 2.6. Measured median
  75-114 ms. (a) 21-31 ms (mm 11.6-15.2 vs 7.1; attention 5.9-8.3 vs 1.9); (b) 17-23; ops run 7003 vs 6470
  (+8.2%); (d) collectives' own self time 0.2-1.0 ms, but DDP's gradient hooks (AccumulateGrad, which launch the
  bucket all-reduces) take 4-21 ms self a step, absent in 1p; residual host 3.9-9.8 us/op.
- Correction (benchmarks/gemm_in_step.py, whose docstring has the figures and commands): the "aten::mm 22-24 ms"
  above held the routed experts' 768 per-expert mm calls (4.6-4.9 ms of it); the 636 dense calls take 17.3-18.8
  ms in the step (12.45 charged by the simulator, 10.8 alone), and the surface prices them alone within 5% in every
  operand layout: the dense gap is the in-step slowdown of the same calls (cold operands), not missing shapes,
  layouts or the grid's edges.
- The calibration's host_seconds_per_op re-run in the same processes: 8 tokens forward 5.65-8.13 us (12.4 once,
  beside a second rank), so one calibration sample moves by about +-30%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm"}
ATTENTION_MARKS = ("scaled_dot_product", "flash_attention")
COMM_MARKS = ("c10d", "gloo", "allreduce", "all_reduce", "record_param_comms", "all_to_all", "broadcast")
VIEW_OPS = {"aten::view", "aten::t", "aten::transpose", "aten::as_strided", "aten::expand", "aten::reshape",
            "aten::permute", "aten::unsqueeze", "aten::squeeze", "aten::slice", "aten::select", "aten::detach",
            "aten::alias", "aten::_unsafe_view", "aten::unflatten", "aten::flatten", "aten::split", "aten::chunk",
            "aten::narrow", "aten::expand_as", "aten::view_as", "aten::unbind", "aten::_reshape_alias",
            "aten::split_with_sizes", "aten::empty", "aten::empty_strided", "aten::lift_fresh", "aten::resolve_conj",
            "aten::resolve_neg", "aten::result_type", "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense"}
FP32 = 4
ISOLATED_CALLS = 50
BACKWARD_OVER_FORWARD = 2  # the simulator's attention backward (simulator.workload)
TOP = 6  # framework (non-aten) events printed, by self time
WARMUP_STEPS, TIMED_STEPS = 3, 6
CALIB_SEQS = (8, 128)  # tokens of backend.opcount.host_seconds_per_op's step: the calibration's, and one sequence


def predicted(plan_path: str, topology: str) -> dict:
    from rackcast.plan import load_plan
    from rackcast.simulator import op_counts
    from rackcast.simulator.costs import eager_bytes_time
    from rackcast.simulator.workload import Workload
    from rackcast.simulator.host_overhead import counted_bytes, eager_bytes, host_bytes, host_ops
    from rackcast.simulator.step import simulate
    from rackcast.topologies import load_topology

    plan = load_plan(plan_path)
    topo = load_topology(topology, plan.topology.domains, plan.topology.usable_gpus or None)
    spec = plan.model_spec()
    t = topo.efficiency.host_op_s
    o = host_ops(op_counts.op_counts(spec, plan.optimizer.name), spec, plan)
    b = host_bytes(eager_bytes(counted_bytes(spec, plan, topo), spec, plan), spec, plan)
    res = simulate(plan, topo=topo)
    bare = simulate(plan, topo=topo.with_efficiency(topo.efficiency.without_host_ops()))
    ops_s = (o.forward + o.bubble_forward) * t.forward + (o.backward + o.bubble_backward) * t.backward \
        + o.optimizer * t.optimizer
    bytes_total = b.forward + b.backward + b.bubble_forward + b.bubble_backward + b.optimizer
    # the first stage's attention cores as the simulator prices them (each at its call's kind and shape), forward +
    # backward (simulator.workload: backward = 2 x forward), all micro-batches
    cores = sum(layer.core_s for chunk in Workload(spec, plan, topo).stages[0].chunks.values() for layer in chunk)
    attention = (1 + BACKWARD_OVER_FORWARD) * plan.microbatches * cores
    opt_kernels = res.phases_s["optimizer"] - o.optimizer * t.optimizer - float(eager_bytes_time(b.optimizer, topo))
    comm = sum(v for k, v in res.phases_s.items() if k.startswith("exposed") or k == "pipeline_p2p")
    return {"step_s": float(res.step_time_s), "bare_step_s": float(bare.step_time_s), "host_ops_s": ops_s,
            "ops": o.forward + o.backward + o.optimizer, "eager_bytes": bytes_total,
            "eager_s": float(eager_bytes_time(bytes_total, topo)), "comm_s": float(comm),
            "opt_kernels_s": opt_kernels, "attention_s": attention,
            "times_us": [t.forward * 1e6, t.backward * 1e6, t.optimizer * 1e6]}


def _bytes(shapes) -> int:
    sizes = []
    for s in shapes or []:
        if isinstance(s, list) and s and all(isinstance(d, int) for d in s):
            n = 1
            for d in s:
                n *= d
            sizes.append(n)
    return FP32 * (sum(sizes) + max(sizes, default=0))


def _split(prof) -> dict:
    import numpy as np

    events = [e for e in prof.events() if e.device_type.name == "CPU"]
    step = [e for e in events if e.name.startswith("ProfilerStep")]
    wall = step[0].time_range.elapsed_us() / 1e6 if step else sum(e.cpu_time_total for e in events if
                                                                    e.cpu_parent is None) / 1e6
    kinds = dict.fromkeys(("gemm_attention", "other_aten", "comm", "framework"), 0.0)  # other_aten: leaf ops only
    xs, ys = [], []
    gemm_calls = 0
    framework: dict[str, float] = {}
    framework_calls: dict[str, int] = {}
    gemms: dict[str, list] = {}  # name: [calls, self ms]
    for e in events:
        self_s = e.self_cpu_time_total / 1e6
        if e.name.startswith("ProfilerStep"):
            kinds["framework"] += self_s
        elif e.name in GEMM_OPS or any(m in e.name for m in ATTENTION_MARKS):
            kinds["gemm_attention"] += self_s
            gemm_calls += 1
            by_gemm = gemms.setdefault(e.name + _within(e), [0, 0.0])
            by_gemm[0] += 1
            by_gemm[1] += self_s * 1e3
        elif any(m in e.name.lower() for m in COMM_MARKS):
            kinds["comm"] += self_s
        elif e.name.startswith("aten::") and not any(c.name.startswith("aten::") for c in e.cpu_children):
            kinds["other_aten"] += self_s
            xs.append(0 if e.name in VIEW_OPS else _bytes(e.input_shapes))
            ys.append(self_s)
        else:
            kinds["framework"] += self_s
            framework[e.name] = framework.get(e.name, 0.0) + self_s
            framework_calls[e.name] = framework_calls.get(e.name, 0) + 1
    x, y = np.asarray(xs, float), np.asarray(ys)
    slope, intercept = np.polyfit(x, y, 1)
    moved = x.sum()
    viewless = [yy for xx, yy in zip(xs, ys) if xx > 0]
    top = sorted(framework.items(), key=lambda x: -x[1])[:TOP]
    return {"wall_s": wall, "kinds": kinds, "gemm_calls": gemm_calls,
            "gemms": {n: [c, round(ms, 2)] for n, (c, ms) in gemms.items()},
            "framework_top": {f"{n} x{framework_calls[n]}": round(v * 1e3, 2) for n, v in top},
            "aten_other_calls": len(ys), "host_per_op_us": intercept * 1e6,
            "fit_bandwidth_GBps": 1 / slope / 1e9 if slope > 0 else float("inf"), "bytes": moved,
            "bytes_s": moved * slope, "median_nonview_us": statistics.median(viewless) * 1e6 if viewless else 0,
            "median_view_us": statistics.median([yy for xx, yy in zip(xs, ys) if xx == 0] or [0]) * 1e6}


def _within(event) -> str:
    """" (optimizer)" for an op inside Optimizer.step, " (experts)" for one inside aten::_grouped_mm (on CPU one
    aten::mm per expert: the routed experts' products, priced as the grouped GEMM), else ""."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("Optimizer.step"):
            return " (optimizer)"
        if parent.name == "aten::_grouped_mm":
            return " (experts)"
        parent = parent.cpu_parent
    return ""


def mm_shapes(prof, topology: str, plan_path: str) -> list[dict]:
    """Every dense aten::mm shape of the profiled step (not the per-expert calls of aten::_grouped_mm): its calls,
    self time a call in the step, unprofiled time a call in isolation (ISOLATED_CALLS, after a warm-up call) and
    the surface's price at that shape (costs.gemm_time, fp32)."""
    import torch

    from rackcast.plan import load_plan
    from rackcast.simulator.costs import GemmShape, gemm_time
    from rackcast.topologies import load_topology

    plan = load_plan(plan_path)
    topo = load_topology(topology, plan.topology.domains, plan.topology.usable_gpus or None)
    rows = []
    by_shape: dict[tuple, list] = {}  # (m, n, k): [calls, self us]
    for e in prof.events():
        if e.name == "aten::mm" and not _within(e):
            (m, k), (_, n) = e.input_shapes[0], e.input_shapes[1]
            row = by_shape.setdefault((m, n, k), [0, 0.0])
            row[0] += 1
            row[1] += e.self_cpu_time_total
    for (m, n, k), (count, self_us) in by_shape.items():
        layouts = {}
        for a_t in (False, True):  # the backward's products take transposed (non-contiguous) operands
            for b_t in (False, True):
                a = torch.randn(k, m).t() if a_t else torch.randn(m, k)
                b = torch.randn(n, k).t() if b_t else torch.randn(k, n)
                torch.mm(a, b)
                t0 = time.perf_counter()
                for _ in range(ISOLATED_CALLS):
                    torch.mm(a, b)
                layouts["TN"[a_t] + "TN"[b_t]] = (time.perf_counter() - t0) / ISOLATED_CALLS * 1e6
        rows.append({"mnk": [m, n, k], "calls": count, "step_us": self_us / count,
                     "alone_us": layouts["NN"], "layouts_us": {k: round(v, 1) for k, v in layouts.items()},
                     "predicted_us": float(gemm_time(2.0 * m * n * k, GemmShape(m, n, k), topo, "fp32")) * 1e6})
    return rows


def child(plan: str, out: str, topology: str) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from rackcast.backend import opcount, train

    args = train.parse_args(["--plan", plan, "--out", out, "--steps", str(WARMUP_STEPS + TIMED_STEPS + 2),
                             "--quiet", "--threads", "1"])
    trainer = train.Trainer(args)
    trainer._data()
    wall = []
    for step in range(WARMUP_STEPS + TIMED_STEPS):
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        t0 = time.perf_counter()
        trainer.train_step(step)
        wall.append(time.perf_counter() - t0)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    counter = opcount._Counter()  # the op count the simulator's host-op term uses, on the real trainer's step
    with counter:
        trainer.train_step(WARMUP_STEPS + TIMED_STEPS + 1)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        trainer.train_step(WARMUP_STEPS + TIMED_STEPS)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    if rank == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(out, "trace.json")))
        calib = {seq: opcount.host_seconds_per_op(seq=seq, samples=5) for seq in CALIB_SEQS}
        result = {"step_wall_s": wall[WARMUP_STEPS:], "load": os.getloadavg(), "profiled": _split(prof),
                  "real_ops": sum(counter.counts.values()), "mm": mm_shapes(prof, topology, plan),
                  "calib_us": {seq: {k: round(v * 1e6, 2) for k, v in c["host_op_s"].items()}
                               for seq, c in calib.items()}}
        Path(out, "step_terms.json").write_text(json.dumps(result, default=str))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--topology", required=True)
    ap.add_argument("--child", metavar="OUT", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.plan, a.child, a.topology)
        return 0
    from gemm_in_step import simulator_prices  # this directory is the script's import path
    from rackcast.backend.launch import worker_env
    from rackcast.plan import load_plan

    pred = predicted(a.plan, a.topology)
    out = Path("runs") / f".step-terms-{Path(a.plan).stem}"
    world = load_plan(a.plan).parallel.gpus
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", "--max-restarts", "0"] if world > 1 else [sys.executable]
    subprocess.run([*cmd, str(Path(__file__).resolve()), a.plan, "--topology", a.topology, "--child", str(out)],
                   check=True, env=worker_env(override=True))
    m = json.loads((out / "step_terms.json").read_text())
    p, k = m["profiled"], m["profiled"]["kinds"]
    print(f"== {a.plan}  load average {m['load']}")
    print(f"predicted step {pred['step_s'] * 1e3:.1f} ms (no host terms {pred['bare_step_s'] * 1e3:.1f}): host ops "
          f"{pred['host_ops_s'] * 1e3:.1f} ms ({pred['ops']:.0f} ops at {pred['times_us']} us f/b/opt), eager bytes "
          f"{pred['eager_bytes'] / 1e6:.1f} MB = {pred['eager_s'] * 1e3:.1f} ms, comm {pred['comm_s'] * 1e3:.1f} ms, "
          f"rest (GEMM, attention, optimizer kernels) "
          f"{(pred['step_s'] - pred['host_ops_s'] - pred['eager_s'] - pred['comm_s']) * 1e3:.1f} ms, of which "
          f"optimizer kernels {pred['opt_kernels_s'] * 1e3:.1f} ms, attention core {pred['attention_s'] * 1e3:.1f} ms")
    w = sorted(m["step_wall_s"])
    print(f"measured step wall (rank 0, unprofiled) min {w[0] * 1e3:.1f} median {statistics.median(w) * 1e3:.1f} "
          f"max {w[-1] * 1e3:.1f} ms; profiled step {p['wall_s'] * 1e3:.1f} ms")
    print(f"  (a) GEMM+attention self {k['gemm_attention'] * 1e3:.1f} ms in {p['gemm_calls']} calls; "
          f"other aten self {k['other_aten'] * 1e3:.1f} ms over {p['aten_other_calls']} calls = "
          f"(b) bytes {p['bytes'] / 1e6:.1f} MB at fitted "
          f"{p['fit_bandwidth_GBps']:.1f} GB/s = {p['bytes_s'] * 1e3:.1f} ms + (c) {p['host_per_op_us']:.2f} us/op "
          f"(median call {p['median_nonview_us']:.1f} us, views {p['median_view_us']:.1f} us)")
    print(f"  (c') framework self (Python, autograd, optimizer loop) {k['framework'] * 1e3:.1f} ms; (d) comm self "
          f"{k['comm'] * 1e3:.1f} ms; ops counted on the real step {m['real_ops']} (predicted {pred['ops']:.0f})")
    print(f"  (a) by op [calls, self ms]: {p['gemms']}")
    mm = m["mm"]
    sim = simulator_prices(a.plan, a.topology)
    print("  dense aten::mm (not _grouped_mm's) by shape, total ms over the step's calls: in the step (profiled "
          f"self) / alone unprofiled / surface at each shape: {sum(r['calls'] * r['step_us'] for r in mm) / 1e3:.1f} / "
          f"{sum(r['calls'] * r['alone_us'] for r in mm) / 1e3:.1f} (slowest operand layout "
          f"{sum(r['calls'] * max(r['layouts_us'].values()) for r in mm) / 1e3:.1f}) / "
          f"{sum(r['calls'] * r['predicted_us'] for r in mm) / 1e3:.1f}; the simulator charges "
          f"{sim['dense_s'] * 1e3:.1f} (forward shapes x 3), routed experts {sim['experts_s'] * 1e3:.1f}, "
          f"Newton-Schulz {sim['newton_schulz_s'] * 1e3:.1f}")
    for r in sorted(mm, key=lambda r: -r["calls"] * r["alone_us"])[:TOP]:
        print(f"    mnk {r['mnk']} x{r['calls']}: step {r['step_us']:.1f} us, alone {r['alone_us']:.1f} us, "
              f"simulator {r['predicted_us']:.1f} us; alone by layout {r['layouts_us']}")
    print(f"  framework self ms by event: {p['framework_top']}")
    print(f"  calibration's host per op now, f/b/opt us by tokens: {m['calib_us']}")
    kernels = k["gemm_attention"] + p["bytes_s"]
    for label, wall in (("median", statistics.median(w)), ("min", w[0])):
        print(f"  host per op implied by the unprofiled {label} step: (wall - (a) - (b)) / real ops = "
              f"{(wall - kernels - k['comm']) / m['real_ops'] * 1e6:.2f} us (predicted mix "
              f"{pred['host_ops_s'] / pred['ops'] * 1e6:.2f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
