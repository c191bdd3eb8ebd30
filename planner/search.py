"""Layout search: enumerate, drop what does not divide or fit, rank with the closed form, verify by simulation.

Stages:
1. planner.space enumerates the layouts; rackcast.plan.validate refuses those that do not divide evenly.
2. Memory (simulator.memory, HBM and host) per layout. Recomputation and optimizer-state location only trade time
   for memory in the estimate, so each layout keeps the lightest choices that fit: no recomputation before selective
   before full, HBM state before host; a heavier choice is kept only where no lighter one fits.
3. simulator.estimate.plan_features per candidate (in a process pool), stacked into numpy arrays; one call of
   step_time ranks them all at once.
4. The verified ranking (planner.verify): candidates are simulated (simulator.step) best estimate first until no
   unsimulated one could beat the best simulated one within the estimate's error band; simulated rows rank first.
5. The failure forecast (planner.forecast) gives the table's rows their P50 days with failures and restarts.

"""

from __future__ import annotations

import math
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np

from rackcast.errors import RackcastError
from rackcast.bounds import parse_date
from rackcast.modelspec import FlopsConvention, ModelSpec
from rackcast.plan import Plan, Predicted, validate
from rackcast.presets import load_model
from rackcast.simulator import metrics
from rackcast.simulator.estimate import plan_features, step_time
from rackcast.simulator.memory import MemoryBreakdown, attention_core_bytes_per_token, memory_breakdown
from rackcast.topologies import load_topology
from rackcast.topologies.spec import Topology
from rackcast.units import GIB
from rackcast.vocab import PHASES

from rackcast.planner.space import (Enumeration, Layout, SpaceOptions, enumerate_space, fast_spec, make_plan,
                           optimizer_for)
from rackcast.planner.verify import ESTIMATE_BAND, MAX_SIMULATED, default_workers, verify_ranking

OBJECTIVES = ("days", "mfu")
CHUNK = 256  # layouts per task handed to a worker
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
    forecast_rows: int = 10  # rows whose days get the failure allowance (the table's rows)


@dataclass
class Row:
    """One candidate and its figures (NaN where a stage did not reach it)."""

    layout: Layout
    status: str  # ranked | invalid | no_fit
    reason: str = ""
    memory: dict = field(default_factory=dict)  # MemoryBreakdown.as_dict() per GPU
    host_per_host: float = math.nan
    step_time_s: float = math.nan
    tokens_per_s: float = math.nan
    mfu: float = math.nan
    days: float = math.nan  # steady-state days to the token budget
    phases: dict = field(default_factory=dict)
    drop_fraction: float = 0.0
    sim: dict = field(default_factory=dict)  # simulated figures when simulated
    rank: int = 0  # 1-based among ranked rows

    @property
    def best_tokens_per_s(self) -> float:
        return self.sim.get("tokens_per_s", self.tokens_per_s)

    @property
    def best_mfu(self) -> float:
        return self.sim.get("mfu", self.mfu)

    @property
    def best_days(self) -> float:
        return self.sim.get("days", self.days)

    @property
    def peak_memory(self) -> float:
        return self.sim.get("peak_memory_bytes", self.memory.get("total", math.nan))


@dataclass
class Result:
    request: Request
    spec: ModelSpec
    topo: Topology  # at the preset's default GPUs per domain
    rows: list[Row]
    ranked: list[Row]
    hbm_bytes: float
    host_bytes: float
    available_days: float  # deadline - start, NaN without a deadline
    counts: dict[str, int]
    timings: dict[str, float]
    sim_note: str = ""
    days_note: str = ""
    batch_note: str = ""  # which global batch the search used and why (planner.batch)
    forecast_days: dict[int, float] = field(default_factory=dict)  # id(row) -> P50 days with failures
    deadline_prob: dict[int, float] = field(default_factory=dict)  # id(row) -> P(finish by the deadline)

    @property
    def winner(self) -> Row:
        return self.ranked[0]

    def days_for(self, row: Row) -> float:
        """P50 days with failures where the forecast ran on this row, else steady-state days."""
        return self.forecast_days.get(id(row), row.best_days)

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


# ---------------------------------------------------------------- the per-layout stage (runs in workers)
_STATE: dict = {}


def _fits(mem: MemoryBreakdown, topo: Topology) -> tuple[bool, float]:
    return bool(metrics.fits_memory(mem.total, mem.host, topo)), metrics.host_bytes_per_host(mem.host, topo)


def offloaded(mem: MemoryBreakdown) -> MemoryBreakdown:
    """The same layout with optimizer state and master weights in host memory (what simulator.memory does for
    state_location: host: nothing else changes), without a second memory_breakdown call."""
    return replace(mem, host=mem.master + mem.optimizer, master=0.0, optimizer=0.0)


def _memory_choices(layout: Layout, spec, topos, r: Request) -> list[tuple[Layout, bool, dict, float]]:
    """The lightest fitting (recompute, optimizer location) choices, or the leanest failure."""
    opts = r.options
    topo = topos[layout.usable]
    out, host_kept, leanest = [], False, None
    levels = [x for x in ("none", "selective", "full") if x in opts.recompute and x in opts.capabilities.recompute]
    if "none" in levels and "selective" in levels and not _selective_saves(spec, layout, r):
        levels.remove("selective")  # it would hold the same memory as no recomputation and only cost time
    for rc in levels:
        mem = memory_breakdown(spec, make_plan(replace(layout, recompute=rc), spec.name, r.topology, r.racks, spec))
        for loc in [x for x in ("hbm", "host") if x in opts.opt_locations and x in opts.capabilities.optimizer_state]:
            if loc == "host" and host_kept:
                continue  # a lighter recomputation with host state already fits: this one is slower
            m = offloaded(mem) if loc == "host" else mem
            ok, hph = _fits(m, topo)
            cand = replace(layout, recompute=rc, opt_location=loc)
            if ok:
                out.append((cand, True, m.as_dict(), hph))
                if loc == "hbm":
                    return out
                host_kept = True
            elif leanest is None or m.total < leanest[2]["total"]:
                leanest = (cand, False, m.as_dict(), hph)
    return out or [leanest]


def _selective_saves(spec, layout: Layout, r: Request) -> bool:
    """Selective recomputation drops only the materialised attention core (none with flash attention)."""
    memo = _STATE.setdefault("selective", {})
    tensor = layout.parallel.tensor
    if tensor not in memo:
        plan = make_plan(layout, spec.name, r.topology, r.racks, spec)
        memo[tensor] = any(attention_core_bytes_per_token(spec, i, plan) > 0 for i in range(spec.layers))
    return memo[tensor]


def _evaluate_chunk(layouts: list[Layout]) -> list[tuple]:
    spec, topos, r = _STATE["spec"], _STATE["topos"], _STATE["request"]
    out = []
    for layout in layouts:
        choices = _STATE["memo"].get(layout) or _memory_choices(layout, spec, topos, r)
        for cand, ok, mem, hph in choices:
            feats, reason = None, ""
            if ok:
                plan = make_plan(cand, spec.name, r.topology, r.racks, spec)
                try:
                    validate(plan, spec, topos[cand.usable].gpus)  # the final choice is validated too
                    feats = plan_features(spec, plan, topos[cand.usable])
                except (RackcastError, ValueError) as exc:
                    reason = str(exc)
            out.append((cand, ok, mem, hph, feats, reason))
    return out


def _run_chunks(chunks, workers: int):
    if workers <= 1 or len(chunks) <= 1:
        return [_evaluate_chunk(c) for c in chunks]
    ctx = multiprocessing.get_context("fork")  # workers inherit _STATE (spec, topologies) without pickling
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        return list(pool.map(_evaluate_chunk, chunks))


# ---------------------------------------------------------------- search
def batch_note(r: Request, spec: ModelSpec, default_usable: int) -> str:
    """One line: the global batch the search used and the rule or option that set it."""
    from rackcast.planner.batch import default_batch

    o = r.options
    if o.batch_range is not None:
        return (f"global batch: per layout the smallest and largest multiples of data x fsdp x micro-batch in "
                f"{o.batch_range[0]:,}..{o.batch_range[1]:,} sequences (--global-batch-range)")
    if o.global_batch:
        return (f"global batch {o.global_batch:,} x {spec.seq_len:,} tokens "
                f"({o.global_batch * spec.seq_len / 1e6:.2f} M tokens per step): --global-batch")
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
    base = load_topology(r.topology, r.racks)
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
    topos = {u: load_topology(r.topology, r.racks, u) for u in usables}
    _STATE.update(spec=fspec, topos=topos, request=r, memo={}, selective={})
    if base.efficiency.host_op_s.measured:  # count the model's ops once, before the pool's workers fork
        from rackcast.simulator.op_counts import op_counts

        op_counts(spec, optimizer_for(spec))
    rows = [Row(layout=lay, status="invalid", reason=why) for lay, why in found.rejected]
    ranked = _evaluate(found.layouts, rows, spec, base, topos, r)
    if "capacity" in r.options.transports and "dropless" in r.options.transports and spec.moe is not None:
        ranked += _refine_capacity(ranked, rows, spec, base, topos, r)
    timings["closed_form_s"] = time.perf_counter() - t0
    _sort(ranked, r.objective, simulated=False)

    result = Result(request=r, spec=spec, topo=base, rows=rows, ranked=ranked, hbm_bytes=base.accelerator.hbm_bytes,
                    host_bytes=base.host.memory_bytes, available_days=avail, counts={}, timings=timings,
                    batch_note=batch_note(r, spec, su.usable_gpus))
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
    result.days_note = apply_forecast(result, max(r.top, r.forecast_rows, 1))
    timings["forecast_s"] = time.perf_counter() - t0
    result.counts = {
        "enumerated": len(rows), "invalid": sum(x.status == "invalid" for x in rows),
        "no_fit": sum(x.status == "no_fit" for x in rows), "ranked": len(ranked),
        "simulated": sum(bool(x.sim) for x in ranked),
    }
    return result


def _evaluate(layouts: list[Layout], rows: list[Row], spec: ModelSpec, base: Topology, topos, r: Request) -> list[Row]:
    """Memory and features for each layout (in the pool), then one vectorised step_time over those that fit."""
    chunks = [layouts[i:i + CHUNK] for i in range(0, len(layouts), CHUNK)]
    ranked, feats = [], []
    for cand, ok, mem, hph, f, reason in (item for chunk in _run_chunks(chunks, r.workers) for item in chunk):
        if not ok:
            rows.append(Row(cand, "no_fit", _no_fit_reason(mem, hph, topos[cand.usable]), mem, hph))
        elif f is None:
            rows.append(Row(cand, "invalid", reason, mem, hph))
        else:
            row = Row(cand, "ranked", "", mem, hph, drop_fraction=f["drop_fraction"])
            rows.append(row)
            ranked.append(row)
            feats.append(f)
    _apply_closed_form(ranked, feats, spec, base, r)
    return ranked


def _refine_capacity(ranked: list[Row], rows: list[Row], spec: ModelSpec, base: Topology, topos,
                     r: Request) -> list[Row]:
    """Capacity transport changes only the expert all-to-all and the load imbalance (not memory or validity), so it
    is tried on the best dropless layouts with experts split over several GPUs rather than on all of them."""
    _sort(ranked, r.objective, simulated=False)
    best = [x for x in ranked if x.layout.parallel.expert > 1][:REFINE]
    layouts = [replace(x.layout, transport="capacity") for x in best]
    _STATE["memo"] = {lay: [(lay, True, x.memory, x.host_per_host)] for lay, x in zip(layouts, best)}
    try:
        return _evaluate(layouts, rows, spec, base, topos, replace(r, workers=1))
    finally:
        _STATE["memo"] = {}


def _no_fit_reason(mem: dict, host_per_host: float, topo: Topology) -> str:
    if mem["total"] > topo.accelerator.hbm_bytes:
        return f"memory per GPU {mem['total'] / GIB:.1f} GiB > HBM {topo.accelerator.hbm_bytes / GIB:.1f} GiB"
    return (f"host memory {host_per_host / GIB:.1f} GiB per host > {topo.host.memory_bytes / GIB:.1f} GiB "
            f"(offloaded optimizer state)")


def _apply_closed_form(ranked: list[Row], feats: list[dict], spec: ModelSpec, topo: Topology, r: Request) -> None:
    """One vectorised step_time call over every candidate. step_time reads only per-GPU hardware figures (peaks,
    link bandwidths, efficiency curves), which do not change with the GPUs used per domain."""
    if not ranked:
        return
    keys = list(feats[0])
    arrays = {k: np.array([f[k] for f in feats], dtype=float) for k in keys}
    times = step_time(arrays, topo)
    tokens = np.array([row.layout.global_batch * spec.seq_len for row in ranked], dtype=float)
    gpus = np.array([row.layout.usable * r.racks for row in ranked], dtype=float)
    rate = metrics.step_metrics(tokens, times["step_time_s"], metrics.model_flops_per_step(spec, tokens), gpus, topo,
                                r.tokens)
    for i, row in enumerate(ranked):
        row.step_time_s = float(times["step_time_s"][i])
        row.tokens_per_s = float(rate.tokens_per_s[i])
        row.mfu = float(rate.mfu[i])
        row.days = float(rate.days_to_budget[i])
        row.phases = {k: float(times[k][i]) for k in PHASES}


def _sort(ranked: list[Row], objective: str, simulated: bool) -> None:
    """Simulated rows first (re-ranked by their simulated figures), then the closed-form order; ties by label."""
    def key(row: Row):
        score = row.best_days if objective == "days" else -row.best_mfu
        sim_fits = not row.sim or row.sim.get("fits", True)
        return (0 if sim_fits else 1, score, row.drop_fraction, row.layout.transport != "dropless", row.layout.label)
    if simulated:
        top = [x for x in ranked if x.sim]
        rest = [x for x in ranked if not x.sim]
        top.sort(key=key)
        ranked[:] = top + rest
    else:
        ranked.sort(key=key)


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
    return Predicted(source=src, step_time_s=row.sim.get("step_time_s", row.step_time_s),
                     tokens_per_s=row.best_tokens_per_s, mfu=row.best_mfu, peak_memory_bytes=row.peak_memory,
                     days_to_budget=row.best_days, phases_s=row.sim.get("phases_s", row.phases),
                     flops_convention=FlopsConvention().label, drop_fraction=row.drop_fraction, fits=True)


# ---------------------------------------------------------------- infeasible requests
def tightest_constraint(result: Result) -> str:
    """One line: why nothing fits, with numbers."""
    rows = result.rows
    mem_rows = [x for x in rows if x.memory]
    if not mem_rows:
        reasons = sorted({x.reason.partition(":")[0] for x in rows})
        example = rows[0].reason if rows else "no layout divides the GPUs"
        return (f"no layout of {result.spec.name} divides {result.request.racks} x {result.topo.name} evenly "
                f"(rules hit: {', '.join(reasons)}; e.g. {example})")
    best = min(mem_rows, key=lambda x: (x.memory["total"], x.layout.label))
    m = best.memory
    hbm = result.hbm_bytes
    lay = best.layout
    gpus_now = lay.replica_gpus()
    # Model state shrinks with the GPUs a replica is sharded over; activations and buffers do not.
    state = m["weights"] + m["gradients"] + m["master"] + m["optimizer"]
    rest = m["total"] - state
    per_domain = lay.usable
    if m["total"] <= hbm:  # HBM fits, host memory does not
        return (f"nothing fits: host memory {best.host_per_host / GIB:.1f} GiB per host exceeds "
                f"{result.host_bytes / GIB:.1f} GiB for the leanest layout ({lay.label})")
    if rest >= hbm:
        need = "no sharding helps: activations and buffers alone exceed HBM"
    else:
        gpus_needed = math.ceil(state * gpus_now / (hbm - rest))
        need = (f"a replica would need about {math.ceil(gpus_needed / per_domain)} {result.topo.domain_label}s "
                f"({gpus_needed} GPUs) to shard model state, have {result.request.racks}")
    return (f"nothing fits: the smallest memory per GPU any layout reaches is {m['total'] / GIB:.1f} GiB "
            f"({lay.label}) against {hbm / GIB:.1f} GiB HBM; {need}")
