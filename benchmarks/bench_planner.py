"""Benchmark of the planner: the full Marin model-size search (every marin-moe shape on 11 GB200 NVL72 racks for
18T tokens, the best layouts of the 10 fastest shapes simulated), then the Marin layout search. Prints candidates per
second of the closed-form stage and seconds per simulated candidate. Target: the size search in at most 60 s on a
2-core machine.

    .venv/bin/python benchmarks/bench_planner.py [--workers 2] [--skip-plan]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time


from rackcast.planner.search import Request, search  # noqa: E402
from rackcast.planner.size import size_search  # noqa: E402


def cpu_s() -> float:
    """CPU seconds of this process and its finished workers (the wall clock alone misleads on a busy machine)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--skip-plan", action="store_true", help="only the model-size search")
    args = ap.parse_args()
    print(f"cores: {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}, workers {args.workers}")

    wall0, cpu0 = time.perf_counter(), cpu_s()
    res = size_search("marin-moe", "gb200-nvl72", 11, 18e12, top=10, workers=args.workers)
    wall, cpu = time.perf_counter() - wall0, cpu_s() - cpu0
    cf, sim = res.timings["closed_form_s"], res.timings["simulate_s"]
    print(f"size search (marin-moe, {len(res.shapes)} shapes): {res.enumerated} layouts enumerated, "
          f"{res.candidates} ranked by the closed form")
    print(f"  closed-form stage: {cf:.1f} s, {res.enumerated / cf:,.0f} enumerated candidates/s, "
          f"{res.candidates / cf:,.0f} ranked candidates/s")
    if res.simulated:
        print(f"  simulated stage: {res.simulated} candidates in {sim:.1f} s, {sim / res.simulated:.2f} s per "
              f"simulated candidate ({args.workers} processes)")
    else:
        print(f"  simulated stage: none ({'; '.join(res.notes)})")
    print(f"  total {wall:.1f} s wall, {cpu:.1f} s CPU (target 60 s wall)")

    if not args.skip_plan:
        wall0, cpu0 = time.perf_counter(), cpu_s()
        r = search(Request(model="marin-535b-a23b", topology="gb200-nvl72", racks=11, tokens=18e12, top=10,
                           workers=args.workers))
        wall, cpu = time.perf_counter() - wall0, cpu_s() - cpu0
        t = r.timings
        print(f"layout search (marin-535b-a23b, 11 racks): {r.counts['enumerated']} enumerated, "
              f"{r.counts['ranked']} ranked, {r.counts['simulated']} simulated")
        print(f"  closed-form stage: {t['closed_form_s']:.1f} s, {r.counts['enumerated'] / t['closed_form_s']:,.0f} "
              f"enumerated candidates/s, {r.counts['ranked'] / t['closed_form_s']:,.0f} ranked candidates/s")
        if r.counts["simulated"]:
            print(f"  simulated stage: {t['simulate_s'] / r.counts['simulated']:.2f} s per simulated candidate")
        print(f"  total {wall:.1f} s wall, {cpu:.1f} s CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
