"""Benchmark of the step simulator on the Marin hero plan (704 GB200, 11 NVL72 racks): wall time per simulated
step, events per second, and how wall time grows with data-parallel replicas (1, 11, 44 racks) and pipeline depth
(1 to 16 stages on the same 704 GPUs).

    .venv/bin/python benchmarks/bench_step_sim.py            # the figures
    .venv/bin/python benchmarks/bench_step_sim.py --profile  # plus the top of a cProfile of one hero step

Each figure is the median of REPEATS warm runs (the first run pays imports, numba's cached kernel load and the
topology cache) on one core, without the trace timeline (record=False; recording adds a little).
Variants come from dataclasses.replace of the hero plan:
- racks R: data = R replicas, global batch R x 1024 sequences (one micro-batch per rank, as the hero);
- pipeline depth p: fsdp = expert = 64 / p, pipeline = p (1F1B), same 11 racks and global batch, so p micro-batches.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from rackcast.plan import BatchSpec, load_plan, validate
from rackcast.simulator.step import simulate

HERO = Path(__file__).resolve().parent.parent / "examples" / "plans" / "marin-535b-hero.yaml"
REPEATS = 3


def timed(plan) -> tuple[float, object]:
    walls, result = [], None
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        result = simulate(plan, record=False)
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls), result


def row(label: str, plan) -> None:
    validate(plan, plan.model_spec(), plan.topology_spec().gpus)
    wall, r = timed(plan)
    print(f"{label:28s} {r.gpus:6d} GPUs  wall {wall:7.3f} s/step  {r.events:8d} events  "
          f"{r.events / wall:10.0f} events/s  simulated step {r.step_time_s:8.3f} s")


def main() -> None:
    hero = load_plan(str(HERO))
    simulate(hero, record=False)  # warm-up
    row("hero (11 racks)", hero)
    print("data-parallel replicas:")
    for racks in (1, 11, 44):
        plan = replace(hero, topology=replace(hero.topology, domains=racks),
                       parallel=replace(hero.parallel, data=racks), batch=BatchSpec(racks * 1024, 16))
        row(f"  {racks} racks", plan)
    print("pipeline depth (704 GPUs):")
    for p in (1, 2, 4, 8, 16):
        plan = replace(hero, parallel=replace(hero.parallel, fsdp=64 // p, expert=64 // p, pipeline=p))
        row(f"  pipeline {p} ({plan.microbatches} micro-batches)", plan)
    t0 = time.perf_counter()
    simulate(hero, record=True)
    print(f"hero with the trace timeline recorded: {time.perf_counter() - t0:.3f} s")
    if "--profile" in sys.argv:
        prof = cProfile.Profile()
        prof.enable()
        simulate(hero, record=False)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
