"""Closed-form step-time estimate of a plan: roofline compute with the efficiency profile, alpha-beta collectives on
the links each group spans, the pipeline bubble by schedule formula, and exposed versus overlapped communication.

Two stages, so the planner can rank thousands of layouts at once:
1. `plan_features(spec, plan, topo)` reduces one plan to a flat dict of scalars (FLOPs, bytes, group sizes, spans);
2. `step_time(features, topo)` evaluates the formulas on numpy arrays, one element per candidate.
`estimate(plan)` runs both for one plan and adds memory, MFU and days to the token budget.

Every op's cost comes from simulator.costs (the same functions the discrete-event workload calls: GEMM, expert,
attention, elementwise, collective, host-copy and optimizer times, the bytes each collective moves), and the result
metrics (fits, tokens/s, MFU, days) from simulator.metrics. What this module adds is the closed-form composition.
Overlap: the expert all-to-all hides behind shared-expert compute, data-parallel gradient reduction
behind the last micro-batch's backward, FSDP gathers behind the previous layer's compute; the rest is exposed.
Host per-op overhead (only where the topology's efficiency.host_op_s is measured, e.g. a calibrated CPU): the op
counts of the backend model (simulator.op_counts) per step, as simulator.host_overhead models them (rank 0's own
forward and backward ops, the extra ones on the pipeline's critical path, the optimizer's), each x its host time per
op, added to compute, pipeline_bubble and optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from rackcast.modelspec import FlopsConvention, ModelSpec
from rackcast.plan import Plan
from rackcast.simulator import costs, metrics
from rackcast.simulator.costs import balancing_time, collective_time, reduction_groups
from rackcast.simulator.host_overhead import host_ops
from rackcast.simulator.memory import BYTES, MemoryBreakdown, memory_breakdown, rank_params
from rackcast.simulator.optimizer_cost import (balancing_reductions, muon_gather_parts, muon_gather_split,
                                               newton_schulz_parts, newton_schulz_split, optimizer_traffic_bytes)
from rackcast.simulator.plan_arrays import COLUMNS, LAYER_SET, PlanArrays, is_arrays, per_key
from rackcast.simulator.placement import place
from rackcast.simulator.routing import expected_max_load_factor
from rackcast.simulator.schedule_formulas import bubble_fraction
from rackcast.topologies.spec import Topology
from rackcast.vocab import PHASES

HOST_OP_FEATURES = ("op_forward", "op_backward", "op_bubble_forward", "op_bubble_backward", "op_optimizer")


def host_op_features(spec: ModelSpec, plan: Plan, topo: Topology) -> dict[str, float]:
    """Host ops per step (simulator.host_overhead.host_ops): rank 0's forward and backward ops, the extra ones on the
    pipeline's critical path, the optimizer's. Zero, and no op counting, where the topology has no measured
    host_op_s."""
    if not topo.efficiency.host_op_s.measured:
        return dict.fromkeys(HOST_OP_FEATURES, 0.0)
    from rackcast.simulator.op_counts import op_counts

    o = host_ops(op_counts(spec, plan.optimizer.name), spec, plan)
    return {"op_forward": o.forward, "op_backward": o.backward, "op_bubble_forward": o.bubble_forward,
            "op_bubble_backward": o.bubble_backward, "op_optimizer": o.optimizer}


@lru_cache(maxsize=4096)
def _load_factor(transport, experts: int, top_k: int, ep: int, tokens_group: float, seed: int = 0):
    """expected_max_load_factor, cached: the planner asks for the same routing geometry many times."""
    return expected_max_load_factor(transport, experts, top_k, ep, tokens_group, seed=seed)


def _rank0_flops(spec: ModelSpec, plan: Plan) -> tuple:
    """Per token, hardware FLOPs of pipeline rank 0's layers by kind (dense GEMMs with the head when rank 0 holds
    the last chunk, attention cores, routed experts, shared experts), its MoE layers and its layer count."""
    hw = costs.HW
    layers = plan.rank_layers(spec, 0)
    gemm = attn = experts = shared = 0.0
    moe_layers = 0
    for i in layers:
        parts = spec.layer_flops_breakdown(i, hw)
        attn += parts.get("attn_scores_values", 0.0)
        experts += parts.get("experts", 0.0)
        shared += parts.get("shared_experts", 0.0)
        gemm += sum(v for k, v in parts.items() if k not in ("attn_scores_values", "experts"))
        moe_layers += spec.is_moe(i)
    if plan.parallel.chunk_ranks(plan.schedule)[-1] == 0:  # rank 0 holds the last chunk (one stage, or the V): the head
        gemm += spec.head_flops_fwd(hw)
    return gemm, attn, experts, shared, moe_layers, len(layers)


def plan_features(spec: ModelSpec, plan: Plan | PlanArrays, topo: Topology) -> dict:
    """The scalars the step-time formulas need, for pipeline rank 0 (the heaviest). For PlanArrays
    (simulator.plan_arrays: many layouts at once, `usable` GPUs per domain each) every value is an array, one element
    per plan; a single Plan is placed on topo's GPUs per domain."""
    arrays = is_arrays(plan)
    par = plan.parallel
    t, cp = par.tensor, par.context
    tokens_mb = plan.tokens_per_microbatch(spec)
    m = plan.microbatches
    gemm, attn, experts, shared, moe_layers, n_layers = per_key(plan, LAYER_SET, lambda p: _rank0_flops(spec, p))
    pl = place(plan, np.where(plan.usable > 0, plan.usable, topo.scale_up.usable_gpus) if arrays else
               topo.scale_up.usable_gpus)
    from rackcast.simulator.memory import layer_activation_bytes_per_token

    # Written in forward, read in backward.
    elementwise, = per_key(plan, LAYER_SET + ("tensor", "sequence_parallel", "expert_tensor"), lambda p: sum(
        2 * layer_activation_bytes_per_token(spec, i, p) for i in p.rank_layers(spec, 0)))
    w_bytes = costs.W_BYTES
    g_bytes = BYTES[plan.grad_dtype]
    rp = rank_params(spec, plan, 0)
    m_imbalance, drop = 1.0, 0.0
    if spec.moe is not None:
        tokens_group = tokens_mb * par.expert_group  # tokens routed inside one expert group per micro-batch
        m_imbalance, drop = per_key(plan, ("transport", "expert", tokens_group), lambda p: _load_factor(
            p.expert_transport, spec.moe.experts, spec.moe.top_k, p.parallel.expert,
            p.tokens_per_microbatch(spec) * p.parallel.expert_group, seed=p.seed))
    recompute_fwd = np.select([plan.recompute == "none", plan.recompute == "selective"], [0.0, attn],
                              gemm + attn + experts)
    efsdp = par.expert_fsdp
    ns = 0.0
    if plan.optimizer.name == "muonh":
        ns = newton_schulz_split(per_key(plan, LAYER_SET, lambda p: newton_schulz_parts(spec, p.rank_layers(spec, 0))),
                                 plan)
    opt_bytes, host_bytes = optimizer_traffic_bytes(rp, plan)
    bal_count, bal_hist, bal_max = per_key(plan, LAYER_SET, lambda p: balancing_reductions(spec, p.rank_layers(spec, 0)))
    muon_bytes = muon_norms = 0.0
    if plan.optimizer.name == "muonh":
        muon_bytes, muon_norms = muon_gather_split(
            per_key(plan, LAYER_SET, lambda p: muon_gather_parts(spec, p.rank_layers(spec, 0))), plan)
    bubble, = per_key(plan, ("schedule", "pipeline", "virtual", m), lambda p: bubble_fraction(
        p.schedule, p.parallel.pipeline, p.microbatches, p.parallel.chunks_per_rank))
    host_ops_ = (0.0,) * len(HOST_OP_FEATURES)
    if topo.efficiency.host_op_s.measured:  # counts per plan (CPU topologies: small searches)
        host_ops_ = per_key(plan, COLUMNS, lambda p: tuple(host_op_features(spec, p, topo).values()))
    features = {
        "microbatches": m,
        "bubble_fraction": bubble,
        "tokens_mb": tokens_mb,
        "gemm_flops": gemm * tokens_mb / t,
        "gemm_size": costs.gemm_size(tokens_mb, spec, t),
        "attn_flops": attn * tokens_mb / t,
        # Expert-tensor ranks split each expert's width but process every row of their experts: per-rank expert
        # FLOPs and GEMM shapes stay those of expert_tensor = 1 (costs.expert_gemm_size, costs.a2a_bytes).
        "expert_flops": experts * tokens_mb * m_imbalance,
        "expert_gemm_size": costs.expert_gemm_size(tokens_mb, spec, par.expert),
        "shared_flops": shared * tokens_mb / t,
        "recompute_flops": recompute_fwd * tokens_mb / t,
        "elementwise_bytes": elementwise * tokens_mb,
        "tp_n": t, "tp_out": pl.tensor.span == "scale_out",
        "tp_bytes": costs.tensor_bytes(tokens_mb, spec), "tp_count": 4 * n_layers,
        "cp_n": cp, "cp_out": pl.context.span == "scale_out",
        "cp_bytes": costs.context_bytes(tokens_mb, spec, t),
        "cp_count": 3 * n_layers,
        "ep_n": par.expert_group, "ep_out": pl.expert.span == "scale_out",
        "a2a_bytes": costs.a2a_bytes(tokens_mb, spec, par.expert_tensor) * m_imbalance, "a2a_count": 4 * moe_layers,
        "pp_n": par.pipeline, "pp_out": pl.pipeline.span == "scale_out",
        "pp_bytes": costs.pipeline_bytes(tokens_mb, spec),
        "dense_grad_bytes": rp.dense * g_bytes,
        **reduction_groups(plan, pl),
        "expert_grad_bytes": rp.expert * g_bytes,
        "efsdp_n": efsdp, "efsdp_out": pl.expert_fsdp.span == "scale_out",
        "expert_fsdp_bytes": np.where(efsdp > 1, rp.expert * w_bytes, 0.0),
        "erep_n": par.expert_replicas, "erep_out": pl.expert_replicas.span == "scale_out",
        "fsdp_n": par.fsdp, "fsdp_out": pl.fsdp.span == "scale_out",
        "fsdp_bytes": rp.dense * w_bytes,
        "opt_bytes": opt_bytes, "ns_flops": ns, "ns_size": costs.newton_schulz_size(spec),
        "bal_count": bal_count, "bal_hist_bytes": bal_hist, "bal_max_bytes": bal_max,
        "muon_gather_bytes": muon_bytes, "muon_norm_count": muon_norms,
        "host_bytes": host_bytes,
        "drop_fraction": drop,
        **dict(zip(HOST_OP_FEATURES, host_ops_)),
    }
    if arrays:
        return {k: np.broadcast_to(np.asarray(v, dtype=float), (len(plan),)) for k, v in features.items()}
    return {k: float(v) for k, v in features.items()}


def step_time(f: dict, topo: Topology) -> dict[str, np.ndarray]:
    """Phase times (seconds) and the step time, elementwise over arrays of features."""
    f = {k: np.asarray(v, dtype=float) for k, v in f.items()}
    eff = topo.efficiency
    slow = 1.0 + eff.comm_compute_slowdown
    gemm_t = costs.gemm_time(f["gemm_flops"], f["gemm_size"], topo)
    attn_t = costs.attention_time(f["attn_flops"], topo)
    expert_t = costs.grouped_gemm_time(f["expert_flops"], f["expert_gemm_size"], topo)
    shared_t = costs.gemm_time(f["shared_flops"], f["gemm_size"], topo)
    elem_t = costs.memory_bound_time(f["elementwise_bytes"], topo)
    recompute_t = costs.gemm_time(f["recompute_flops"], f["gemm_size"], topo)
    fwd = gemm_t + attn_t + expert_t
    compute_mb = 3 * fwd + recompute_t + elem_t  # forward + backward (2x) + recomputation + elementwise
    tp_t = f["tp_count"] * collective_time(topo, "all_reduce", f["tp_n"], f["tp_bytes"], f["tp_out"])
    cp_t = f["cp_count"] * collective_time(topo, "send_recv", f["cp_n"], f["cp_bytes"], f["cp_out"]) * \
        np.maximum(f["cp_n"] - 1, 0)
    cp_exposed = np.maximum(0.0, cp_t - 3 * attn_t)
    a2a_t = f["a2a_count"] * collective_time(topo, "all_to_all", f["ep_n"], f["a2a_bytes"], f["ep_out"])
    a2a_exposed = np.maximum(0.0, a2a_t - 3 * shared_t)  # shared experts run while tokens travel
    # Forward and backward each gather the sharded weights (dense over fsdp, experts over their FSDP group).
    fsdp_t = 2 * (collective_time(topo, "all_gather", f["fsdp_n"], f["fsdp_bytes"], f["fsdp_out"]) +
                  collective_time(topo, "all_gather", f["efsdp_n"], f["expert_fsdp_bytes"], f["efsdp_out"]))
    fsdp_exposed = np.maximum(0.0, fsdp_t - compute_mb)
    pp_t = 2 * collective_time(topo, "send_recv", np.minimum(f["pp_n"], 2), f["pp_bytes"], f["pp_out"])
    mb_time = compute_mb * np.where(a2a_t + tp_t + fsdp_t > 0, slow, 1.0) + tp_t + cp_exposed + a2a_exposed + \
        fsdp_exposed + pp_t
    m = f["microbatches"]
    busy = m * mb_time
    pipeline_t = busy / (1.0 - f["bubble_fraction"])
    bubble_t = pipeline_t - busy
    # Gradient reduction (costs.gradient_reductions), hidden behind the last backward.
    groups = {"inner": ("inner_n", "inner_out"), "data": ("outer_n", "outer_out"),
              "expert_fsdp": ("efsdp_n", "efsdp_out"), "expert_replicas": ("erep_n", "erep_out")}
    dp_t = sum(collective_time(topo, c.kind, f[groups[c.axis][0]], c.nbytes, f[groups[c.axis][1]])
               for c in costs.gradient_reductions(f["dense_grad_bytes"], f["expert_grad_bytes"], f["inner_n"],
                                                  f["efsdp_n"]))
    dp_exposed = np.maximum(0.0, dp_t - 2 * fwd)
    optimizer_t = costs.optimizer_time(f["opt_bytes"], f["ns_flops"], f["ns_size"], topo) + balancing_time(f, topo) + \
        costs.muon_gather_time(f, topo)
    host_t = costs.host_link_time(f["host_bytes"], topo)
    # Host per-op overhead (features in ops; zero without measured host_op_s), blocking: added, not overlapped.
    h = eff.host_op_s
    op_c = f.get("op_forward", 0.0) * h.forward + f.get("op_backward", 0.0) * h.backward
    op_b = f.get("op_bubble_forward", 0.0) * h.forward + f.get("op_bubble_backward", 0.0) * h.backward
    op_o = f.get("op_optimizer", 0.0) * h.optimizer
    step = pipeline_t + dp_exposed + optimizer_t + host_t + op_c + op_b + op_o
    compute_total = m * (compute_mb * np.where(a2a_t + tp_t + fsdp_t > 0, slow, 1.0)) + op_c
    bubble_t = bubble_t + op_b
    optimizer_t = optimizer_t + op_o
    return {
        "step_time_s": step,
        "compute": compute_total,
        "exposed_expert_a2a": m * a2a_exposed,
        "exposed_tensor_comm": m * (tp_t + cp_exposed),
        "exposed_fsdp_gather": m * fsdp_exposed,
        "pipeline_p2p": m * pp_t,
        "pipeline_bubble": bubble_t,
        "exposed_dp_comm": dp_exposed,
        "optimizer": optimizer_t,
        "host_transfer": host_t,
        "expert_a2a_total": m * a2a_t,
        "dp_comm_total": dp_t,
    }


@dataclass(frozen=True)
class Estimate:
    fits: bool
    memory: MemoryBreakdown
    hbm_bytes: float
    host_bytes_per_host: float
    host_capacity_bytes: float
    step_time_s: float
    phases_s: dict[str, float]
    tokens_per_step: int
    tokens_per_s: float
    mfu: float
    model_flops_per_step: float
    days_to_budget: float
    drop_fraction: float
    flops_convention: str
    gpus: int

    def as_dict(self) -> dict:
        return {
            "fits": self.fits, "gpus": self.gpus,
            "memory_per_gpu_bytes": self.memory.as_dict(), "hbm_bytes": self.hbm_bytes,
            "host_bytes_per_host": self.host_bytes_per_host, "host_capacity_bytes": self.host_capacity_bytes,
            "step_time_s": self.step_time_s, "phases_s": self.phases_s,
            "tokens_per_step": self.tokens_per_step, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
            "model_flops_per_step": self.model_flops_per_step, "days_to_budget": self.days_to_budget,
            "drop_fraction": self.drop_fraction, "flops_convention": self.flops_convention,
        }


def estimate(plan: Plan, convention: FlopsConvention = FlopsConvention(), spec: ModelSpec | None = None,
             topo: Topology | None = None) -> Estimate:
    spec = spec or plan.model_spec()
    topo = topo or plan.topology_spec()
    mem = memory_breakdown(spec, plan)
    feats = plan_features(spec, plan, topo)
    times = {k: float(v) for k, v in step_time(feats, topo).items()}
    tokens = plan.tokens_per_step(spec)
    step = times["step_time_s"]
    model_flops = metrics.model_flops_per_step(spec, tokens, convention)
    rate = metrics.step_metrics(tokens, step, model_flops, topo.gpus, topo, plan.tokens)
    return Estimate(
        fits=bool(metrics.fits_memory(mem.total, mem.host, topo)), memory=mem, hbm_bytes=topo.accelerator.hbm_bytes,
        host_bytes_per_host=metrics.host_bytes_per_host(mem.host, topo), host_capacity_bytes=topo.host.memory_bytes,
        step_time_s=step, phases_s={k: times[k] for k in PHASES}, tokens_per_step=tokens,
        tokens_per_s=rate.tokens_per_s, mfu=rate.mfu, model_flops_per_step=model_flops,
        days_to_budget=rate.days_to_budget, drop_fraction=feats["drop_fraction"], flops_convention=convention.label, gpus=topo.gpus,
    )
