"""Fit efficiency-profile factors to measured step and phase times (`rackcast calibrate --from-run/--from-measurement`).

The factors multiply a topology's efficiency profile (so the fitted topology predicts other layouts and scales):
    gemm            the GEMM and grouped-GEMM curves, surfaces or      identified by compute time (and optimizer time)
                    ceilings
    attention       the attention efficiency                           compute time of plans that differ in attention
                                                                       share (sequence length, micro-batch)
    memory_bound    the memory-bound efficiency and, where eager bytes  optimizer time, compute of different mixes
                    are counted (simulator.op_bytes; costs.eager_bytes_
                    time), the share of the measured bandwidth they
                    achieve (efficiency.eager_bandwidth, not capped at 1)
    all_reduce, all_gather, reduce_scatter, all_to_all, send_recv
                    that collective's bus-bandwidth curves             its exposed phase (exposed_dp_comm,
                                                                       exposed_expert_a2a, pipeline p2p + bubble)
    comm_compute_slowdown  additive (not a factor), clamped to [0, 0.95]  compute time of plans with and without
                                                                       overlapping communication
    op_overhead     the host times per op, all three (forward,          compute time of plans with different
                    backward, optimizer; simulator.host_overhead; only  micro-batch sizes (overhead is per op, the
                    where the topology has measured host_op_s)          rest per token)
Efficiencies are clamped to (0, 1] (eager_bandwidth only to (0, EAGER_BANDWIDTH_MAX]: cache-resident tensors may
beat the out-of-cache copy figure it is a share of). Identifiability: one step time alone fits one number, so with
step times only (no phase times) a single `overall` factor scales every efficiency together; each phase time adds
one equation, so k factors need at least k independent measured quantities (a single run with phases fits
gemm-or-compute, one factor per exposed communication phase and optimizer; separating gemm, attention and
memory_bound needs runs with different compute mixes). The result reports each factor's posterior standard error and
whether it was identified (standard error below SE_IDENTIFIED).

Method: residuals log(predicted / measured step time) and (predicted - measured phase) / measured step time, over
all measurements, each weighted by NOISE / its measurement's scatter (Measurement.scatter; weighted least squares:
a measurement that moved between repeats says less), evaluated with the vectorised simulator.estimate.step_time
(features computed once per plan); Levenberg-Marquardt on log-factors with numeric derivatives, minimising
    sum r^2 + (NOISE / PRIOR_SIGMA)^2 sum theta^2,
the maximum a posteriori estimate for residuals of scatter NOISE and a log-normal prior on each factor,
log factor ~ N(0, PRIOR_SIGMA^2) around its microbenchmark value (comm_compute_slowdown, additive, gets the same
normal prior on its shift, in absolute units: see PRIOR_SIGMA). Where the measurements pin a factor the prior barely
moves it; where they are silent on it, or only fix a combination with others, it stays near its microbenchmark
value instead of drifting. Standard errors are posterior ones: sqrt(diag(inv(J^T J + w I))) x NOISE, w the prior
weight.

    rackcast calibrate --from-run runs/tiny-1proc --out fitted.yaml     # fits the factors a run informs
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from rackcast.plan import Plan
from rackcast.simulator.estimate import plan_features, step_time
from rackcast.topologies.spec import EAGER_BANDWIDTH_MAX, CollectiveCurves, CurvePoint, Topology

FACTORS = ("gemm", "attention", "memory_bound", "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
           "send_recv", "comm_compute_slowdown", "op_overhead")
# Trainer phases and the estimate's: the trainer counts pipeline p2p inside the bubble, so the two are summed.
PHASE_GROUPS = {"compute": ("compute",), "exposed_expert_a2a": ("exposed_expert_a2a",),
                "exposed_tensor_comm": ("exposed_tensor_comm",), "exposed_fsdp_gather": ("exposed_fsdp_gather",),
                "pipeline": ("pipeline_p2p", "pipeline_bubble"), "exposed_dp_comm": ("exposed_dp_comm",),
                "optimizer": ("optimizer",), "host_transfer": ("host_transfer",)}
NOISE = 0.03  # assumed scatter of one measured quantity (fraction of its step time), for the standard errors
# Prior standard deviation of each log-factor, chosen a priori (not tuned to any validation result): a factor e (2.7x)
# off its microbenchmark value is a one-sigma event, two sigma 7.4x. Microbenchmarks of the same kernels rarely miss
# what a training step achieves by more than a few x, so this admits every plausible correction while ruling out
# the order-of-magnitude drifts of a poorly identified fit. comm_compute_slowdown is additive, in [0, 0.95]: its
# shift keeps the same weight, so its prior is N(0, PRIOR_SIGMA^2) in absolute units, wider than its whole range:
# effectively none, as before (its clamp bounds it, not the prior).
PRIOR_SIGMA = 1.0
SE_IDENTIFIED = 0.1  # a factor counts as identified when its standard error (log factor) is below this
EFFICIENCY_FLOOR = 1e-6  # a scaled efficiency stays in [this, 1]: positive, so every time it divides stays finite


@dataclass
class Measurement:
    plan: Plan
    step_time_s: float
    phases_s: dict[str, float] = field(default_factory=dict)  # trainer phase names (rackcast.vocab.MEASURED_PHASES)
    label: str = ""
    # Relative scatter of this measurement where it was measured (validate: half the relative range of its repeats
    # or run halves); below NOISE, or unknown (0), it counts as NOISE. Its residuals weigh NOISE / scatter.
    scatter: float = 0.0


@dataclass
class FitResult:
    fitted: dict[str, float]  # the fitted parameters by name ("overall" when only step times were measured)
    factors: dict[str, float]  # what they mean for every factor apply_factors knows
    std_error: dict[str, float]  # of log(factor); slowdown: absolute
    identified: dict[str, bool]
    rms_before: float
    rms_after: float
    step_error_before: list[float]  # relative step-time errors per measurement
    step_error_after: list[float]
    topology: Topology
    iterations: int

    def as_dict(self) -> dict:
        return {"fitted": self.fitted, "factors": self.factors, "std_error": self.std_error,
                "identified": self.identified,
                "rms_residual_before": self.rms_before, "rms_residual_after": self.rms_after,
                "step_error_before": self.step_error_before, "step_error_after": self.step_error_after,
                "iterations": self.iterations}


def _bounded(efficiency: float) -> float:
    return min(1.0, max(EFFICIENCY_FLOOR, efficiency))


def _scale(curve: list[CurvePoint], f: float) -> list[CurvePoint]:
    return [CurvePoint(p.size, _bounded(p.value * f)) for p in curve]


def apply_factors(topo: Topology, factors: dict[str, float]) -> Topology:
    """The topology with its efficiency profile scaled by `factors` (missing names: unchanged)."""
    e = topo.efficiency
    g = factors.get("gemm", 1.0)
    coll = {k: CollectiveCurves(_scale(c.scale_up, factors.get(k, 1.0)), _scale(c.scale_out, factors.get(k, 1.0)))
            for k, c in e.collectives.items()}
    slow = min(0.95, max(0.0, e.comm_compute_slowdown + factors.get("comm_compute_slowdown", 0.0)))
    eff = replace(e, gemm=_scale(e.gemm, g), grouped_gemm=_scale(e.grouped_gemm, g),
                  gemm_surface=[p.scaled(g, EFFICIENCY_FLOOR) for p in e.gemm_surface],
                  grouped_gemm_surface=[p.scaled(g, EFFICIENCY_FLOOR) for p in e.grouped_gemm_surface],
                  gemm_ceiling=min(1.0, e.gemm_ceiling * g), grouped_gemm_ceiling=min(1.0, e.grouped_gemm_ceiling * g),
                  host_op_s=e.host_op_s.scaled(factors.get("op_overhead", 1.0)),
                  attention=_bounded(e.attention * factors.get("attention", 1.0)),
                  attention_surface=[p.scaled(factors.get("attention", 1.0), EFFICIENCY_FLOOR)
                                     for p in e.attention_surface],
                  memory_bound=_bounded(e.memory_bound * factors.get("memory_bound", 1.0)),
                  eager_bandwidth=min(EAGER_BANDWIDTH_MAX, max(EFFICIENCY_FLOOR, e.eager_bandwidth
                                                                * factors.get("memory_bound", 1.0))),
                  collectives=coll, comm_compute_slowdown=slow)
    return topo.with_efficiency(eff)


class _Problem:
    def __init__(self, measurements: list[Measurement], topo: Topology):
        self.topo = topo
        feats = []
        for m in measurements:
            spec = m.plan.model_spec()
            t = topo.with_usable_gpus(m.plan.topology.usable_gpus) if m.plan.topology.usable_gpus else topo
            feats.append(plan_features(spec, m.plan, t))  # host ops in ops: x host_op_s in step_time
        self.features = {k: np.array([f[k] for f in feats], dtype=float) for k in feats[0]}
        self.step = np.array([m.step_time_s for m in measurements])
        self.phase_rows = []  # (measurement index, phase group, measured seconds)
        for i, m in enumerate(measurements):
            for group, names in PHASE_GROUPS.items():
                if any(n in m.phases_s for n in names):
                    self.phase_rows.append((i, group, sum(m.phases_s.get(n, 0.0) for n in names)))
        # Weighted least squares: each residual over its measurement's scatter, in units of NOISE.
        each = np.array([NOISE / max(NOISE, m.scatter if m.scatter == m.scatter else 0.0) for m in measurements])
        self.weights = np.concatenate([each, np.array([each[i] for i, _, _ in self.phase_rows])])

    def predict(self, factors: dict[str, float]) -> dict[str, np.ndarray]:
        return step_time(self.features, apply_factors(self.topo, factors))

    def residuals(self, factors: dict[str, float]) -> np.ndarray:
        p = self.predict(factors)
        r = [np.log(p["step_time_s"] / self.step)]
        if self.phase_rows:
            r.append(np.array([(sum(p[n][i] for n in PHASE_GROUPS[g]) - v) / self.step[i]
                               for i, g, v in self.phase_rows]))
        return np.concatenate(r)

    def weighted(self, factors: dict[str, float]) -> np.ndarray:
        return self.residuals(factors) * self.weights


def _to_factors(names: list[str], theta: np.ndarray) -> dict[str, float]:
    out = {}
    for n, t in zip(names, theta):
        if n == "overall":
            out.update({k: math.exp(t) for k in FACTORS if k not in ("comm_compute_slowdown", "op_overhead")})
            out["op_overhead"] = math.exp(-t)  # a time, not an efficiency: slower is larger
        elif n == "comm_compute_slowdown":
            out[n] = float(t)
        else:
            out[n] = math.exp(t)
    return out


def fit(measurements: list[Measurement], topo: Topology, names: list[str] | None = None,
        iterations: int = 60, prior_sigma: float = PRIOR_SIGMA) -> FitResult:
    """Least-squares factors (see the module docstring). names: which to fit (default: all that the measurements
    are sensitive to; `overall` alone when no phase times were measured). The host per-op overhead is part of the
    predictions (and op_overhead a factor) where the topology has measured host_op_s. prior_sigma: the prior's
    standard deviation of a log-factor (a very large one leaves the data alone to decide)."""
    if not measurements:
        raise ValueError("fit needs at least one measurement")
    prob = _Problem(measurements, topo)
    if names is None:
        names = list(FACTORS) if prob.phase_rows else ["overall"]
    theta = np.zeros(len(names))
    h = 1e-4
    prior = (NOISE / prior_sigma) ** 2

    def jac(th, r0):
        cols = []
        for j in range(len(th)):
            t2 = th.copy()
            t2[j] += h
            cols.append((prob.weighted(_to_factors(names, t2)) - r0) / h)
        return np.stack(cols, axis=1)

    plain_before = prob.residuals(_to_factors(names, theta))
    r = plain_before * prob.weights
    J = jac(theta, r)
    active = np.linalg.norm(J, axis=0) > 1e-9  # factors the measurements are not sensitive to stay at 1
    if names != ["overall"]:
        names = [n for n, a in zip(names, active) if a]
        theta = np.zeros(len(names))
        J = J[:, active]
    rms_before = float(np.sqrt(np.mean(plain_before ** 2)))
    step_before = list(np.exp(plain_before[: len(measurements)]) - 1)
    lam, it = 1e-2, 0
    cost = float(r @ r + prior * theta @ theta)
    for it in range(1, iterations + 1):
        A = J.T @ J + prior * np.eye(len(names))
        g = J.T @ r + prior * theta
        step = np.linalg.solve(A + lam * np.diag(np.diag(A) + 1e-12), -g)
        t_new = theta + step
        r_new = prob.weighted(_to_factors(names, t_new))
        c_new = float(r_new @ r_new + prior * t_new @ t_new)
        if c_new < cost:
            theta, r, cost, lam = t_new, r_new, c_new, max(lam / 3, 1e-7)
            J = jac(theta, r)
            if np.max(np.abs(step)) < 1e-7:
                break
        else:
            lam *= 4
            if lam > 1e8:
                break
    # Standard errors at the assumed measurement scatter (not the residual, which is 0 for exact data): they say
    # how well the measurements pin each factor, whatever the luck of this fit.
    cov = np.linalg.pinv(J.T @ J + prior * np.eye(len(names))) * NOISE ** 2
    se = np.sqrt(np.maximum(np.diag(cov), 0.0))
    sens = np.linalg.norm(J, axis=0)
    factors = _to_factors(names, theta)
    plain = prob.residuals(factors)
    std = {n: float(s) for n, s in zip(names, se)}
    ident = {n: bool(s < SE_IDENTIFIED and sv > 1e-9) for n, s, sv in zip(names, se, sens)}
    fitted = {n: float(t) if n == "comm_compute_slowdown" else math.exp(t) for n, t in zip(names, theta)}
    return FitResult(fitted=fitted, factors=factors, std_error=std, identified=ident, rms_before=rms_before,
                     rms_after=float(np.sqrt(np.mean(plain ** 2))), step_error_before=[float(x) for x in step_before],
                     step_error_after=[float(x) for x in np.exp(plain[: len(measurements)]) - 1],
                     topology=apply_factors(topo, factors), iterations=it)


def synthetic(plans: list[Plan], topo: Topology, truth: dict[str, float]) -> list[Measurement]:
    """Measurements that the topology scaled by `truth` would produce (the estimate's step and phase times)."""
    prob = _Problem([Measurement(p, 1.0) for p in plans], topo)
    pred = prob.predict(truth)
    out = []
    for i, p in enumerate(plans):
        phases = {k: float(pred[k][i]) for k in ("compute", "exposed_expert_a2a", "exposed_dp_comm", "optimizer",
                                                  "pipeline_bubble", "pipeline_p2p")}
        out.append(Measurement(p, float(pred["step_time_s"][i]), phases, label=p.name))
    return out
