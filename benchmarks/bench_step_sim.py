"""Benchmark of the step simulator on the Marin hero plan (704 GB200, 11 NVL72 racks): wall time per simulated
step, events per second, and how wall time grows with data-parallel replicas (1, 11, 44 racks) and pipeline depth
(1 to 16 stages on the same 704 GPUs).

    .venv/bin/python benchmarks/bench_step_sim.py            # the figures
    .venv/bin/python benchmarks/bench_step_sim.py --profile  # plus the top of a cProfile of one hero step
    .venv/bin/python benchmarks/bench_step_sim.py --compare-ref main [--repeats 12]
        # the 16-stage step as of main and as of this tree, taking turns step by step (see `compare`)

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


def worker() -> None:
    """A persistent worker for `compare`: after a warm-up, one 16-stage step per line read from stdin, answering
    with a JSON line of its CPU seconds (process time, so time spent waiting for a core on a shared machine does not
    count), wall seconds, event count, simulated step time and a digest of the simulated result."""
    plan = pipeline_variant(load_plan(str(HERO)), 16)
    validate(plan, plan.model_spec(), plan.topology_spec().gpus)
    simulate(plan, record=False)  # warm-up: imports, numba's cache load (or compile, the first time for a ref)
    print("ready", Path(simulate.__code__.co_filename).resolve(), flush=True)
    for _ in sys.stdin:
        t0, w0 = time.process_time(), time.perf_counter()
        r = simulate(plan, record=False)
        cpu, wall = time.process_time() - t0, time.perf_counter() - w0
        digest = hashlib.sha256(json.dumps(r.as_dict(), sort_keys=True, default=repr).encode())  # floats: repr, exact
        print(json.dumps({"cpu": cpu, "wall": wall, "step_time_s": r.step_time_s, "events": r.events,
                          "digest": digest.hexdigest()[:16]}), flush=True)


def compare(ref: str, steps: int) -> None:
    """The 16-stage step as of git `ref` and as of this tree: two worker processes that take turns, one step each
    (who goes first alternates), so both see the same machine load; CPU and wall seconds min / median / max of each,
    the median of new / old over the pairs, and whether the simulated results agree."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from git_ref import package_at

    envs = {"old": dict(os.environ, PYTHONPATH=str(package_at(ref))), "new": dict(os.environ)}
    procs = {label: subprocess.Popen([sys.executable, __file__, "--worker"], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True) for label, env in envs.items()}
    sources = {label: p.stdout.readline().split(maxsplit=1) for label, p in procs.items()}
    if any(words[0] != "ready" for words in sources.values()) or sources["old"][1] == sources["new"][1]:
        raise SystemExit(f"bench_step_sim: the workers did not start on two different trees: {sources}")
    runs = {"old": [], "new": []}
    for i in range(steps):
        for label in ("old", "new") if i % 2 == 0 else ("new", "old"):
            procs[label].stdin.write("step\n")
            procs[label].stdin.flush()
            runs[label].append(json.loads(procs[label].stdout.readline()))
    for p in procs.values():
        p.stdin.close()
        p.wait()
    load = os.getloadavg()
    print(f"16-stage step (16 micro-batches, hero cluster), seconds per simulated step, min / median / max over "
          f"{steps} warm steps each, old and new taking turns; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    for label in ("old", "new"):
        r = runs[label][-1]
        figures = []
        for what in ("cpu", "wall"):
            x = sorted(run[what] for run in runs[label])
            figures.append(f"{what} {x[0]:.3f} / {statistics.median(x):.3f} / {x[-1]:.3f}")
        print(f"  {label} ({ref if label == 'old' else 'this tree'}): {'   '.join(figures)}   simulated step "
              f"{r['step_time_s']!r} s, {r['events']} events, digest {r['digest']}")
    ratio = statistics.median(n["cpu"] / o["cpu"] for o, n in zip(runs["old"], runs["new"]))
    print(f"  new / old CPU per step, median over the {steps} pairs: {ratio:.2f}")
    same = {r["digest"] for r in runs["old"] + runs["new"]}
    print(f"  same simulated result: {len(same) == 1}")


def main() -> None:
    if "--worker" in sys.argv:
        worker()
        return
    if "--compare-ref" in sys.argv:
        steps = int(sys.argv[sys.argv.index("--repeats") + 1]) if "--repeats" in sys.argv else 12
        compare(sys.argv[sys.argv.index("--compare-ref") + 1], steps)
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
