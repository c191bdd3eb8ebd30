"""Benchmark of the planner, in one run: the closed-form stage's layouts per second on one core (the per-layout
scalar path the search used before, next to the array path it uses now), the Marin layout search, the Marin
model-size search, layout searches on 16,384 GPUs (a Llama 3.1 405B-class dense model and a DeepSeek-V3-class MoE on
2,048 HGX H100 nodes), and the simulated step the verified ranking runs most (16 pipeline stages, 16 micro-batches on
the Marin hero cluster). Every figure is min / median / max wall seconds over --repeats runs (the machine may be
shared: the spread is part of the figure), with the CPU seconds of the median run.

Targets (issue 17): closed form >= 100,000 layouts/s on one core, Marin layout search <= 5 s, size search <= 10 s,
each 16,384-GPU search <= 30 s, the 16-stage step <= 0.3 s. The DeepSeek-V3-class search uses a global batch of
16,384 sequences (one per GPU; the recipe's 15,360 does not divide any layout of 16,384 GPUs whose tensor x context
groups stay inside a node). The 16,384-GPU searches forecast failures for --forecast-rows rows (the CLI's default
is 10; at 2,048 nodes one row's Monte Carlo can take tens of seconds, so the benchmark times one and prints it
apart).

    .venv/bin/python benchmarks/bench_planner.py [--repeats 3] [--workers N] [--scalar-sample 2000]
                                                 [--skip-size] [--skip-16k] [--skip-step] [--skip-16k-search]
                                                 [--compare-ref GITREF [--compare-runs 50] [--skip-ref-search]]
                                                 [--only-deepseek [--compare-ref GITREF]]

--compare-ref times the whole tree as of GITREF (e.g. main) beside this one, interleaved (old, new, new, old, ...:
each run a fresh process, a warm-up search then one timed, the 1-minute load average read beside it): the closed
form's layouts/s (the Marin layout space, one core, no simulation) and, unless --skip-ref-search, the Marin layout
search as `make plan` runs it; then planner/search.py alone as of GITREF beside this tree's in one process (both on
this tree's enumeration and simulator), the closed form on the CPU clock, interleaved. It also times the failure forecast's Monte Carlo kernel as of GITREF beside this
tree's on the top 16,384-GPU row, alternating, and says whether the two give the same runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from rackcast.plan import load_plan, validate
from rackcast.planner.search import Request, offloaded, search
from rackcast.planner.size import size_search
from rackcast.planner.space import SpaceOptions, enumerate_space, fast_spec, make_plan
from rackcast.planner.verify import default_workers
from rackcast.presets import load_model
from rackcast.simulator import metrics
from rackcast.simulator.estimate import plan_features, step_time
from rackcast.simulator.memory import memory_breakdown
from rackcast.topologies import load_topology

HERO = Path(__file__).resolve().parent.parent / "examples" / "plans" / "marin-535b-hero.yaml"
MARIN = dict(model="marin-535b-a23b", topology="gb200-nvl72", racks=11, tokens=18e12)
LLAMA = dict(model="llama-3.1-405b", topology="h100-hgx", racks=2048, tokens=15.6e12)
DEEPSEEK = dict(model="deepseek-v3-class", topology="h100-hgx", racks=2048, tokens=14.8e12)
DEEPSEEK_REQUEST = Request(**DEEPSEEK, options=SpaceOptions(global_batch=16384))
DEEPSEEK_TITLE = "16,384 GPUs: deepseek-v3-class on 2,048 x h100-hgx, global batch 16,384"


def cpu_s() -> float:
    """CPU seconds of this process and its finished workers (the wall clock alone misleads on a busy machine)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def repeat(fn, repeats: int):
    """[(wall, cpu, result)] of `repeats` calls of fn."""
    out = []
    for _ in range(repeats):
        wall0, cpu0 = time.perf_counter(), cpu_s()
        result = fn()
        out.append((time.perf_counter() - wall0, cpu_s() - cpu0, result))
    return out


def spread(values, fmt: str = "{:.2f}") -> str:
    """min / median / max."""
    values = sorted(values)
    return " / ".join(fmt.format(v) for v in (values[0], statistics.median(values), values[-1]))


def median_run(runs):
    return sorted(runs, key=lambda x: x[0])[len(runs) // 2]


# ------------------------------------------------------------------------------------------------ closed form
def scalar_closed_form(layouts, spec, r: Request) -> int:
    """The closed-form stage as planner.search ran it before the array path, on one core: per layout, memory at each
    recompute level (HBM, then host state), the lightest fitting choice validated, plan_features of that one plan;
    then one step_time over the stacked features. Returns the candidates ranked."""
    topos = {u: load_topology(r.topology, r.racks, u) for u in {lay.usable for lay in layouts}}
    feats = []
    for lay in layouts:
        topo = topos[lay.usable]
        for rc in ("none", "selective", "full"):
            mem = memory_breakdown(spec, make_plan(replace(lay, recompute=rc), spec.name, r.topology, r.racks, spec))
            chosen = None
            for loc, m in (("hbm", mem), ("host", offloaded(mem))):
                if metrics.fits_memory(m.total, m.host, topo):
                    chosen = replace(lay, recompute=rc, opt_location=loc)
                    break
            if chosen is not None:
                plan = make_plan(chosen, spec.name, r.topology, r.racks, spec)
                validate(plan, spec, topo.gpus)
                feats.append(plan_features(spec, plan, topo))
                break
    if feats:
        step_time({k: np.array([f[k] for f in feats]) for k in feats[0]}, topos[layouts[0].usable])
    return len(feats)


def closed_form(repeats: int, sample: int) -> None:
    spec = fast_spec(load_model(MARIN["model"]))
    base = load_topology(MARIN["topology"], MARIN["racks"])
    su = base.scale_up
    found = enumerate_space(spec, MARIN["racks"], su.usable_gpus, su.domain_size, SpaceOptions(), MARIN["tokens"])
    r = Request(**MARIN, top=0, simulate=False, forecast_rows=0, workers=1)
    picked = random.Random(0).sample(found.layouts, min(sample, len(found.layouts)))
    search(r)  # warm-up: caches and numba's kernels
    scalar, array, loads = [], [], []
    for _ in range(repeats):  # interleaved, so both see the same load
        loads.append(os.getloadavg()[0])
        scalar += repeat(lambda: scalar_closed_form(picked, spec, r), 1)
        array += repeat(lambda: search(r), 1)
    enumerated = array[0][2].counts["enumerated"]
    scalar_rates = [len(picked) / w for w, _, _ in scalar]
    array_rates = [enumerated / res.timings["closed_form_s"] for _, _, res in array]
    print(f"closed form on one core, Marin 535B on 11 x gb200-nvl72 ({enumerated:,} layouts enumerated, "
          f"{len(found.layouts):,} valid): layouts/s min / median / max over {repeats} interleaved runs "
          f"(load average {min(loads):.1f}-{max(loads):.1f})")
    print(f"  scalar, per layout (the previous search; {len(picked):,} sampled valid layouts): "
          f"{spread(scalar_rates, '{:,.0f}')}")
    print(f"  arrays, all layouts at once (simulator.plan_arrays; enumerated layouts / closed-form stage): "
          f"{spread(array_rates, '{:,.0f}')}")


# ------------------------------------------------------------------------------------------------ old vs new
TIMED_SEARCH = """
import hashlib, json, os, sys, time, types
import rackcast.planner.search as planner_search
from rackcast.planner.search import Request, search
from rackcast.planner.space import SpaceOptions
fields = json.loads(sys.argv[1])
request = Request(**dict(fields, options=SpaceOptions(**fields.get("options", {}))))
if sys.argv[2] == "cpu":  # the search's stage timer reads this process's CPU clock instead of the wall clock
    planner_search.time = types.SimpleNamespace(perf_counter=time.process_time)
search(request)  # warm-up: imports, caches, numba's kernels
load = os.getloadavg()[0]
wall0 = time.perf_counter()
res = search(request)
wall_s = time.perf_counter() - wall0
def exact(x):  # floats as their exact hex, for the digest
    if isinstance(x, float):
        return x.hex()
    if isinstance(x, dict):
        return {str(k): exact(v) for k, v in sorted(x.items())}
    return x
rows = [(row.layout.label, row.rank, exact(row.days), exact(row.mfu), exact(row.sim)) for row in res.ranked]
print(json.dumps(dict(wall_s=wall_s, load=load, enumerated=res.counts["enumerated"], ranked=res.counts["ranked"],
                      simulated=res.counts["simulated"], winner=res.winner.layout.label,
                      winner_tokens_per_s=res.winner.best_tokens_per_s, module=planner_search.__file__,
                      digest=hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16], **res.timings)))
"""


def timed_search(pythonpath: str | None, request: dict, clock: str) -> dict:
    """One search in a fresh process (the tree on `pythonpath`, or this one): its stage timings (on the wall or the
    process's CPU clock), total wall seconds and the load average."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    # Run outside the repository: `python -c` puts the working folder first on sys.path, and this tree's rackcast/
    # there would shadow the old tree's.
    out = subprocess.run([sys.executable, "-c", TIMED_SEARCH, json.dumps(request), clock], env=env, check=True,
                         capture_output=True, text=True, cwd=tempfile.gettempdir()).stdout
    return json.loads(out.splitlines()[-1])


def compare_trees(ref: str, repeats: int, workers: int, with_search: bool) -> None:
    """The closed form (and the Marin layout search) as of `ref` and in this tree, interleaved repeats. On a shared
    machine the wall clock mostly measures the other jobs, so the one-core closed form is timed on both clocks."""
    from git_ref import package_at

    trees = {"old": str(package_at(ref)), "new": None}
    closed = dict(MARIN, top=0, simulate=False, forecast_rows=0, workers=1)
    cases = [("closed form, layouts/s on the wall clock (Marin space, 1 core, no simulation)", closed, "wall",
              lambda x: x["enumerated"] / x["closed_form_s"], "{:,.0f}"),
             ("  enumeration wall s (same runs)", None, None, lambda x: x["enumerate_s"], "{:.2f}"),
             ("closed form, layouts per CPU second (the same search, its stage timer on the process's CPU clock)",
              closed, "cpu", lambda x: x["enumerated"] / x["closed_form_s"], "{:,.0f}"),
             ("  enumeration CPU s (same runs)", None, None, lambda x: x["enumerate_s"], "{:.2f}")]
    if with_search:
        cases.append(("Marin layout search as `make plan`, total wall s", dict(MARIN, workers=workers), "wall",
                      lambda x: x["wall_s"], "{:.2f}"))
    runs = {}
    for case, request, clock, _, _ in cases:
        if request is None:
            continue
        runs[case] = {"old": [], "new": []}
        for i in range(repeats):
            for label in (("old", "new") if i % 2 == 0 else ("new", "old")):
                runs[case][label].append(timed_search(trees[label], request, clock))
    modules = {label: sorted({x["module"] for r in runs.values() for x in r[label]}) for label in ("old", "new")}
    print(f"old ({ref}) vs new (this tree), interleaved, {repeats} fresh processes each; min / median / max")
    print(f"  planner.search from: old {', '.join(modules['old'])}; new {', '.join(modules['new'])}")
    source = None
    for case, request, _, value, fmt in cases:
        source = case if request is not None else source
        print(f"  {case}")
        for label in ("old", "new"):
            loads = [x["load"] for x in runs[source][label]]
            print(f"    {label}: {spread((value(x) for x in runs[source][label]), fmt)}"
                  f"   (load average {min(loads):.1f}-{max(loads):.1f})")
    same = {case: {x["winner"] for side in r.values() for x in side} for case, r in runs.items()}
    print(f"  the same winner in every run: {all(len(w) == 1 for w in same.values())}")
    compare_search_module(ref, repeats)


def compare_deepseek(ref: str, repeats: int, workers: int) -> None:
    """The 16,384-GPU DeepSeek-V3-class search as of `ref` and in this tree, interleaved fresh processes (a warm-up
    search then one timed, each): total wall s, the verified ranking's wall s, and whether every run ranked the same
    rows with the same figures (a digest of every ranked row's label, rank, estimate and simulated figures)."""
    from git_ref import package_at

    trees = {"old": str(package_at(ref)), "new": None}
    request = dict(DEEPSEEK, workers=workers, forecast_rows=1, options={"global_batch": 16384})
    runs = {"old": [], "new": []}
    for i in range(repeats):
        for label in (("old", "new") if i % 2 == 0 else ("new", "old")):
            runs[label].append(timed_search(trees[label], request, "wall"))
            x = runs[label][-1]
            print(f"  {label} run {len(runs[label])}: total {x['wall_s']:.2f} s, verified ranking {x['simulate_s']:.2f} s"
                  f" (load average {x['load']:.2f})", flush=True)
    print(f"DeepSeek-V3-class search on 16,384 GPUs, old ({ref}) vs new (this tree), interleaved, {repeats} fresh "
          f"processes each, {workers} workers; min / median / max")
    for label in ("old", "new"):
        xs = runs[label]
        loads = [x["load"] for x in xs]
        print(f"  {label}: total wall s {spread(x['wall_s'] for x in xs)}, verified ranking wall s "
              f"{spread(x['simulate_s'] for x in xs)}, enumeration {spread(x['enumerate_s'] for x in xs)}, closed form "
              f"{spread(x['closed_form_s'] for x in xs)}   (load average {min(loads):.1f}-{max(loads):.1f})")
        print(f"    {xs[0]['enumerated']:,} enumerated, {xs[0]['ranked']:,} ranked, {xs[0]['simulated']} simulated; "
              f"winner {xs[0]['winner']}: {xs[0]['winner_tokens_per_s'] / 1e6:.3f} M tokens/s")
    digests = {x["digest"] for side in runs.values() for x in side}
    print(f"  the same ranked rows and simulated figures in every run: {len(digests) == 1} ({', '.join(digests)})")


def compare_search_module(ref: str, repeats: int) -> None:
    """planner/search.py as of `ref` beside this tree's, in this process (both on this tree's enumeration and
    simulator, so only the search module differs), interleaved: the closed-form stage on the process's CPU clock."""
    import types

    from git_ref import load_module_at
    from rackcast.planner import search as new

    old = load_module_at(ref, "planner/search.py")
    mods = {"old": old, "new": new}
    request = dict(MARIN, top=0, simulate=False, forecast_rows=0, workers=1)
    stage_cpu, loads = {"old": [], "new": []}, []
    clocks = {label: m.time for label, m in mods.items()}
    try:
        for m in mods.values():
            m.time = types.SimpleNamespace(perf_counter=time.process_time)
            m.search(m.Request(**request))  # warm-up
        for i in range(repeats):
            loads.append(os.getloadavg()[0])
            for label in (("old", "new") if i % 2 == 0 else ("new", "old")):
                res = mods[label].search(mods[label].Request(**request))
                stage_cpu[label].append(res.timings["closed_form_s"])
    finally:
        for label, m in mods.items():
            m.time = clocks[label]
    enumerated = res.counts["enumerated"]
    print(f"  closed form, planner/search.py as of {ref} vs this tree's in one process, {repeats} interleaved runs "
          f"each (load average {min(loads):.1f}-{max(loads):.1f}): CPU s, then layouts per CPU second")
    for label in ("old", "new"):
        print(f"    {label}: {spread(stage_cpu[label], '{:.3f}')} s   "
              f"{spread((enumerated / x for x in stage_cpu[label]), '{:,.0f}')} layouts/s")


# ------------------------------------------------------------------------------------------------ searches
def layout_search(title: str, request: Request, repeats: int) -> None:
    runs = repeat(lambda: search(request), repeats)
    wall, cpu, res = median_run(runs)
    t, c = res.timings, res.counts
    print(f"{title}: {c['enumerated']:,} enumerated, {c['ranked']:,} ranked, {c['simulated']} simulated")
    print(f"  total wall s min / median / max: {spread(w for w, _, _ in runs)} (median run: {cpu:.1f} s CPU, "
          f"{request.workers} processes)")
    print(f"  median run: enumeration {t['enumerate_s']:.2f} s, closed form {t['closed_form_s']:.2f} s, verified "
          f"ranking {t['simulate_s']:.2f} s ({c['simulated']} simulations), forecast {t['forecast_s']:.2f} s "
          f"({max(request.top, request.forecast_rows)} rows)")
    print(f"  winner {res.winner.layout.label}: {res.winner.best_tokens_per_s / 1e6:.3f} M tokens/s "
          f"({'simulated' if res.winner.sim else 'estimated'})")


def size(repeats: int, workers: int) -> None:
    runs = repeat(lambda: size_search("marin-moe", MARIN["topology"], MARIN["racks"], MARIN["tokens"], top=10,
                                      workers=workers), repeats)
    wall, cpu, res = median_run(runs)
    print(f"size search (marin-moe on 11 x gb200-nvl72, {len(res.shapes)} shapes): {res.enumerated:,} layouts "
          f"enumerated, {res.candidates:,} ranked, {res.simulated} simulated")
    print(f"  total wall s min / median / max: {spread(w for w, _, _ in runs)} (median run: {cpu:.1f} s CPU; closed "
          f"form {res.timings['closed_form_s']:.1f} s, simulations {res.timings['simulate_s']:.1f} s)")


def step(repeats: int) -> None:
    from rackcast.simulator.step import simulate

    hero = load_plan(str(HERO))
    plan = replace(hero, parallel=replace(hero.parallel, fsdp=4, expert=4, pipeline=16))
    simulate(plan, record=False)  # warm-up: imports, numba's cached kernels, the topology graph
    runs = repeat(lambda: simulate(plan, record=False), repeats)
    res = runs[0][2]
    print(f"simulated step, hero cluster with 16 pipeline stages ({plan.microbatches} micro-batches, {res.events:,} "
          f"events): wall s min / median / max {spread(w for w, _, _ in runs)}")


def forecast_one(request: Request, compare_ref: str | None, repeats: int, compare_runs: int) -> None:
    res = search(replace(request, top=0, simulate=False, forecast_rows=0))
    from rackcast.planner.search import apply_forecast

    wall0 = time.perf_counter()
    apply_forecast(res, 1)
    print(f"  one row's failure forecast (planner.forecast, 1,000 runs): {time.perf_counter() - wall0:.1f} s")
    if compare_ref:
        forecast_kernels(res, compare_ref, repeats, compare_runs)


def forecast_kernels(res, ref: str, repeats: int, runs: int) -> None:
    """The forecast's Monte Carlo kernel (planner.forecast_sim.simulate) on the top row's inputs, as of `ref` and
    now, alternating, `runs` runs each: CPU seconds (all threads) and wall seconds, and whether they agree."""
    from rackcast.planner import forecast_sim
    from rackcast.planner.forecast import prepare
    from git_ref import load_module_at

    old = load_module_at(ref, "planner/forecast_sim.py")
    plan = res.plan_for(res.ranked[0])
    inputs = prepare(plan, res.request.tokens, exact_shrink=False).inputs
    for sim in (old.simulate, forecast_sim.simulate):
        sim(inputs, 0, 2)  # warm-up: numba's cache load or compile
    timed = {"old": [], "new": []}
    outs = {}
    for _ in range(repeats):
        for label, sim in (("old", old.simulate), ("new", forecast_sim.simulate)):
            wall0, cpu0 = time.perf_counter(), cpu_s()
            outs[label] = sim(inputs, 0, runs)
            timed[label].append((time.perf_counter() - wall0, cpu_s() - cpu0))
    same = (np.array_equal(outs["old"].times, outs["new"].times) and np.array_equal(outs["old"].fails,
                                                                                     outs["new"].fails))
    fails = outs["new"].fails.sum(axis=1).mean()
    print(f"  forecast kernel, {runs} runs of the top row ({inputs.domains:,} domains, {fails:,.0f} failures per "
          f"run), min / median / max over {repeats}: identical results {same}")
    for label in ("old", "new"):
        print(f"    {label} ({ref if label == 'old' else 'this tree'}): CPU s {spread(c for _, c in timed[label])}"
              f"   wall s {spread(w for w, _ in timed[label])}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=default_workers())
    ap.add_argument("--scalar-sample", type=int, default=2000, help="valid layouts the scalar path prices")
    ap.add_argument("--forecast-rows", type=int, default=1, help="rows forecast in the 16,384-GPU searches")
    ap.add_argument("--skip-size", action="store_true")
    ap.add_argument("--skip-16k", action="store_true")
    ap.add_argument("--skip-step", action="store_true")
    ap.add_argument("--skip-16k-search", action="store_true", help="16,384-GPU rows: time only the failure forecast")
    ap.add_argument("--compare-ref", metavar="GITREF",
                    help="also time the tree as of GITREF beside this one, interleaved (the closed form, the Marin "
                         "layout search, planner/search.py alone) and the forecast kernel on the top 16,384-GPU row")
    ap.add_argument("--compare-runs", type=int, default=50, help="Monte Carlo runs per --compare-ref timing")
    ap.add_argument("--only-deepseek", action="store_true",
                    help="run only the 16,384-GPU DeepSeek-V3-class search (with --compare-ref: it alone, old vs new)")
    ap.add_argument("--skip-ref-search", action="store_true",
                    help="--compare-ref: compare the closed form only, not the whole Marin layout search")
    args = ap.parse_args()
    print(f"cores: {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}, workers {args.workers}, "
          f"repeats {args.repeats}")
    if args.only_deepseek:
        if args.compare_ref:
            compare_deepseek(args.compare_ref, args.repeats, args.workers)
        else:
            layout_search(DEEPSEEK_TITLE, replace(DEEPSEEK_REQUEST, workers=args.workers,
                                                  forecast_rows=args.forecast_rows), args.repeats)
        return 0
    if args.compare_ref:
        compare_trees(args.compare_ref, args.repeats, args.workers, not args.skip_ref_search)
    closed_form(args.repeats, args.scalar_sample)
    layout_search("Marin layout search (marin-535b-a23b, 11 x gb200-nvl72, 18e12 tokens, as `make plan`)",
                  Request(**MARIN, workers=args.workers), args.repeats)
    if not args.skip_size:
        size(args.repeats, args.workers)
    if not args.skip_16k:
        for title, req in (("16,384 GPUs: llama-3.1-405b on 2,048 x h100-hgx", Request(**LLAMA)),
                           (DEEPSEEK_TITLE, DEEPSEEK_REQUEST)):
            req = replace(req, workers=args.workers, forecast_rows=args.forecast_rows)
            if not args.skip_16k_search:
                layout_search(title, req, args.repeats)
            else:
                print(title)
            forecast_one(req, args.compare_ref, args.repeats, args.compare_runs)
    if not args.skip_step:
        step(args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
