"""Benchmark of the step simulator on the Marin hero plan (704 GB200, 11 NVL72 racks): wall time per simulated
step, events per second, and how wall time grows with data-parallel replicas (1, 11, 44 racks) and pipeline depth
(1 to 16 stages on the same 704 GPUs).

    .venv/bin/python benchmarks/bench_step_sim.py            # the figures
    .venv/bin/python benchmarks/bench_step_sim.py --profile  # plus the top of a cProfile of one hero step
    .venv/bin/python benchmarks/bench_step_sim.py --compare-ref main [--repeats 5]
        # the 16-stage step as of main and as of this tree, side by side (see `compare`)

Each figure is the median of REPEATS warm runs (the first run pays imports, numba's cached kernel load and the
topology cache) on one core, without the trace timeline (record=False; recording adds a little).
Variants come from dataclasses.replace of the hero plan:
- racks R: data = R replicas, global batch R x 1024 sequences (one micro-batch per rank, as the hero);
- pipeline depth p: fsdp = expert = 64 / p, pipeline = p (1F1B), same 11 racks and global batch, so p micro-batches.
"""

from __future__ import annotations

import cProfile
import hashlib
import json
import os
import pstats
import statistics
import subprocess
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


def pipeline_variant(hero, p: int):
    return replace(hero, parallel=replace(hero.parallel, fsdp=64 // p, expert=64 // p, pipeline=p))


def worker(repeats: int) -> None:
    """One process's figures for the 16-stage step: CPU seconds of each of `repeats` warm runs (process time, so
    time spent waiting for a core on a shared machine does not count) and a digest of the simulated result."""
    plan = pipeline_variant(load_plan(str(HERO)), 16)
    validate(plan, plan.model_spec(), plan.topology_spec().gpus)
    simulate(plan, record=False)  # warm-up: imports, numba's cache load (or compile, the first time for a ref)
    cpu, r = [], None
    for _ in range(repeats):
        t0 = time.process_time()
        r = simulate(plan, record=False)
        cpu.append(time.process_time() - t0)
    digest = hashlib.sha256(json.dumps(r.as_dict(), sort_keys=True, default=repr).encode())  # floats: repr, exact
    print(json.dumps({"cpu": cpu, "step_time_s": r.step_time_s, "events": r.events,
                      "digest": digest.hexdigest()[:16]}))


def compare(ref: str, rounds: int, per_round: int) -> None:
    """The 16-stage step as of git `ref` and as of this tree, in alternating worker processes (same machine load):
    CPU seconds min / median / max over all warm runs of each, and whether the simulated results agree."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from git_ref import package_at

    old_env = dict(os.environ, PYTHONPATH=str(package_at(ref)))
    cmd = [sys.executable, __file__, "--worker", str(per_round)]
    runs = {"old": [], "new": []}
    for _ in range(rounds):
        for label, env in (("old", old_env), ("new", dict(os.environ))):
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            runs[label].append(json.loads(out.strip().splitlines()[-1]))
    load = os.getloadavg()
    print(f"16-stage step (16 micro-batches, hero cluster), CPU s per simulated step, min / median / max over "
          f"{rounds} x {per_round} warm runs; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    for label in ("old", "new"):
        cpu = sorted(c for r in runs[label] for c in r["cpu"])
        r = runs[label][-1]
        print(f"  {label} ({ref if label == 'old' else 'this tree'}): {cpu[0]:.3f} / {statistics.median(cpu):.3f} / "
              f"{cpu[-1]:.3f} s   simulated step {r['step_time_s']!r} s, {r['events']} events, digest {r['digest']}")
    same = {r["digest"] for r in runs["old"] + runs["new"]}
    print(f"  same simulated result: {len(same) == 1}")


def main() -> None:
    if "--worker" in sys.argv:
        worker(int(sys.argv[sys.argv.index("--worker") + 1]))
        return
    if "--compare-ref" in sys.argv:
        repeats = int(sys.argv[sys.argv.index("--repeats") + 1]) if "--repeats" in sys.argv else 5
        compare(sys.argv[sys.argv.index("--compare-ref") + 1], rounds=repeats, per_round=3)
        return
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
        plan = pipeline_variant(hero, p)
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
