"""Host (dispatch) overhead of a plan's training step: framework ops x the measured host time per op
(EfficiencyProfile.host_op_s: forward, backward and optimizer ops apart, from `rackcast calibrate`). Kernels are
priced by FLOPs and bytes; when they are tiny
(small models on a CPU) each op's fixed host cost dominates. Op counts come from backend.opcount (counted on the real
backend model; simulator.op_counts runs and caches it). The closed-form estimate (simulator.estimate) adds the
per-step totals below; the discrete-event simulator (simulator.workload, simulator.step) adds the per-layer ops to
each compute task, so the pipeline bubble grows through the schedule itself. Both only where host_op_s is measured.

Model, per pipeline rank s holding layers L(s) (rackcast.layout.ParallelSpec.rank_layers):
    ops_mb(s) = [embed if s holds the first chunk] + sum over L(s) of (layer ops - expert-loop ops x (1 - 1/ep))
                + [head and loss if s holds the last chunk],   times (1 + bwd_over_fwd) for the backward
    compute overhead = m x ops_mb(s) x t_op on each rank (m micro-batches per step; t_op = host_op_s.forward for
        forward ops, .backward for backward ops);
    with pipeline p > 1 the step's critical path is (m + p - 1) x max_s ops_mb(s) x t_op (the bubble grows too);
    optimizer overhead = optimizer ops x |L(s)| / layers x host_op_s.optimizer (its per-tensor loop).
Communication is blocking in the CPU trainer, so the overhead is added, not overlapped. Recomputation is not counted
(the trainer does not recompute). This module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from rackcast.modelspec import ModelSpec
from rackcast.plan import Plan
from rackcast.topologies.spec import HostOpTimes


def layer_forward_ops(counts: dict, plan: Plan, layer: int) -> float:
    """Forward ops of one layer on a rank holding 1/ep of its routed experts: the same as with all of them, since
    the backend runs a rank's experts as grouped GEMMs (backend.moe.GroupedExperts), whatever their number."""
    return counts["fwd_layers"][layer]


def ops_per_microbatch(counts: dict, spec: ModelSpec, plan: Plan, stage: int) -> float:
    """ops_mb(stage): forward and backward ops of one micro-batch on pipeline rank `stage`."""
    owner = plan.parallel.chunk_ranks(plan.schedule)
    fwd = 0.0
    if owner[0] == stage:
        fwd += counts["fwd_embed"]
    if owner[-1] == stage:
        fwd += counts["fwd_head"]
    for i in plan.rank_layers(spec, stage):
        fwd += layer_forward_ops(counts, plan, i)
    return fwd * (1.0 + counts["bwd_over_fwd"])


def optimizer_ops(counts: dict, spec: ModelSpec, plan: Plan, stage: int) -> float:
    """Optimizer ops of one step on pipeline rank `stage` (its share of the layers)."""
    return counts["optimizer_ops"] * len(plan.rank_layers(spec, stage)) / spec.layers


@dataclass
class HostOps:
    """Framework ops of one step on rank 0, by kind (forward ops, backward ops, optimizer ops): its own, and the
    extra ones on the pipeline's critical path (the bubble they cause)."""

    forward: float
    backward: float
    bubble_forward: float
    bubble_backward: float
    optimizer: float


def host_ops(counts: dict, spec: ModelSpec, plan: Plan) -> HostOps:
    p, m = plan.parallel.pipeline, plan.microbatches
    per_stage = [ops_per_microbatch(counts, spec, plan, s) / (1.0 + counts["bwd_over_fwd"]) for s in range(p)]
    own = m * per_stage[0]
    critical = (m + p - 1) * max(per_stage) if p > 1 else own
    bwd = counts["bwd_over_fwd"]
    return HostOps(forward=own, backward=own * bwd, bubble_forward=critical - own,
                   bubble_backward=(critical - own) * bwd, optimizer=optimizer_ops(counts, spec, plan, 0))


@dataclass
class Overhead:
    compute_s: float  # rank 0's own op overhead in forward + backward
    bubble_s: float  # extra pipeline wait it causes (critical path less rank 0's own)
    optimizer_s: float
    ops_per_step: float  # on rank 0

    @property
    def total_s(self) -> float:
        return self.compute_s + self.bubble_s + self.optimizer_s


def host_overhead(counts: dict, spec: ModelSpec, plan: Plan, times: HostOpTimes) -> Overhead:
    """The closed-form overhead of one step (rank 0's view) at host times per op `times`."""
    o = host_ops(counts, spec, plan)
    return Overhead(compute_s=o.forward * times.forward + o.backward * times.backward,
                    bubble_s=o.bubble_forward * times.forward + o.bubble_backward * times.backward,
                    optimizer_s=o.optimizer * times.optimizer, ops_per_step=o.forward + o.backward + o.optimizer)
