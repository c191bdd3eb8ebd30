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

Eager memory traffic (same topologies, where simulator.op_bytes has the model's counted bytes): an eager framework
runs every op as its own kernel, reading and writing whole tensors, so each micro-batch's forward and backward and
the optimizer step also move the counted bytes of their non-GEMM, non-attention-core ops, at
costs.eager_bytes_time (the measured bandwidth; see there why not efficiency.memory_bound). With b = tokens per
micro-batch / seq_len sequences, a part's bytes are fixed + per_sequence x b; per rank s, as the op counts:
    bytes_mb(s) = [embed] + sum over L(s) of layer bytes + [head and loss],  x (1 + bwd_bytes / fwd_bytes) for the
    backward (the backward's total spread over the parts as their forward bytes), the critical path as above, and
    optimizer bytes x |L(s)| / layers.
Those bytes replace the analytic terms that model a fused stack's traffic (stage_work's elementwise_bytes and the
optimizer update's bytes, costs.optimizer_time): counted twice otherwise. Where the bytes are not counted (a model
over simulator.op_bytes.MAX_PARAMS, or not counted yet), the analytic terms stand.
"""

from __future__ import annotations

from dataclasses import dataclass

from rackcast.modelspec import ModelSpec
from rackcast.plan import Plan
from rackcast.simulator.costs import eager_bytes_time
from rackcast.topologies.spec import HostOpTimes, Topology


def layer_forward_ops(counts: dict, plan: Plan, layer: int) -> float:
    """Forward ops of one layer on a rank holding 1/ep of its routed experts: the same as with all of them, since
    the backend runs a rank's experts as grouped GEMMs (backend.moe.GroupedExperts), whatever their number."""
    return counts["fwd_layers"][layer]


def _stage_forward(embed: float, head: float, layer, spec: ModelSpec, plan: Plan, stage: int) -> float:
    """Forward amount of one micro-batch on pipeline rank `stage`: the embedding's on the first chunk's rank, the
    head's on the last's, layer(i) for each layer it holds."""
    owner = plan.parallel.chunk_ranks(plan.schedule)
    fwd = (embed if owner[0] == stage else 0.0) + (head if owner[-1] == stage else 0.0)
    for i in plan.rank_layers(spec, stage):
        fwd += layer(i)
    return fwd


def ops_per_microbatch(counts: dict, spec: ModelSpec, plan: Plan, stage: int) -> float:
    """ops_mb(stage): forward and backward ops of one micro-batch on pipeline rank `stage`."""
    fwd = _stage_forward(counts["fwd_embed"], counts["fwd_head"], lambda i: layer_forward_ops(counts, plan, i),
                         spec, plan, stage)
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


def _per_step(per_stage: list[float], bwd_over_fwd: float, optimizer: float, plan: Plan) -> HostOps:
    """Rank 0's own amounts of a step and the extra ones on the pipeline's critical path, from each stage's forward
    amount per micro-batch (see the module docstring)."""
    p, m = plan.parallel.pipeline, plan.microbatches
    own = m * per_stage[0]
    critical = (m + p - 1) * max(per_stage) if p > 1 else own
    return HostOps(forward=own, backward=own * bwd_over_fwd, bubble_forward=critical - own,
                   bubble_backward=(critical - own) * bwd_over_fwd, optimizer=optimizer)


def host_ops(counts: dict, spec: ModelSpec, plan: Plan) -> HostOps:
    per_stage = [ops_per_microbatch(counts, spec, plan, s) / (1.0 + counts["bwd_over_fwd"])
                 for s in range(plan.parallel.pipeline)]
    return _per_step(per_stage, counts["bwd_over_fwd"], optimizer_ops(counts, spec, plan, 0), plan)


# ------------------------------------------------------------------------------------------ eager memory traffic
def _at(part: list, sequences: float) -> float:
    """A counted [fixed, per_sequence] pair's bytes at `sequences` sequences."""
    return part[0] + part[1] * sequences


@dataclass(frozen=True)
class EagerBytes:
    """A plan's counted eager bytes per micro-batch (simulator.op_bytes), by where they run."""

    embed: float
    layers: tuple[float, ...]
    head: float
    bwd_over_fwd: float  # the backward's bytes over the forward's
    opt_step: float  # one optimizer step, all layers


def eager_bytes(nbytes: dict, spec: ModelSpec, plan: Plan) -> EagerBytes:
    """The counted bytes at the plan's sequences per micro-batch (tokens per micro-batch / seq_len)."""
    b = plan.tokens_per_microbatch(spec) / nbytes["seq_len"]
    layers = tuple(_at(part, b) for part in nbytes["fwd_layers"])
    embed, head = _at(nbytes["fwd_embed"], b), _at(nbytes["fwd_head"], b)
    return EagerBytes(embed=embed, layers=layers, head=head,
                      bwd_over_fwd=_at(nbytes["bwd"], b) / (embed + head + sum(layers)), opt_step=nbytes["opt_step"])


def optimizer_bytes(e: EagerBytes, spec: ModelSpec, plan: Plan, stage: int) -> float:
    """Optimizer bytes of one step on pipeline rank `stage` (its share of the layers, as optimizer_ops)."""
    return e.opt_step * len(plan.rank_layers(spec, stage)) / spec.layers


def host_bytes(e: EagerBytes, spec: ModelSpec, plan: Plan) -> HostOps:
    """Eager bytes of one step on rank 0 by kind, as host_ops counts ops."""
    per_stage = [_stage_forward(e.embed, e.head, lambda i: e.layers[i], spec, plan, s)
                 for s in range(plan.parallel.pipeline)]
    return _per_step(per_stage, e.bwd_over_fwd, optimizer_bytes(e, spec, plan, 0), plan)


class HostCosts:
    """Seconds of host ops and eager bytes for the discrete-event workload (simulator.workload): a forward's ops x
    host_op_s.forward plus its bytes at costs.eager_bytes_time; a backward action's bwd_over_fwd times those (kind
    BW: all; B or W: half each). counts and bytes are None where not measured or not counted."""

    def __init__(self, counts: dict | None, nbytes: EagerBytes | None, times: HostOpTimes, topo: Topology):
        self.counts, self.bytes, self.times, self.topo = counts, nbytes, times, topo

    def stage_ends(self, spec: ModelSpec, plan: Plan, stage: int, first: bool, last: bool) -> dict[str, float]:
        """The embedding's (on the first chunk's rank) and the head's (the last's) forward ops and bytes."""
        c, b = self.counts or {}, self.bytes
        return {"embed_ops": c.get("fwd_embed", 0.0) if first else 0.0,
                "head_ops": c.get("fwd_head", 0.0) if last else 0.0,
                "embed_bytes": b.embed if b and first else 0.0, "head_bytes": b.head if b and last else 0.0}

    def optimizer_s(self, spec: ModelSpec, plan: Plan, stage: int) -> float:
        """The optimizer step's host ops and eager bytes on rank `stage`."""
        s = optimizer_ops(self.counts, spec, plan, stage) * self.times.optimizer if self.counts else 0.0
        if self.bytes:
            s += eager_bytes_time(optimizer_bytes(self.bytes, spec, plan, stage), self.topo)
        return s

    def forward_s(self, forward_ops: float, forward_bytes: float = 0.0) -> float:
        return forward_ops * self.times.forward + eager_bytes_time(forward_bytes, self.topo)

    def backward_s(self, forward_ops: float, kind: str, forward_bytes: float = 0.0) -> float:
        if not self.counts:
            return 0.0
        share = 1.0 if kind == "BW" else 0.5
        ops_s = self.counts["bwd_over_fwd"] * forward_ops * self.times.backward
        ratio = self.bytes.bwd_over_fwd if self.bytes else 0.0
        return share * (ops_s + eager_bytes_time(ratio * forward_bytes, self.topo))


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


def host_costs(spec: ModelSpec, plan: Plan, topo: Topology) -> HostCosts:
    """HostCosts of a plan: op counts (simulator.op_counts) and eager bytes (simulator.op_bytes, where counted) only
    where the topology's host_op_s is measured."""
    times = topo.efficiency.host_op_s
    if not times.measured:
        return HostCosts(None, None, times, topo)
    from rackcast.simulator import op_bytes, op_counts

    counted = op_bytes.lookup(spec, plan.optimizer.name)
    counts = op_counts.op_counts(spec, plan.optimizer.name)
    return HostCosts(counts, eager_bytes(counted, spec, plan) if counted else None, times, topo)
