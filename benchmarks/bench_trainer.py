"""Benchmark of the PyTorch trainer: tokens/s and MFU of the tiny Marin-shaped MoE on 1, 2 and 4 processes with
data-parallel, expert-parallel and pipeline layouts (gloo on CPU, one thread per process).

    .venv/bin/python benchmarks/bench_trainer.py [--steps 12]

Each layout runs the real worker under torchrun (global batch 8 x 128 tokens, micro-batch 2) and reads the
medians from its record.json. MFU is against local-cpu's calibrated fp32 matmul peak per process (the model runs in
fp32 on CPU); "vs bf16" is the same against the bf16 peak the simulator uses. With 4 processes on a 2-core
machine each process gets about half a core.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from rackcast.backend.tiny_runs import run_worker, write_plan

LAYOUTS = [
    ("1 proc", {}, "1f1b"),
    ("DP2", {"data": 2}, "1f1b"),
    ("EP2 (x DP2 folded)", {"data": 2, "expert": 2}, "1f1b"),
    ("PP2 1f1b", {"pipeline": 2}, "1f1b"),
    ("DP4", {"data": 4}, "1f1b"),
    ("EP2 x DP2 (data 4)", {"data": 4, "expert": 2}, "1f1b"),
    ("EP2 x DP2 x PP2", {"data": 2, "expert": 2, "pipeline": 2}, "1f1b"),
    ("PP4 gpipe", {"pipeline": 4}, "gpipe"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    print(f"{'layout':<22}{'procs':>6}{'tokens/s':>11}{'step s':>9}{'MFU':>8}{'vs bf16':>9}  top phases")
    with tempfile.TemporaryDirectory() as tmp:
        for name, parallel, schedule in LAYOUTS:
            world = parallel.get("data", 1) * parallel.get("pipeline", 1)
            plan = write_plan(Path(tmp) / f"{len(parallel)}-{world}.yaml", parallel, schedule=schedule)
            out = Path(tmp) / f"run-{name.replace(' ', '_')}"
            t0 = time.time()
            result = run_worker(plan, out, args.steps, world=world, timeout=600, launcher="torchrun")
            if result.returncode != 0:
                print(f"{name:<22}{world:>6}  failed: {result.stderr.strip().splitlines()[-1]}")
                continue
            rec = json.loads((out / "record.json").read_text())
            phases = sorted(((v, k) for k, v in rec["phases_s"].items() if v == v and v > 0), reverse=True)[:3]
            top = ", ".join(f"{k} {100 * v / rec['step_time_s']:.0f}%" for v, k in phases)
            print(f"{name:<22}{world:>6}{rec['tokens_per_s']:>11,.0f}{rec['step_time_s']:>9.3f}"
                  f"{100 * rec['mfu']:>7.2f}%{100 * rec['mfu_vs_bf16_peak']:>8.2f}%  {top}"
                  f"   ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
