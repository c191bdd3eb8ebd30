"""Closed-form step-time estimate of a plan: roofline compute with the efficiency profile, alpha-beta collectives on
the links each group spans, the pipeline bubble by schedule formula, and exposed versus overlapped communication.

Two stages, so the planner can rank thousands of layouts at once:
1. `plan_features(spec, plan, topo)` reduces one plan to a flat dict of scalars (FLOPs, bytes, group sizes, spans);
2. `step_time(features, topo)` evaluates the formulas on numpy arrays, one element per candidate.
`estimate(plan)` runs both for one plan and adds memory, MFU and days to the token budget.

Every op's cost comes from simulator.costs (the same functions the discrete-event workload calls: GEMM, expert,
attention, elementwise, collective, host-copy and optimizer times, the bytes each collective moves), and the result
metrics (fits, tokens/s, MFU, days) from simulator.metrics. What this module adds is the closed-form composition.
Dense GEMMs are priced by name (simulator.gemms: fused Q/K/V, router, gated norms, head, ...), each at its own
shape: a stage's FLOPs of each name are features ("gemm:NAME", "gemm_end:NAME" for the head end), the rank's shape
of each too ("gemm_m:NAME", ...), and one stacked costs.gemm_time call prices every name of a plan
(simulator.gemms.GemmRates).
Pipeline: every stage's work comes from the layers it holds (simulator.stage_work: the head on the last chunk, the
embedding on the first, global-attention layers at their cost); the slowest stage is busy every micro-batch, the
others fill and drain the pipeline as the schedule's closed form says (schedule_formulas.bubble_coefficients), and
sends are exposed only along the fill and the drain.
Overlap: the expert all-to-all hides behind shared-expert compute, FSDP gathers behind the previous layer's compute
(the first layer's of each forward or backward and the embedding / head ends are exposed), the data-parallel
gradient reduction behind the last micro-batch's backward when the plan overlaps it (plan.overlap_grad_reduce),
else after it (under ZeRO-1/2 a reduce-scatter, then the updated weights' all-gather after the optimizer step,
exposed; under ZeRO-2 every earlier micro-batch's reduction too, hidden behind the following micro-batches' work
where it can be); the rest is exposed. simulator.workload and step model the same, op by op; tests/
test_estimate_vs_simulator.py holds the two within 5%.
Host per-op overhead (only where the topology's efficiency.host_op_s is measured, e.g. a calibrated CPU): the op
counts of the backend model (simulator.op_counts) per step, as simulator.host_overhead models them (rank 0's own
forward and backward ops, the extra ones on the pipeline's critical path, the optimizer's), each x its host time per
op, added to compute, pipeline_bubble and optimizer. With them, where simulator.op_bytes has the model's counted
eager bytes and the plan runs the model as they were counted (simulator.host_overhead.counted_bytes), the same
parts' bytes at costs.eager_bytes_time (simulator.host_overhead.host_bytes: each rank's share, recomputation
included), which then replace the fused elementwise_bytes and optimizer-update traffic (feature eager_bytes_counted
1; 0: the analytic terms stand).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from rackcast.modelspec import FlopsConvention, ModelSpec
from rackcast.plan import Plan
from rackcast.simulator import costs, metrics
from rackcast.simulator.attention_cost import CORE_FIELDS, Core, kind_cores
from rackcast.simulator.costs import balancing_time, collective_time, group_per_domain, reduction_groups
from rackcast.simulator.gemms import GEMM_NAMES, gemm_rates, gemm_seconds, rank_shape, shapes_by_name, \
    tail_expert_shape
from rackcast.simulator.host_overhead import HOST_OP_FEATURES, counted_bytes, host_op_features
from rackcast.simulator.memory import BYTES, MemoryBreakdown, memory_breakdown, rank_params
from rackcast.simulator.optimizer_cost import (balancing_reductions, muon_gather_parts, muon_gather_split,
                                               newton_schulz_parts, newton_schulz_split, optimizer_traffic_bytes)
from rackcast.simulator.plan_arrays import COLUMNS, LAYER_SET, PlanArrays, is_arrays, per_key
from rackcast.simulator.placement import place
from rackcast.simulator.routing import expected_max_load_factor
from rackcast.simulator.schedule_formulas import bubble_coefficients, paced_bubble_time_s, pacing_coefficients
from rackcast.simulator.stage_features import FIRST_CHUNK_PREFIXES, STAGE_KEYS, stage_compute_s, stage_features
from rackcast.topologies.spec import ATTENTION_KINDS, Topology
from rackcast.vocab import PHASES, PRECISIONS

def eager_bytes_counted(spec: ModelSpec, plan: Plan | PlanArrays, topo: Topology) -> bool:
    """Whether the counted eager bytes replace the analytic elementwise and optimizer-update traffic
    (host_overhead.counted_bytes)."""
    return counted_bytes(spec, plan, topo) is not None


@lru_cache(maxsize=4096)
def _load_factor(transport, experts: int, top_k: int, ep: int, tokens_group: float, seed: int = 0):
    """expected_max_load_factor, cached: the planner asks for the same routing geometry many times."""
    return expected_max_load_factor(transport, experts, top_k, ep, tokens_group, seed=seed)


def _stage_gemm_flops(f: dict, pre: str, rates) -> tuple:
    """A features dict's GEMM FLOPs of the stage prefixed `pre`, stacked as gemm_seconds takes them (rates:
    simulator.gemms.GemmRates)."""
    def stack(ns, key):
        return np.stack([f[pre + key + n] for n in ns]) if ns else np.zeros(1)

    return stack(rates.names, "gemm:"), stack(rates.end_names, "gemm_end:")


def _shapes(f: dict, col=lambda x: x) -> tuple[dict, costs.GemmShape, costs.GemmShape]:
    """The dense GEMM shapes by name, the grouped expert GEMM shape and the multi-token-prediction blocks'
    (balanced) one of a features dict (plan_features); `col` applied to each field."""
    dense = {name: costs.GemmShape(col(f["gemm_m:" + name]), col(f["gemm_n:" + name]), col(f["gemm_k:" + name]))
             for name in GEMM_NAMES}
    grouped = (col(f["expert_m"]), col(f["expert_n"]), col(f["expert_k"]), col(f["expert_groups"]))
    return dense, costs.GemmShape(*grouped), costs.GemmShape(col(f["tail_expert_m"]), *grouped[1:])


def _cores(f: dict) -> tuple[Core, ...]:
    """The attention cores of each kind (simulator.attention_cost.kind_cores) of a features dict (plan_features)."""
    return tuple(Core(kind, *(f[f"core_{kind}_{name}"] for name in CORE_FIELDS)) for kind in ATTENTION_KINDS)


def _mean_context_layer_s(spec: ModelSpec, topo: Topology, tokens_mb, tensor, context, across):
    """One layer's K/V exchange seconds (costs.context_bytes, a send_recv over the context group), the mean over
    the model's layers, summed in layer order; layers alike to it (costs.context_layer_key) priced once."""
    priced = {}
    for i in range(spec.layers):
        key = costs.context_layer_key(spec, i)
        if key not in priced:
            priced[key] = collective_time(topo, "send_recv", context,
                                          costs.context_bytes(tokens_mb, spec, tensor, context, i), across)
    return sum(priced[costs.context_layer_key(spec, i)] for i in range(spec.layers)) / spec.layers


def plan_features(spec: ModelSpec, plan: Plan | PlanArrays, topo: Topology) -> dict:
    """The scalars the step-time formulas need: the pipeline stages' work (simulator.stage_features: the slowest
    stage's, keys STAGE_KEYS, the mean of the other stages', prefixed "o_", and the interleaved schedules' first
    chunks'), and rank 0's gradient
    reduction and optimizer step (rank 0 finishes the schedule last). For PlanArrays (simulator.plan_arrays: many
    layouts at once, `usable` GPUs per domain each) every value is an array, one element per plan; a single Plan is
    placed on topo's GPUs per domain."""
    arrays = is_arrays(plan)
    par = plan.parallel
    t, cp = par.tensor, par.context
    tokens_mb = plan.tokens_per_microbatch(spec)
    routed_mb = plan.routed_tokens_per_microbatch(spec)  # what one rank dispatches to the experts
    m = plan.microbatches
    pl = place(plan, np.where(plan.usable > 0, plan.usable, topo.scale_up.usable_gpus) if arrays else
               topo.scale_up.usable_gpus)
    w_bytes = costs.W_BYTES
    g_bytes = BYTES[plan.grad_dtype]
    rp = rank_params(spec, plan, 0)
    m_imbalance, drop = 1.0, 0.0
    if spec.moe is not None:
        tokens_group = routed_mb * par.expert_group  # tokens routed inside one expert group per micro-batch
        m_imbalance, drop = per_key(plan, ("transport", "expert", tokens_group), lambda p: _load_factor(
            p.expert_transport, spec.moe.experts, spec.moe.top_k, p.parallel.expert,
            p.routed_tokens_per_microbatch(spec) * p.parallel.expert_group, seed=p.seed))
    full = np.asarray(plan.recompute == "full", dtype=float)
    recomputed_attn = np.asarray(plan.recompute != "none", dtype=float)
    gemm_names = shapes_by_name(spec)
    dense_shapes = {name: rank_shape(g, tokens_mb, t) for name, g in gemm_names.items()}
    # The most loaded rank's experts: balanced rows x the routing draw's imbalance (capacity: the padded rows).
    expert_shape = costs.expert_shape(costs.expert_rows(routed_mb, spec, par.expert_group) * m_imbalance, spec,
                                      par.expert, par.expert_tensor)

    counted = eager_bytes_counted(spec, plan, topo)  # the counted eager bytes replace the fused traffic terms
    # The pipeline stages' work (simulator.stage_features): the slowest stage's, the others' mean, first chunks.
    per_plan = {"tokens_mb": tokens_mb, "routed_mb": routed_mb, "imbalance": m_imbalance, "tensor": t, "context": cp,
                "pipeline": par.pipeline, "expert_group": par.expert_group, "full": full,
                "recomputed_attn": recomputed_attn, "fsdp_gathered": par.fsdp > 1,
                "expert_fsdp_gathered": par.expert_fsdp > 1, "counted": counted}
    tail_grouped = tail_expert_shape(spec, routed_mb, par)
    stage_features_ = stage_features(spec, plan, topo, per_plan, dense_shapes, (expert_shape, tail_grouped))
    ns = 0.0
    if plan.optimizer.name == "muonh":
        ns = newton_schulz_split(per_key(plan, LAYER_SET, lambda p: newton_schulz_parts(spec, p.rank_layers(spec, 0))),
                                 plan)
    opt_bytes, host_bytes = optimizer_traffic_bytes(rp, plan)
    opt_bytes = 0.0 if counted else opt_bytes
    bal_count, bal_hist, bal_max = per_key(plan, LAYER_SET, lambda p: balancing_reductions(spec, p.rank_layers(spec, 0)))
    muon_bytes = muon_norms = muon_tp_bytes = muon_tp_norms = 0.0
    if plan.optimizer.name == "muonh":
        muon_bytes, muon_norms, muon_tp_bytes, muon_tp_norms = muon_gather_split(
            per_key(plan, LAYER_SET, lambda p: muon_gather_parts(spec, p.rank_layers(spec, 0))), plan)
    bub_f, bub_b, bub_w, pace_f, pace_b = per_key(plan, ("schedule", "pipeline", "virtual", m), lambda p: (
        *bubble_coefficients(p.schedule, p.parallel.pipeline, p.microbatches, p.parallel.chunks_per_rank),
        *pacing_coefficients(p.schedule, p.parallel.pipeline, p.microbatches, p.parallel.chunks_per_rank)))
    host_ops_ = (0.0,) * len(HOST_OP_FEATURES)
    if topo.efficiency.host_op_s.measured:  # counts per plan (CPU topologies: small searches)
        host_ops_ = per_key(plan, COLUMNS, lambda p: tuple(host_op_features(spec, p, topo).values()))
    features = {
        "microbatches": m, "chunks_per_rank": par.chunks_per_rank,
        "bubble_f": bub_f, "bubble_b": bub_b, "bubble_w": bub_w, "pace_f": pace_f, "pace_b": pace_b,
        **stage_features_,
        "tokens_mb": tokens_mb,
        **{f"gemm_{d}:{n}": getattr(dense_shapes[n], d) if n in dense_shapes else 1.0 for n in GEMM_NAMES
           for d in "mnk"},
        "tail_expert_m": tail_grouped.m,
        **{f"core_{c.kind}_{name}": getattr(c, name) for c in kind_cores(spec, tokens_mb, t, cp)
           for name in CORE_FIELDS},
        "expert_m": expert_shape.m, "expert_n": expert_shape.n, "expert_k": expert_shape.k,
        "expert_groups": expert_shape.groups,
        "recompute_full": full, "overlap_grad_reduce": float(plan.overlap_grad_reduce),
        "precision": PRECISIONS.index(plan.precision),  # costs.compute_peak reads the index
        "tp_n": t, "tp_out": pl.tensor.span == "scale_out", "tp_pd": group_per_domain(pl.tensor),
        "tp_bytes": costs.tensor_bytes(tokens_mb, spec),
        "cp_n": cp, "cp_out": pl.context.span == "scale_out",
        # one layer's K/V exchange (forward; the backward sends as much back), the mean over the model's layers
        "cp_layer_s": _mean_context_layer_s(spec, topo, tokens_mb, t, cp, pl.context.span == "scale_out"),
        "ep_n": par.expert_group, "ep_out": pl.expert.span == "scale_out",
        "count_exchange_s": costs.count_exchange_time(topo, spec, par, pl.expert.span == "scale_out"),
        # node-limited routing sends only part of the cross-domain copies over the NICs (costs.cross_domain_a2a_share)
        "a2a_bytes": costs.a2a_bytes(routed_mb, spec, par.expert_tensor) * m_imbalance *
        costs.cross_domain_a2a_share(spec, pl.expert.domains),
        # pipeline hops between neighbouring stages, inside a domain and across (stages are placed outermost)
        "pp_hops_out": pl.pipeline.domains - 1, "pp_hops_up": par.pipeline - pl.pipeline.domains,
        "pp_bytes": costs.pipeline_bytes(tokens_mb, spec),
        "dense_grad_bytes": rp.dense * g_bytes,
        "top_grad_bytes": (rp.embed_end + rp.head_end) * g_bytes,  # the embedding/head ends this rank holds
        **reduction_groups(plan, pl),
        "expert_grad_bytes": rp.expert * g_bytes,
        "zero": par.zero, "dense_weight_bytes": rp.dense * w_bytes, "expert_weight_bytes": rp.expert * w_bytes,
        "efsdp_n": par.expert_fsdp, "efsdp_out": pl.expert_fsdp.span == "scale_out",
        "efsdp_pd": group_per_domain(pl.expert_fsdp),
        "erep_n": par.expert_replicas, "erep_out": pl.expert_replicas.span == "scale_out",
        "erep_pd": group_per_domain(pl.expert_replicas),
        "fsdp_n": par.fsdp, "fsdp_out": pl.fsdp.span == "scale_out", "fsdp_pd": group_per_domain(pl.fsdp),
        "opt_bytes": opt_bytes, "ns_flops": ns, "ns_dim": spec.d_model,
        "bal_count": bal_count, "bal_hist_bytes": bal_hist, "bal_max_bytes": bal_max,
        "muon_gather_bytes": muon_bytes, "muon_norm_count": muon_norms,
        "muon_tp_gather_bytes": muon_tp_bytes, "muon_tp_norm_count": muon_tp_norms,
        "host_bytes": host_bytes,
        "drop_fraction": drop,
        **dict(zip(HOST_OP_FEATURES, host_ops_)), "eager_bytes_counted": float(counted),
    }
    if arrays:
        return {k: np.broadcast_to(np.asarray(v, dtype=float), (len(plan),)) for k, v in features.items()}
    return {k: float(v) for k, v in features.items()}


def _stage_time(f: dict, pre: str, topo: Topology, slow, rates, chunks=None) -> dict:
    """One stage's micro-batch (all its chunks), features prefixed `pre`: forward, input-gradient and
    weight-gradient seconds including the communication each exposes, and the parts of it. Mirrors the workload
    (simulator.workload): every layer's forward runs 2 tensor-parallel all-reduces and, in MoE layers, a dispatch
    and a combine all-to-all, each hiding behind half the shared experts' work; its backward the same at twice the
    work; full recomputation runs the forward (and its communication) once more before the backward. `rates`: the
    plan's GEMM rates (simulator.gemms.gemm_rates), shared by its stages; `chunks` the stage's chunks (default the
    plan's chunks per rank; 1 for a single chunk)."""
    g = lambda k: f[pre + k]  # noqa: E731
    full = f["recompute_full"]
    fwd, rec, elem, shared = stage_compute_s(g, gemm_seconds(rates, *_stage_gemm_flops(f, pre, rates)),
                                             *_shapes(f)[1:], _cores(f), full, topo, f["precision"])
    layers, moe = g("layers"), g("moe_layers")
    tp_one = collective_time(topo, "all_reduce", f["tp_n"], f["tp_bytes"], f["tp_out"], f["tp_pd"])
    tp_t = (4 + 2 * full) * layers * tp_one
    # The trainer's K/V exchanges block (backend.context_parallel): forward, its recomputation and backward, exposed.
    cp_exposed = layers * f["cp_layer_s"] * (2 + full) + sum(
        collective_time(topo, "send_recv", f["cp_n"], g(k), f["cp_out"]) for k in ("mtp_cp_bytes", "mtp_cp_grad_bytes"))
    a2a_one = collective_time(topo, "all_to_all", f["ep_n"], f["a2a_bytes"], f["ep_out"])
    # The forward dispatch (and its recomputation's) pays the count exchange before it (costs.count_exchange_time).
    dispatch_one = a2a_one + f["count_exchange_s"]
    shared_layer = shared / np.maximum(moe, 1)
    # Forward (and its recomputation): two exchanges under half the shared experts each; backward: under all of it.
    half_hidden = np.maximum(0.0, a2a_one - shared_layer / 2)
    counts_exposed = moe * (np.maximum(0.0, dispatch_one - shared_layer / 2) - half_hidden)  # per forward
    a2a_exposed = 2 * moe * ((1 + full) * half_hidden + np.maximum(0.0, a2a_one - shared_layer)) + \
        (1 + full) * counts_exposed
    a2a_t = (4 + 2 * full) * moe * a2a_one + (1 + full) * moe * f["count_exchange_s"]
    compute = 3 * fwd + rec + elem
    # FSDP: forward and backward of each chunk gather their layers one ahead; the first layer's gather of each is
    # exposed, the rest hide behind compute where it is long enough.
    gathers = collective_time(topo, "all_gather", f["fsdp_n"], g("fsdp_bytes") / np.maximum(layers, 1), f["fsdp_out"],
                              f["fsdp_pd"]) * layers + \
        collective_time(topo, "all_gather", f["efsdp_n"], g("expert_fsdp_bytes") / np.maximum(moe, 1), f["efsdp_out"],
                        f["efsdp_pd"]) * moe
    actions = 2 * (f["chunks_per_rank"] if chunks is None else chunks)
    first = gathers * actions / np.maximum(layers, 1)
    fsdp_t = 2 * gathers
    ends = 2 * (collective_time(topo, "all_gather", f["fsdp_n"], g("fsdp_embed_bytes"), f["fsdp_out"], f["fsdp_pd"]) +
                collective_time(topo, "all_gather", f["fsdp_n"], g("fsdp_head_bytes"), f["fsdp_out"], f["fsdp_pd"]))
    fsdp_exposed = ends + np.where(fsdp_t > 0, first + np.maximum(0.0, fsdp_t - first - compute), 0.0)
    # Communication kernels take SMs from the compute they overlap (the profile's comm_compute_slowdown).
    overlapped = np.minimum(compute, np.minimum(3 * shared_layer * moe, a2a_t) + fsdp_t)
    compute = compute + slow * overlapped
    comm = tp_t + cp_exposed + a2a_exposed + fsdp_exposed
    spread = (comm - (1 + full) * counts_exposed) / 3  # the count exchanges run in the forwards only
    return {"fwd": fwd, "rec": rec, "elem": elem, "compute": compute, "tp": tp_t + cp_exposed, "a2a": a2a_exposed,
            "a2a_total": a2a_t, "fsdp": fsdp_exposed, "total": compute + comm,
            # schedule units: F, B (input gradients, after recomputation), W (weight gradients)
            "F": fwd + elem / 2 + spread + counts_exposed, "B": fwd + rec + elem / 2 + spread + full * counts_exposed,
            "W": fwd + spread}


def _reduction_time(f: dict, topo: Topology, dense_bytes, expert_bytes):
    """Seconds of the gradient reduction of these bytes (costs.gradient_reductions) over the plan's groups."""
    groups = {"inner": "inner", "data": "outer", "expert_fsdp": "efsdp", "expert_replicas": "erep"}
    return sum(collective_time(topo, c.kind, f[groups[c.axis] + "_n"], c.nbytes, f[groups[c.axis] + "_out"],
                               f[groups[c.axis] + "_pd"])
               for c in costs.gradient_reductions(dense_bytes, expert_bytes, f["inner_n"], f["efsdp_n"], f["zero"]))


_STAGE_KEY_SET = frozenset(STAGE_KEYS)


class _FirstChunks(dict):
    """The first chunks' features of the plans `rows` (an index array) out of stacked ones (plan_features): the
    STAGE_KEYS prefixed FIRST_CHUNK_PREFIXES unprefixed, as (chunk, plan) arrays, the plans' own features as (plan,)
    arrays, broadcast against them; each built on first use."""

    def __init__(self, features: dict, rows: np.ndarray):
        super().__init__()
        self.features, self.rows = features, rows

    def __missing__(self, key):
        f = self.features
        if key in _STAGE_KEY_SET:
            value = np.stack([np.reshape(f[p + key], -1)[self.rows] for p in FIRST_CHUNK_PREFIXES])
        else:
            value = f[key] if np.ndim(f[key]) == 0 else f[key][self.rows]
        self[key] = value
        return value


def step_time(f: dict, topo: Topology) -> dict[str, np.ndarray]:
    """Phase times (seconds) and the step time, elementwise over arrays of features."""
    f = {k: np.asarray(v, dtype=float) for k, v in f.items()}
    eff = topo.efficiency
    slow = eff.comm_compute_slowdown
    has = lambda key: tuple(n for n in GEMM_NAMES if np.any(f[key + n]) or np.any(f["o_" + key + n]))  # noqa: E731
    rates = gemm_rates(has("gemm:"), has("gemm_end:"), _shapes(f)[0], topo, f["precision"])
    h = _stage_time(f, "", topo, slow, rates)
    o = _stage_time(f, "o_", topo, slow, rates)
    m, v = f["microbatches"], f["chunks_per_rank"]
    # Pipeline: the slowest stage is busy m micro-batches; fill and drain run through the others, per model chunk,
    # as the schedule's closed form gives it (simulator.schedule_formulas.bubble_coefficients). Sends overlap the
    # next micro-batch's work except along the fill (first forward) and the drain (last backward): one chain of
    # hops each way.
    chain = f["pp_hops_up"] * collective_time(topo, "send_recv", 2, f["pp_bytes"], False) + \
        f["pp_hops_out"] * collective_time(topo, "send_recv", 2, f["pp_bytes"], True)
    pp_t = 2 * chain
    busy = m * h["total"]
    bubble_t = (f["bubble_f"] * o["F"] + f["bubble_b"] * o["B"] + f["bubble_w"] * o["W"]) / v
    if np.any(f["paced"]):  # interleaved: from the first chunks' times (schedule_formulas.paced_bubble_time_s),
        # priced only for the plans that are, all four first chunks (FIRST_CHUNK_PREFIXES) in one pass
        rows = np.flatnonzero(f["paced"])
        each = rates.take(rows)
        each = each._replace(layers=each.layers[:, None], ends=each.ends[:, None])  # against (chunk, plan)
        first = _stage_time(_FirstChunks(f, rows), "", topo, slow, each, chunks=1)
        units = {k: tuple(first[u][i] for u in "FBW") for i, k in enumerate(FIRST_CHUNK_PREFIXES)}
        # the first round runs at the slowest first-chunk forward, the cool-down at the slowest backward: each taken
        # apart over the first chunk of most compute (x1_) and the embedding's (e1_); B and W from different chunks
        # can overstate a full backward (B + W) slightly, where x1_ and e1_ differ
        slowest = tuple(np.maximum(a, b) for a, b in zip(units["x1_"], units["e1_"]))
        take = lambda x: np.reshape(x, -1)[rows]  # noqa: E731
        paced_t = paced_bubble_time_s((take(f["bubble_f"]), take(f["bubble_b"]), take(f["bubble_w"])),
                                      (take(f["pace_f"]), take(f["pace_b"])), units["o1_"], units["h1_"], slowest)
        bubble_t = np.array(np.broadcast_to(bubble_t, np.shape(f["paced"])))
        np.put(bubble_t, rows, paced_t)
    pipeline_t = busy + bubble_t + pp_t
    # Gradient reduction (costs.gradient_reductions), hidden behind the last backward.
    dp_t = _reduction_time(f, topo, f["dense_grad_bytes"], f["expert_grad_bytes"])
    # ZeRO-1/2: the updated weights' all-gather over the replicas follows the optimizer step, exposed.
    groups = {"inner": "inner", "data": "outer", "expert_fsdp": "efsdp", "expert_replicas": "erep"}
    gather_t = sum(collective_time(topo, c.kind, f[groups[c.axis] + "_n"], c.nbytes, f[groups[c.axis] + "_out"],
                                   f[groups[c.axis] + "_pd"])
                   for c in costs.parameter_gathers(f["dense_weight_bytes"], f["expert_weight_bytes"], f["inner_n"],
                                                    f["efsdp_n"], f["zero"]))
    # Overlapped (plan.overlap_grad_reduce): each layer's reduction starts once the last micro-batch's backward has
    # produced its gradients, so the backward of all but the first layer processed hides it; otherwise it all waits.
    # What the stage produces last cannot hide: the first layer processed and the embedding/head ends, whose
    # reduction starts after the stage's final action (as the workload issues it).
    window = (2 * h["fwd"] + h["rec"]) * (1.0 - 1.0 / np.maximum(f["layers"], 1))
    layer_dense = (f["dense_grad_bytes"] - f["top_grad_bytes"]) / np.maximum(f["layers"], 1)
    tail_t = _reduction_time(f, topo, f["top_grad_bytes"] + layer_dense,
                             f["expert_grad_bytes"] / np.maximum(f["moe_layers"], 1))
    dp_exposed = np.where(f["overlap_grad_reduce"] > 0, np.maximum(tail_t, dp_t - window), dp_t) + gather_t
    # ZeRO-2 keeps only its gradient shard, so every micro-batch but the last reduces its gradients too, in the
    # background of the following micro-batches' work; what they cannot hide is exposed.
    early_t = np.where(f["zero"] >= 2, (m - 1) * dp_t, 0.0)
    dp_exposed = dp_exposed + np.maximum(0.0, early_t - (m - 1) * h["total"])
    ns_shape = costs.GemmShape(f["ns_dim"], f["ns_dim"], f["ns_dim"])
    optimizer_t = costs.optimizer_time(f["opt_bytes"], f["ns_flops"], ns_shape, topo, f["precision"]) + \
        balancing_time(f, topo) + \
        costs.muon_gather_time(f, topo)
    host_t = costs.host_link_time(f["host_bytes"], topo)
    # Host per-op overhead (features in ops; zero without measured host_op_s), blocking: added, not overlapped.
    hop = eff.host_op_s
    op_c = f.get("op_forward", 0.0) * hop.forward + f.get("op_backward", 0.0) * hop.backward
    op_b = f.get("op_bubble_forward", 0.0) * hop.forward + f.get("op_bubble_backward", 0.0) * hop.backward
    op_o = f.get("op_optimizer", 0.0) * hop.optimizer
    # Counted eager bytes (zero where not counted), memory-bound, blocking as the host ops are.
    eager = lambda *keys: costs.eager_bytes_time(sum(f.get(k, 0.0) for k in keys), topo)  # noqa: E731
    op_c = op_c + eager("eager_forward", "eager_backward")
    op_b = op_b + eager("eager_bubble_forward", "eager_bubble_backward")
    op_o = op_o + eager("eager_optimizer")
    step = pipeline_t + dp_exposed + optimizer_t + host_t + op_c + op_b + op_o
    return {
        "step_time_s": step,
        "compute": m * h["compute"] + op_c,
        "exposed_expert_a2a": m * h["a2a"],
        "exposed_tensor_comm": m * h["tp"],
        "exposed_fsdp_gather": m * h["fsdp"],
        "pipeline_p2p": pp_t,
        "pipeline_bubble": bubble_t + op_b,
        "exposed_dp_comm": dp_exposed,
        "optimizer": optimizer_t + op_o,
        "host_transfer": host_t,
        "expert_a2a_total": m * h["a2a_total"],
        "dp_comm_total": dp_t + gather_t + early_t,
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
    band: dict  # simulator.metrics.error_band: the stack profile's band around step time, MFU and days

    def as_dict(self) -> dict:
        return {
            "fits": self.fits, "gpus": self.gpus,
            "memory_per_gpu_bytes": self.memory.as_dict(), "hbm_bytes": self.hbm_bytes,
            "host_bytes_per_host": self.host_bytes_per_host, "host_capacity_bytes": self.host_capacity_bytes,
            "step_time_s": self.step_time_s, "phases_s": self.phases_s,
            "tokens_per_step": self.tokens_per_step, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
            "model_flops_per_step": self.model_flops_per_step, "days_to_budget": self.days_to_budget,
            "drop_fraction": self.drop_fraction, "flops_convention": self.flops_convention, "band": self.band,
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
        days_to_budget=rate.days_to_budget, drop_fraction=feats["drop_fraction"], flops_convention=convention.label,
        gpus=topo.gpus, band=metrics.error_band(step, rate.mfu, rate.days_to_budget, topo),
    )
