"""Where a CPU training step's time goes: wall against CPU time per step, the ops by input shape, and each grouped GEMM
of the step timed again in isolation at the shapes the step passed it (issues 14 and 15).

    .venv/bin/python benchmarks/profile_step.py examples/plans/tiny-1proc.yaml [--threads 1,2] [--steps 8]

For each thread count (one fresh process each, interleaved over --repeats rounds) it runs the real trainer
(backend.train.Trainer, one process) for --steps steps and prints, leaving out the first (warm-up) step:
- wall and process CPU time per step (min / median / max) and the load average: wall far above CPU time x threads
  means the process waited for a core (a shared machine); CPU time far above one thread's means threads spinning in
  OpenMP waits;
- one profiled step (torch.profiler, record_shapes): the ops with the most self time, by input shape, and the step's
  time by kind (GEMMs, attention kernels, everything else);
- every `aten::_grouped_mm` shape of that step re-run alone in the same process: its mean time a call in the step
  against in isolation (the isolated figure has warm caches and no neighbours).
The profiler's times are wall times, so on a shared machine they include time spent waiting for a core.
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

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm")
ATTENTION_MARK = "scaled_dot_product"
ISOLATED_CALLS = 50  # timed calls per grouped GEMM shape in isolation (after one warm-up call)
TOP_OPS = 15


def _spread(values: list[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}"


def _isolated_grouped_mm(shapes: list[list[int]], offs_len: int) -> float:
    """Mean seconds of one grouped_mm call at the step's input shapes, rows split evenly over the groups."""
    import torch
    import torch.nn.functional as F

    a_shape, b_shape = shapes[0], shapes[1]
    a, b = torch.randn(*a_shape), torch.randn(*b_shape)
    rows = a_shape[0] if len(b_shape) == 3 else a_shape[1]  # 2-D x 3-D: rows of a; 2-D x 2-D (weight grad): k
    offs = torch.linspace(rows / offs_len, rows, offs_len).round().to(torch.int32)
    F.grouped_mm(a, b, offs=offs)
    t0 = time.perf_counter()
    for _ in range(ISOLATED_CALLS):
        F.grouped_mm(a, b, offs=offs)
    return (time.perf_counter() - t0) / ISOLATED_CALLS


def child(plan: str, threads: int, steps: int) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    from torch.profiler import ProfilerActivity, profile

    from rackcast.backend import train

    args = train.parse_args(["--plan", plan, "--out", f"runs/.profile-step-{os.getpid()}", "--steps", str(steps + 1),
                             "--quiet", "--threads", str(threads)])
    trainer = train.Trainer(args)
    trainer._data()
    wall, cpu = [], []
    for step in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        trainer.train_step(step)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        trainer.train_step(steps)
    events = prof.key_averages(group_by_input_shape=True)
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    kinds = {"gemm": 0.0, "attention": 0.0}
    for e in events:
        kind = "gemm" if e.key in GEMM_OPS else "attention" if ATTENTION_MARK in e.key else None
        if kind:
            kinds[kind] += e.self_cpu_time_total / 1e6
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:TOP_OPS]
    grouped = [{"shapes": e.input_shapes, "calls": e.count, "step_s": e.cpu_time_total / 1e6 / e.count,
                "isolated_s": _isolated_grouped_mm(e.input_shapes, e.input_shapes[2][0])}
               for e in events if e.key == "aten::_grouped_mm"]
    return {"threads": torch.get_num_threads(), "wall_s": wall[1:], "cpu_s": cpu[1:], "load": os.getloadavg()[0],
            "profiled_s": total, "kinds": kinds | {"other": total - sum(kinds.values())},
            "top": [{"op": e.key, "shapes": str(e.input_shapes)[:80], "calls": e.count,
                     "self_s": e.self_cpu_time_total / 1e6} for e in top], "grouped": grouped}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts, one process each")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per process (the first is left out)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds over the thread counts, interleaved")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.plan, args.child, args.steps)))
        return 0
    results: dict[int, list[dict]] = {}
    for _ in range(args.repeats):
        for threads in (int(t) for t in args.threads.split(",")):
            r = subprocess.run([sys.executable, str(Path(__file__).resolve()), args.plan, "--child", str(threads),
                                "--steps", str(args.steps)], capture_output=True, text=True, check=True)
            results.setdefault(threads, []).append(json.loads(r.stdout.strip().splitlines()[-1]))
    for threads, runs in results.items():
        wall = [w for r in runs for w in r["wall_s"]]
        cpu = [c for r in runs for c in r["cpu_s"]]
        last = runs[-1]
        loads = ", ".join(f"{r['load']:.1f}" for r in runs)
        print(f"\n{threads} thread(s): step wall s {_spread(wall)}   CPU s {_spread(cpu)}   (min / median / max over "
              f"{len(wall)} steps; load average {loads})")
        kinds = "  ".join(f"{k} {v:.3f} s" for k, v in last["kinds"].items())
        print(f"  profiled step {last['profiled_s']:.3f} s: {kinds}")
        for t in last["top"]:
            per_call_ms = t["self_s"] * 1e3 / t["calls"]
            print(f"  {t['op']:<34} {t['calls']:>4} calls {per_call_ms:>8.3f} ms/call  {t['shapes']}")
        for g in last["grouped"]:
            print(f"  grouped_mm {str(g['shapes'][:2]):<32} in the step {g['step_s'] * 1e3:.3f} ms/call, alone "
                  f"{g['isolated_s'] * 1e3:.3f} ms/call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
