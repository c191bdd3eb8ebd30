"""Verified ranking: simulate candidates best estimate first until no unsimulated one can beat the best simulated one.

The closed-form estimate ranks every layout; the discrete-event simulator (simulator.step) is slower and closer to
what runs. A candidate the simulator has not seen could still win if its estimate is off, so the search keeps
simulating, in estimate order, until the next candidate's estimate, moved by the estimate's error band in its favour,
no longer beats the best simulated figure:

    days objective:  simulate the next candidate while  est_days x (1 - band) <  best simulated days
    mfu objective:   simulate the next candidate while  est_mfu  x (1 + band) >  best simulated MFU

Candidates are sorted by estimate, so the rule stops at the first one that fails it. The simulator is deterministic
and the rule is applied in estimate order, so which candidates end up simulated does not depend on the number of
worker processes: the pool keeps `workers` simulations running, the next candidates in estimate order that the rule
may still want (speculatively: a worker takes the next one as soon as it is free), and the results are applied in
estimate order; simulations still running at the stopping point are stopped and dropped. A cap bounds the work;
when it stops the search early the result says which candidate could still have won. Ctrl-C stops the simulations
cleanly and keeps what was simulated. A candidate whose step is too large to simulate (simulator.step.check_work)
keeps its estimate and counts as not best. `verify_ranking` applies the rule to a layout search's result
(planner.search) with simulator.step, without recording timelines (record=False: the same figures, faster).

    from rackcast.planner.verify import ESTIMATE_BAND, verify, verify_ranking
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Sequence

from rackcast.errors import RackcastError
from rackcast.plan import Plan
from rackcast.simulator import metrics

# The default error band of the closed-form estimate against the simulator (relative, on the step time), until the
# fidelity work provides a band per efficiency profile. Rationale: the estimate and the simulator price the same
# work with the same cost formulas; the simulator adds what a closed form cannot see (links shared between groups,
# drawn routing imbalance, the pipeline schedule's real timeline). Over the 48 best Marin 535B layouts on 11 GB200
# racks (`rackcast plan --model marin-535b-a23b --topology gb200-nvl72 --racks 11 --tokens 18e12 --max-simulate 48
# --json`) the estimate's step time was 0.4% to 2.5% above the simulated one; 3% covers that spread. Small CPU models
# with pipelines differ by much more (about 20% for tiny-moe on local-cpu, where host per-op time on the pipeline's
# critical path dominates): pass --band for those. The band is a search tolerance (how far an estimate may be off
# before a candidate is ruled out), not a prediction.
ESTIMATE_BAND = 0.03
# At most this many candidates are simulated per search by default (seconds each at 10,000+ GPUs).
MAX_SIMULATED = 48


@dataclass
class Verification:
    simulated: list[int]  # indices (in estimate order) whose simulation was kept
    stop_index: int  # first candidate not simulated (len(candidates) when all were)
    reason: str  # "verified" | "cap" | "interrupted" | "all"
    band: float
    cap: int


def can_beat(estimate_score: float, best_simulated: float, objective: str, band: float) -> bool:
    """Whether a candidate with this estimated score could beat the best simulated score within the band.
    Scores: days (lower is better) or MFU (higher is better)."""
    if math.isnan(best_simulated):
        return True
    if objective == "days":
        return estimate_score * (1.0 - band) < best_simulated
    return estimate_score * (1.0 + band) > best_simulated


_TASK: dict = {}  # the simulate_one of the running verify(); forked workers inherit it (closures do not pickle)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops the pool


def _run_task(i: int) -> dict:
    return _TASK["simulate_one"](i)


def _stop(pool: ProcessPoolExecutor) -> None:
    """Shut the pool down without waiting for the simulations it is running (their results are not wanted)."""
    workers_running = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in workers_running:
        proc.terminate()


def verify(estimates: Sequence[float], simulate_one: Callable[[int], dict], sim_score: Callable[[dict], float], *,
           objective: str, band: float = ESTIMATE_BAND, cap: int = MAX_SIMULATED, minimum: int = 1, workers: int = 1,
           on_result: Callable[[int, dict], None] | None = None,
           progress: Callable[[int, int, str], None] | None = None) -> Verification:
    """Apply the rule to candidates whose estimated scores are `estimates` (best first). simulate_one(i) returns the
    simulated figures of candidate i (run in a fork pool when workers > 1); sim_score(figures) its score, NaN when it
    must not count as best (e.g. it does not fit memory). The first `minimum` candidates are always simulated.
    on_result(i, figures) is called for every kept simulation, in estimate order."""
    n = len(estimates)
    cap = min(cap, n)
    kept: list[int] = []
    results: dict[int, dict] = {}
    best = math.nan
    i = 0
    reason = "all"
    pool = None
    futures: dict = {}  # in flight: future -> candidate index
    next_j = 0  # the next candidate to submit; candidates 0..next_j-1 are submitted (or done)

    def wanted(j: int) -> bool:  # the best simulated only gets better, so a candidate unwanted now stays unwanted
        return j < minimum or can_beat(estimates[j], best, objective, band)

    def top_up() -> None:  # keep every worker busy: submit, in estimate order, what the rule may still want
        nonlocal next_j
        submitted = next_j
        while len(futures) < workers and next_j < cap and wanted(next_j):
            futures[pool.submit(_run_task, next_j)] = next_j
            next_j += 1
        if progress and next_j > submitted:
            progress(len(kept), cap, f"simulating candidates {min(futures.values()) + 1}-{next_j} by estimate")

    _TASK["simulate_one"] = simulate_one
    if workers > 1 and cap > 1:
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork"),
                                   initializer=_ignore_sigint)
    try:
        while i < n:
            if i >= cap:
                reason = "cap"
                break
            if i >= minimum and not can_beat(estimates[i], best, objective, band):
                reason = "verified"
                break
            if pool is not None:
                top_up()
            while i not in results:
                if pool is None:
                    if progress:
                        progress(len(kept), cap, f"simulating candidate {i + 1} by estimate")
                    results[i] = simulate_one(i)
                    continue
                done, _ = wait(futures, return_when=FIRST_COMPLETED)
                for f in done:
                    results[futures.pop(f)] = f.result()
                top_up()  # a free worker takes the next candidate while candidate i is still running
            figures = results.pop(i)
            kept.append(i)
            if on_result:
                on_result(i, figures)
            score = sim_score(figures)
            if not math.isnan(score) and (math.isnan(best) or
                                          (score < best if objective == "days" else score > best)):
                best = score
            i += 1
    except KeyboardInterrupt:
        reason = "interrupted"
        for f, j in futures.items():  # keep what the interrupted round finished, in estimate order
            if f.done() and not f.cancelled() and f.exception() is None:
                results.setdefault(j, f.result())
        while i in results:
            kept.append(i)
            if on_result:
                on_result(i, results.pop(i))
            i += 1
        if pool is not None:
            _stop(pool)
            pool = None
    finally:
        if pool is not None and futures:  # the rule stopped: the speculative simulations still running are not wanted
            _stop(pool)
        elif pool is not None:
            pool.shutdown()
        _TASK.clear()
    if progress:
        progress(len(kept), len(kept), "simulated")
    return Verification(simulated=kept, stop_index=i, reason=reason, band=band, cap=cap)


def default_workers() -> int:
    """All cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


# ---------------------------------------------------------------- the search's simulations
def _simulate_one(plan: Plan) -> dict:
    """The simulated figures of `plan`, or {"refused": the line} for a step too large to simulate
    (simulator.step.check_work): the candidate keeps its estimate."""
    from rackcast.simulator.step import simulate

    try:
        res = simulate(plan, seed=0, record=False)  # the figures only: no timeline to keep
    except RackcastError as exc:
        return {"refused": str(exc)}
    return {"step_time_s": float(res.step_time_s), "tokens_per_s": float(res.tokens_per_s), "mfu": float(res.mfu),
            "peak_memory_bytes": float(res.peak_memory_bytes),
            "phases_s": {k: float(v) for k, v in dict(res.phases_s).items()}}


def simulate_plans(plans: list[Plan], workers: int) -> list[dict]:
    """Simulated figures of each plan (simulator.step), in a process pool when workers > 1."""
    if workers > 1 and len(plans) > 1:
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork")) as pool:
            return list(pool.map(_simulate_one, plans))
    return [_simulate_one(p) for p in plans]


def attach_simulation(result, row, sim: dict) -> None:
    """Keep a simulation's figures on a planner.search Row, with its days to the budget and whether it fits HBM."""
    sim["days"] = metrics.days_to_budget(result.request.tokens, sim["tokens_per_s"])
    sim["fits"] = bool(metrics.fits_memory(sim["peak_memory_bytes"], row.memory.get("host", 0.0), result.topo))
    row.sim = sim


def _score(row_or_sim, objective: str) -> float:
    return row_or_sim["days"] if objective == "days" else row_or_sim["mfu"]


def verify_ranking(result, progress=None) -> str:
    """Simulate the candidates of a planner.search Result best estimate first until none left unsimulated can beat
    the best simulated one within the estimate's error band; returns the line that says where the figures come
    from."""
    r, ranked = result.request, result.ranked
    estimates = [row.days if r.objective == "days" else row.mfu for row in ranked]

    def simulate_one(i: int) -> dict:
        return _simulate_one(result.plan_for(ranked[i]))

    def score(sim: dict) -> float:
        return _score(sim, r.objective) if sim.get("fits") else math.nan

    refused: dict[int, str] = {}  # candidates too large to simulate: the refusal

    def on_result(i: int, sim: dict) -> None:
        if "refused" in sim:
            refused[i] = sim["refused"]
        else:
            attach_simulation(result, ranked[i], sim)

    v = verify(estimates, simulate_one, score, objective=r.objective, band=r.band,
               cap=max(r.max_simulate, r.top), minimum=r.top, workers=r.workers, on_result=on_result, progress=progress)
    n = len(v.simulated)
    band = f"the estimate's {100 * v.band:.0f}% error band (planner.verify)"
    best = min((x for x in ranked if x.sim and x.sim["fits"]), default=None,
               key=lambda x: _score(x.sim, r.objective) * (1 if r.objective == "days" else -1))
    unit = "days" if r.objective == "days" else "MFU"

    def fmt(value: float) -> str:
        return f"{value:.3g} days" if r.objective == "days" else f"MFU {100 * value:.1f}%"

    head = f"{n - len(refused)} simulated (simulator.step, {r.workers} processes), best estimate first"
    if refused:
        first = min(refused)
        head += (f" ({len(refused)} too large to simulate keep their estimate, e.g. "
                 f"{ranked[first].layout.parallel_label}: {refused[first]})")
    if v.reason == "all":
        return f"{head}: every ranked candidate"
    if v.reason == "interrupted":
        return f"{head}; interrupted (Ctrl-C): the ranking is not verified past the simulated rows"
    nxt = ranked[v.stop_index]
    if best is None:
        return f"{head}; none of them fits memory when simulated, so the estimate's order stands unverified"
    if v.reason == "cap":
        return (f"{head}; stopped at the cap (--max-simulate {v.cap}): {nxt.layout.label} (estimate "
                f"{fmt(estimates[v.stop_index])}) could still beat the best simulated "
                f"({fmt(_score(best.sim, r.objective))}) "
                f"within {band}")
    return (f"{head}, until no other could beat the best simulated ({fmt(_score(best.sim, r.objective))}) within "
            f"{band}: the next, {nxt.layout.parallel_label}, is estimated at {fmt(estimates[v.stop_index])}; "
            f"simulated rows are ranked by simulated {unit}, the rest by estimate")
