"""The cost model: what each op of a training step costs on a topology, the one definition that both the closed-form
estimate (simulator.estimate) and the discrete-event workload (simulator.workload) call.

Sizes (bytes a collective moves, the GEMM shape that picks an efficiency) and times (compute, memory-bound work, host
copies, collectives, the optimizer step). Every function takes plain numbers or numpy arrays, which broadcast, so the
planner can price many layouts at once.

Conventions:
- hardware work (`HW`): the FLOPs kernels really execute — attention counted causally over its window, the output
  head included — which prices compute time; model FLOPs (the MFU numerator, simulator.metrics) follow the plan's
  FlopsConvention instead;
- compute time = FLOPs / (bf16 peak x efficiency), the efficiency read from the topology's profile at the op's size:
  dense GEMMs at the size of one `2 x tokens x d_model^2 / tensor` GEMM, routed experts at one expert's GEMM on the
  grouped-GEMM curve, attention cores at the attention fraction; backward = 2 x forward;
- memory-bound work (elementwise ops, the optimizer's state update) = bytes / (HBM bandwidth x memory_bound);
- a collective of `nbytes` per rank (the nccl-tests size) over n ranks takes steps x latency + factor x nbytes /
  (bandwidth x efficiency(nbytes)) on the slowest hop of its span (simulator.collective_formulas).

    from rackcast.simulator import costs
    costs.gemm_time(flops, costs.gemm_size(tokens_mb, spec, tensor), topo)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from rackcast.modelspec import FlopsConvention, ModelSpec
from rackcast.simulator import collective_formulas as formulas
from rackcast.simulator.activations import BYTES
from rackcast.topologies.spec import Topology

HW = FlopsConvention(attention="causal", window="window", head=True)  # the work kernels really do
W_BYTES = BYTES["bf16"]  # activations and gathered weights on the wire


# ------------------------------------------------------------------------------------------------------- efficiency
def efficiency(curve, sizes):
    """Efficiency-profile curve at `sizes` (log-linear, clamped; as topologies.spec.interpolate), vectorised."""
    return formulas.efficiency_at([p.size for p in curve], [p.value for p in curve], np.maximum(sizes, 1e-30))


# ------------------------------------------------------------------------------------------------------------ sizes
def gemm_size(tokens_mb, spec: ModelSpec, tensor):
    """FLOPs of one dense GEMM of a micro-batch (2 x tokens x d_model^2 / tensor): the size its efficiency is read at."""
    return 2 * tokens_mb * spec.d_model * spec.d_model / tensor


def expert_gemm_size(tokens_mb, spec: ModelSpec, expert):
    """FLOPs of one routed expert's GEMM: the rows routed to it from the `expert` ranks of its group (at least one)
    times its input and hidden widths. Expert-tensor ranks split the width but process every row of their experts,
    so the GEMM per expert keeps the rows x width of expert_tensor = 1."""
    moe = spec.moe
    if moe is None:
        return 0.0 * tokens_mb
    return 2 * np.maximum(tokens_mb * expert * (moe.top_k / moe.experts), 1.0) * spec.expert_input_dim * moe.expert_ffn


def newton_schulz_size(spec: ModelSpec) -> float:
    """GEMM size the MuonH orthogonalisation runs at (one d_model^3 product)."""
    return 2 * spec.d_model ** 3


def a2a_bytes(tokens_mb, spec: ModelSpec, expert_tensor):
    """Expert dispatch (or combine) bytes per rank per direction, balanced routing: every routed row (top_k per
    token, expert_input_dim wide) goes to each of the expert_tensor ranks holding a slice of its expert."""
    top_k = spec.moe.top_k if spec.moe else 0
    x = spec.expert_input_dim if spec.moe else 0
    return tokens_mb * top_k * x * W_BYTES * expert_tensor


def tensor_bytes(tokens_mb, spec: ModelSpec):
    """Tensor-parallel all-reduce of one layer output (tokens x d_model)."""
    return tokens_mb * spec.d_model * W_BYTES


def context_bytes(tokens_mb, spec: ModelSpec, tensor):
    """Context-parallel key/value block one rank passes to the next per ring step (local KV heads, split by tensor)."""
    a = spec.attention
    return tokens_mb * 2 * a.kv_heads_local * a.head_dim * W_BYTES / tensor


def pipeline_bytes(tokens_mb, spec: ModelSpec):
    """Activations (or their gradients) one pipeline stage sends the next per micro-batch."""
    return tokens_mb * spec.d_model * W_BYTES


class Collective(NamedTuple):
    """One collective of a step: its kind, the parallel axis (a simulator.stepnet axis) and the bytes per rank."""

    kind: str
    axis: str
    nbytes: object  # float or array
    stream: str  # the simulator's stream for it (dp: dense gradients, edp: expert gradients)
    name: str


def gradient_reductions(dense_bytes, expert_bytes, inner, expert_fsdp) -> tuple[Collective, ...]:
    """Gradient reduction of `dense_bytes` and `expert_bytes` of gradients: reduce-scatter inside the fsdp x context
    group (`inner` ranks, axis "inner") and all-reduce of the shard across data replicas; for experts, reduce-scatter
    inside their FSDP group (none when expert_fsdp is 1) and all-reduce of the shard across the remaining copies."""
    return (Collective("reduce_scatter", "inner", dense_bytes, "dp", "grad reduce-scatter"),
            Collective("all_reduce", "data", dense_bytes / inner, "dp", "grad all-reduce"),
            Collective("reduce_scatter", "expert_fsdp", expert_bytes * (expert_fsdp > 1), "edp",
                       "expert grad reduce-scatter"),
            Collective("all_reduce", "expert_replicas", expert_bytes / expert_fsdp, "edp", "expert grad all-reduce"))


# ------------------------------------------------------------------------------------------------------------ times
def gemm_time(flops, size, topo: Topology):
    """Dense GEMM work at the GEMM efficiency of `size`."""
    return flops / (topo.peak_flops("bf16") * efficiency(topo.efficiency.gemm, size))


def grouped_gemm_time(flops, size, topo: Topology):
    """Routed-expert work at the grouped-GEMM efficiency of one expert's GEMM of `size`."""
    return flops / (topo.peak_flops("bf16") * efficiency(topo.efficiency.grouped_gemm, size))


def attention_time(flops, topo: Topology):
    """Attention-core work (scores and values) at the attention fraction of peak."""
    return flops / (topo.peak_flops("bf16") * topo.efficiency.attention)


def memory_bound_time(nbytes, topo: Topology):
    """Bytes read and written by memory-bound kernels (elementwise ops, optimizer updates)."""
    return nbytes / (topo.accelerator.hbm_bandwidth_Bps * topo.efficiency.memory_bound)


def host_link_time(nbytes, topo: Topology):
    """Bulk copies between host and GPU memory over the host link."""
    return nbytes / (topo.host.link_bandwidth_Bps * topo.efficiency.host_link)


def optimizer_time(update_bytes, newton_schulz_flops, ns_size, topo: Topology):
    """The optimizer step on one rank (without its reductions): the update's HBM traffic plus the MuonH
    orthogonalisation at the GEMM efficiency of `ns_size` (newton_schulz_size; simulator.optimizer_cost gives the
    bytes and FLOPs)."""
    return memory_bound_time(update_bytes, topo) + gemm_time(newton_schulz_flops, ns_size, topo)


def _flat_time(topo: Topology, kind: str, n, nbytes, span_out):
    curves = topo.efficiency.collectives[kind]
    eff = np.where(span_out, efficiency(curves.scale_out, nbytes), efficiency(curves.scale_up, nbytes))
    bw = np.where(span_out, topo.link_bandwidth_Bps("scale_out"), topo.link_bandwidth_Bps("scale_up"))
    lat = np.where(span_out, topo.link_latency_s("scale_out"), topo.link_latency_s("scale_up"))
    return formulas.collective_time(kind, nbytes, np.maximum(n, 2.0), np.maximum(bw, 1e-30), lat, eff)


def collective_time(topo: Topology, kind: str, n, nbytes, span_out, per_domain=1):
    """Alpha-beta time of a collective on the topology; arrays broadcast. span_out: true where the group crosses
    domains (slowest hop: the NIC) — the efficiency curve of that span applies. per_domain: the group's ranks in each
    domain when it spans several with the same number in each (group_per_domain); a ring collective then runs in
    the phases of collective_formulas.HIERARCHY. Zero for one rank or no bytes."""
    n = np.asarray(n, dtype=float)
    nbytes = np.asarray(nbytes, dtype=float)
    span_out = np.asarray(span_out, dtype=bool)
    t = _flat_time(topo, kind, n, nbytes, span_out)
    pd = np.asarray(per_domain, dtype=float)
    if kind in formulas.HIERARCHY and np.any(pd > 1):
        local, cross = np.maximum(pd, 1.0), np.maximum(n / np.maximum(pd, 1.0), 1.0)
        hier = sum(_flat_time(topo, k, local, nbytes, False) if level == "local" else
                   np.where(cross > 1, _flat_time(topo, k, cross, nbytes / local, True), 0.0)
                   for k, level in formulas.HIERARCHY[kind])
        t = np.where(span_out & (pd > 1), hier, t)
    return np.where((n > 1) & (nbytes > 0), t, 0.0)


def group_per_domain(group) -> int:
    """Ranks per domain of a placement Group that spans several domains with the same number (> 1) in each (the
    hierarchical case of collective_time), else 1."""
    even = (group.domains > 1) & (group.per_domain > 1) & (group.size == group.per_domain * group.domains)
    return np.where(even, group.per_domain, 1)


def reduction_groups(plan, pl) -> dict:
    """The two levels a reduction over the token-sharding ranks runs on: inside the fsdp x context group, then across
    data replicas (sizes from the layout, and whether each crosses domains); pl: simulator.placement.place(plan, ...)."""
    par = plan.parallel
    inner = pl.inner
    return {"inner_n": par.reduction_inner, "inner_out": inner.span == "scale_out", "inner_pd": group_per_domain(inner),
            "outer_n": par.reduction_outer, "outer_out": pl.data.span == "scale_out",
            "outer_pd": group_per_domain(pl.data)}


def balancing_time(f: dict, topo: Topology):
    """Balancing's reductions per step (simulator.optimizer_cost.balancing_reductions: f["bal_count"] reductions,
    f["bal_hist_bytes"], f["bal_max_bytes"]), blocking, priced as a hierarchical all-reduce over the token-sharding
    ranks like the gradient reduction (groups of reduction_groups): reduce-scatter inside the fsdp x context group,
    all-reduce of the shard across data replicas, all-gather inside again; the extremes all-reduced at both levels."""
    inner, outer = f["inner_n"], f["outer_n"]
    ipd, opd = f.get("inner_pd", 1), f.get("outer_pd", 1)
    hist = (collective_time(topo, "reduce_scatter", inner, f["bal_hist_bytes"], f["inner_out"], ipd) +
            collective_time(topo, "all_reduce", outer, f["bal_hist_bytes"] / np.maximum(inner, 1), f["outer_out"],
                            opd) +
            collective_time(topo, "all_gather", inner, f["bal_hist_bytes"], f["inner_out"], ipd))
    extremes = (collective_time(topo, "all_reduce", inner, f["bal_max_bytes"], f["inner_out"], ipd) +
                collective_time(topo, "all_reduce", outer, f["bal_max_bytes"], f["outer_out"], opd))
    return f["bal_count"] * (hist + extremes)


def muon_gather_time(f: dict, topo: Topology):
    """MuonH on fsdp-sharded matrices (simulator.optimizer_cost.muon_gather: f["muon_gather_bytes"],
    f["muon_norm_count"]): the all-gather of the fp32 updates and the scalar norm all-reduces over the fsdp group
    (f["fsdp_n"], f["fsdp_out"], in the hierarchy of f["fsdp_pd"] as every fsdp collective), blocking."""
    gather = collective_time(topo, "all_gather", f["fsdp_n"], f["muon_gather_bytes"], f["fsdp_out"], f["fsdp_pd"])
    norms = f["muon_norm_count"] * collective_time(topo, "all_reduce", f["fsdp_n"], BYTES["fp32"], f["fsdp_out"],
                                                   f["fsdp_pd"])
    return np.where(np.asarray(f["muon_gather_bytes"]) > 0, gather + norms, 0.0)
