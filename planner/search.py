"""Layout search: enumerate, drop what does not divide or fit, rank with the closed form, verify by simulation.

Stages:
1. planner.space enumerates the layouts; rackcast.plan.validate refuses those that do not divide evenly.
2. Memory (simulator.memory, HBM and host) of every layout at once (simulator.plan_arrays). Recomputation and
   optimizer-state location only trade time for memory in the estimate, so each layout keeps the lightest choices
   that fit: no recomputation before selective before full, HBM state before host; a heavier choice is kept only
   where no lighter one fits.
3. simulator.estimate.plan_features and step_time over all the kept candidates at once, as arrays (one call each).
4. The verified ranking (planner.verify): candidates are simulated (simulator.step) best estimate first until no
   unsimulated one could beat the best simulated one within the estimate's error band; simulated rows rank first.
5. The failure forecast (planner.forecast) gives the table's rows their P50 days with failures and restarts.

"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from rackcast.errors import RackcastError
from rackcast.bounds import parse_date
from rackcast.modelspec import FlopsConvention, ModelSpec
from rackcast.plan import Plan, Predicted, PredictedBand, validate
from rackcast.presets import load_model
from rackcast.simulator import metrics
from rackcast.simulator.estimate import plan_features, step_time
from rackcast.simulator.memory import MemoryBreakdown, attention_core_bytes_per_token, memory_breakdown
from rackcast.simulator.plan_arrays import PARALLEL_FIELDS, PlanArrays
from rackcast.topologies import load_topology
from rackcast.topologies.spec import Topology
from rackcast.units import GIB
from rackcast.vocab import PHASES

from rackcast.planner.infeasible import tightest_constraint
from rackcast.planner.rows import MEMORY_PARTS, OverMemory, Rejected, Row
from rackcast.planner.space import (Enumeration, Layout, SpaceOptions, enumerate_space, expert_transport, fast_spec,
                                    make_plan, optimizer_for)
from rackcast.planner.verify import ESTIMATE_BAND, MAX_SIMULATED, default_workers, verify_ranking

OBJECTIVES = ("days", "mfu")
REFINE = 100  # best dropless layouts also tried with capacity transport


@dataclass(frozen=True)
class Request:
    model: str | ModelSpec  # preset name or YAML path (plan), or an inline spec (size search)
    topology: str
    racks: int
    tokens: float
    start: str = ""
    deadline: str = ""
    objective: str = "days"
    top: int = 1  # simulate at least the best `top` by estimate; 0: no simulation
    options: SpaceOptions = SpaceOptions()
    workers: int = field(default_factory=default_workers)
    simulate: bool = True
    band: float = ESTIMATE_BAND  # the estimate's error band the verified ranking allows (planner.verify)
    max_simulate: int = MAX_SIMULATED
    command: str = ""
    forecast_rows: int = 10  # rows whose days get the failure allowance (the table's rows; 0 with top 0: none)
    memory_per_gpu: float = 0.0  # bytes a candidate may use per GPU (headroom, or a smaller part); 0: the HBM


@dataclass
class Result:
    request: Request
    spec: ModelSpec
    topo: Topology  # at the preset's default GPUs per domain
    evaluated: list[Row]  # the candidates the closed form priced, in the order it priced them
    rejected: Rejected  # the refused layouts; their Rows are built only when `rows` is read
    ranked: list[Row]
    hbm_bytes: float
    host_bytes: float
    available_days: float  # deadline - start, NaN without a deadline
    counts: dict[str, int]
    timings: dict[str, float]
    sim_note: str = ""
    days_note: str = ""
    batch_note: str = ""  # which global batch the search used and why (planner.batch)
    memory_note: str = ""  # the memory per GPU candidates were fitted into, when the request held it below HBM
    forecast_days: dict[int, float] = field(default_factory=dict)  # id(row) -> P50 days with failures
    deadline_prob: dict[int, float] = field(default_factory=dict)  # id(row) -> P(finish by the deadline)

    @property
    def rows(self) -> list[Row]:
        """Every candidate: the refused (invalid, then over memory; Rejected builds them once) and then the evaluated
        ones."""
        return self.rejected.rows() + self.evaluated

    @property
    def winner(self) -> Row:
        return self.ranked[0]

    def days_for(self, row: Row) -> float:
        """P50 days with failures where the forecast ran on this row, else steady-state days."""
        return self.forecast_days.get(id(row), row.best_days)

    def band_for(self, row: Row) -> dict:
        """The error band around the row's step time, MFU and steady-state days (simulator.metrics.error_band: the
        stack profile's band; {} where the profile has none)."""
        step = row.sim.get("step_time_s", row.step_time_s)
        return metrics.error_band(step, row.best_mfu, row.best_days, self.topo)

    def p50_days(self, row: Row) -> float:
        """P50 days with failures and restarts (planner.forecast), NaN where the forecast did not run on the row."""
        return self.forecast_days.get(id(row), math.nan)

    def meets_deadline(self, row: Row) -> bool | None:
        if math.isnan(self.available_days):
            return None
        return self.days_for(row) <= self.available_days

    def plan_for(self, row: Row, name: str = "") -> Plan:
        r = self.request
        return make_plan(row.layout, r.model, r.topology, r.racks, self.spec, tokens=r.tokens, start=r.start,
                         deadline=r.deadline, name=name)


def available_days(start: str, deadline: str) -> float:
    if not deadline:
        return math.nan
    if not start:
        raise RackcastError("a deadline needs a start date (the days available are deadline - start)",
                            option="start")
    days = (parse_date(deadline, "deadline", option="deadline") - parse_date(start, "start", option="start")).days
    if days <= 0:
        raise RackcastError(f"deadline {deadline} is not after the start {start}", option="deadline")
    return float(days)


# ---------------------------------------------------------------- the closed-form stage (arrays over layouts)
def offloaded(mem: MemoryBreakdown) -> MemoryBreakdown:
    """The same layout with optimizer state and master weights in host memory (what simulator.memory does for
    state_location: host: nothing else changes), without a second memory_breakdown call; arrays pass through."""
    return replace(mem, host=mem.master + mem.optimizer, master=0.0 * mem.master, optimizer=0.0 * mem.optimizer)


def layout_columns(layouts: list[Layout]) -> dict[str, list]:
    """The layouts' fields as simulator.plan_arrays columns."""
    pars = [lay.parallel for lay in layouts]
    columns = {k: [getattr(p, k) for p in pars] for k in PARALLEL_FIELDS}
    columns.update(usable=[lay.usable for lay in layouts], global_batch=[lay.global_batch for lay in layouts],
                   micro_batch=[lay.micro_batch for lay in layouts], schedule=[lay.schedule for lay in layouts],
                   recompute=[lay.recompute for lay in layouts], state_location=[lay.opt_location for lay in layouts],
                   transport=[expert_transport(lay.transport) for lay in layouts])
    return columns


def plan_arrays(layouts: list[Layout], spec: ModelSpec, r: Request) -> PlanArrays:
    """The layouts as one simulator.plan_arrays.PlanArrays (the plans make_plan would build, as columns)."""
    return PlanArrays(make_plan(layouts[0], spec.name, r.topology, r.racks, spec), layout_columns(layouts))


def _selective_saves(spec: ModelSpec, layouts: list[Layout], r: Request) -> np.ndarray:
    """Per layout: whether selective recomputation drops anything (the materialised attention core; nothing with
    flash attention). It depends on the tensor degree only."""
    memo = {}
    for lay in layouts:
        t = lay.parallel.tensor
        if t not in memo:
            plan = make_plan(lay, spec.name, r.topology, r.racks, spec)
            memo[t] = any(attention_core_bytes_per_token(spec, i, plan) > 0 for i in range(spec.layers))
    return np.array([memo[lay.parallel.tensor] for lay in layouts], dtype=bool)


def _memory_choices(layouts: list[Layout], spec: ModelSpec, topos, r: Request):
    """For every layout, the lightest fitting (recompute, optimizer location) choices, or the leanest failure.
    Returns ([(candidate, memory dict, host bytes per host)] in layout order, the OverMemory of those that fit
    nowhere)."""
    opts, n = r.options, len(layouts)
    levels = [x for x in ("none", "selective", "full") if x in opts.recompute and x in opts.capabilities.recompute]
    locations = [x for x in ("hbm", "host") if x in opts.opt_locations and x in opts.capabilities.optimizer_state]
    skip_selective = np.zeros(n, dtype=bool)
    if "none" in levels and "selective" in levels:  # it would hold the same memory as none and only cost time
        skip_selective = ~_selective_saves(spec, layouts, r)
    arrays = plan_arrays(layouts, spec, r)
    usable = arrays.usable
    tried = []  # (level, location, MemoryBreakdown of arrays, fits, host bytes per host, tried mask)
    done, host_kept = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    emitted = []  # (order, mask, index into tried)
    for level in levels:
        mem = memory_breakdown(spec, arrays.replace(recompute=[level] * n, state_location=["hbm"] * n))
        active = ~done & ~(skip_selective if level == "selective" else np.zeros(n, dtype=bool))
        for loc in locations:
            m = offloaded(mem) if loc == "host" else mem
            fits, hph = np.zeros(n, dtype=bool), np.zeros(n)
            for u, topo in topos.items():
                here = usable == u
                fits[here] = metrics.fits_memory(m.total[here], m.host[here], topo)
                hph[here] = metrics.host_bytes_per_host(m.host[here], topo)
            mask = active & ~host_kept if loc == "host" else active.copy()
            tried.append((level, loc, m, fits, hph, mask))
            ok = fits & mask
            emitted.append((len(emitted), ok, len(tried) - 1))
            if loc == "hbm":
                done |= ok
                active &= ~ok
            else:
                host_kept |= ok
    any_fit = np.zeros(n, dtype=bool)
    for _, ok, _ in emitted:
        any_fit |= ok
    # The leanest failure: the first smallest total among the choices tried (every one, where nothing fit).
    totals = np.array([np.where(mask, m.total, np.inf) for _, _, m, _, _, mask in tried])
    leanest = np.argmin(totals, axis=0)
    picks = [(np.flatnonzero(ok), order, k) for order, ok, k in emitted]
    index = np.concatenate([p[0] for p in picks])
    order = np.concatenate([np.full(len(p[0]), p[1]) for p in picks])
    sort = np.lexsort((order, index))  # per layout, in the order its choices were tried
    which = np.concatenate([np.full(len(p[0]), p[2]) for p in picks])[sort]
    index = index[sort]
    lists = {k: v.tolist() for k, v in _memory_columns(tried, n, index, which).items()}
    mems = [dict(zip(MEMORY_PARTS, vals)) for vals in zip(*(lists[p] for p in MEMORY_PARTS))]
    cands = [Layout(lay.usable, lay.parallel, lay.global_batch, lay.micro_batch, lay.schedule, tried[k][0],
                    tried[k][1], lay.transport) for lay, k in zip((layouts[i] for i in index.tolist()), which.tolist())]
    over = np.flatnonzero(~any_fit)
    over_memory = OverMemory(layouts, over, [(t[0], t[1]) for t in tried], leanest[over],
                             _memory_columns(tried, n, over, leanest[over]), topos)
    return list(zip(cands, mems, lists["host_per_host"])), over_memory


def _memory_columns(tried, n: int, index: np.ndarray, which: np.ndarray) -> dict[str, np.ndarray]:
    """MEMORY_PARTS and host bytes per host of layout index[j] under the choice tried[which[j]]."""
    columns = {k: np.zeros(len(index)) for k in (*MEMORY_PARTS, "host_per_host")}
    for k, (_, _, m, _, hph, _) in enumerate(tried):
        sel = which == k
        d = m.as_dict()
        for part in MEMORY_PARTS:
            columns[part][sel] = np.broadcast_to(d[part], (n,))[index[sel]]
        columns["host_per_host"][sel] = hph[index[sel]]
    return columns


# ---------------------------------------------------------------- search
def capped(topo: Topology, r: Request) -> Topology:
    """The topology whose memory per GPU the search fits candidates into: its HBM, or the request's smaller cap."""
    return topo.with_memory_cap(r.memory_per_gpu) if r.memory_per_gpu else topo


def batch_note(r: Request, spec: ModelSpec, default_usable: int) -> str:
    """One line: the global batch the search used and the rule or option that set it."""
    from rackcast.planner.batch import default_batch

    o = r.options
    if o.batch_range is not None:
        return (f"global batch: per layout the smallest and largest multiples of data x fsdp x micro-batch in "
                f"{o.batch_range[0]:,}..{o.batch_range[1]:,} sequences (--global-batch-range)")
    if o.global_batch:
        return (f"global batch {o.global_batch:,} x {spec.seq_len:,} tokens "
                f"({o.global_batch * spec.seq_len:,} tokens per step): --global-batch")
    return default_batch(spec, default_usable * r.racks, r.tokens).rule


def resolve_spec(model: str | ModelSpec) -> ModelSpec:
    return model if isinstance(model, ModelSpec) else load_model(model)


def search(r: Request, progress=None) -> Result:
    """progress(done, total, what), when given, hears each stage and each round of simulations."""
    if r.objective not in OBJECTIVES:
        raise RackcastError(f"objective must be one of {', '.join(OBJECTIVES)}, got {r.objective!r}",
                            option="objective")
    if r.racks <= 0:
        raise RackcastError(f"racks must be positive, got {r.racks}", option="racks")
    if r.tokens <= 0:
        raise RackcastError(f"token budget must be positive, got {r.tokens:g}", option="tokens")
    if r.top < 0:
        raise RackcastError(f"simulated top count must be >= 0, got {r.top}", option="top")
    if not 0 <= r.band < 1:
        raise RackcastError(f"band must lie in [0, 1), got {r.band:g}", option="band")
    if r.max_simulate < 1:
        raise RackcastError(f"simulated layouts must be >= 1, got {r.max_simulate}", option="max_simulate")
    if progress:
        progress(0, 0, "ranking layouts by the closed-form estimate")
    avail = available_days(r.start, r.deadline)
    spec = resolve_spec(r.model)
    if not (math.isfinite(r.memory_per_gpu) and r.memory_per_gpu >= 0):
        raise RackcastError(f"memory per GPU must be a positive number of GiB (0: the whole HBM), got "
                            f"{r.memory_per_gpu / GIB:g} GiB",
                            option="memory_per_gpu")
    full = load_topology(r.topology, r.racks)
    base = capped(full, r)
    su = base.scale_up
    for u in r.options.usable:
        if not 0 < u <= su.domain_size:
            raise RackcastError(f"usable GPUs per domain must lie in 1..{su.domain_size} for {base.name}, got {u}",
                                option="usable_gpus")
    timings = {}
    t0 = time.perf_counter()
    fspec = fast_spec(spec)
    found: Enumeration = enumerate_space(fspec, r.racks, su.usable_gpus, su.domain_size, r.options, r.tokens)
    timings["enumerate_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    usables = sorted({lay.usable for lay in found.layouts} | set(r.options.usable or ()))
    topos = {u: capped(load_topology(r.topology, r.racks, u), r) for u in usables}
    if base.efficiency.host_op_s.measured:  # count the model's ops once
        from rackcast.simulator.op_counts import op_counts

        op_counts(spec, optimizer_for(spec))
    rejected, evaluated = Rejected(invalid=found.rejected), []
    ranked = _evaluate(found.layouts, rejected, evaluated, fspec, base, topos, r)
    if "capacity" in r.options.transports and "dropless" in r.options.transports and spec.moe is not None:
        ranked += _refine_capacity(ranked, evaluated, fspec, base, topos, r)
    timings["closed_form_s"] = time.perf_counter() - t0
    _sort(ranked, r.objective, simulated=False)

    result = Result(request=r, spec=spec, topo=base, evaluated=evaluated, rejected=rejected, ranked=ranked, hbm_bytes=base.accelerator.hbm_bytes,
                    host_bytes=base.host.memory_bytes, available_days=avail, counts={}, timings=timings,
                    batch_note=batch_note(r, spec, su.usable_gpus))
    if base.accelerator.hbm_bytes < full.accelerator.hbm_bytes:
        result.memory_note = (f"memory per GPU held to {base.accelerator.hbm_bytes / GIB:.3g} GiB "
                              f"(memory_per_gpu) of the topology's {full.accelerator.hbm_bytes / GIB:.3g} GiB HBM")
    if not ranked:
        raise RackcastError(tightest_constraint(result))
    t0 = time.perf_counter()
    if r.simulate and r.top:
        result.sim_note = verify_ranking(result, progress)
    else:
        result.sim_note = "not simulated (top 0)" if not r.top else "not simulated"
    timings["simulate_s"] = time.perf_counter() - t0
    _sort(ranked, r.objective, simulated=True)
    for i, row in enumerate(ranked, 1):
        row.rank = i
    t0 = time.perf_counter()
    if progress:
        progress(0, 0, "forecasting failures and restarts")
    rows_forecast = max(r.top, r.forecast_rows)
    result.days_note = apply_forecast(result, rows_forecast) if rows_forecast else "no failure forecast (0 rows)"
    timings["forecast_s"] = time.perf_counter() - t0
    refused = rejected.counts()
    result.counts = {
        "enumerated": sum(refused.values()) + len(evaluated), **refused, "ranked": len(ranked),
        "simulated": sum(bool(x.sim) for x in ranked),
    }
    return result


def _evaluate(layouts: list[Layout], rejected: Rejected, evaluated: list[Row], spec: ModelSpec, base: Topology, topos,
              r: Request) -> list[Row]:
    """Memory of every layout, the lightest fitting choices, then the closed form over those that fit (arrays).
    Layouts that fit nowhere join `rejected`; the candidates' rows join `evaluated` and are returned."""
    if not layouts:
        return []
    kept, over_memory = _memory_choices(layouts, spec, topos, r)
    rejected.over_memory.append(over_memory)
    return _closed_form_by_usable(kept, evaluated, spec, base, topos, r)


def _closed_form_by_usable(kept: list[tuple[Layout, dict, float]], evaluated: list[Row], spec: ModelSpec, base: Topology,
                           topos, r: Request) -> list[Row]:
    """_closed_form once per count of GPUs used per domain, on that count's topology: per-GPU figures can depend on
    it (processes that time-share a CPU host's cores, topologies.spec.Topology.time_shared); placement takes each
    candidate's own. The rows keep `kept`'s order and are added to `evaluated`."""
    by_usable: dict[int, list[int]] = {}
    for i, (cand, _, _) in enumerate(kept):
        by_usable.setdefault(cand.usable, []).append(i)
    out: list[Row | None] = [None] * len(kept)
    for usable, idx in sorted(by_usable.items()):
        for i, row in zip(idx, _closed_form([kept[i] for i in idx], spec, topos.get(usable, base), r)):
            out[i] = row
    evaluated.extend(out)
    return out


def _closed_form(kept: list[tuple[Layout, dict, float]], spec: ModelSpec, topo: Topology, r: Request) -> list[Row]:
    """simulator.estimate.plan_features and step_time once over every candidate (simulator.plan_arrays), all using
    `topo`'s per-GPU figures."""
    if not kept:
        return []
    layouts = [k[0] for k in kept]
    feats = plan_features(spec, plan_arrays(layouts, spec, r), topo)
    times = step_time(feats, topo)
    tokens = np.array([lay.global_batch * spec.seq_len for lay in layouts], dtype=float)
    gpus = np.array([lay.usable * r.racks for lay in layouts], dtype=float)
    rate = metrics.step_metrics(tokens, times["step_time_s"], metrics.model_flops_per_step(spec, tokens), gpus, topo,
                                r.tokens)
    phases = [dict(zip(PHASES, vals)) for vals in zip(*(times[k].tolist() for k in PHASES))]
    ranked = [Row(lay, "ranked", "", mem, hph, step_time_s=st, tokens_per_s=tps, mfu=mfu, days=days, phases=ph,
                  drop_fraction=drop)
              for (lay, mem, hph), st, tps, mfu, days, ph, drop in zip(
                  kept, times["step_time_s"].tolist(), np.broadcast_to(rate.tokens_per_s, len(kept)).tolist(),
                  np.broadcast_to(rate.mfu, len(kept)).tolist(),
                  np.broadcast_to(rate.days_to_budget, len(kept)).tolist(), phases, feats["drop_fraction"].tolist())]
    return ranked


def _refine_capacity(ranked: list[Row], evaluated: list[Row], spec: ModelSpec, base: Topology, topos,
                     r: Request) -> list[Row]:
    """Capacity transport changes only the expert all-to-all and the load imbalance (not memory or validity), so it
    is tried on the best dropless layouts with experts split over several GPUs rather than on all of them."""
    _sort(ranked, r.objective, simulated=False)
    best = [x for x in ranked if x.layout.parallel.expert > 1][:REFINE]
    return _closed_form_by_usable([(replace(x.layout, transport="capacity"), x.memory, x.host_per_host) for x in best],
                                  evaluated, spec, base, topos, r)


def _sort(ranked: list[Row], objective: str, simulated: bool) -> None:
    """Simulated rows first (re-ranked by their simulated figures), then the closed-form order; ties by label."""
    def key(row: Row):
        score = row.best_days if objective == "days" else -row.best_mfu
        sim_fits = not row.sim or row.sim.get("fits", True)
        return (0 if sim_fits else 1, score, row.drop_fraction, row.layout.transport != "dropless")
    if simulated:
        top = [x for x in ranked if x.sim]
        rest = [x for x in ranked if not x.sim]
        ranked[:] = _sorted_then_by_label(top, key) + rest
    else:
        ranked[:] = _sorted_then_by_label(ranked, key)


def _sorted_then_by_label(rows: list[Row], key) -> list[Row]:
    """sorted(rows, key=lambda x: (key(x), x.layout.label)), building labels only for rows whose keys tie (a label
    is a string built on first use; most rows never need one)."""
    keys = [key(x) for x in rows]
    order = sorted(range(len(rows)), key=keys.__getitem__)
    out, start = [], 0
    for end in range(1, len(order) + 1):
        if end == len(order) or keys[order[end]] != keys[order[start]]:
            run = [rows[i] for i in order[start:end]]
            if len(run) > 1:
                run.sort(key=lambda x: x.layout.label)
            out += run
            start = end
    return out


# ---------------------------------------------------------------- forecast
def apply_forecast(result: Result, k: int) -> str:
    """Days with the failure and restart allowance (planner.forecast: P50 of its Monte Carlo) for the best k; the
    rest keep steady-state days."""
    from rackcast.planner.forecast import forecast_days
    from rackcast.simulator.estimate import estimate

    avail = None if math.isnan(result.available_days) else result.available_days
    for row in result.ranked[:k]:
        plan = result.plan_for(row)
        est = estimate(plan, spec=result.spec, topo=load_topology(plan.topology.name, plan.topology.domains,
                                                                  plan.topology.usable_gpus))
        if row.sim:  # forecast from the simulated speed
            est = replace(est, step_time_s=row.sim["step_time_s"], tokens_per_s=row.sim["tokens_per_s"])
        days, prob = forecast_days(plan, result.request.tokens, avail, est=est)
        result.forecast_days[id(row)] = days
        result.deadline_prob[id(row)] = prob
    return (f"the failure forecast (planner.forecast, P50 of its Monte Carlo) ran on the top "
            f"{min(k, len(result.ranked))}")


def predicted_for(result: Result, row: Row) -> Predicted:
    src = "simulate" if row.sim else "estimate"
    step = row.sim.get("step_time_s", row.step_time_s)
    return Predicted(source=src, step_time_s=step,
                     tokens_per_s=row.best_tokens_per_s, mfu=row.best_mfu, peak_memory_bytes=row.peak_memory,
                     days_to_budget=row.best_days, phases_s=row.sim.get("phases_s", row.phases),
                     flops_convention=FlopsConvention().label, drop_fraction=row.drop_fraction, fits=True,
                     band=PredictedBand.of(result.band_for(row)))
