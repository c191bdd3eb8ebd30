"""Benchmark of the planner: the closed-form stage's layouts per second, the Marin layout search (closed form plus the
verified ranking's simulations), the Marin model-size search, and layout searches on 16,384 GPUs (a Llama 3.1
405B-class dense model and a DeepSeek-V3-class MoE on 2,048 HGX H100 nodes). Prints wall and CPU seconds per stage.

Targets (issue 17): closed form >= 100,000 layouts/s on one core, Marin layout search <= 5 s, size search <= 10 s,
each 16,384-GPU search <= 30 s. The DeepSeek-V3-class search uses a global batch of 16,384 sequences (one per GPU;
the recipe's 15,360 does not divide any layout of 16,384 GPUs whose tensor x context groups stay inside a node).

    .venv/bin/python benchmarks/bench_planner.py [--workers N] [--skip-size] [--skip-16k]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

from rackcast.planner.search import Request, search
from rackcast.planner.size import size_search
from rackcast.planner.space import SpaceOptions
from rackcast.planner.verify import default_workers


def cpu_s() -> float:
    """CPU seconds of this process and its finished workers (the wall clock alone misleads on a busy machine)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def layout_search(title: str, request: Request) -> None:
    wall0, cpu0 = time.perf_counter(), cpu_s()
    r = search(request)
    wall, cpu = time.perf_counter() - wall0, cpu_s() - cpu0
    t, c = r.timings, r.counts
    print(f"{title}: {c['enumerated']} enumerated, {c['ranked']} ranked, {c['simulated']} simulated")
    print(f"  enumeration {t['enumerate_s']:.2f} s; closed-form stage {t['closed_form_s']:.2f} s "
          f"({c['enumerated'] / max(t['closed_form_s'], 1e-9):,.0f} enumerated layouts/s, "
          f"{c['ranked'] / max(t['closed_form_s'], 1e-9):,.0f} ranked/s, {request.workers} processes)")
    if c["simulated"]:
        print(f"  verified ranking: {c['simulated']} simulations in {t['simulate_s']:.2f} s "
              f"({t['simulate_s'] / c['simulated']:.2f} s each, {request.workers} processes); "
              f"forecast {t['forecast_s']:.2f} s")
    print(f"  winner {r.winner.layout.label}: {r.winner.best_tokens_per_s / 1e6:.3f} M tokens/s "
          f"({'simulated' if r.winner.sim else 'estimated'})")
    print(f"  total {wall:.1f} s wall, {cpu:.1f} s CPU")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=default_workers())
    ap.add_argument("--skip-size", action="store_true", help="leave out the model-size search")
    ap.add_argument("--skip-16k", action="store_true", help="leave out the 16,384-GPU searches")
    args = ap.parse_args()
    print(f"cores: {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}, workers {args.workers}")
    print("closed form: the per-layout path (simulator.estimate.plan_features per layout, one vectorised step_time); "
          "an array path over all layouts at once is not in this version, so there is no second column")

    layout_search("Marin layout search (marin-535b-a23b, 11 x gb200-nvl72, 18e12 tokens)",
                  Request(model="marin-535b-a23b", topology="gb200-nvl72", racks=11, tokens=18e12,
                          workers=args.workers))
    if not args.skip_size:
        wall0, cpu0 = time.perf_counter(), cpu_s()
        res = size_search("marin-moe", "gb200-nvl72", 11, 18e12, top=10, workers=args.workers)
        wall, cpu = time.perf_counter() - wall0, cpu_s() - cpu0
        cf, sim = res.timings["closed_form_s"], res.timings["simulate_s"]
        print(f"size search (marin-moe, {len(res.shapes)} shapes): {res.enumerated} layouts enumerated, "
              f"{res.candidates} ranked by the closed form, {res.simulated} simulated")
        print(f"  closed-form stage {cf:.1f} s ({res.enumerated / cf:,.0f} enumerated layouts/s); simulated stage "
              f"{sim:.1f} s")
        print(f"  total {wall:.1f} s wall, {cpu:.1f} s CPU")
    if not args.skip_16k:
        layout_search("16,384 GPUs, llama-3.1-405b on 2048 x h100-hgx, 15.6e12 tokens",
                      Request(model="llama-3.1-405b", topology="h100-hgx", racks=2048, tokens=15.6e12,
                              workers=args.workers))
        layout_search("16,384 GPUs, deepseek-v3-class on 2048 x h100-hgx, 14.8e12 tokens, global batch 16,384",
                      Request(model="deepseek-v3-class", topology="h100-hgx", racks=2048, tokens=14.8e12,
                              workers=args.workers, options=SpaceOptions(global_batch=16384)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
