"""Where an expert-parallel step's "compute" time goes, on every rank: the per-expert count exchange, the EP path's own
framework ops and the wait for the peer rank, against the same plan without expert parallelism.

    .venv/bin/python benchmarks/profile_ep_step.py PLAN.yaml [PLAN.yaml ...] [--steps 12] [--repeats 2]

Each plan runs under torchrun (one thread per process, gloo on loopback, as `rackcast validate` trains it), the plans
interleaved over --repeats rounds. Every rank runs the real trainer (backend.train.Trainer) for --steps steps and
reports, over the steps after the first two (the fastest fifth's mean and the median, rackcast.spread):
- step_s, compute (backend.record.step_phases: fwd_bwd less the communication timed inside it), a2a_timed (the
  exposed_expert_a2a phase) and optimizer, as the trainer times them;
- count_exchange: the wall time of each `all_to_all_single` of the per-expert counts (an int64 tensor of
  experts x expert-tensor entries, the only all_to_all of integers), split into its floor (the fastest call of the
  step, the exchange's own latency) and the rest (waiting for the peer rank to arrive);
- ep_dispatch_fwd: the wall time of ExpertParallelMoE.dispatch_compute_combine's forward (rows exchange included);
- then one step under torch.profiler: ops by self CPU time, and the aten op count of the step.
The load average is printed beside the figures: on a shared machine, waits for a core inflate every wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_STEPS = 2  # warm-up steps left out of the figures
TOP_OPS = 12


def _worker(plan: str, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from rackcast.backend import expert_parallel, record, train
    from rackcast.spread import fastest_mean

    args = train.parse_args(["--plan", plan, "--out", out, "--steps", str(steps + 1), "--quiet", "--threads", "1"])
    trainer = train.Trainer(args)
    trainer._data()
    counts_s: list[float] = []
    dispatch_s: list[float] = []
    original_a2a = dist.all_to_all_single

    def timed_a2a(output, input, *a, **k):  # the count exchange is the only all_to_all of integers
        t0 = time.perf_counter()
        result = original_a2a(output, input, *a, **k)
        if not input.is_floating_point():
            counts_s.append(time.perf_counter() - t0)
        return result

    expert_parallel.dist.all_to_all_single = timed_a2a
    moe_class = expert_parallel.ExpertParallelMoE
    original_dcc = moe_class.dispatch_compute_combine

    def timed_dcc(self, *a, **k):
        t0 = time.perf_counter()
        result = original_dcc(self, *a, **k)
        dispatch_s.append(time.perf_counter() - t0)
        return result

    moe_class.dispatch_compute_combine = timed_dcc
    rows = []
    for step in range(steps):
        trainer.timer.pop()
        counts_s.clear()
        dispatch_s.clear()
        t0 = time.perf_counter()
        trainer.train_step(step)
        step_s = time.perf_counter() - t0
        phases = trainer.timer.pop()
        split = record.step_phases(phases, step_s)
        rows.append({"step_s": step_s, "compute": split["compute"],
                     "a2a_timed": phases.get("exposed_expert_a2a", 0.0),
                     "optimizer": phases.get("optimizer", 0.0),
                     "count_calls": len(counts_s), "count_exchange": sum(counts_s),
                     "count_floor": min(counts_s) * len(counts_s) if counts_s else 0.0,
                     "ep_dispatch_fwd": sum(dispatch_s)})
    steady = rows[SKIP_STEPS:]
    summary = {key: {"fastest_mean": fastest_mean([r[key] for r in steady]),
                     "median": statistics.median(r[key] for r in steady)} for key in steady[0]}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.train_step(steps)
    events = prof.key_averages()
    aten = [e for e in events if e.key.startswith("aten::")]
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:TOP_OPS]
    report = {"rank": dist.get_rank(), "summary": summary,
              "profiled_aten_calls": sum(e.count for e in aten),
              "top_self": [(e.key, e.count, e.self_cpu_time_total / 1e3) for e in top],
              "calls": {e.key: e.count for e in events},
              "self_ms": {e.key: e.self_cpu_time_total / 1e3 for e in events}}
    Path(out, f"profile-rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def _run(plan: str, steps: int) -> list[dict]:
    from rackcast.backend.launch import LOOPBACK_ENDPOINT, worker_env

    with tempfile.TemporaryDirectory(prefix="profile-ep-") as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", LOOPBACK_ENDPOINT, "--max-restarts", "0", __file__, "--worker", plan,
               "--steps", str(steps), "--out", out]
        subprocess.run(cmd, cwd=ROOT, env=worker_env(override=True), check=True, stdout=subprocess.DEVNULL)
        return [json.loads(p.read_text()) for p in sorted(Path(out).glob("profile-rank*.json"))]


def _print(plan: str, ranks: list[dict]) -> None:
    print(f"\n{Path(plan).stem}  (load average {Path('/proc/loadavg').read_text().split()[:3]})")
    keys = list(ranks[0]["summary"])
    print("  ms, fastest-fifth mean / median  " + "  ".join(f"rank{r['rank']}" for r in ranks))
    for key in keys:
        cells = []
        for r in ranks:
            s = r["summary"][key]
            scale = 1 if key == "count_calls" else 1e3
            cells.append(f"{s['fastest_mean'] * scale:7.2f} / {s['median'] * scale:7.2f}")
        print(f"  {key:<16}" + "  ".join(cells))
    for r in ranks:
        print(f"  rank{r['rank']} profiled step: {r['profiled_aten_calls']} aten calls; "
              "top self CPU (name, calls, ms):")
        for name, calls, ms in r["top_self"]:
            print(f"    {name:<40} {calls:>6} {ms:8.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plans", nargs="*")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help="also write every rank's report here")
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.steps, args.out)
        return 0
    results: dict[str, list] = {p: [] for p in args.plans}
    for _ in range(args.repeats):
        for plan in args.plans:
            ranks = _run(plan, args.steps)
            results[plan].append(ranks)
            _print(plan, ranks)
    if args.json:
        args.json.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
