"""The run forecast's Monte Carlo model: one training run from its first step to its token budget, with failures,
restarts, checkpoints, spares and repairs. Two implementations of the same model:

- `simulate_reference(inputs, seed, runs)`: a SimPy model (one process each for the trainer, the pooled failure
  clock and every repair), the readable definition;
- `simulate(inputs, seed, runs)`: the same state machine in numba over runs in parallel, for the bulk of the runs.
Both draw from the same counter-based random stream (SplitMix64 per run), in the same order, so a seed gives the
same runs to rounding (tests/test_forecast.py checks that).

The model. Time is wall-clock seconds; work is steady-state seconds (the run needs `work_s` of them at full speed).
- Failures of every unit in use (GPUs, trays, domains, links, software) are pooled: the minimum of independent
  exponentials is exponential with the summed rate, so one clock per run suffices. It runs on the cumulative
  hazard, so a rate change (a domain out of service) does not redraw it. Each failure draws its class by rate
  share and a healthy domain uniformly. Failures strike at any time, also during checkpoints and restarts.
- Compute runs in segments of `interval_s` wall seconds, each followed by a checkpoint write; the last segment
  ends the work and is checkpointed too (the final save), so with W a multiple of tau this is Daly's model. With
  `interval_s` 0 there are no checkpoints and a failure loses everything done.
- A failure loses the segment in progress (and the checkpoint being written), then costs `restart_s`; a failure
  during a restart starts the restart again (Daly 2006).
- GPU and tray failures take units out of their domain until `repair_s` later; a domain runs while its missing
  units are within its spares. A domain without spares is out of service: policy "shrink" restarts without it
  (fewer data-parallel replicas, `rate_factor[domains in the job]` of full speed, its checkpoint time from
  `checkpoint_s[domains]`) and takes it back at the first checkpoint after its repair (a planned restart);
  policy "wait" stops until every domain is back. Shrinking below what the layout allows (rate factor 0) waits.

Outputs per run: wall time and its split into restart, waiting for repair, lost work (compute and checkpoint writes
rolled back), checkpoint writes, degraded running (the extra time of running at reduced speed) and useful work
(which sums to `work_s`), and the failure count per class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
import simpy

CLASSES = ("gpu", "tray", "domain", "link", "software")
CAUSES = ("restart", "wait_repair", "lost_work", "checkpoint", "degraded", "useful")
SHRINK, WAIT_POLICY = 0, 1
COMPUTE, CHECKPOINT, DOWN, WAITING = 0, 1, 2, 3
REPAIR_CAPACITY = 4096  # pending repairs one run may hold at once
EPS_S = 1e-6  # a last segment shorter than this merges into the one before (float noise in summed progress)
MAX_EVENTS = 50_000_000  # a run that needs more is reported as not finishing (e.g. checkpoints off, many faults)

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64 increment (Steele, Lea, Flood 2014)
_RUN_GAMMA = 0xD1B54A32D192ED03
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_U53 = 2.0 ** -53


@dataclass(frozen=True)
class SimInputs:
    """Everything one forecast needs, as plain numbers (built from a plan by planner.forecast)."""

    work_s: float  # steady-state seconds of work (token budget / full-speed tokens per second)
    interval_s: float  # compute wall seconds between checkpoints; 0: no checkpoints
    restart_s: float  # detection + rescheduling + reload
    repair_s: float  # until a failed GPU or tray is back as a spare
    domains: int
    spares: int  # spare GPUs per domain
    rate_per_domain_s: float  # failures per second of one domain in use (all classes)
    class_probs: tuple[float, ...]  # share of each class in CLASSES
    class_units: tuple[int, ...]  # GPUs a failure of each class takes out of its domain
    rate_factor: tuple[float, ...]  # speed with n domains in the job, n = 0..domains (1.0 at n = domains)
    checkpoint_s: tuple[float, ...]  # checkpoint write time with n domains in the job
    policy: int = SHRINK

    def __post_init__(self):
        if len(self.rate_factor) != self.domains + 1 or len(self.checkpoint_s) != self.domains + 1:
            raise ValueError("rate_factor and checkpoint_s need one entry per domain count 0..domains")
        if self.rate_factor[self.domains] <= 0:
            raise ValueError("the full layout must run (rate_factor[domains] > 0)")


# ---------------------------------------------------------------------------------------------- random stream

def _mix_py(z: int) -> int:
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK
    return z ^ (z >> 31)


class Stream:
    """SplitMix64 stream of run `run` under `seed` (pure Python twin of the numba one)."""

    def __init__(self, seed: int, run: int):
        self.state = _mix_py(_mix_py(seed & _MASK) ^ ((run * _RUN_GAMMA) & _MASK))

    def uniform(self) -> float:
        self.state = (self.state + _GOLDEN) & _MASK
        return (_mix_py(self.state) >> 11) * _U53


_G = np.uint64(_GOLDEN)
_RG = np.uint64(_RUN_GAMMA)
_M1, _M2 = np.uint64(_MIX1), np.uint64(_MIX2)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)


@numba.njit(cache=True, inline="always")
def _mix(z):
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@numba.njit(cache=True, inline="always")
def _uniform(state):
    """Advance a one-element uint64 state array and return a float in [0, 1)."""
    state[0] = state[0] + _G
    return np.float64(_mix(state[0]) >> _S11) * _U53


# ------------------------------------------------------------------------------------------------ numba model

@numba.njit(cache=True, inline="always")
def _nth_healthy(pick, out_sorted, k_out):
    """Index of the `pick`-th (0-based) domain in service, in index order, in O(domains out) instead of a scan over
    all domains: every domain out of service at or below the candidate shifts it up by one (the out list is
    ascending, so one pass settles it). The same domain the scan over all domains picks, so the same runs."""
    d = pick
    for j in range(k_out):
        if out_sorted[j] <= d:
            d += 1
        else:
            break
    return d


@numba.njit(cache=True, inline="always")
def _sorted_insert(arr, n, value):
    """Insert `value` into the ascending first n entries of arr (room for n + 1)."""
    i = n
    while i > 0 and arr[i - 1] > value:
        arr[i] = arr[i - 1]
        i -= 1
    arr[i] = value


@numba.njit(cache=True, inline="always")
def _sorted_remove(arr, n, value):
    """Remove `value` from the ascending first n entries of arr."""
    i = 0
    while arr[i] != value:
        i += 1
    for j in range(i, n - 1):
        arr[j] = arr[j + 1]


@numba.njit(cache=True)
def _run_one(seed, run, work, tau, restart, repair, n_dom, spares, rate_dom, cum_probs, units, rf, ck, policy,
             out_times, out_fails):
    """One run of the state machine described in the module docstring; returns 0, or 1 when it did not finish."""
    state = np.empty(1, dtype=np.uint64)
    state[0] = _mix(_mix(seed) ^ (np.uint64(run) * _RG))
    n_cls = cum_probs.shape[0]
    missing = np.zeros(n_dom, dtype=np.int64)
    is_out = np.zeros(n_dom, dtype=np.bool_)
    out_sorted = np.empty(n_dom, dtype=np.int64)  # the domains out of service, ascending (first k_out entries)
    rep_t = np.empty(REPAIR_CAPACITY)
    rep_d = np.empty(REPAIR_CAPACITY, dtype=np.int64)
    rep_u = np.empty(REPAIR_CAPACITY, dtype=np.int64)
    n_rep = 0
    k_out = 0
    n_job = n_dom
    t = 0.0
    p = 0.0
    seg_wall = 0.0
    seg_work = 0.0
    ck_wall = 0.0
    last = False
    t_up = 0.0
    phase = COMPUTE
    t_restart = t_wait = t_lost = t_ckpt = t_degraded = t_useful = 0.0
    h = -math.log(1.0 - _uniform(state))
    lam = rate_dom * n_dom
    finished = False
    for _ in range(MAX_EVENTS):
        dt_rep = math.inf
        i_rep = -1
        for i in range(n_rep):
            if rep_t[i] - t < dt_rep:
                dt_rep = rep_t[i] - t
                i_rep = i
        dt_fail = h / lam if lam > 0.0 else math.inf
        r = rf[n_job]
        if phase == COMPUTE:
            remaining = work - p
            dt_state = (remaining - seg_work) / r
            last = True
            if tau > 0.0 and tau - seg_wall < dt_state - EPS_S:
                dt_state = tau - seg_wall
                last = False
            if tau > 0.0 and seg_wall == 0.0 and not (policy == SHRINK and n_job < n_dom - k_out):
                # Fast-forward whole segment + checkpoint cycles that end before the next event and the last
                # segment; the same arithmetic as stepping them one by one.
                cycle = tau + ck[n_job]
                n = math.floor(remaining / (r * tau)) - 1
                dt_event = min(dt_fail, dt_rep)
                if dt_event < math.inf:
                    n = min(n, math.floor(dt_event / cycle))
                if n >= 1:
                    dt = n * cycle
                    t += dt
                    h -= lam * dt
                    p += n * r * tau
                    t_useful += n * r * tau
                    t_degraded += n * (tau - r * tau)
                    t_ckpt += n * ck[n_job]
                    continue
        elif phase == CHECKPOINT:
            dt_state = ck[n_job] - ck_wall
        elif phase == DOWN:
            dt_state = t_up - t
        else:
            dt_state = math.inf
        dt = min(dt_rep, dt_state, dt_fail)
        t += dt
        if lam > 0.0:
            h = max(h - lam * dt, 0.0)
        if phase == COMPUTE:
            seg_wall += dt
            seg_work += r * dt
        elif phase == CHECKPOINT:
            ck_wall += dt
        elif phase == DOWN:
            t_restart += dt
        else:
            t_wait += dt
        if dt == dt_rep:  # a repair comes back
            d = rep_d[i_rep]
            missing[d] -= rep_u[i_rep]
            n_rep -= 1
            rep_t[i_rep], rep_d[i_rep], rep_u[i_rep] = rep_t[n_rep], rep_d[n_rep], rep_u[n_rep]
            if is_out[d] and missing[d] <= spares:
                is_out[d] = False
                _sorted_remove(out_sorted, k_out, d)
                k_out -= 1
                lam = rate_dom * (n_dom - k_out)
                if phase == WAITING and ((policy == WAIT_POLICY and k_out == 0) or
                                         (policy == SHRINK and rf[n_dom - k_out] > 0.0)):
                    phase = DOWN
                    t_up = t + restart
        elif dt == dt_state:
            if phase == COMPUTE:
                if last:
                    seg_work = work - p
                if tau == 0.0:
                    t_useful += seg_work
                    t_degraded += seg_wall - seg_work
                    finished = True
                    break
                phase = CHECKPOINT
                ck_wall = 0.0
            elif phase == CHECKPOINT:
                p += seg_work
                t_useful += seg_work
                t_degraded += seg_wall - seg_work
                t_ckpt += ck_wall
                seg_wall = seg_work = ck_wall = 0.0
                if last:
                    finished = True
                    break
                if policy == SHRINK and n_job < n_dom - k_out:  # a repaired domain rejoins: planned restart
                    phase = DOWN
                    t_up = t + restart
                else:
                    phase = COMPUTE
            else:  # the restart is done: the healthy domains form the job
                n_job = n_dom - k_out
                phase = WAITING if rf[n_job] <= 0.0 else COMPUTE
        else:  # a failure
            u = _uniform(state)
            c = n_cls - 1
            for j in range(n_cls):
                if u < cum_probs[j]:
                    c = j
                    break
            healthy = n_dom - k_out
            d = _nth_healthy(min(int(_uniform(state) * healthy), healthy - 1), out_sorted, k_out)
            h = -math.log(1.0 - _uniform(state))
            out_fails[c] += 1
            if units[c] > 0 and repair > 0.0:
                if n_rep == REPAIR_CAPACITY:
                    return 1
                missing[d] += units[c]
                rep_t[n_rep], rep_d[n_rep], rep_u[n_rep] = t + repair, d, units[c]
                n_rep += 1
                if missing[d] > spares:
                    is_out[d] = True
                    _sorted_insert(out_sorted, k_out, d)
                    k_out += 1
                    lam = rate_dom * (n_dom - k_out)
            if phase == COMPUTE or phase == CHECKPOINT:
                t_lost += seg_wall + ck_wall
                seg_wall = seg_work = ck_wall = 0.0
            if (policy == WAIT_POLICY and k_out > 0) or rf[n_dom - k_out] <= 0.0:
                phase = WAITING
            else:
                phase = DOWN
                t_up = t + restart
    if not finished:
        return 1
    out_times[0] = t
    out_times[1] = t_restart
    out_times[2] = t_wait
    out_times[3] = t_lost
    out_times[4] = t_ckpt
    out_times[5] = t_degraded
    out_times[6] = t_useful
    return 0


@numba.njit(cache=True, parallel=True)
def _run_many(seed, first, count, work, tau, restart, repair, n_dom, spares, rate_dom, cum_probs, units, rf, ck,
              policy, times, fails, flags):
    for i in numba.prange(count):
        flags[i] = _run_one(seed, np.uint64(first + i), work, tau, restart, repair, n_dom, spares, rate_dom,
                            cum_probs, units, rf, ck, policy, times[i], fails[i])


@dataclass(frozen=True)
class Outcomes:
    """Per-run results: `times[:, 0]` wall seconds, `times[:, 1:]` seconds per cause in CAUSES order;
    `fails` counts per class in CLASSES order; `unfinished` marks runs that hit an internal limit."""

    times: np.ndarray
    fails: np.ndarray
    unfinished: np.ndarray

    @property
    def wall_s(self) -> np.ndarray:
        return self.times[:, 0]


def _cumulative(probs) -> np.ndarray:
    cum = np.cumsum(np.asarray(probs, dtype=float))
    if cum[-1] > 0:
        cum /= cum[-1]
    cum[-1] = 1.0
    return cum


def simulate(inputs: SimInputs, seed: int, runs: int, first_run: int = 0) -> Outcomes:
    """Runs `first_run .. first_run + runs - 1` of the numba model (parallel over runs, deterministic)."""
    times = np.zeros((runs, 1 + len(CAUSES)))
    fails = np.zeros((runs, len(CLASSES)), dtype=np.int64)
    flags = np.zeros(runs, dtype=np.int64)
    _run_many(np.uint64(seed & _MASK), first_run, runs, float(inputs.work_s), float(inputs.interval_s),
              float(inputs.restart_s), float(inputs.repair_s), int(inputs.domains), int(inputs.spares),
              float(inputs.rate_per_domain_s), _cumulative(inputs.class_probs),
              np.asarray(inputs.class_units, dtype=np.int64), np.asarray(inputs.rate_factor, dtype=float),
              np.asarray(inputs.checkpoint_s, dtype=float), int(inputs.policy), times, fails, flags)
    return Outcomes(times=times, fails=fails, unfinished=flags.astype(bool))


# ---------------------------------------------------------------------------------------------- SimPy model

class _Run:
    """One run as SimPy processes: the trainer, the pooled failure clock, one process per repair."""

    def __init__(self, inputs: SimInputs, seed: int, run: int):
        self.x = inputs
        self.env = simpy.Environment()
        self.rng = Stream(seed, run)
        self.cum = _cumulative(inputs.class_probs)
        self.missing = [0] * inputs.domains
        self.is_out = [False] * inputs.domains
        self.n_job = inputs.domains
        self.phase = COMPUTE
        self.wake: simpy.Event | None = None
        self.cause = dict.fromkeys(CAUSES, 0.0)
        self.fails = [0] * len(CLASSES)
        self.trainer = self.env.process(self._trainer())
        self.clock = self.env.process(self._failures())

    @property
    def k_out(self) -> int:
        return sum(self.is_out)

    @property
    def rate(self) -> float:
        return self.x.rate_per_domain_s * (self.x.domains - self.k_out)

    def _must_wait(self) -> bool:
        x = self.x
        return (x.policy == WAIT_POLICY and self.k_out > 0) or x.rate_factor[x.domains - self.k_out] <= 0.0

    def _trainer(self):
        x, env = self.x, self.env
        p = 0.0
        while True:
            start = env.now
            try:
                if self.phase == COMPUTE:
                    r = x.rate_factor[self.n_job]
                    seg, last = (x.work_s - p) / r, True
                    if x.interval_s > 0.0 and x.interval_s < seg - EPS_S:
                        seg, last = x.interval_s, False
                    yield env.timeout(seg)
                    seg_wall, seg_work = seg, (x.work_s - p) if last else r * seg
                    if x.interval_s == 0.0:
                        self.cause["useful"] += seg_work
                        self.cause["degraded"] += seg_wall - seg_work
                        return
                    self.phase = CHECKPOINT
                elif self.phase == CHECKPOINT:
                    yield env.timeout(x.checkpoint_s[self.n_job])
                    p += seg_work
                    self.cause["useful"] += seg_work
                    self.cause["degraded"] += seg_wall - seg_work
                    self.cause["checkpoint"] += env.now - start
                    if last:
                        return
                    rejoin = x.policy == SHRINK and self.n_job < x.domains - self.k_out
                    self.phase = DOWN if rejoin else COMPUTE
                elif self.phase == DOWN:
                    yield env.timeout(x.restart_s)
                    self.cause["restart"] += env.now - start
                    self.n_job = x.domains - self.k_out
                    self.phase = WAITING if x.rate_factor[self.n_job] <= 0.0 else COMPUTE
                else:
                    self.wake = env.event()
                    yield self.wake
                    self.cause["wait_repair"] += env.now - start
                    self.phase = DOWN
            except simpy.Interrupt:  # a failure: lose the segment in progress, then restart or wait
                elapsed = env.now - start
                if self.phase == COMPUTE:
                    self.cause["lost_work"] += elapsed
                elif self.phase == CHECKPOINT:
                    self.cause["lost_work"] += seg_wall + elapsed
                elif self.phase == DOWN:
                    self.cause["restart"] += elapsed
                else:
                    self.cause["wait_repair"] += elapsed
                self.phase = WAITING if self._must_wait() else DOWN

    def _failures(self):
        env = self.env
        h = -math.log(1.0 - self.rng.uniform())
        while True:
            lam = self.rate
            start = env.now
            try:
                if lam > 0.0:
                    yield env.timeout(h / lam)
                else:
                    yield env.event()  # no healthy domain: only a repair (an interrupt) changes that
            except simpy.Interrupt:  # the rate changed: keep the hazard used so far
                h = max(h - lam * (env.now - start), 0.0)
                continue
            self._failure()
            h = -math.log(1.0 - self.rng.uniform())

    def _failure(self):
        x = self.x
        u = self.rng.uniform()
        c = next((j for j, edge in enumerate(self.cum) if u < edge), len(self.cum) - 1)
        healthy = [d for d in range(x.domains) if not self.is_out[d]]
        d = healthy[min(int(self.rng.uniform() * len(healthy)), len(healthy) - 1)]
        self.fails[c] += 1
        units = x.class_units[c]
        if units > 0 and x.repair_s > 0.0:
            self.missing[d] += units
            self.env.process(self._repair(d, units))
            if self.missing[d] > x.spares:
                self.is_out[d] = True
        if self.trainer.is_alive:
            self.trainer.interrupt()

    def _repair(self, d: int, units: int):
        x = self.x
        yield self.env.timeout(x.repair_s)
        self.missing[d] -= units
        if self.is_out[d] and self.missing[d] <= x.spares:
            self.is_out[d] = False
            self.clock.interrupt()
            if self.phase == WAITING and not self._must_wait() and self.wake is not None \
                    and not self.wake.triggered:
                self.wake.succeed()

    def run(self) -> tuple[list[float], list[int]]:
        self.env.run(until=self.trainer)
        return [self.env.now, *(self.cause[c] for c in CAUSES)], self.fails


def simulate_reference(inputs: SimInputs, seed: int, runs: int, first_run: int = 0) -> Outcomes:
    """The same runs as `simulate`, through the SimPy model (slow: for tests and reading)."""
    times, fails = [], []
    for run in range(first_run, first_run + runs):
        t, f = _Run(inputs, seed, run).run()
        times.append(t)
        fails.append(f)
    return Outcomes(times=np.array(times), fails=np.array(fails, dtype=np.int64),
                    unfinished=np.zeros(runs, dtype=bool))
