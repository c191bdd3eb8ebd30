"""The cost model: what each op of a training step costs on a topology, the one definition that both the closed-form
estimate (simulator.estimate) and the discrete-event workload (simulator.workload) call.

Sizes (bytes a collective moves, the GEMM shapes that set an efficiency) and times (compute, memory-bound work, host
copies, collectives, the optimizer step). Every function takes plain numbers or numpy arrays, which broadcast, so the
planner can price many layouts at once.

Conventions:
- hardware work (`HW`, simulator.attention_cost): the FLOPs kernels really execute — attention counted causally
  over its window (a banded call's masked excess added where it is priced), the output head included — which
  prices compute time; model FLOPs (the MFU numerator, simulator.metrics) follow the plan's
  FlopsConvention instead;
- compute time = FLOPs / (compute peak x efficiency): the peak of the dtype the plan's matrix products run in
  (compute_peak: bf16, fp32 without autocast, fp8 where the topology lists it), the efficiency a fraction of that
  peak at the op's GEMM shape (GemmShape: m x n x k, groups): each dense GEMM at its own
  (simulator.gemms.rank_shape), routed experts as one grouped GEMM of a rank's local experts, each its routed rows
  x expert width x input width. Where the topology has measured curves (`rackcast calibrate`) the efficiency is
  the measured surface's at the shape (simulator.gemm_surface), else the curve's at one group's FLOPs; otherwise
  the shape model (gemm_seconds): output tiles in waves over the SMs under the kernel-level ceiling, the HBM
  roofline, the launch floor. Attention cores at the efficiency of their call's kind and shape where the topology
  has a measured attention surface, else at the attention fraction, on the work their kernel executes
  (simulator.attention_cost); backward = 2 x forward;
- memory-bound work (elementwise ops, the optimizer's state update) = bytes / (HBM bandwidth x memory_bound);
  eager ops' counted bytes (simulator.op_bytes), where they replace that term = bytes / (HBM bandwidth x
  eager_bandwidth);
- a collective of `nbytes` per rank (the nccl-tests size) over n ranks takes steps x latency + factor x nbytes /
  (bandwidth x efficiency(nbytes)) on the slowest hop of its span (simulator.collective_formulas).

    from rackcast.simulator import costs
    costs.gemm_time(flops, costs.GemmShape(m, n, k), topo, plan.precision)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from rackcast.modelspec import ModelSpec
from rackcast.simulator import collective_formulas as formulas
from rackcast.simulator.activations import BYTES, INDEX_BYTES
from rackcast.simulator.attention_cost import HW, Core, core_efficiency
from rackcast.simulator.gemm_surface import surface_efficiency
from rackcast.topologies import PRESET_DIR
from rackcast.topologies.spec import Topology
from rackcast.vocab import PRECISIONS

W_BYTES = BYTES["bf16"]  # activations and gathered weights on the wire


# ------------------------------------------------------------------------------------------------------------ peaks
def _peak(topo: Topology, precision: str) -> float:
    preset = PRESET_DIR / f"{topo.name}.yaml"  # a plan built in code: name the preset file the topology came from
    return topo.precision_peak(precision, where=str(preset) if preset.is_file() else f"topology {topo.name}")


def compute_peak(topo: Topology, precision):
    """Dense FLOP/s every GEMM, grouped GEMM, attention core and optimizer product of a plan is priced against (the
    efficiencies are fractions of it): the topology's peak for the plan's `precision` (Topology.peak_dtype).
    `precision`: a vocab.PRECISIONS name, or an array of indices into PRECISIONS (the estimate's "precision"
    feature). A plan file is checked for its peak when it loads (rackcast.plan.load_plan)."""
    if isinstance(precision, str):
        return _peak(topo, precision)
    codes = np.asarray(precision).astype(int)
    if codes.size and (codes == codes.flat[0]).all():  # one precision (the planner's arrays): no np.unique pass
        return np.full(codes.shape, _peak(topo, PRECISIONS[codes.flat[0]]), dtype=float)
    peak = np.zeros(codes.shape)
    for code in np.unique(codes):
        peak = np.where(codes == code, _peak(topo, PRECISIONS[code]), peak)
    return peak


def unquantised(precision):
    """The precision of the work an fp8 recipe leaves out of fp8: fp8 plans quantise the linear layers' GEMMs (dense,
    shared and routed experts, router) and keep the attention core, the output head and the optimizer's products in
    bf16, as DeepSeek-V3 trained ("we maintain the original precision (e.g., BF16 or FP32) for ... the output head,
    ... attention operators", arXiv:2412.19437 section 3.3.1) and as Transformer Engine's fp8 autocast does (it
    casts te.Linear GEMMs; attention stays bf16 unless asked). Other precisions map to themselves; `precision` as
    in compute_peak (a name, or an array of PRECISIONS indices)."""
    if isinstance(precision, str):
        return "bf16" if precision == "fp8" else precision
    codes = np.asarray(precision).astype(int)
    return np.where(codes == PRECISIONS.index("fp8"), PRECISIONS.index("bf16"), codes)


def element_bytes(precision):
    """Bytes of one matrix element in `precision` (a name, or an array of PRECISIONS indices)."""
    if isinstance(precision, str):
        return BYTES[precision]
    return np.array([BYTES[p] for p in PRECISIONS], dtype=float)[np.asarray(precision).astype(int)]


# ------------------------------------------------------------------------------------------------------- efficiency
def efficiency(curve, sizes):
    """Efficiency-profile curve at `sizes` (log-linear, clamped; as topologies.spec.interpolate), vectorised."""
    return formulas.efficiency_at([p.size for p in curve], [p.value for p in curve], np.maximum(sizes, 1e-30))


# ------------------------------------------------------------------------------------------------------------ sizes
class GemmShape(NamedTuple):
    """`groups` GEMMs of m x n x k each (rows x output columns x reduction), run as one kernel (a grouped GEMM when
    groups > 1); fields are floats or arrays, which broadcast."""

    m: object
    n: object
    k: object
    groups: object = 1.0


def expert_rows(tokens_mb, spec: ModelSpec, expert_group):
    """Rows routed to one expert per micro-batch, balanced routing: the expert group's tokens x top_k / experts."""
    moe = spec.moe
    return 0.0 * tokens_mb if moe is None else tokens_mb * expert_group * (moe.top_k / moe.experts)


def expert_shape(rows, spec: ModelSpec, expert, expert_tensor) -> GemmShape:
    """One rank's grouped expert GEMM: its experts / expert local experts, each `rows` (at least one) x its slice of
    the expert width (expert_ffn / expert_tensor) x the expert input width."""
    moe = spec.moe
    if moe is None:
        return GemmShape(1.0, 1.0, 1.0)  # no routed work to price
    return GemmShape(np.maximum(rows, 1.0), moe.expert_ffn / expert_tensor, spec.expert_input_dim,
                     moe.experts / expert)


def newton_schulz_shape(spec: ModelSpec) -> GemmShape:
    """The GEMM the MuonH orthogonalisation runs (one d_model^3 product)."""
    return GemmShape(spec.d_model, spec.d_model, spec.d_model)


def a2a_bytes(tokens_mb, spec: ModelSpec, expert_tensor):
    """Expert dispatch (or combine) bytes per rank per direction, balanced routing: every routed row (top_k per
    token, expert_input_dim wide) goes to each of the expert_tensor ranks holding a slice of its expert."""
    top_k = spec.moe.top_k if spec.moe else 0
    x = spec.expert_input_dim if spec.moe else 0
    return tokens_mb * top_k * x * W_BYTES * expert_tensor


def count_exchange_bytes(spec: ModelSpec, expert_tensor):
    """Per-rank send buffer of the per-expert token-count all-to-all over the expert group that blocks before every
    forward expert dispatch (counts carry no gradient): one int64 count per (expert, expert-tensor rank), as
    backend.expert_parallel.ExpertParallelMoE.dispatch_compute_combine sends them. Megatron-Core's all-to-all
    dispatcher likewise exchanges tokens-per-expert over the expert group before its permuted all-to-all
    (megatron/core/transformer/moe/token_dispatcher.py, MoEAlltoAllTokenDispatcher.preprocess)."""
    return spec.moe.experts * expert_tensor * INDEX_BYTES if spec.moe else 0


def count_exchange_time(topo: Topology, spec: ModelSpec, parallel, span_out):
    """Seconds of one count exchange (count_exchange_bytes, the flat all_to_all's alpha-beta time: at these few
    bytes its latency). Priced as a latency of the forward dispatch it always immediately precedes on the same
    group (the dispatch needs the counts for its split sizes), so it adds no collective of its own to the step:
    the estimate adds it to each forward dispatch's all-to-all time, the simulator to that Comm's lead_s. parallel:
    a ParallelSpec (or the estimate's arrays of them)."""
    nbytes = count_exchange_bytes(spec, parallel.expert_tensor)
    return collective_time(topo, "all_to_all", parallel.expert_group, nbytes, span_out)


def node_limited_copies(spec: ModelSpec, domains):
    """Copies of a token that cross into other scale-up domains' NICs, as a count before the remote share (arrays
    broadcast): top_k without node-limited routing (every routed row is sent), and with it (moe.node_limit M over
    moe.expert_groups G) at most one per domain the token reaches: R = min(top_k, domains, M x the domains one
    expert group touches). DeepSeek-V3 (arXiv:2412.19437, sections 2.1.2 and 3.2.2) sends each token across
    InfiniBand once per target node, to at most M nodes, and forwards it over NVLink to the experts there. The
    experts lie contiguously over the expert group's `domains`, so a group touches D/G domains when G divides D,
    one when D divides G, and may straddle one more otherwise."""
    moe = spec.moe
    d = np.asarray(domains, dtype=float)
    if moe is None or not moe.node_limit:
        return moe.top_k + 0.0 * d if moe is not None else 0.0 * d
    g = moe.expert_groups
    aligned = (np.mod(d, g) == 0) | (np.mod(g, d) == 0)
    spans = np.ceil(d / g) + np.where(aligned, 0.0, 1.0)
    return np.minimum(np.minimum(moe.top_k, d), moe.node_limit * spans)


def cross_domain_a2a_share(spec: ModelSpec, domains):
    """Share of an all-to-all's cross-domain bytes that go over the NICs: node_limited_copies / top_k (1 without
    node-limited routing, or within one domain); the rest of those copies are forwarded inside the destination
    domain (scale-up). The one formula both the estimate (its a2a bytes) and the simulator (ExpertLoads.port_bytes)
    price node-limited routing with."""
    d = np.asarray(domains, dtype=float)
    if spec.moe is None:
        return 1.0 + 0.0 * d
    return np.where(d > 1, node_limited_copies(spec, d) / spec.moe.top_k, 1.0)


def tensor_bytes(tokens_mb, spec: ModelSpec):
    """Tensor-parallel all-reduce of one layer output (tokens x d_model)."""
    return tokens_mb * spec.d_model * W_BYTES


def context_bytes(tokens_mb, spec: ModelSpec, tensor, context, layer: int):
    """Key/value (and short-convolution halo) bytes one rank receives for `layer` per micro-batch forward under context parallelism (arrays
    broadcast), as backend.context_parallel exchanges them; the backward sends as many back (the all-gather's
    reduce-scatter, the halo's gradient). A global layer, or a window layer whose window - 1 reaches past one chunk
    of seq_len / context tokens, all-gathers every other rank's chunk: (context - 1) x tokens_mb tokens. A window
    layer otherwise takes only the previous rank's last window - 1 positions of each sequence:
    tokens_mb x (window - 1) / chunk tokens. Per token: K (head_dim) and V (v_head_dim) of the layer's KV heads,
    split by tensor (latent attention: its keys and values expanded per head, as backend.latent_attention exchanges
    them); plus the short convolutions' halos at every site (conv_halo_bytes)."""
    a = spec.attention
    context = np.asarray(context, dtype=float)
    chunk = spec.seq_len / context
    per_token = spec.kv_heads(layer) * (a.head_dim + a.v_head_dim) * W_BYTES / tensor
    window = 0 if spec.is_global(layer) else spec.context(layer)
    halo = (window > 0) & (window - 1 <= chunk)
    tokens = np.where(halo, tokens_mb * max(window - 1, 0) / chunk, (context - 1) * tokens_mb)
    sites = spec.conv.sites if spec.conv is not None else ()
    return np.where(context > 1, tokens * per_token, 0.0) + conv_halo_bytes(tokens_mb, spec, tensor, context, sites)


def context_layer_key(spec: ModelSpec, layer: int) -> bool:
    """What context_bytes reads of `layer`: whether it attends globally (its KV heads and window follow from it);
    layers with the same key exchange the same bytes."""
    return spec.is_global(layer)


def mtp_context_bytes(tokens_mb, spec: ModelSpec, tensor, context, backward: bool = False):
    """Bytes one rank of the stage holding the multi-token-prediction modules receives for them per micro-batch
    under context parallelism (backend.mtp): each module's block exchanges keys and values as the main model's last
    layer does (context_bytes, its gradient back in the backward), and the forward takes the next rank's first
    depth + 1 token ids of each sequence (the lookahead, int64; no gradient)."""
    if spec.mtp is None:
        return 0.0
    context = np.asarray(context, dtype=float)
    blocks = spec.mtp.depth * context_bytes(tokens_mb, spec, tensor, context, spec.layers - 1)
    if backward:
        return blocks
    sequences = tokens_mb * context / spec.seq_len
    return blocks + np.where(context > 1, sequences * (spec.mtp.depth + 1) * INDEX_BYTES, 0.0)


def conv_halo_bytes(tokens_mb, spec: ModelSpec, tensor, context, sites):
    """Bytes of the previous rank's last kernel - 1 positions of each sequence that the causal short convolutions at
    `sites` (ConvSpec.sites: k and v of the stored KV heads, split by tensor; attn and mlp of d_model) receive per
    micro-batch forward under context parallelism (and send back in backward)."""
    if spec.conv is None or not sites:
        return 0.0
    context = np.asarray(context, dtype=float)
    kv = spec.attention.kv_heads_stored or spec.attention.kv_heads_local
    width = sum(kv * spec.attention.head_dim / tensor if s in ("k", "v") else spec.d_model for s in sites)
    sequences = tokens_mb * context / spec.seq_len
    return np.where(context > 1, sequences * (spec.conv.kernel - 1) * width * W_BYTES, 0.0)


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


def gradient_reductions(dense_bytes, expert_bytes, inner, expert_fsdp, zero=0) -> tuple[Collective, ...]:
    """Gradient reduction of `dense_bytes` and `expert_bytes` of gradients: reduce-scatter inside the fsdp x context
    group (`inner` ranks, axis "inner"), then across the data replicas an all-reduce of the shard, or under ZeRO-1/2
    (`zero` >= 1) a reduce-scatter, each replica keeping the gradients of the state it updates (Rajbhandari et al.,
    ZeRO, arXiv:1910.02054, section 7: a reduce-scatter of gradients and an all-gather of updated parameters instead
    of one all-reduce; `parameter_gathers` is the second half); for experts, reduce-scatter inside their FSDP group
    (none when expert_fsdp is 1), then the same choice across the remaining copies. Bytes are zero where a
    collective does not apply (arrays of layouts share one list)."""
    sharded = np.asarray(zero) >= 1
    return (Collective("reduce_scatter", "inner", dense_bytes, "dp", "grad reduce-scatter"),
            Collective("all_reduce", "data", dense_bytes / inner * ~sharded, "dp", "grad all-reduce"),
            Collective("reduce_scatter", "data", dense_bytes / inner * sharded, "dp", "grad reduce-scatter (zero)"),
            Collective("reduce_scatter", "expert_fsdp", expert_bytes * (expert_fsdp > 1), "edp",
                       "expert grad reduce-scatter"),
            Collective("all_reduce", "expert_replicas", expert_bytes / expert_fsdp * ~sharded, "edp",
                       "expert grad all-reduce"),
            Collective("reduce_scatter", "expert_replicas", expert_bytes / expert_fsdp * sharded, "edp",
                       "expert grad reduce-scatter (zero)"))


def parameter_gathers(dense_bytes, expert_bytes, inner, expert_fsdp, zero=0) -> tuple[Collective, ...]:
    """Under ZeRO-1/2 (`zero` >= 1), after the optimizer step: every data replica updated its shard of the weights
    and all-gathers the others' (`dense_bytes`, `expert_bytes`: the weights in their stored dtype, before the
    fsdp x context and expert-FSDP splits that gradient_reductions applies too); nothing otherwise."""
    sharded = np.asarray(zero) >= 1
    return (Collective("all_gather", "data", dense_bytes / inner * sharded, "dp", "param all-gather (zero)"),
            Collective("all_gather", "expert_replicas", expert_bytes / expert_fsdp * sharded, "edp",
                       "expert param all-gather (zero)"))


# ------------------------------------------------------------------------------------------------------------ times
def gemm_seconds(shape: GemmShape, topo: Topology, ceiling, precision):
    """One kernel of `shape` on the shape model: output tiles (tile_m x tile_n of the accelerator) of every group,
    run in waves of one tile per SM, each tile 2 x tile_m x tile_n x k FLOPs at the SM's share of the compute peak of
    `precision` x `ceiling` (a partly filled tile or wave costs a full one); no less than its operands (in
    `precision`) and output (fp8's in bf16) moved at the memory-bound HBM rate (the roofline), nor than the stack
    profile's launch floor."""
    a, e = topo.accelerator, topo.efficiency
    m, n, k, groups = (np.asarray(v, dtype=float) for v in shape)
    tiles = groups * np.ceil(m / a.tile_m) * np.ceil(n / a.tile_n)
    waves = np.ceil(tiles / a.sms)
    compute = waves * 2.0 * a.tile_m * a.tile_n * k * a.sms / (compute_peak(topo, precision) * ceiling)
    memory = memory_bound_time(groups * (element_bytes(precision) * (m * k + k * n) +
                                         element_bytes(unquantised(precision)) * m * n), topo)
    return np.maximum(np.maximum(compute, memory), e.launch_s)


def _efficiency(shape: GemmShape, topo: Topology, curve, ceiling, precision, surface=()):
    """Fraction of the compute peak of `precision` a kernel of `shape` reaches: the measured surface at its m x n x k
    where there is one (simulator.gemm_surface), else the measured curve at one group's FLOPs, else the shape
    model's FLOPs / (peak x gemm_seconds)."""
    m, n, k, groups = (np.asarray(v, dtype=float) for v in shape)
    flops = 2.0 * m * n * k
    if surface:
        return surface_efficiency(surface, m, n, k)
    if curve:
        return efficiency(curve, flops)
    return np.maximum(groups, 1e-30) * flops / (compute_peak(topo, precision) *
                                                gemm_seconds(shape, topo, ceiling, precision))


def gemm_efficiency(shape: GemmShape, topo: Topology, precision):
    e = topo.efficiency
    return _efficiency(shape, topo, e.gemm, e.gemm_ceiling, precision, e.gemm_surface)


def grouped_gemm_efficiency(shape: GemmShape, topo: Topology, precision):
    e = topo.efficiency
    return _efficiency(shape, topo, e.grouped_gemm, e.grouped_gemm_ceiling, precision, e.grouped_gemm_surface)


def gemm_time(flops, shape: GemmShape, topo: Topology, precision):
    """Dense GEMM work of `flops` run as GEMMs of `shape` in `precision` (gemm_efficiency)."""
    return flops / (compute_peak(topo, precision) * gemm_efficiency(shape, topo, precision))


def grouped_gemm_time(flops, shape: GemmShape, topo: Topology, precision):
    """Routed-expert work of `flops` run as grouped GEMMs of `shape` in `precision` (grouped_gemm_efficiency)."""
    return flops / (compute_peak(topo, precision) * grouped_gemm_efficiency(shape, topo, precision))


def attention_time(flops, topo: Topology, precision, core: Core | None = None):
    """Attention-core work of `flops` (scores and values, counted in HW) run as calls of `core`'s kind and shape
    (simulator.attention_cost: the work its kernel executes, core.ratio x flops, at the measured efficiency of that
    shape, else at the attention fraction) of the compute peak of `precision` (unquantised: fp8 plans run it in
    bf16). Without `core`: the attention fraction, as counted. A stack whose window kernel skips masked entries
    (efficiency.masked_window_work False) does the counted work."""
    ratio = 1.0 if core is None or not topo.efficiency.masked_window_work else core.ratio
    return flops * ratio / (compute_peak(topo, unquantised(precision)) * core_efficiency(core, topo))


def memory_bound_time(nbytes, topo: Topology):
    """Bytes read and written by memory-bound kernels (elementwise ops, optimizer updates)."""
    return nbytes / (topo.accelerator.hbm_bandwidth_Bps * topo.efficiency.memory_bound)


def eager_bytes_time(nbytes, topo: Topology):
    """Bytes counted op by op as an eager framework runs them (simulator.op_bytes), at the measured bandwidth times
    efficiency.eager_bandwidth (1 as calibrated: the measured figure is itself the best eager copy or add over the
    bytes it reads and writes, counted the same way; a fit may scale it, validation.fit). Not
    efficiency.memory_bound, which relates a fused stack's minimal bytes to the eager elementwise mix's time, so it
    already holds the eager ops' extra traffic that these counted bytes make explicit."""
    return nbytes / (topo.accelerator.hbm_bandwidth_Bps * topo.efficiency.eager_bandwidth)


def host_link_time(nbytes, topo: Topology):
    """Bulk copies between host and GPU memory over the host link."""
    return nbytes / (topo.host.link_bandwidth_Bps * topo.efficiency.host_link)


def optimizer_time(update_bytes, newton_schulz_flops, ns_shape: GemmShape, topo: Topology, precision):
    """The optimizer step on one rank (without its reductions): the update's HBM traffic plus the MuonH
    orthogonalisation at the GEMM efficiency of `ns_shape` in `precision` (newton_schulz_shape;
    simulator.optimizer_cost gives the bytes and FLOPs)."""
    return memory_bound_time(update_bytes, topo) + gemm_time(newton_schulz_flops, ns_shape, topo,
                                                             unquantised(precision))


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
    """MuonH on fsdp- and tensor-sharded matrices (simulator.optimizer_cost.muon_gather: f["muon_gather_bytes"],
    f["muon_norm_count"] over the fsdp group, f["muon_tp_gather_bytes"], f["muon_tp_norm_count"] over the tensor
    group): the all-gather of the fp32 updates and the scalar norm all-reduces over each group (f["fsdp_n"],
    f["fsdp_out"], in the hierarchy of f["fsdp_pd"] as every fsdp collective; f["tp_n"], f["tp_out"], f["tp_pd"]),
    blocking."""
    gather = collective_time(topo, "all_gather", f["fsdp_n"], f["muon_gather_bytes"], f["fsdp_out"], f["fsdp_pd"])
    norms = f["muon_norm_count"] * collective_time(topo, "all_reduce", f["fsdp_n"], BYTES["fp32"], f["fsdp_out"],
                                                   f["fsdp_pd"])
    tp_gather = collective_time(topo, "all_gather", f["tp_n"], f["muon_tp_gather_bytes"], f["tp_out"], f["tp_pd"])
    tp_norms = f["muon_tp_norm_count"] * collective_time(topo, "all_reduce", f["tp_n"], BYTES["fp32"], f["tp_out"],
                                                         f["tp_pd"])
    return (np.where(np.asarray(f["muon_gather_bytes"]) > 0, gather + norms, 0.0) +
            np.where(np.asarray(f["muon_tp_gather_bytes"]) > 0, tp_gather + tp_norms, 0.0))
