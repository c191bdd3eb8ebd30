"""Every matrix product of a CPU training step, in the step and alone, beside the simulator's price (issue 15).

    .venv/bin/python benchmarks/gemm_in_step.py runs/validate-r5/plans/1p-mb2.yaml --topology runs/calibrated-r5.yaml
    .venv/bin/python benchmarks/gemm_in_step.py runs/validate-r5/plans/dp2-mb2.yaml --topology runs/calibrated-r5.yaml

The real trainer (backend.train.Trainer, one torch thread per process, under torchrun where the plan has several
ranks) runs warm-up steps, then rank 0 runs STEPS steps under a dispatch mode (torch.utils._python_dispatch) that
records every aten mm / addmm / bmm / baddbmm / _grouped_mm call: its phase (forward, backward: an autograd node is
running, optimizer: inside Optimizer.step), its operand layout (N contiguous, T a transposed view: what BLAS gets as
a transpose flag) and its time (perf_counter around the call only, so the mode's own Python is outside it; the
trainer's profiler-free step). Each distinct call is then replayed alone: warm (calibrate's Timer: operands reused
in a loop, as the calibrated surface is measured), in the calibrated layout (NN, contiguous operands), and cold
(median per call with a buffer of --flush-mib touched between calls, outside the timing: the operands evicted from
the caches). Priced: each dense product at its own m x n x k on the calibrated surface (costs.gemm_time), and what
the simulator charges: the model's GEMMs (simulator.gemms) at their forward shapes x (1 + 2 backward), the routed
experts (costs.grouped_gemm_time at costs.expert_shape) x 3, MuonH's Newton-Schulz at costs.newton_schulz_shape.
On CPU, aten::_grouped_mm runs one aten::mm per expert below the dispatcher's Python key, so a profiler's aten::mm
total (benchmarks/step_terms.py) also holds the routed experts' products; here they are _grouped_mm's.

Findings (2026-12-02/03, 2-core CPU shared with other jobs, calibrated-r5 topology, ms per step of rank 0). Runs of
this command: A `benchmarks/gemm_in_step.py /work/main/runs/validate-r5/plans/1p-mb2.yaml --topology
/work/main/runs/calibrated-r5.yaml` (00:01 UTC, load average 0.9-1.2); B the same on dp2-mb2.yaml (00:04, load
1.9-2.4); C 1p-mb2 with `--repeat --flush-mib 4 8 16 24 32 48` (00:28, load average 0.1-0.4 over the run; two
earlier C runs at load 2.6-5.7 doubled the in-step figures, 40 and 73 ms, and are void). Runs P: the same
measurements as prototype scripts before this file existed (23:55-00:05, load 0.3-1.2 for 1p, 2.0 for the repeat).
- 1p-mb2, dense aten::mm: 636 calls = simulator.gemms' 53 forward products (every one it lists but the 3 short
  convolutions a layer, which the trainer runs as shifted copies) x 3 x 4 micro-batches, forward x @ W^T in layout
  NT, data gradient dY @ W in NN, weight gradient dY^T @ X in TN (tests/test_gemm_in_step.py); no product is
  missing. The simulator charges 12.45 ms (0.37 of it for the convolutions); the surface at each call's own shape
  11.29. A: in the step 21.6, alone warm 12.7 (NN layout 12.7). P: in the step 17.4-18.8 (17.3-18.8 as profiled
  self time in step_terms), alone warm 10.8 (NN 11.3). So the dense gap is (d), the in-step slowdown of the same
  calls, +60-70%; not (b): the layouts the step runs are if anything faster alone than NN (P: forward NT 3.43 vs
  4.03, backward NN 3.61, TN 3.72 vs 3.61; NT is faster at narrow outputs, 256x8x64 11.4 vs 19.3 us); not (c): the
  clamped shapes (m 4 or 8 below the m axis's 32, n 4 below the n axis's 8) move 0.1 ms; and for (a), pricing each
  backward product at its own shape instead of the forward's x 2 would lower the charge (P: 7.26 vs 8.06 ms, alone
  7.33), away from the step.
- The in-step excess grows with the call's operand and output bytes (P: 74 KiB +4-10 us, 384 KiB +18-46 us; about
  10 GB/s over the 636 calls) and appears alone only with the caches flushed between calls (P, alternating warm
  and cold calls: 12.2 ms after 4 MiB touched, 12.4 after 8, 14.8 after 16, 26.5 after 24, 22.7 after 32, 33.7 after
  48; L2 1 MiB a core, L3 32 MiB shared with the machine's other tenants). In the step, timed again at once on the
  same operands (P, load 2.0): 17.9-18.6 first, 14.1-14.3 repeated, 11.2 warm alone: about 4 ms of the excess is
  operands out of cache, about 3 ms stays (the second call's fresh output, the interpreter's work between calls).
  C (this command, one run): in the step 25.6, repeated at once 17.2, alone warm 13.9 (NN 13.6), cold 17.4 (4
  MiB), 18.4 (8), 24.5 (16), 40.7 (24), 45.8 (32), 55.7 (48); routed experts in the step 8.9, warm 4.7; optimizer
  in the step 7.2, warm 4.0 (the machine ran slower than in P throughout: warm 13.9 against 10.8).
  The residency sits between L2-cold and L3-cold and moves with the machine's other load: a calibration at any one
  flush size would be chosen to match the step (a fit), so the surface is left as measured (warm, as calibrate
  measures it, which prices the calls alone within 5%).
- Routed experts: on CPU aten::_grouped_mm runs one aten::mm per expert (96 calls, 768 mm); step_terms' earlier
  "aten::mm 22-24 ms" held those (4.6-4.9 ms of profiled self time). A: in the step 7.8, alone warm 3.9,
  simulator 4.94 (P: in the step 6.1-7.0).
- MuonH Newton-Schulz (100 bmm + 200 baddbmm, 204.9 MFLOP; the simulator counts 203.2): A: in the step 5.6, alone
  warm 4.3 (P: 3.85; profiled in step_terms 3.4-4.5), simulator 2.93 (every FLOP at one 64 x 64 x 64 product); at
  each call's own m x n x k the dense surface would charge 5.69 and the grouped surface (groups = batch) 7.70, both
  further off, so it is left as it is.
- dp2-mb2 (B): dense mm 318 calls in the step 14.95 (P, load 0.6-0.7: 8.0-8.7), alone warm 5.87 (NN 5.98),
  surface 5.64, simulator 6.23; routed experts 48 calls in the step 4.5 (P: 2.7-4.3), simulator 2.47.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rackcast.units import MIB

WARMUP_STEPS, STEPS = 3, 3
REPLAY_CALLS = 40  # per-call timings of a cold replay (the median is kept)
BACKWARD_PRODUCTS = 2  # a GEMM's backward: the data gradient and the weight gradient, each the forward's FLOPs


def _layout(t) -> str:
    return "N" if t.is_contiguous() else ("T" if t.stride()[-2] == 1 else "S")


def capture(trainer, steps: int, repeat: bool = False) -> dict:
    """{key: {"calls", "step_s" (in-step seconds, summed), "args" (clones of one call's operands)}} over `steps`
    trainer steps; key (op, phase, operand shapes, layout). `repeat`: each call is run again at once on the same
    operands (now in cache), its seconds summed as "repeat_s"."""
    import torch
    import torch.optim.optimizer as optimizer_hooks
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    operands = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2), aten.bmm.default: (0, 1),
                aten.baddbmm.default: (1, 2), aten._grouped_mm.default: (0, 1)}
    in_optimizer = [False]
    hooks = [optimizer_hooks.register_optimizer_step_pre_hook(lambda *_: in_optimizer.__setitem__(0, True)),
             optimizer_hooks.register_optimizer_step_post_hook(lambda *_: in_optimizer.__setitem__(0, False))]
    calls: dict = {}

    class Timed(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func not in operands:
                return func(*args, **(kwargs or {}))
            t0 = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            seconds = time.perf_counter() - t0
            again = 0.0
            if repeat:
                t0 = time.perf_counter()
                func(*args, **(kwargs or {}))
                again = time.perf_counter() - t0
            a, b = (args[i] for i in operands[func])
            phase = "optimizer" if in_optimizer[0] else \
                "backward" if torch._C._current_autograd_node() is not None else "forward"
            key = (func.__name__.split(".")[0], phase, tuple(a.shape), tuple(b.shape), _layout(a) + _layout(b))
            row = calls.setdefault(key, {"calls": 0, "step_s": 0.0, "repeat_s": 0.0, "args": None,
                                         "kwargs": kwargs or {}})
            row["calls"] += 1
            row["step_s"] += seconds
            row["repeat_s"] += again
            if row["args"] is None:
                row["args"] = [x.detach().clone(memory_format=torch.preserve_format)
                               if isinstance(x, torch.Tensor) else x for x in args]
            return out

    with Timed():
        for step in range(steps):
            trainer.train_step(WARMUP_STEPS + step)
    for h in hooks:
        h.remove()
    return calls


def replay(key, row, flush_mib: list[float]) -> dict:
    """One call alone: warm (calibrate's Timer), in NN layout (mm only), cold at each of flush_mib (median of
    per-call timings, a buffer of that many MiB touched between calls): "cold_s" {MiB: seconds}."""
    import torch

    from rackcast.backend.calibrate_compute import Timer

    func = getattr(torch.ops.aten, key[0]).default
    args, kwargs = row["args"], row["kwargs"]
    timer = Timer(torch.device("cpu"), samples=5, target_s=0.005)
    out = {"warm_s": timer(lambda: func(*args, **kwargs))}
    if key[0] == "mm":
        a, b = (x.contiguous() for x in args)
        out["nn_s"] = timer(lambda: torch.mm(a, b))
    out["cold_s"] = {}
    for mib in flush_mib:
        flush = torch.zeros(int(mib * MIB) // torch.zeros(()).element_size())
        cold = []
        for _ in range(REPLAY_CALLS):
            flush.add_(1.0)
            t0 = time.perf_counter()
            func(*args, **kwargs)
            cold.append(time.perf_counter() - t0)
        out["cold_s"][str(mib)] = statistics.median(cold)
    return out


def simulator_prices(plan_path: str, topology: str) -> dict:
    """Seconds a step of rank 0 is charged for its dense GEMMs (without and with the short convolutions), routed
    experts and Newton-Schulz products, and the pricing of one dense product at its own shape (a function)."""
    from rackcast.plan import load_plan
    from rackcast.simulator import costs
    from rackcast.simulator.gemms import embed_gemms, gemms_seconds, layer_gemms, tail_work
    from rackcast.simulator.optimizer_cost import newton_schulz_flops
    from rackcast.simulator.stage_work import stage_work
    from rackcast.topologies import load_topology

    plan = load_plan(plan_path)
    topo = load_topology(topology, plan.topology.domains, plan.topology.usable_gpus or None)
    spec, par = plan.model_spec(), plan.parallel
    tokens = plan.tokens_per_microbatch(spec)
    per_mb = (1 + BACKWARD_PRODUCTS) * plan.microbatches
    gemms = [g for i in range(spec.layers) for g in layer_gemms(spec, i)]
    ends = list(tail_work(spec).gemms + embed_gemms(spec))
    dense = gemms_seconds(gemms + ends, tokens, par.tensor, topo, plan.precision)
    convs = gemms_seconds([g for g in gemms if g.part == "conv"], tokens, par.tensor, topo, plan.precision)
    shape = costs.expert_shape(costs.expert_rows(tokens, spec, par.expert_group), spec, par.expert, par.expert_tensor)
    experts = float(costs.grouped_gemm_time(stage_work(spec, plan).experts[0] * tokens, shape, topo, plan.precision))
    ns = newton_schulz_flops(spec, plan, list(range(spec.layers)))
    return {"dense_s": per_mb * dense, "conv_s": per_mb * convs, "experts_s": per_mb * experts,
            "newton_schulz_s": float(costs.gemm_time(ns, costs.newton_schulz_shape(spec), topo, plan.precision)),
            "own_shape": lambda m, n, k: float(costs.gemm_time(2.0 * m * n * k, costs.GemmShape(m, n, k), topo,
                                                                plan.precision))}


def child(plan: str, out: str, topology: str, flush_mib: list[float], repeat: bool) -> None:
    import torch

    from rackcast.backend import train

    args = train.parse_args(["--plan", plan, "--out", out, "--steps", str(WARMUP_STEPS + STEPS), "--quiet",
                             "--threads", "1"])
    trainer = train.Trainer(args)
    trainer._data()
    for step in range(WARMUP_STEPS):
        trainer.train_step(step)
    calls = capture(trainer, STEPS, repeat)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    price = simulator_prices(plan, topology)["own_shape"]
    rows = []
    for key, row in calls.items():
        r = {"op": key[0], "phase": key[1], "a": key[2], "b": key[3], "layout": key[4],
             "calls": row["calls"] / STEPS, "step_s": row["step_s"] / row["calls"],
             "repeat_s": row["repeat_s"] / row["calls"], **replay(key, row, flush_mib)}
        if key[0] == "mm":
            (m, k), n = key[2], key[3][1]
            r["surface_s"] = price(m, n, k)
        rows.append(r)
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, "gemm_in_step.json").write_text(json.dumps({"rows": rows, "load": list(_loadavg())}))


def _loadavg():
    import os

    return os.getloadavg()


def _total(rows, field: str) -> float:
    return sum(r["calls"] * r[field] for r in rows if field in r) * 1e3


def _cold(rows) -> str:
    sizes = rows[0]["cold_s"] if rows else {}
    return ", ".join(f"{mib} MiB {sum(r['calls'] * r['cold_s'][mib] for r in rows) * 1e3:.2f}" for mib in sizes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--topology", required=True)
    ap.add_argument("--flush-mib", type=float, nargs="+", default=[32.0],
                    help="buffer touched between cold calls (MiB), one cold timing per size")
    ap.add_argument("--repeat", action="store_true", help="time each in-step call again at once (operands cached)")
    ap.add_argument("--child", metavar="OUT", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.plan, a.child, a.topology, a.flush_mib, a.repeat)
        return 0
    from rackcast.backend.launch import worker_env
    from rackcast.plan import load_plan

    out = Path("runs") / f".gemm-in-step-{Path(a.plan).stem}"
    world = load_plan(a.plan).parallel.gpus
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", "--max-restarts", "0"] if world > 1 else [sys.executable]
    subprocess.run([*cmd, str(Path(__file__).resolve()), a.plan, "--topology", a.topology, "--flush-mib",
                    *map(str, a.flush_mib), *(["--repeat"] if a.repeat else []), "--child", str(out)], check=True,
                   env=worker_env(override=True))
    result = json.loads((out / "gemm_in_step.json").read_text())
    rows, sim = result["rows"], simulator_prices(a.plan, a.topology)
    print(f"== {a.plan}  load average {result['load']}  (ms per step, rank 0)")
    mm = [r for r in rows if r["op"] == "mm"]
    print(f"dense mm: {sum(r['calls'] for r in mm):.0f} calls: in the step {_total(mm, 'step_s'):.2f} (repeated at "
          f"once {_total(mm, 'repeat_s'):.2f}), alone warm {_total(mm, 'warm_s'):.2f} (NN layout "
          f"{_total(mm, 'nn_s'):.2f}), alone cold ({_cold(mm)}); "
          f"surface at own shapes {_total(mm, 'surface_s'):.2f}; simulator {sim['dense_s'] * 1e3:.2f} (of which "
          f"convolutions, no mm in the trainer, {sim['conv_s'] * 1e3:.2f})")
    for phase in ("forward", "backward"):
        for layout in sorted({r["layout"] for r in mm if r["phase"] == phase}):
            sel = [r for r in mm if r["phase"] == phase and r["layout"] == layout]
            print(f"  {phase} {layout}: {sum(r['calls'] for r in sel):.0f} calls: step {_total(sel, 'step_s'):.2f}, "
                  f"warm {_total(sel, 'warm_s'):.2f}, NN {_total(sel, 'nn_s'):.2f}, cold ({_cold(sel)}), "
                  f"surface {_total(sel, 'surface_s'):.2f}")
    for r in sorted(mm, key=lambda r: -r["calls"] * r["step_s"]):
        (m, k), n = r["a"], r["b"][1]
        print(f"    {r['phase']:8s} {r['layout']} {m}x{n}x{k} x{r['calls']:.0f}: step {r['step_s'] * 1e6:.1f}, warm "
              f"{r['warm_s'] * 1e6:.1f}, NN {r['nn_s'] * 1e6:.1f}, coldest {max(r['cold_s'].values()) * 1e6:.1f}, "
              f"surface {r['surface_s'] * 1e6:.1f} us")
    for label, ops, price in (("routed experts (_grouped_mm)", ("_grouped_mm",), sim["experts_s"]),
                              ("optimizer (bmm, baddbmm)", ("bmm", "baddbmm"), sim["newton_schulz_s"])):
        sel = [r for r in rows if r["op"] in ops]
        print(f"{label}: {sum(r['calls'] for r in sel):.0f} calls: in the step {_total(sel, 'step_s'):.2f}, alone "
              f"warm {_total(sel, 'warm_s'):.2f}, cold ({_cold(sel)}); simulator {price * 1e3:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
