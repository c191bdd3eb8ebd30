"""Host (dispatch) overhead of a plan's training step: framework ops on the critical path x the measured host time
per op (EfficiencyProfile.op_overhead_s from `rackcast calibrate`). The simulator prices kernels by FLOPs and bytes
only; when kernels are tiny (small models on a CPU) each op's fixed host cost dominates, so compare and validate add
this term to the simulator's prediction ("simulate + op overhead"). Op counts come from backend.opcount (counted
on the real backend model, once per model and optimizer).

Model, per pipeline rank s holding layers L(s) (simulator.memory.rank_layers):
    ops_mb(s) = [embed if s holds the first chunk] + sum over L(s) of (layer ops - expert-loop ops x (1 - 1/ep))
                + [head and loss if s holds the last chunk],   times (1 + bwd_over_fwd) for the backward
    compute overhead = m x ops_mb(s) x t_op on each rank (m micro-batches per step);
    with pipeline p > 1 the step's critical path is (m + p - 1) x max_s ops_mb(s) x t_op (the bubble grows too);
    optimizer overhead = optimizer ops x |L(s)| / layers x t_op (the per-tensor loop of the optimizer).
Communication is blocking in the CPU trainer, so the overhead is added, not overlapped.
This module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rackcast.modelspec import ModelSpec
from rackcast.plan import Plan
from simulator.memory import rank_layers
from simulator.schedules import stage_to_rank


def ops_per_microbatch(counts: dict, spec: ModelSpec, plan: Plan, stage: int) -> float:
    par = plan.parallel
    v = 2 if plan.schedule == "dualpipev" else par.virtual
    owner = stage_to_rank(plan.schedule, par.pipeline, v)
    fwd = 0.0
    if owner[0] == stage:
        fwd += counts["fwd_embed"]
    if owner[-1] == stage:
        fwd += counts["fwd_head"]
    for i in rank_layers(spec, plan, stage):
        fwd += counts["fwd_layers"][i] - counts["fwd_experts"][i] * (1.0 - 1.0 / par.expert)
    return fwd * (1.0 + counts["bwd_over_fwd"])


@dataclass
class Overhead:
    compute_s: float  # rank 0's own op overhead in forward + backward
    bubble_s: float  # extra pipeline wait it causes (critical path less rank 0's own)
    optimizer_s: float
    ops_per_step: float  # on rank 0

    @property
    def total_s(self) -> float:
        return self.compute_s + self.bubble_s + self.optimizer_s


def host_overhead(counts: dict, spec: ModelSpec, plan: Plan, op_overhead_s: float) -> Overhead:
    p, m = plan.parallel.pipeline, plan.microbatches
    per_stage = [ops_per_microbatch(counts, spec, plan, s) for s in range(p)]
    own = m * per_stage[0]
    critical = (m + p - 1) * max(per_stage) if p > 1 else own
    opt = counts["optimizer_ops"] * len(rank_layers(spec, plan, 0)) / spec.layers
    return Overhead(compute_s=own * op_overhead_s, bubble_s=(critical - own) * op_overhead_s,
                    optimizer_s=opt * op_overhead_s, ops_per_step=own + opt)


@dataclass
class WithOverhead:
    """A prediction (SimResult or Estimate) plus the host overhead, with the fields compare reads."""

    base: object
    overhead: Overhead
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    phases_s: dict = field(default_factory=dict)
    peak_memory_bytes: float = 0.0
    drop_fraction: float = 0.0

    @classmethod
    def of(cls, base, overhead: Overhead) -> "WithOverhead":
        step = base.step_time_s + overhead.total_s
        phases = dict(base.phases_s)
        phases["compute"] = phases.get("compute", 0.0) + overhead.compute_s
        phases["pipeline_bubble"] = phases.get("pipeline_bubble", 0.0) + overhead.bubble_s
        phases["optimizer"] = phases.get("optimizer", 0.0) + overhead.optimizer_s
        peak = getattr(base, "peak_memory_bytes", None)
        if peak is None:
            peak = base.memory.total
        return cls(base=base, overhead=overhead, step_time_s=step, tokens_per_s=base.tokens_per_s *
                   base.step_time_s / step, mfu=base.mfu * base.step_time_s / step, phases_s=phases,
                   peak_memory_bytes=float(peak), drop_fraction=float(base.drop_fraction))
