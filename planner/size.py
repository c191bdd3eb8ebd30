"""Model-size search: vary the shape along a family, find each shape's best layout, and report size against days.

Families (each shape is built in code from the family's rules; the numbers come from the family's presets):
- marin-moe: widths 2048..8192 in steps of 1024 (head dim, KV-head ratios, attention pattern, vocabulary, gated
  norms and convolutions from marin-535b-a23b); depth from width by interpolating the (width, layers) points of the
  marin-moe presets (the ladder rungs and the d5120/d6144 siblings), rounded to a multiple of the local:global period,
  keeping the widest preset's width per layer beyond it; expert layouts from the d6144 candidates (4-of-128 and
  4-of-256 with expert width = hidden, 8-of-384 with expert width = hidden/2; latent = hidden/2 and two shared
  experts of width hidden/2 in all), scaled with the width.
- dense-gpt: the Megatron-LM shapes of the gpt-*.yaml presets (layers, width, heads), with the family's rules
  (head dim = width / heads, MLP width = 4 x width, the vocabulary and sequence length of the presets).

Per shape: total and active parameters, the best layout, the fewest domains one replica needs, tokens/s, days to the
token budget, whether it meets the deadline, and whether it is on the Pareto front of size against days.

"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from rackcast.errors import RackcastError
from rackcast.layout import ParallelSpec
from rackcast.modelspec import ModelSpec
from rackcast.presets import list_models, load_model

from rackcast.planner.rows import Row
from rackcast.planner.search import Request, Result, apply_forecast, search
from rackcast.planner.verify import ESTIMATE_BAND, MAX_SIMULATED, attach_simulation, simulate_plans, verify
from rackcast.planner.space import SpaceOptions

FAMILIES = ("marin-moe", "dense-gpt")
MARIN_TEMPLATE = "marin-535b-a23b"
MARIN_WIDTHS = tuple(range(2048, 8192 + 1, 1024))
MARIN_EXPERT_PRESETS = ("marin-d6144-e128k4", "marin-d6144-e256k4", "marin-535b-a23b")


def family_presets(family: str) -> list[ModelSpec]:
    return [s for s in (load_model(n) for n in list_models()) if s.family == family]


def depth_for(width: int, points: list[tuple[int, int]], period: int) -> int:
    """Layers for a width: a preset's own count where one exists; otherwise linear interpolation between the
    presets' (width, layers) points (beyond the widest, its width per layer), rounded to a multiple of `period`."""
    exact = dict(points)
    if width in exact:
        return exact[width]
    xs, ys = zip(*sorted(points))
    layers = width * ys[-1] / xs[-1] if width > xs[-1] else float(np.interp(width, xs, ys))
    return max(period, int(round(layers / period)) * period)


def _largest_divisor_at_most(n: int, limit: float) -> int:
    return max(d for d in range(1, n + 1) if n % d == 0 and d <= max(limit, 1))


def marin_shapes(widths: tuple[int, ...] = MARIN_WIDTHS) -> list[ModelSpec]:
    tpl = load_model(MARIN_TEMPLATE)
    presets = family_presets("marin-moe")
    points = sorted({(s.d_model, s.layers) for s in presets if s.name.startswith("marin-")})  # not tiny test models
    a = tpl.attention
    shapes = []
    for name in MARIN_EXPERT_PRESETS:
        m = load_model(name).moe
        d0 = load_model(name).d_model
        for width in widths:
            heads = width // a.head_dim
            kv_local = _largest_divisor_at_most(heads, heads * a.kv_heads_local / a.heads)
            kv_global = _largest_divisor_at_most(heads, heads * a.kv_heads_global / a.heads)
            attention = replace(a, heads=heads, kv_heads_local=kv_local, kv_heads_global=kv_global,
                                kv_heads_stored=max(kv_local, kv_global) if a.kv_heads_stored else 0)
            moe = replace(m, expert_ffn=m.expert_ffn * width // d0, latent_dim=m.latent_dim * width // d0,
                          shared_ffn=m.shared_ffn * width // d0, dense_layers=[])
            shapes.append(replace(tpl, name=f"marin-moe-d{width}-e{m.experts}k{m.top_k}",
                                  layers=depth_for(width, points, a.global_every), d_model=width,
                                  attention=attention, moe=moe,
                                  description=f"marin-moe family: d{width}, {m.top_k}-of-{m.experts} experts"))
    return shapes


def dense_gpt_shapes() -> list[ModelSpec]:
    presets = sorted((s for s in family_presets("dense-gpt") if s.name.startswith("gpt-")),
                     key=lambda s: (s.d_model, s.layers))  # the Megatron table, not the tiny test model
    shapes = []
    for p in presets:
        heads = p.attention.heads
        attention = replace(p.attention, heads=heads, head_dim=p.d_model // heads, kv_heads_local=heads,
                            kv_heads_global=heads)
        shapes.append(replace(p, name=f"dense-gpt-d{p.d_model}-l{p.layers}", attention=attention, ffn=4 * p.d_model,
                              description=f"dense-gpt family: {p.layers} layers, d{p.d_model} ({p.name})"))
    return shapes


def family_shapes(family: str) -> list[ModelSpec]:
    if family == "marin-moe":
        return marin_shapes()
    if family == "dense-gpt":
        return dense_gpt_shapes()
    raise RackcastError(f"model family must be one of {', '.join(FAMILIES)}, got {family!r}", option="family")


@dataclass
class ShapeResult:
    spec: ModelSpec
    result: Result | None  # None when nothing fits
    reason: str = ""  # the tightest constraint when nothing fits
    min_domains_per_replica: int = 0  # fewest domains any fitting layout's replica spans
    one_domain_memory: float = math.nan  # bytes per GPU of the Marin-style one-domain replica (see below)
    one_domain_label: str = ""
    pareto: bool = False

    @property
    def best(self) -> Row | None:
        return self.result.winner if self.result else None

    @property
    def days(self) -> float:
        return self.result.days_for(self.best) if self.result else math.inf


@dataclass
class SizeResult:
    family: str
    topology: str
    racks: int
    tokens: float
    shapes: list[ShapeResult]
    candidates: int = 0  # layouts ranked by the closed form across all shapes
    enumerated: int = 0
    simulated: int = 0
    timings: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def one_domain_replica(spec: ModelSpec, topology: str, racks: int, options: SpaceOptions,
                       tokens: float = 0.0) -> tuple[float, str]:
    """Memory per GPU of Marin's layout style confined to one domain: experts split over the domain (the largest
    expert degree that divides both), non-expert state sharded over it (fsdp = GPUs per domain), data parallel
    across domains, the whole per-GPU batch as one micro-batch, full recomputation, optimizer state in HBM.
    It is the check behind "~360B trains on one rack, ~707B needs two racks" (Marin's sizing of the 535B run,
    https://github.com/marin-community/marin/issues/7201)."""
    from rackcast.simulator.memory import memory_breakdown
    from rackcast.topologies import load_topology

    from rackcast.planner.space import Layout, default_global_batch, make_plan

    topo = load_topology(topology, racks, options.usable[0] if options.usable else None)
    u = topo.scale_up.usable_gpus
    gb = options.global_batch or default_global_batch(spec, load_topology(topology).scale_up.usable_gpus, racks, tokens)
    experts = math.gcd(spec.moe.experts, u) if spec.moe else 1
    mb = max(1, gb // (racks * u))
    lay = Layout(u, ParallelSpec(data=racks, fsdp=u, expert=experts), gb, mb, "1f1b", "full", "hbm", "dropless")
    mem = memory_breakdown(spec, make_plan(lay, spec, topology, racks, spec))
    return mem.total, lay.label


def size_search(family: str, topology: str, racks: int, tokens: float, start: str = "", deadline: str = "",
                objective: str = "days", top: int = 10, workers: int = 2,
                options: SpaceOptions | None = None, band: float = ESTIMATE_BAND,
                max_simulate: int = MAX_SIMULATED) -> SizeResult:
    """Best layout per shape (closed form), then the verified ranking over the shapes' best layouts (planner.verify):
    the `top` best by estimate are simulated, and more while an unsimulated shape could still beat the best
    simulated one within the estimate's error band `band` (at most `max_simulate`)."""
    from rackcast.topologies import load_topology

    # One GPU count per domain (the preset's default), so "domains per replica" compares across shapes.
    options = options or SpaceOptions.coarse(usable=(load_topology(topology).scale_up.usable_gpus,))
    out = SizeResult(family, topology, racks, tokens, [])
    t0 = time.perf_counter()
    for spec in family_shapes(family):
        req = Request(model=spec, topology=topology, racks=racks, tokens=tokens, start=start, deadline=deadline,
                      objective=objective, top=0, options=options, workers=workers, simulate=False, forecast_rows=0)
        one_mem, one_label = one_domain_replica(spec, topology, racks, options, tokens)
        try:
            res = search(req)
        except RackcastError as exc:
            if "nothing fits" not in str(exc) and "no layout" not in str(exc):
                raise
            out.shapes.append(ShapeResult(spec, None, str(exc), one_domain_memory=one_mem,
                                          one_domain_label=one_label))
            continue
        out.enumerated += res.counts["enumerated"]
        out.candidates += res.counts["ranked"]
        fitting = [r.layout for r in res.ranked]
        per_domain = min(lay.usable for lay in fitting)
        out.shapes.append(ShapeResult(spec, res, min_domains_per_replica=min(
            -(-lay.replica_gpus() // per_domain) for lay in fitting), one_domain_memory=one_mem,
            one_domain_label=one_label))
    out.timings["closed_form_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    feasible = [s for s in out.shapes if s.result]
    if top and feasible:
        out.notes.append(_verify_shapes(out, feasible, objective, band, max_simulate, top, workers))
        out.simulated = sum(bool(s.best.sim) for s in feasible)
    out.timings["simulate_s"] = time.perf_counter() - t0
    for s in feasible:
        s.result.forecast_days.clear()
        apply_forecast(s.result, 1)
    if feasible:
        out.notes.append("days of each shape's best layout are the P50 with failures and restarts (planner.forecast)"
                         " from its simulated speed where src is sim, from the closed-form estimate where it is est")
    _mark_pareto(out.shapes)
    return out


def _verify_shapes(out: SizeResult, feasible: list[ShapeResult], objective: str, band: float, cap: int, top: int,
                   workers: int) -> str:
    """The verified ranking of planner.verify over the shapes' best layouts: simulated best estimate first (at least
    `top`), until no unsimulated shape could beat the best simulated one within the estimate's error band."""
    sign = 1 if objective == "days" else -1
    order = sorted(feasible, key=lambda s: (sign * _score(s.best, objective), s.spec.name))
    estimates = [_score(s.best, objective) for s in order]

    def simulate_one(i: int) -> dict:
        return simulate_plans([order[i].result.plan_for(order[i].best)], 1)[0]

    def on_result(i: int, sim: dict) -> None:
        if "refused" not in sim:  # a step too large to simulate keeps its estimate (planner.verify._simulate_one)
            attach_simulation(order[i].result, order[i].best, sim)

    def score(sim: dict) -> float:
        return (sim["days"] if objective == "days" else sim["mfu"]) if sim.get("fits") else math.nan

    v = verify(estimates, simulate_one, score, objective=objective, band=band, cap=max(cap, top), minimum=top,
               workers=workers, on_result=on_result)
    head = (f"the best layouts of {len(v.simulated)} shapes were simulated (simulator.step), best estimate first, "
            f"the first {min(top, len(order))} always")
    if v.reason == "all":
        return f"{head}: every shape"
    if v.reason == "cap":
        return f"{head}; stopped at the cap of {v.cap}: the rest could still beat the best within the band"
    if v.reason == "interrupted":
        return f"{head}; interrupted (Ctrl-C): the rest are estimated (src est)"
    return (f"{head}, until no other could beat the best simulated within the estimate's {100 * band:.0f}% error "
            f"band (planner.verify); the other {len(order) - len(v.simulated)} shapes' figures are estimated (src est)")


def _score(row: Row, objective: str) -> float:
    return row.days if objective == "days" else row.mfu


def _mark_pareto(shapes: list[ShapeResult]) -> None:
    """On the front: no other shape is at least as large and at least as fast, and strictly better in one."""
    feasible = [s for s in shapes if s.result]
    for s in feasible:
        size, days = s.spec.params_total, s.days
        s.pareto = not any(o is not s and o.spec.params_total >= size and o.days <= days and
                           (o.spec.params_total > size or o.days < days) for o in feasible)
