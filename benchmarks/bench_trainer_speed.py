"""Benchmark of the trainer's kernels and steps on CPU, the current code next to a baseline commit's, in one run.

    .venv/bin/python benchmarks/bench_trainer_speed.py [--baseline 104865f] [--repeats 3] [--skip-baseline] \
        [--only experts,attention,tiny,marin] [--compile] [--threads N]

The baseline (default: main before issue 14, per-expert Python loop, dense window mask, per-matrix optimizer) is
checked out into a temporary git worktree with its own virtual environment (`make setup` there), and every figure
is measured by the same child code under both interpreters, interleaved (baseline, current, baseline, ...), the
kernel figures on one torch thread; min, median and max over the repeats are printed. The machine may be shared:
the spread is part of the figure. Figures:

1. expert block (GroupedExperts) forward and backward at marin-ladder-d768's expert shape: E=192, d=w=384, top-4,
   256 tokens (the baseline's backward takes tens of seconds, so it runs once);
2. attention core at sequence 4,096 (marin-ladder-d768's 6 heads of 128): a local layer (window 1,024) against a
   global one, forward + backward (baseline: SDPA with the dense window mask; current: backend.attention's banded
   attention; global: causal SDPA in both);
3. tiny-1proc step time: the real worker (`python -m rackcast.backend.train`) on examples/plans/tiny-1proc.yaml,
   the median step time of its record.json, on each side's default torch threads as `rackcast train` runs it
   (`--threads N` forces N on both sides);
4. one process of the Marin-shaped marin-cpu-d512 (d_model 512, 32 experts top-4), MuonH and AdamW, global batch
   16 x 512 tokens: MFU against local-cpu's calibrated fp32 matmul peak (the trainer's own record.json), against
   the best fp32 matmul measured in this run, and by CPU time (record.json's step_cpu_s in place of the wall step:
   the rate while the process had a core, which another job's load does not move).
With --compile, the current code's tiny-1proc and marin-cpu-d512 runs are repeated with the plan's `compile: true`
(backend.compiled) beside its eager runs: the steady step time (record.json's median, which skips the first step)
and the compile time apart (the first step's time less that median).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "104865f"  # main before issue 14
EXPERT_SHAPE = {"experts": 192, "dim": 384, "width": 384, "top_k": 4, "tokens": 256}  # marin-ladder-d768's experts
ATTN_SHAPE = {"heads": 6, "head_dim": 128, "seq": 4096, "window": 1024}
MARIN_PRESET = ROOT / "rackcast" / "model_presets" / "marin-cpu-d512.yaml"
MARIN_BATCH = {"global_batch": 16, "micro_batch": 4}


# ------------------------------------------------------------------------------------------------ child side
def _child_experts(repeats: int) -> dict:
    import torch

    from rackcast.backend.layers import make_normal
    from rackcast.backend.moe import GroupedExperts

    s = EXPERT_SHAPE
    ex = GroupedExperts(s["experts"], s["dim"], s["width"], "swiglu", False)
    ex.init_weights(make_normal(0.02, torch.Generator().manual_seed(0)))
    ids = torch.randint(0, s["experts"], (s["tokens"] * s["top_k"],), generator=torch.Generator().manual_seed(1))
    counts = torch.bincount(ids, minlength=s["experts"])
    x = torch.randn(ids.numel(), s["dim"], requires_grad=True)
    fwd, bwd = [], []
    for _ in range(repeats + 1):  # the first is a warm-up
        ex.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        y = ex(x, counts.tolist())
        t1 = time.perf_counter()
        y.backward(torch.ones_like(y))
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
    return {"forward_s": fwd[1:], "backward_s": bwd[1:]}


def _child_attention(repeats: int) -> dict:
    import torch
    import torch.nn.functional as F

    from rackcast.backend import attention

    s = ATTN_SHAPE
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, s["heads"], s["seq"], s["head_dim"], generator=g, requires_grad=True) for _ in range(3))
    if hasattr(attention, "banded_attention"):
        local = lambda: attention.banded_attention(q, k, v, s["window"])  # noqa: E731
    else:
        mask = attention.window_mask(s["seq"], s["window"], q.device)
        local = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # noqa: E731
    full = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    out = {"local_s": [], "global_s": []}
    for i in range(repeats + 1):
        for name, fn in (("local_s", local), ("global_s", full)):
            t0 = time.perf_counter()
            fn().sum().backward()
            if i:
                out[name].append(time.perf_counter() - t0)
    return out


def _child_peak(repeats: int) -> dict:
    import torch

    best = 0.0
    for n in (256, 512, 1024):
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        for _ in range(repeats * 3):
            t0 = time.perf_counter()
            a @ b
            best = max(best, 2.0 * n**3 / (time.perf_counter() - t0))
    return {"fp32_matmul_flops": best}


def child(kind: str, repeats: int) -> int:
    import torch

    torch.set_num_threads(1)
    try:  # the current code's process settings (the baseline has none)
        from rackcast.backend.cpu_runtime import keep_freed_memory

        keep_freed_memory()
    except ImportError:
        pass
    fn = {"experts": _child_experts, "attention": _child_attention, "peak": _child_peak}[kind]
    print(json.dumps(fn(repeats)))
    return 0


# ------------------------------------------------------------------------------------------------ parent side
class Side:
    """One implementation: a checkout and its interpreter."""

    def __init__(self, name: str, root: Path, python: Path):
        self.name, self.root, self.python = name, root, python

    def child(self, kind: str, repeats: int, timeout: float = 1800) -> dict:
        script = ROOT / "benchmarks" / Path(__file__).name
        r = subprocess.run([str(self.python), str(script), "--child", kind, "--repeats", str(repeats)],
                           cwd=self.root, capture_output=True, text=True, timeout=timeout)
        if r.returncode:
            raise RuntimeError(f"{self.name} {kind}: {r.stderr.strip()[-2000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    def train(self, plan: Path, out: Path, steps: int, data_dir: Path, threads: int = 0) -> dict:
        """The worker's record.json, plus first_step_s (the first step, which pays any compilation); `threads` torch
        threads (0: the side's own default, as `rackcast train` runs it)."""
        from rackcast.units import SECONDS_PER_HOUR  # parent side only: a baseline's child may predate it

        cmd = [str(self.python), "-m", "rackcast.backend.train", "--plan", str(plan), "--steps", str(steps),
               "--out", str(out), "--quiet", "--data-dir", str(data_dir)]
        cmd += ["--threads", str(threads)] if threads else []
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
        r = subprocess.run(cmd, cwd=self.root, capture_output=True, text=True, timeout=SECONDS_PER_HOUR, env=env)  # one run at most an hour
        if r.returncode:
            raise RuntimeError(f"{self.name} train {plan.name}: {r.stderr.strip()[-2000:]}")
        return json.loads((out / "record.json").read_text()) | {"first_step_s": _first_step_s(out)}


def setup_baseline(rev: str, where: Path) -> Side:
    folder = where / "baseline"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(folder), rev], check=True,
                   capture_output=True)
    subprocess.run(["make", "-C", str(folder), "setup"], check=True, capture_output=True)
    return Side(f"baseline {rev}", folder, folder / ".venv" / "bin" / "python")


def _spread(values: list[float], scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    v = [x * scale for x in values]
    return f"min {fmt.format(min(v))}  median {fmt.format(statistics.median(v))}  max {fmt.format(max(v))}"


def _first_step_s(out: Path) -> float:
    import pyarrow.parquet as pq

    return pq.read_table(out / "metrics.parquet", columns=["step_time_s"]).to_pydict()["step_time_s"][0]


def _with_compile(plan: Path, where: Path) -> Path:
    data = yaml.safe_load(plan.read_text()) | {"compile": True}
    where.write_text(yaml.safe_dump(data, sort_keys=False))
    return where


def _plan(path: Path, model: str, optimizer: str, batch: dict, fp32_field: bool = True) -> Path:
    """A one-process local-cpu plan in fp32 (fp32_field False: without the precision field, for a baseline that
    predates it and runs fp32 on CPU anyway)."""
    opt = {"name": optimizer, "lr": 0.01} | ({"adam_lr": 0.003} if optimizer == "muonh" else {})
    plan = {"name": path.stem, "model": model, "topology": {"name": "local-cpu", "domains": 1, "usable_gpus": 1},
            "parallel": {}, "batch": batch, "optimizer": opt} | ({"precision": "fp32"} if fp32_field else {})
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=BASELINE, help="git revision of the implementation to compare against")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="steps per tiny-1proc run")
    ap.add_argument("--marin-steps", type=int, default=4, help="steps per marin-cpu-d512 run")
    ap.add_argument("--marin-repeats", type=int, default=1, help="marin-cpu-d512 runs per side and optimizer")
    ap.add_argument("--skip-baseline", action="store_true", help="measure the current code only")
    ap.add_argument("--only", default="experts,attention,tiny,marin", help="comma-separated figures to measure")
    ap.add_argument("--compile", action="store_true",
                    help="also run the current code's tiny-1proc and marin-cpu-d512 plans with compile: true")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads of the trainer runs (default 0: each side's own default, as rackcast train)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.repeats)
    only = set(args.only.split(","))
    current = Side("current", ROOT, Path(sys.executable))
    tmp = Path(tempfile.mkdtemp(prefix="bench-trainer-speed-"))
    data_dir = ROOT / "runs" / ".data"
    try:
        sides = [current] if args.skip_baseline else [setup_baseline(args.baseline, tmp), current]
        threads = args.threads or "each side's default"
        print(f"sides: {', '.join(s.name for s in sides)}; kernels on one torch thread, trainer runs on {threads} "
              f"thread(s); {args.repeats} repeats, interleaved")
        if "experts" in only:
            s = EXPERT_SHAPE
            print(f"\n1. expert block, E={s['experts']} d=w={s['dim']} top-{s['top_k']} {s['tokens']} tokens "
                  f"(seconds)")
            for side in sides:
                r = side.child("experts", 1 if side is not current else args.repeats)
                ratio = [b / f for f, b in zip(r["forward_s"], r["backward_s"])]
                print(f"  {side.name:<18} forward {_spread(r['forward_s'])}   backward {_spread(r['backward_s'])}"
                      f"   backward/forward {_spread(ratio, fmt='{:.2f}')}")
        if "attention" in only:
            s = ATTN_SHAPE
            print(f"\n2. attention core fwd+bwd, seq {s['seq']}, {s['heads']} heads x {s['head_dim']}, "
                  f"window {s['window']} (seconds)")
            results = {side.name: {"local_s": [], "global_s": []} for side in sides}
            for _ in range(args.repeats):
                for side in sides:
                    r = side.child("attention", 1)
                    for k in r:
                        results[side.name][k] += r[k]
            for name, r in results.items():
                ratio = [a / b for a, b in zip(r["local_s"], r["global_s"])]
                print(f"  {name:<18} local {_spread(r['local_s'])}   global {_spread(r['global_s'])}   "
                      f"local/global {_spread(ratio, fmt='{:.2f}')}")
        if "tiny" in only:
            print(f"\n3. tiny-1proc step time, {args.steps} steps per run (record.json median, seconds)")
            tiny = Path("examples") / "plans" / "tiny-1proc.yaml"  # each side's own (fp32 on CPU in both)
            variants = [(side, side.root / tiny, side.name) for side in sides]
            if args.compile:
                variants.append((current, _with_compile(ROOT / tiny, tmp / "tiny-1proc-compile.yaml"),
                                 "current compile"))
            times = {name: [] for _, _, name in variants}
            compile_s = []
            for i in range(args.repeats):
                for side, plan, name in variants:
                    rec = side.train(plan, tmp / f"tiny-{name.replace(' ', '-')}-{i}", args.steps, data_dir,
                                     args.threads)
                    times[name].append(rec["step_time_s"])
                    if name == "current compile":
                        compile_s.append(rec["first_step_s"] - rec["step_time_s"])
            for name, t in times.items():
                print(f"  {name:<18} {_spread(t)}")
            if compile_s:
                print(f"  compile time (first step less the median step): {_spread(compile_s, fmt='{:.1f}')} s")
            if len(sides) == 2:
                old, new = (times[s.name] for s in sides)
                print(f"  speed-up: {min(old) / min(new):.2f}x (min / min), "
                      f"{statistics.median(old) / statistics.median(new):.2f}x (median / median), "
                      f"{max(old) / max(new):.2f}x (max / max)")
        if "marin" in only:
            peak = current.child("peak", args.repeats)["fp32_matmul_flops"]  # the best of this run's matmuls
            b = MARIN_BATCH
            print(f"\n4. marin-cpu-d512, one process, global batch {b['global_batch']} x 512 tokens, micro-batch "
                  f"{b['micro_batch']}, {args.marin_steps} steps; best fp32 matmul measured now "
                  f"{peak / 1e9:.1f} GFLOP/s")
            for optimizer in ("muonh", "adamw"):
                plan = _plan(tmp / f"marin-{optimizer}.yaml", str(MARIN_PRESET), optimizer, b)
                old = _plan(tmp / f"marin-{optimizer}-baseline.yaml", str(MARIN_PRESET), optimizer, b, False)
                variants = [(side, plan if side is current else old, side.name) for side in sides]
                if args.compile:
                    variants.append((current, _with_compile(plan, tmp / f"marin-{optimizer}-compile.yaml"),
                                     "current compile"))
                runs: dict[str, list[dict]] = {name: [] for _, _, name in variants}
                for i in range(args.marin_repeats):
                    for side, p, name in variants:
                        try:
                            runs[name].append(side.train(p, tmp / f"marin-{optimizer}-{name.replace(' ', '-')}-{i}",
                                                         args.marin_steps, data_dir, args.threads))
                        except RuntimeError as exc:  # a baseline may not run this preset: say so, keep going
                            print(f"  {optimizer:<6} {name:<18} failed: {str(exc).splitlines()[0][:200]}")
                for name, recs in runs.items():
                    if not recs:
                        continue
                    step = [r["step_time_s"] for r in recs]
                    mfu = [r["mfu"] for r in recs]
                    ours = [r["model_flops_per_step"] / r["step_time_s"] / peak for r in recs]
                    extra = ""
                    if name == "current compile":
                        extra = f"\n{'':<27} compile (first step less the median) " + _spread(
                            [r["first_step_s"] - r["step_time_s"] for r in recs], fmt="{:.1f}") + " s"
                    if all("step_cpu_s" in r for r in recs):  # a baseline before record.json's step_cpu_s has none
                        by_cpu = [r["model_flops_per_step"] / r["step_cpu_s"] / r["peak_flops"] for r in recs]
                        cpu_s = _spread([r["step_cpu_s"] for r in recs], fmt="{:.2f}")
                        extra += f"\n{'':<27} by CPU time (step_cpu_s {cpu_s} s) MFU % {_spread(by_cpu, 100, '{:.1f}')}"
                    print(f"  {optimizer:<6} {name:<18} step s {_spread(step, fmt='{:.2f}')}\n{'':<27} MFU % of "
                          f"local-cpu's {recs[0]['peak_flops'] / 1e9:.0f} GFLOP/s {_spread(mfu, 100, '{:.1f}')}"
                          f"\n{'':<27} % of this run's best matmul {_spread(ours, 100, '{:.1f}')}{extra}")
    finally:
        if not args.skip_baseline and (tmp / "baseline").exists():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tmp / "baseline")],
                           capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
