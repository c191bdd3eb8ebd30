"""Host (dispatch) overhead of a plan's training step: framework ops x the measured host time per op
(EfficiencyProfile.host_op_s: forward, backward and optimizer ops apart, from `rackcast calibrate`). Kernels are
priced by FLOPs and bytes; when they are tiny
(small models on a CPU) each op's fixed host cost dominates. Op counts come from backend.opcount (counted on the real
backend model; simulator.op_counts runs and caches it). The closed-form estimate (simulator.estimate) adds the
per-step totals below; the discrete-event simulator (simulator.workload, simulator.step) adds the per-layer ops to
each compute task, so the pipeline bubble grows through the schedule itself. Both only where host_op_s is measured.

Model, per pipeline rank s holding layers L(s) (rackcast.layout.ParallelSpec.rank_layers):
    ops_mb(s) = [embed if s holds the first chunk] + sum over L(s) of layer ops (the whole layer's, whatever ep:
                a rank runs its local experts as one grouped GEMM, see layer_forward_ops)
                + [head and loss if s holds the last chunk],   times (1 + bwd_over_fwd) for the backward,
                plus the recomputed forward's ops (sum over L(s) of layer ops x recompute_share: the trainer
                recomputes, backend.recompute),
                plus, where the expert group has more than one rank, per MoE layer of L(s) the expert-parallel
                dispatch path's own ops, counted apart (ep_dispatch_ops: ep_fwd forward ops, ep_bwd backward ops,
                not a ratio of the forward; ep_fwd again under full recomputation, which reruns the block), and in
                capacity mode (any ep) capacity_fwd / capacity_bwd likewise
    compute overhead = m x ops_mb(s) x t_op on each rank (m micro-batches per step; t_op = host_op_s.forward for
        forward ops, recomputed ones included, .backward for backward ops);
    with pipeline p > 1 the step's critical path is (m + p - 1) x ops_mb(s*) x t_op, s* the stage with the most
        ops (the bubble grows too);
    optimizer overhead = (optimizer ops + the step's end and gradient reduction's ops: step_end_ops) x |L(s)| /
        layers x host_op_s.optimizer (its per-tensor loop).
Communication is blocking in the CPU trainer, so the overhead is added, not overlapped. This module does not import
torch.

Eager memory traffic (same topologies, where simulator.op_bytes has the model's counted bytes and the plan runs the
model as they were counted: `counted_bytes`, the one place that decides): an eager framework runs every op as its
own kernel, reading and writing whole tensors, so each micro-batch's forward and backward and the optimizer step
also move the counted bytes of their non-GEMM, non-attention-core ops, at costs.eager_bytes_time (the measured
bandwidth x efficiency.eager_bandwidth; see there why not efficiency.memory_bound). The counts are one process's,
whole model; a rank's share:
- forward/backward: b = tokens per rank per micro-batch / seq_len sequences (context parallelism already splits the
  tokens: ParallelSpec.tokens_per_microbatch), a part's bytes fixed + per_sequence x b; each layer's / tensor
  (backend.tensor_parallel splits the attention heads and MLP widths, with sequence parallelism the norms, router
  and routed experts along the sequence; without it those run whole on every tensor rank, so dividing the whole
  layer undercounts them: the counts have no per-module split). Not divided by expert parallelism: a rank runs its
  E/ep local experts on the rows every rank of its expert group sends them, about tokens x top_k rows in balance,
  as many as one process's experts get from its own micro-batch, so its expert activations stay one process's
  (any parameter-sized ops among them, in the counts' fixed part, do shrink with ep; the counts do not split the
  experts out, so they are left whole: an overcount of those).
  Embedding and head run whole on every tensor rank (replicated). Per rank s:
    bytes_mb(s) = [embed] + sum over L(s) of layer bytes / tensor + [head and loss],  x (1 + bwd_bytes / fwd_bytes)
    for the backward (the backward's total spread over the parts as their forward bytes), plus the recomputed
    forward's (layer bytes x recompute_share), the critical path as above;
- optimizer: the counted step x `update_share` (this rank's optimizer_cost.optimizer_traffic_bytes over one
  process's holding the whole model: the pipeline's layer split, tensor, FSDP / ZeRO state shards and the expert
  split, as the analytic term it replaces divides them).
Those bytes replace the analytic terms that model a fused stack's traffic (stage_work's elementwise_bytes and the
optimizer update's bytes, costs.optimizer_time): counted twice otherwise. Where `counted_bytes` is None (host times
not measured; a model over simulator.op_bytes.MAX_PARAMS or not counted yet; a plan not run as counted: COUNTED_AS)
the analytic terms stand.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from rackcast.layout import ParallelSpec
from rackcast.modelspec import ModelSpec
from rackcast.plan import Plan
from rackcast.simulator.activations import attention_module_bytes_per_token, layer_activation_bytes_per_token
from rackcast.simulator.costs import eager_bytes_time
from rackcast.simulator.memory import rank_params
from rackcast.simulator.optimizer_cost import optimizer_traffic_bytes
from rackcast.topologies.spec import HostOpTimes, Topology

# How backend.opcount.bytes_at runs the model it counts: fp32 without autocast (build_model's default dtype), SDPA's
# default (fused) kernel. A plan run otherwise moves other bytes (bf16 autocast's casts, the materialised score
# matrix), so the fused analytic terms price it instead (`counted_bytes`).
COUNTED_AS = {"precision": "fp32", "attention_kernel": "flash"}


def runs_as_counted(plan) -> bool:
    """Whether the plan runs the model as backend.opcount counted its bytes (COUNTED_AS)."""
    return all(getattr(plan, field) == value for field, value in COUNTED_AS.items())


def counted_bytes(spec: ModelSpec, plan, topo: Topology) -> dict | None:
    """The counted eager bytes (simulator.op_bytes) that price this plan, or None where the analytic fused terms
    stand: host times not measured (no op overhead at all, nothing looked up), the model's bytes not counted, or the
    plan not run as they were counted (COUNTED_AS). The one place that decides; `plan` a Plan or PlanArrays."""
    if not topo.efficiency.host_op_s.measured:
        return None
    if not runs_as_counted(plan):
        return None
    from rackcast.simulator import op_bytes

    return op_bytes.lookup(spec, plan.optimizer.name)


def layer_forward_ops(counts: dict, plan: Plan, layer: int) -> float:
    """Forward ops of one layer on a rank holding 1/ep of its routed experts: the same as with all of them, since
    the backend runs a rank's experts as grouped GEMMs (backend.moe.GroupedExperts), whatever their number."""
    return counts["fwd_layers"][layer]


def ep_dispatch_ops(counts: dict, spec: ModelSpec, plan: Plan, layer: int) -> tuple[float, float]:
    """(forward, backward) ops the expert-parallel dispatch path (backend.expert_parallel.ExpertParallelMoE) adds to
    MoE layer `layer` per micro-batch beyond its counted one-process ops: ep_fwd / ep_bwd where the plan exchanges
    rows (an expert group of more than one rank), plus capacity_fwd / capacity_bwd in capacity mode (at any ep: the
    trainer runs the path for it); (0, 0) elsewhere. Counted apart on the real code (backend.opcount.
    count_ep_dispatch: counts exchange, split sizes to the host, regrouping by local expert; capacity cuts), the
    same at any expert degree and number of local experts; backward is its own count, not bwd_over_fwd times the
    forward. The one home of these ops for the closed form (host_ops) and the discrete-event workload."""
    forward = backward = 0.0
    if spec.is_moe(layer) and plan.parallel.expert_group > 1:
        forward, backward = float(counts["ep_fwd"]), float(counts["ep_bwd"])
    if spec.is_moe(layer) and plan.expert_transport.mode == "capacity":
        forward, backward = forward + counts["capacity_fwd"], backward + counts["capacity_bwd"]
    return forward, backward


def recompute_share(spec: ModelSpec, plan: Plan, layer: int) -> float:
    """Share of a layer's forward ops and eager bytes its recomputation runs again in backward (backend.recompute):
    1 under full (the whole block), 0 without. Selective reruns the attention module (all but its projections'
    matrix products, which are not counted as bytes). The counts have no per-module split (the tables would have to
    be counted again), so its share is approximated by the attention module's part of the tensors the eager layer
    saves (activations.attention_module_bytes_per_token over layer_activation_bytes_per_token, "eager"): the
    tensors its ops write, as the memory model sees them. Approximate: the module's ops that save nothing (e.g. the
    flash kernel's own) are not in it."""
    if plan.recompute == "full":
        return 1.0
    if plan.recompute == "selective":
        return attention_module_bytes_per_token(spec, layer, plan) / \
            layer_activation_bytes_per_token(spec, layer, plan, activations="eager")
    return 0.0


def update_share(spec: ModelSpec, plan: Plan, stage: int) -> float:
    """Pipeline rank `stage`'s share of one process's optimizer-update bytes (the whole model): the analytic update
    bytes (optimizer_cost.optimizer_traffic_bytes) of its parameters and state shards over those of one process
    holding every parameter."""
    whole = replace(plan, parallel=ParallelSpec(), schedule="1f1b")
    own = optimizer_traffic_bytes(rank_params(spec, plan, stage), plan)[0]
    return float(own) / float(optimizer_traffic_bytes(rank_params(spec, whole), whole)[0])


def _stage_forward(embed: float, head: float, layer, spec: ModelSpec, plan: Plan, stage: int) -> float:
    """Forward amount of one micro-batch on pipeline rank `stage`: the embedding's on the first chunk's rank, the
    head's on the last's, layer(i) for each layer it holds."""
    owner = plan.parallel.chunk_ranks(plan.schedule)
    fwd = (embed if owner[0] == stage else 0.0) + (head if owner[-1] == stage else 0.0)
    for i in plan.rank_layers(spec, stage):
        fwd += layer(i)
    return fwd


def _stage_recompute(layer, spec: ModelSpec, plan: Plan, stage: int) -> float:
    """Recomputed forward amount of one micro-batch on pipeline rank `stage` (layer(i) x recompute_share)."""
    if plan.recompute == "none":
        return 0.0
    return sum(layer(i) * recompute_share(spec, plan, i) for i in plan.rank_layers(spec, stage))


def ops_per_microbatch(counts: dict, spec: ModelSpec, plan: Plan, stage: int) -> float:
    """ops_mb(stage): forward, backward and recomputed forward ops of one micro-batch on pipeline rank `stage`, the
    expert-parallel dispatch path's (ep_dispatch_ops) included."""
    return sum(amounts[stage] for amounts in _stage_amounts(*_op_inputs(counts, spec, plan)))


def optimizer_ops(counts: dict, spec: ModelSpec, plan: Plan, stage: int) -> float:
    """Optimizer ops of one step on pipeline rank `stage` (its share of the layers)."""
    return counts["optimizer_ops"] * len(plan.rank_layers(spec, stage)) / spec.layers


def step_end_ops(counts: dict, spec: ModelSpec, plan: Plan, stage: int) -> float:
    """The ops of one step on pipeline rank `stage` outside its micro-batches and optimizer (its share of the
    layers of each, counted on the whole model: backend.opcount.count_grad_reduction, _step): the step's end
    (step_ops: the router balancer's step, zero_grad) and the gradient reduction the trainer runs (backend.train):
    none on one rank or under ZeRO-2 (backend.zero reduces); over token ranks (data x fsdp x context) without
    FSDP, the expert gradients' flat reduction (expert_reduce_ops) and the dense ones' by DDP (ddp_ops: a gradient
    copy into its bucket and a re-view per dense parameter, the comm hook's average and all-reduce per bucket) or,
    on pipeline and tensor-parallel ranks, which DDP does not wrap, flat (dense_reduce_ops). Priced with the
    optimizer's per-tensor loop (host_op_s.optimizer), whose kind of per-parameter loop they are."""
    p = plan.parallel
    ops = float(counts["step_ops"])
    if p.gpus > 1 and p.zero != 2 and p.fsdp == 1 and p.data * p.context > 1:
        dense = "dense_reduce_ops" if p.pipeline > 1 or p.tensor > 1 else "ddp_ops"
        ops += counts["expert_reduce_ops"] + counts[dense]
    return ops * len(plan.rank_layers(spec, stage)) / spec.layers


def per_step_ops(counts: dict, spec: ModelSpec, plan: Plan, stage: int) -> float:
    """Ops of one step on pipeline rank `stage` run once a step: the optimizer's and step_end_ops'."""
    return optimizer_ops(counts, spec, plan, stage) + step_end_ops(counts, spec, plan, stage)


@dataclass
class HostOps:
    """Framework ops of one step on rank 0, by kind (forward ops, recomputed ones included; backward ops; optimizer
    and the step's other once-a-step ops: per_step_ops): its own, and the extra ones on the pipeline's critical
    path (the bubble they cause)."""

    forward: float
    backward: float
    bubble_forward: float
    bubble_backward: float
    optimizer: float


def _per_step(forward: list[float], recomputed: list[float], backward: list[float], optimizer: float,
              plan: Plan) -> HostOps:
    """Rank 0's own amounts of a step and the extra ones on the pipeline's critical path, from each stage's forward,
    recomputed and backward amounts per micro-batch (see the module docstring)."""
    p, m = plan.parallel.pipeline, plan.microbatches
    own_f, own_b = m * (forward[0] + recomputed[0]), m * backward[0]
    if p == 1:
        return HostOps(forward=own_f, backward=own_b, bubble_forward=0.0, bubble_backward=0.0, optimizer=optimizer)
    heavy = max(range(p), key=lambda s: forward[s] + backward[s] + recomputed[s])
    crit_f, crit_b = (m + p - 1) * (forward[heavy] + recomputed[heavy]), (m + p - 1) * backward[heavy]
    return HostOps(forward=own_f, backward=own_b, bubble_forward=crit_f - own_f, bubble_backward=crit_b - own_b,
                   optimizer=optimizer)


def _stage_amounts(embed: float, head: float, layer, bwd_over_fwd: float, spec: ModelSpec, plan: Plan,
                   extra=None) -> tuple[list[float], list[float], list[float]]:
    """Each pipeline rank's forward, recomputed and backward amounts (ops or bytes) per micro-batch, from the ends'
    and each layer's forward amount; extra(i): layer i's (forward, backward) amounts outside that ratio
    (ep_dispatch_ops), rerun by a full recomputation (the whole block), not by a selective one (attention only)."""
    stages = range(plan.parallel.pipeline)
    forward = [_stage_forward(embed, head, layer, spec, plan, s) for s in stages]
    recomputed = [_stage_recompute(layer, spec, plan, s) for s in stages]
    backward = [f * bwd_over_fwd for f in forward]
    if extra is not None:
        for s in stages:
            f, b = (sum(x) for x in zip((0.0, 0.0), *(extra(i) for i in plan.rank_layers(spec, s))))
            forward[s] += f
            backward[s] += b
            recomputed[s] += f if plan.recompute == "full" else 0.0
    return forward, recomputed, backward


def _step_amounts(embed: float, head: float, layer, bwd_over_fwd: float, optimizer: float, spec: ModelSpec,
                  plan: Plan) -> HostOps:
    """Per-step amounts (ops or bytes) on rank 0 (_stage_amounts' per micro-batch, over the step)."""
    forward, recomputed, backward = _stage_amounts(embed, head, layer, bwd_over_fwd, spec, plan)
    return _per_step(forward, recomputed, backward, optimizer, plan)


def _op_inputs(counts: dict, spec: ModelSpec, plan: Plan) -> tuple:
    """_stage_amounts' arguments for the counted ops."""
    return (counts["fwd_embed"], counts["fwd_head"], lambda i: layer_forward_ops(counts, plan, i),
            counts["bwd_over_fwd"], spec, plan, lambda i: ep_dispatch_ops(counts, spec, plan, i))


def host_ops(counts: dict, spec: ModelSpec, plan: Plan) -> HostOps:
    forward, recomputed, backward = _stage_amounts(*_op_inputs(counts, spec, plan))
    return _per_step(forward, recomputed, backward, per_step_ops(counts, spec, plan, 0), plan)


# ------------------------------------------------------------------------------------------ eager memory traffic
def _at(part: list, sequences: float) -> float:
    """A counted [fixed, per_sequence] pair's bytes at `sequences` sequences."""
    return part[0] + part[1] * sequences


@dataclass(frozen=True)
class EagerBytes:
    """A plan's counted eager bytes per micro-batch on one rank (simulator.op_bytes; see the module docstring for
    its share), by where they run."""

    embed: float
    layers: tuple[float, ...]
    head: float
    bwd_over_fwd: float  # the backward's bytes over the forward's
    opt_step: float  # one optimizer step of one process holding the whole model


def eager_bytes(nbytes: dict, spec: ModelSpec, plan: Plan) -> EagerBytes:
    """The counted bytes at the plan's sequences per micro-batch (tokens per rank per micro-batch / seq_len), each
    layer's divided over the tensor ranks."""
    b = plan.tokens_per_microbatch(spec) / nbytes["seq_len"]
    whole_layers = [_at(part, b) for part in nbytes["fwd_layers"]]
    embed, head = _at(nbytes["fwd_embed"], b), _at(nbytes["fwd_head"], b)
    return EagerBytes(embed=embed, layers=tuple(x / plan.parallel.tensor for x in whole_layers), head=head,
                      bwd_over_fwd=_at(nbytes["bwd"], b) / (embed + head + sum(whole_layers)),
                      opt_step=nbytes["opt_step"])


def optimizer_bytes(e: EagerBytes, spec: ModelSpec, plan: Plan, stage: int) -> float:
    """Optimizer bytes of one step on pipeline rank `stage` (its update_share of the counted step)."""
    return e.opt_step * update_share(spec, plan, stage)


def host_bytes(e: EagerBytes, spec: ModelSpec, plan: Plan) -> HostOps:
    """Eager bytes of one step on rank 0 by kind, as host_ops counts ops."""
    return _step_amounts(e.embed, e.head, lambda i: e.layers[i], e.bwd_over_fwd, optimizer_bytes(e, spec, plan, 0),
                         spec, plan)


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
        """The optimizer step's host ops and eager bytes on rank `stage`, and the step's other once-a-step ops
        (per_step_ops)."""
        s = per_step_ops(self.counts, spec, plan, stage) * self.times.optimizer if self.counts else 0.0
        if self.bytes:
            s += eager_bytes_time(optimizer_bytes(self.bytes, spec, plan, stage), self.topo)
        return s

    def forward_s(self, forward_ops: float, forward_bytes: float = 0.0, share: float = 1.0) -> float:
        """A forward's host ops and eager bytes; `share` of them for a recomputation (recompute_share)."""
        return share * (forward_ops * self.times.forward + eager_bytes_time(forward_bytes, self.topo))

    def backward_s(self, forward_ops: float, kind: str, forward_bytes: float = 0.0, backward_ops: float = 0.0) -> float:
        """A backward's host ops (bwd_over_fwd x `forward_ops`, plus `backward_ops` counted as they are:
        ep_dispatch_ops) and eager bytes; half of them for a B or a W."""
        if not self.counts:
            return 0.0
        share = 1.0 if kind == "BW" else 0.5
        ops_s = (self.counts["bwd_over_fwd"] * forward_ops + backward_ops) * self.times.backward
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
    """HostCosts of a plan: op counts (simulator.op_counts) only where the topology's host_op_s is measured, eager
    bytes where `counted_bytes` finds them."""
    times = topo.efficiency.host_op_s
    if not times.measured:
        return HostCosts(None, None, times, topo)
    from rackcast.simulator import op_counts

    counted = counted_bytes(spec, plan, topo)
    counts = op_counts.op_counts(spec, plan.optimizer.name)
    return HostCosts(counts, eager_bytes(counted, spec, plan) if counted else None, times, topo)


# each HostOps field of the ops ("op_") and of their counted eager bytes ("eager_")
HOST_OP_FEATURES = tuple(f"{kind}_{f.name}" for kind in ("op", "eager") for f in fields(HostOps))


def host_op_features(spec: ModelSpec, plan: Plan, topo: Topology) -> dict[str, float]:
    """Host ops per step (host_ops), as the closed-form estimate's features (simulator.estimate): rank 0's forward
    and backward ops, the extra ones on the pipeline's critical path, the optimizer's; their eager bytes where
    counted_bytes finds them. Zero, and no op counting, where the topology has no measured host_op_s."""
    if not topo.efficiency.host_op_s.measured:
        return dict.fromkeys(HOST_OP_FEATURES, 0.0)
    from rackcast.simulator import op_counts

    ops = host_ops(op_counts.op_counts(spec, plan.optimizer.name), spec, plan)
    counted = counted_bytes(spec, plan, topo)
    moved = host_bytes(eager_bytes(counted, spec, plan), spec, plan) if counted else HostOps(0.0, 0.0, 0.0, 0.0, 0.0)
    return {f"{kind}_{f.name}": getattr(amounts, f.name) for kind, amounts in (("op", ops), ("eager", moved))
            for f in fields(HostOps)}
