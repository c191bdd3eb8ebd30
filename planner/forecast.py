"""The run forecast: from a plan's steady-state speed to the date the model is done, with failures, restarts,
checkpoints and spares (the Monte Carlo model is in planner.forecast_sim, the closed forms in
planner.forecast_formulas, the failure figures in topologies/reliability/).

`prepare` turns a plan, a token budget and reliability figures into the model's inputs: the work (token budget /
tokens per second of `simulator.estimate`), the checkpoint size (parameters in the master precision plus optimizer
state, from the ModelSpec) and its write time at the topology's checkpoint bandwidth per domain (every domain in the
job writes its share), the restart cost (detection + rescheduling + reading the checkpoint back), the pooled failure
rate of the GPUs, trays, domains and links in use, the spares per domain, and the speed of the layout with fewer
domains (estimate() of the plan with fewer data-parallel replicas, each keeping its share of the batch).
`forecast` runs the Monte Carlo and summarises it; `best_interval` searches checkpoint intervals with common random
numbers; `forecast_days` is the planner's short form.

"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from rackcast.planner.forecast_formulas import daly_interval_s, young_interval_s
from rackcast.planner.forecast_sim import CAUSES, CLASSES, SHRINK, WAIT_POLICY, SimInputs, simulate
from rackcast.bounds import parse_date
from rackcast.errors import RackcastError
from rackcast.modelspec import ModelSpec
from rackcast.plan import ParallelSpec, Plan, validate
from rackcast.simulator.estimate import Estimate, estimate
from rackcast.simulator.memory import BYTES, FP32, rank_params
from rackcast.topologies.reliability import SPARES_POLICIES, ReliabilitySpec, load_reliability
from rackcast.topologies.spec import Topology
from rackcast.units import SECONDS_PER_DAY, SECONDS_PER_HOUR

CHUNK_RUNS = 1000  # runs per numba call, so progress shows and Ctrl-C is seen between calls
SEARCH_RUNS = 2000  # runs per interval in the checkpoint-interval search
SEARCH_POINTS = 21  # intervals in the search grid, geometric around Young's interval
SEARCH_SPAN = 2.5  # the grid spans Young's interval x 2^-SPAN .. x 2^+SPAN

# Work bounds, checked before the Monte Carlo starts: the steady-state run it forecasts, the events (checkpoints and
# failures) one run goes through, and the runs; beyond them a forecast would not finish in minutes.
MAX_STEADY_DAYS = 3650.0  # ten years of steady-state training
MAX_EVENTS_PER_RUN = 1_000_000
MAX_RUNS = 1_000_000
MAX_TOTAL_EVENTS = 5e9  # runs x events per run (the numba model does ~1e8-1e9 events/s)
MAX_EXACT_SHRINK = 256  # shrunk layouts estimated one by one (each estimate takes milliseconds)

Progress = Callable[[int, int], None]


def checkpoint_bytes(spec: ModelSpec, plan: Plan) -> float:
    """One checkpoint: every parameter in its master precision (fp32 with a master copy) plus optimizer state
    (AdamW: 2 fp32 moments; MuonH: 1 fp32 momentum, 2 for the Adam and AdamH groups), as simulator.memory counts."""
    whole = rank_params(spec, replace(plan, parallel=ParallelSpec(), schedule="1f1b"))
    params = whole.dense + whole.expert
    weight_bytes = FP32 if plan.optimizer.master_weights else BYTES[plan.precision]
    if plan.optimizer.name == "adamw":
        states = 2 * FP32 * params
    else:
        states = FP32 * (params + whole.adam_only + whole.head)
    return weight_bytes * params + states


def _replicas_with(plan: Plan, topo: Topology, domains_in_job: int) -> tuple[int, int]:
    """Data-parallel replicas (and domains they use) that fit on `domains_in_job` healthy domains; (0, 0) if the
    layout cannot shrink that way (a replica neither fills whole domains nor packs evenly into one)."""
    usable = topo.scale_up.usable_gpus
    replica_gpus = topo.gpus // plan.parallel.data
    if replica_gpus <= usable and usable % replica_gpus == 0:
        return domains_in_job * (usable // replica_gpus), domains_in_job
    if replica_gpus % usable == 0:
        per = replica_gpus // usable
        return domains_in_job // per, (domains_in_job // per) * per
    return 0, 0


def shrink_factors(plan: Plan, spec: ModelSpec, topo: Topology, full: Estimate) -> list[float]:
    """Speed (tokens/s over the full layout's) with n = 0..domains healthy domains in the job; 0 where the layout
    cannot run. Each replica keeps its share of the global batch, so steps carry fewer tokens. The MAX_EXACT_SHRINK
    largest n are estimated; below them (that many domains out at once: a state runs almost never reach) the speed
    scales with the replicas left, as `prepare(exact_shrink=False)` does for all, so the work stays bounded."""
    factors = []
    per_replica_batch = plan.batch.global_batch // plan.parallel.data
    for n in range(topo.domains + 1):
        if n == topo.domains:
            factors.append(1.0)
            continue
        replicas, used = _replicas_with(plan, topo, n)
        if replicas < 1 or replicas >= plan.parallel.data:
            factors.append(0.0 if replicas < 1 else 1.0)
            continue
        if n < topo.domains - MAX_EXACT_SHRINK:
            factors.append(replicas / plan.parallel.data)
            continue
        small = replace(plan, parallel=replace(plan.parallel, data=replicas),
                        batch=replace(plan.batch, global_batch=per_replica_batch * replicas),
                        topology=replace(plan.topology, domains=used))
        small_topo = topo.with_domains(used)
        try:
            validate(small, spec, small_topo.gpus)
        except RackcastError:
            factors.append(0.0)
            continue
        factors.append(estimate(small, spec=spec, topo=small_topo).tokens_per_s / full.tokens_per_s)
    return factors


@dataclass(frozen=True)
class Setup:
    """What the forecast derived from the plan and the reliability figures (all reported)."""

    tokens: float
    tokens_per_s: float
    steady_days: float
    gpus: int
    domains: int
    spares_per_domain: int
    checkpoint_bytes: float
    checkpoint_write_s: float  # with every domain writing
    restart_s: float  # detection + rescheduling + reload
    reload_s: float
    job_failures_per_day: dict[str, float]  # whole job at full strength, by class
    mtbf_s: float  # whole job at full strength
    rate_factor: list[float]
    policy: str
    interval_s: float
    inputs: SimInputs


def prepare(plan: Plan, tokens: float | None = None, reliability: ReliabilitySpec | None = None,
            interval_s: float | None = None, policy: str | None = None, est: Estimate | None = None,
            exact_shrink: bool = True) -> Setup:
    """The Monte Carlo inputs for `plan` (see the module docstring). exact_shrink=False scales the speed of a
    shrunk layout linearly with its replicas instead of estimating it (for fast planner calls)."""
    rel = reliability or load_reliability()
    policy = policy or rel.spares_policy
    if policy not in SPARES_POLICIES:
        raise RackcastError(f"spares policy must be one of {', '.join(SPARES_POLICIES)}, got {policy!r}")
    interval_s = rel.checkpoint_interval_s if interval_s is None else float(interval_s)
    if not math.isfinite(interval_s) or interval_s < 0:
        raise RackcastError(f"checkpoint interval must be >= 0 (0: no checkpoints), got {interval_s}")
    tokens = plan.tokens if tokens is None else float(tokens)
    if not math.isfinite(tokens) or tokens <= 0:
        raise RackcastError("a positive token budget is needed (or tokens: in the plan)", option="tokens")
    spec, topo = plan.model_spec(), plan.topology_spec()
    est = est or estimate(plan, spec=spec, topo=topo)
    work_s = tokens / est.tokens_per_s
    if work_s / SECONDS_PER_DAY > MAX_STEADY_DAYS:
        raise RackcastError(f"tokens: {tokens:.3g} tokens at {est.tokens_per_s:.3g} tokens/s take "
                            f"{work_s / SECONDS_PER_DAY:,.0f} days of steady-state training; the forecast covers at "
                            f"most {MAX_STEADY_DAYS:,.0f} days")
    su = topo.scale_up
    domains, usable = topo.domains, su.usable_gpus
    spares = su.domain_size - usable
    tray_gpus = su.gpus_per_tray or su.domain_size
    trays = math.ceil(usable / tray_gpus)
    links = usable * topo.scale_out.nics_per_gpu
    r = rel.rates
    # A rack-scale NVLink fabric (switch trays cabled to several compute trays, as NVL72) fails as a unit; an HGX
    # node's NVSwitches sit on its one baseboard, whose faults the GPU and tray rates already count (Llama 3's
    # "faulty GPU (incl. NVLink)" row), so the fabric rate applies only where a domain spans several trays.
    fabric_units = 1 if su.domain_size > tray_gpus else 0
    per_domain_day = {"gpu": usable * r.gpu_per_gpu_day, "tray": trays * r.tray_per_tray_day,
                      "domain": fabric_units * r.rack_per_rack_day, "link": links * r.link_per_link_day,
                      "software": usable * r.software_per_gpu_day}
    rate_domain_day = sum(per_domain_day.values())
    storage_Bps = topo.checkpoint_storage_Bps or rel.fallback_storage_Bps_per_gpu * usable
    if storage_Bps <= 0:
        raise RackcastError(f"topology {topo.name} has no checkpoint_storage_Bps and the reliability figures no "
                            f"fallback_storage_Bps_per_gpu: the checkpoint write time is unknown")
    ckpt = checkpoint_bytes(spec, plan)
    checkpoint_s = [0.0] + [ckpt / (storage_Bps * n) for n in range(1, domains + 1)]
    reload_s = ckpt / (storage_Bps * domains)  # read back at the write bandwidth (assumed symmetric)
    restart_s = rel.detection_s + rel.reschedule_s + reload_s
    if exact_shrink:
        factors = shrink_factors(plan, spec, topo, est)
    else:
        factors = [_replicas_with(plan, topo, n)[0] / plan.parallel.data if n < domains else 1.0
                   for n in range(domains + 1)]
        factors = [min(f, 1.0) for f in factors]
    if interval_s == 0 and rate_domain_day > 0:
        raise RackcastError("checkpointing is disabled (interval 0) but failure rates are not zero: every failure "
                            "would restart the run from its first step")
    inputs = SimInputs(
        work_s=work_s, interval_s=interval_s, restart_s=restart_s, repair_s=rel.repair_s, domains=domains,
        spares=spares, rate_per_domain_s=rate_domain_day / SECONDS_PER_DAY,
        class_probs=tuple(per_domain_day[c] / rate_domain_day if rate_domain_day else 0.0 for c in CLASSES),
        class_units=(1, tray_gpus, 0, 0, 0), rate_factor=tuple(factors), checkpoint_s=tuple(checkpoint_s),
        policy=SHRINK if policy == "shrink" else WAIT_POLICY)
    job_rate_day = rate_domain_day * domains
    events = expected_events(work_s, interval_s, job_rate_day)
    if events > MAX_EVENTS_PER_RUN:
        raise RackcastError(f"checkpoint interval: {events:,.0f} checkpoints and failures expected per run "
                            f"({work_s / SECONDS_PER_DAY:,.1f} days, a checkpoint every {interval_s:g} s, "
                            f"{job_rate_day:,.1f} failures per day); the forecast runs at most "
                            f"{MAX_EVENTS_PER_RUN:,}")
    return Setup(
        tokens=tokens, tokens_per_s=est.tokens_per_s, steady_days=work_s / SECONDS_PER_DAY, gpus=topo.gpus,
        domains=domains, spares_per_domain=spares, checkpoint_bytes=ckpt, checkpoint_write_s=checkpoint_s[domains],
        restart_s=restart_s, reload_s=reload_s,
        job_failures_per_day={c: per_domain_day[c] * domains for c in CLASSES},
        mtbf_s=SECONDS_PER_DAY / job_rate_day if job_rate_day else math.inf, rate_factor=list(factors),
        policy=policy, interval_s=interval_s, inputs=inputs)


def expected_events(work_s: float, interval_s: float, job_failures_per_day: float) -> float:
    """Checkpoints plus failures one run goes through, about (the work bound of the Monte Carlo)."""
    checkpoints = work_s / interval_s if interval_s > 0 else 0.0
    return checkpoints + work_s / SECONDS_PER_DAY * job_failures_per_day


def check_runs(runs: int, setup: Setup) -> None:
    """Refuse a run count beyond the Monte Carlo's work bound (one line naming --runs)."""
    if not 1 <= runs <= MAX_RUNS:
        raise RackcastError(f"runs: {runs:,} is outside 1..{MAX_RUNS:,}")
    per_run = expected_events(setup.inputs.work_s, setup.interval_s, sum(setup.job_failures_per_day.values()))
    if runs * max(per_run, 1.0) > MAX_TOTAL_EVENTS:
        raise RackcastError(f"runs: {runs:,} runs x {per_run:,.0f} events each exceed the forecast's "
                            f"{MAX_TOTAL_EVENTS:.0e} events; fewer runs")


def run_many(inputs: SimInputs, seed: int, runs: int, progress: Progress | None = None):
    """All runs in chunks (same results as one call: each run's random stream depends only on seed and index)."""
    parts = []
    for first in range(0, runs, CHUNK_RUNS):
        parts.append(simulate(inputs, seed, min(CHUNK_RUNS, runs - first), first_run=first))
        if progress:
            progress(first + len(parts[-1].unfinished), runs)
    times = np.concatenate([p.times for p in parts])
    fails = np.concatenate([p.fails for p in parts])
    unfinished = np.concatenate([p.unfinished for p in parts])
    return times, fails, unfinished


@dataclass(frozen=True)
class IntervalSearch:
    best_s: float  # the interval minimising expected days (vertex of a quadratic in log interval near the best)
    best_expected_days: float
    young_s: float
    daly_s: float
    grid_s: list[float]
    grid_expected_days: list[float]
    runs: int


def best_interval(setup: Setup, seed: int = 0, runs: int = SEARCH_RUNS, grid_s: list[float] | None = None,
                  progress: Progress | None = None) -> IntervalSearch | None:
    """Expected days over a grid of checkpoint intervals for a prepared forecast; None when nothing fails."""
    if math.isinf(setup.mtbf_s):
        return None
    return search_intervals(setup.inputs, setup.checkpoint_write_s, setup.mtbf_s, seed, runs, grid_s, progress)


def search_intervals(inputs: SimInputs, checkpoint_s: float, mtbf_s: float, seed: int = 0, runs: int = SEARCH_RUNS,
                     grid_s: list[float] | None = None, progress: Progress | None = None) -> IntervalSearch:
    """Expected days for every interval of a grid (default: geometric around Young's interval), all on the same
    runs (common random numbers, so differences between intervals are not noise between samples)."""
    young = young_interval_s(checkpoint_s, mtbf_s)
    if grid_s is None:
        grid_s = [max(young * 2.0 ** float(e), 1.0) for e in np.linspace(-SEARCH_SPAN, SEARCH_SPAN, SEARCH_POINTS)]
    means = []
    for i, tau in enumerate(grid_s):
        outcome = simulate(replace(inputs, interval_s=tau), seed, runs)
        means.append(float(outcome.wall_s.mean()) / SECONDS_PER_DAY)
        if progress:
            progress(i + 1, len(grid_s))
    k = int(np.argmin(means))
    best, best_days = grid_s[k], means[k]
    lo, hi = max(k - 2, 0), min(k + 3, len(grid_s))
    if hi - lo >= 3:  # refine: the vertex of a parabola through the points around the best, in log interval
        x = np.log(grid_s[lo:hi])
        a, b, _ = np.polyfit(x, means[lo:hi], 2)
        if a > 0 and x[0] <= -b / (2 * a) <= x[-1]:
            best = float(math.exp(-b / (2 * a)))
    return IntervalSearch(best_s=float(best), best_expected_days=best_days, young_s=young,
                          daly_s=daly_interval_s(checkpoint_s, mtbf_s), grid_s=[float(g) for g in grid_s],
                          grid_expected_days=means, runs=runs)


@dataclass(frozen=True)
class Forecast:
    setup: Setup
    runs: int
    seed: int
    start: dt.date | None
    deadline: dt.date | None
    days: np.ndarray = field(repr=False)  # wall days of every run
    expected_days: float
    p10_days: float
    p50_days: float
    p90_days: float
    probability_by_deadline: float  # NaN without a deadline
    goodput: float  # useful (steady-state) time over wall time, over all runs
    lost_days: dict[str, float]  # mean days per cause (CAUSES except "useful")
    failures: dict[str, float]  # mean failures per run by class
    unfinished_runs: int
    interval: IntervalSearch | None

    def date_after(self, days: float) -> str:
        return (self.start + dt.timedelta(days=math.floor(days))).isoformat() if self.start else ""

    def as_dict(self) -> dict:
        s = self.setup
        out = {
            "tokens": s.tokens, "steady_state_days": s.steady_days, "tokens_per_s": s.tokens_per_s,
            "gpus": s.gpus, "domains": s.domains, "spares_per_domain": s.spares_per_domain,
            "spares_policy": s.policy, "checkpoint_interval_s": s.interval_s,
            "checkpoint_bytes": s.checkpoint_bytes, "checkpoint_write_s": s.checkpoint_write_s,
            "restart_s": s.restart_s, "reload_s": s.reload_s, "job_mtbf_hours": s.mtbf_s / SECONDS_PER_HOUR,
            "job_failures_per_day": s.job_failures_per_day, "speed_with_n_domains": s.rate_factor,
            "runs": self.runs, "seed": self.seed,
            "start": self.start.isoformat() if self.start else None,
            "deadline": self.deadline.isoformat() if self.deadline else None,
            "expected_days": self.expected_days,
            "p10_days": self.p10_days, "p50_days": self.p50_days, "p90_days": self.p90_days,
            "p10_date": self.date_after(self.p10_days) or None, "p50_date": self.date_after(self.p50_days) or None,
            "p90_date": self.date_after(self.p90_days) or None,
            "probability_by_deadline": None if math.isnan(self.probability_by_deadline)
            else self.probability_by_deadline,
            "goodput": self.goodput, "lost_days": self.lost_days, "failures_per_run": self.failures,
            "unfinished_runs": self.unfinished_runs,
        }
        if self.interval:
            iv = self.interval
            out["best_checkpoint_interval_s"] = iv.best_s
            out["best_interval_expected_days"] = iv.best_expected_days
            out["young_interval_s"] = iv.young_s
            out["daly_interval_s"] = iv.daly_s
            out["interval_search"] = {"runs": iv.runs, "interval_s": iv.grid_s, "expected_days": iv.grid_expected_days}
        return out


def forecast(plan: Plan, tokens: float | None = None, start: str | dt.date | None = None,
             deadline: str | dt.date | None = None, runs: int = 10_000, seed: int = 0,
             reliability: ReliabilitySpec | None = None, interval_s: float | None = None, policy: str | None = None,
             search: bool = True, search_runs: int = SEARCH_RUNS, progress: Progress | None = None,
             search_progress: Progress | None = None, setup: Setup | None = None) -> Forecast:
    """Monte Carlo forecast of the whole run (see the module docstring); deterministic for a seed."""
    if runs < 1:
        raise RackcastError(f"runs must be >= 1, got {runs}")
    if not 0 <= seed < 2**32:
        raise RackcastError(f"seed: {seed} is outside 0..2^32-1")
    start_d = parse_date(start, "start") if isinstance(start, str) else start
    deadline_d = parse_date(deadline, "deadline") if isinstance(deadline, str) else deadline
    if deadline_d is not None and start_d is None:
        raise RackcastError("a deadline needs a start date")
    if deadline_d is not None and deadline_d <= start_d:
        raise RackcastError(f"deadline {deadline_d} is not after the start {start_d}")
    setup = setup or prepare(plan, tokens, reliability, interval_s, policy)
    check_runs(runs, setup)
    times, fails, unfinished = run_many(setup.inputs, seed, runs, progress)
    days = times[:, 0] / SECONDS_PER_DAY
    days[unfinished] = math.inf
    finished = ~unfinished
    prob = math.nan
    if deadline_d is not None:
        prob = float(np.mean(days <= (deadline_d - start_d).days))
    p10, p50, p90 = (float(v) for v in np.percentile(days, [10, 50, 90]))
    useful = times[finished, 1 + CAUSES.index("useful")].sum()
    interval = best_interval(setup, seed, min(runs, search_runs), progress=search_progress) if search else None
    expected = float(days[0] + (days - days[0]).mean())  # the mean shifted by one run: exact when all runs agree
    return Forecast(
        setup=setup, runs=runs, seed=seed, start=start_d, deadline=deadline_d, days=days,
        expected_days=expected, p10_days=p10, p50_days=p50, p90_days=p90, probability_by_deadline=prob,
        goodput=float(useful / times[finished, 0].sum()) if finished.any() else 0.0,
        lost_days={c: float(times[finished, 1 + i].mean()) / SECONDS_PER_DAY
                   for i, c in enumerate(CAUSES) if c != "useful"},
        failures={c: float(fails[:, i].mean()) for i, c in enumerate(CLASSES)},
        unfinished_runs=int(unfinished.sum()), interval=interval)


def forecast_days(plan: Plan, tokens: float | None = None, deadline_days: float | None = None, *,
                  runs: int = 1000, seed: int = 0, reliability: ReliabilitySpec | None = None,
                  est: Estimate | None = None, exact_shrink: bool = False) -> tuple[float, float]:
    """For the planner: (P50 days to the token budget with failures, probability of finishing within
    `deadline_days`; NaN without a deadline). `est` reuses an estimate already made for the plan."""
    setup = prepare(plan, tokens, reliability, est=est, exact_shrink=exact_shrink)
    times, _, unfinished = run_many(setup.inputs, seed, runs)
    days = np.where(unfinished, math.inf, times[:, 0] / SECONDS_PER_DAY)
    prob = float(np.mean(days <= deadline_days)) if deadline_days is not None else math.nan
    return float(np.percentile(days, 50)), prob
