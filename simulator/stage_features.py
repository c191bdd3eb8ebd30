"""The pipeline stages' features of the closed form (simulator.estimate.plan_features), for one plan or many
(simulator.plan_arrays): every stage's work per micro-batch from the layers it holds (simulator.stage_work), priced
(stage_compute_s) to find the slowest stage, reduced to that stage's (STAGE_KEYS, no prefix: it sets the steady
state) and the mean of the others' ("o_": they fill and drain the pipeline).

Interleaved schedules (vocab.INTERLEAVED_SCHEDULES) pace their first round and cool-down by each rank's first chunk
(simulator.schedule_formulas.paced_bubble_time_s), so for those plans the same keys of the first chunks
(stage_work first_chunks=True) too: the slowest stage's ("h1_"), the others' mean ("o1_"), the one of most
compute ("x1_") and the first stage's, which holds the embedding and its exposed gather ("e1_"). They are zero for
the other plans, which never read them: the planner prices tens of thousands of layouts at once, most of them not
interleaved, and builds and prices the first chunks' columns only for the interleaved ones.
"""

from __future__ import annotations

import numpy as np

from rackcast.modelspec import ModelSpec
from rackcast.plan import Plan
from rackcast.simulator import costs
from rackcast.simulator.attention_cost import kind_cores
from rackcast.simulator.gemms import GEMM_NAMES, gemm_rates, gemm_seconds, names_used
from rackcast.simulator.plan_arrays import LAYER_SET, PlanArrays, is_arrays, per_key_table
from rackcast.simulator.stage_work import stage_work
from rackcast.topologies.spec import Topology
from rackcast.vocab import INTERLEAVED_SCHEDULES

STAGE_KEYS = ("attn_flops", "band_attn_flops", "expert_flops", "tail_attn_flops", "tail_band_attn_flops",
              "tail_expert_flops", "rec_attn_flops", "rec_band_attn_flops", "rec_expert_flops", "elementwise_bytes",
              "layers", "moe_layers", "fsdp_bytes", "fsdp_embed_bytes", "fsdp_head_bytes", "expert_fsdp_bytes",
              "mtp_cp_bytes", "mtp_cp_grad_bytes") + \
    tuple("gemm:" + n for n in GEMM_NAMES) + tuple("gemm_end:" + n for n in GEMM_NAMES)  # ... and each GEMM's
FIRST_CHUNK_PREFIXES = ("h1_", "o1_", "x1_", "e1_")
_STAGE_ROWS = ("attn", "band_attn", "experts", "tail_attn", "tail_band_attn", "tail_experts", "elem_bytes", "layers",
               "moe_layers", "dense_params", "expert_params", "first", "last")
_STAGE_FIELDS = LAYER_SET + ("tensor", "sequence_parallel", "expert_tensor")  # what stage_work reads


def stage_compute_s(g, gemm_s: tuple, grouped: costs.GemmShape, tail_grouped: costs.GemmShape, cores: tuple,
                    full, topo: Topology, precision) -> tuple:
    """(forward, recomputation, elementwise, shared-expert) seconds of one stage's micro-batch from its FLOPs and
    bytes (g: feature name -> value; gemm_s its GEMMs' simulator.gemms.gemm_seconds; costs), in the plan's
    `precision` (costs.compute_peak; the ends and the attention core costs.unquantised): dense GEMMs each at its
    own shape (gemm_s), the attention cores of causal and banded calls each at its kind's core (`cores`:
    simulator.attention_cost.kind_cores), routed experts at the grouped-GEMM
    efficiency of the `grouped` shape (the multi-token prediction blocks' at the balanced `tail_grouped`),
    elementwise traffic memory-bound; full recomputation (`full` 1) redoes the layers' GEMMs."""
    layers, ends, shared = gemm_s
    causal, banded = cores

    def attention(prefix: str):
        return costs.attention_time(g(prefix + "attn_flops"), topo, precision, causal) + \
            costs.attention_time(g(prefix + "band_attn_flops"), topo, precision, banded)

    tail = attention("tail_") + \
        costs.grouped_gemm_time(g("tail_expert_flops"), tail_grouped, topo, costs.unquantised(precision))
    fwd = layers + ends + tail + attention("") + costs.grouped_gemm_time(g("expert_flops"), grouped, topo, precision)
    rec = full * layers + attention("rec_") + costs.grouped_gemm_time(g("rec_expert_flops"), grouped, topo, precision)
    return fwd, rec, costs.memory_bound_time(g("elementwise_bytes"), topo), shared


def _stage_rows(spec: ModelSpec, plan: Plan, width: int, first_chunks: bool = False) -> np.ndarray:
    """simulator.stage_work's per-stage rows of one plan (of each stage's first chunk: `first_chunks`):
    _STAGE_ROWS, then the GEMM FLOPs of each name the model's layers have and of each name its ends have
    (simulator.gemms.names_used), each padded with zeros to `width` stages, flattened."""
    w = stage_work(spec, plan, first_chunks=first_chunks)
    layer_names, end_names = names_used(spec)
    rows = [np.asarray(getattr(w, k), dtype=float) for k in _STAGE_ROWS] + \
        [w.gemm_layers[:, GEMM_NAMES.index(n)] for n in layer_names] + \
        [w.gemm_ends[:, GEMM_NAMES.index(n)] for n in end_names]
    out = np.zeros((len(rows), width))
    out[:, :plan.parallel.pipeline] = rows
    return out.ravel()


def _col(x):
    """A per-plan value against the stage axis."""
    return np.asarray(x, dtype=float)[..., None]


def _priced_columns(spec: ModelSpec, flat: np.ndarray, per_plan: dict, rates, shapes: tuple, topo: Topology,
                    precision, width: int) -> tuple[dict, tuple, np.ndarray]:
    """From _stage_rows' table (`flat`, one row per plan): every stage's STAGE_KEYS values without the GEMMs', its
    GEMM FLOPs (layer names, end names: stacked as gemm_seconds takes them) and its cost (3 forwards +
    recomputation + elementwise seconds; -inf past the plan's stages). Per-stage and micro-batch on one rank.
    Expert-tensor ranks split each expert's width but process every row of their experts: per-rank expert FLOPs
    stay those of expert_tensor = 1 (costs.expert_shape: rows x width / et). Recomputation redoes the layers'
    forward (full) or the attention core (selective), never the head. Names the model lacks are zero. The
    multi-token-prediction blocks' routed experts at balanced routing."""
    layer_names, end_names = names_used(spec)
    every = np.moveaxis(flat.reshape(flat.shape[:-1] + (len(_STAGE_ROWS) + len(layer_names) + len(end_names),
                                                        width)), -2, 0)
    rows = dict(zip(_STAGE_ROWS, every))
    v = {k: _col(x) for k, x in per_plan.items()}
    tok, tt, imb, routed, full = v["tokens_mb"], v["tensor"], v["imbalance"], v["routed_mb"], v["full"]
    top = spec.top_param_breakdown()
    embed_end = top.get("embedding", 0) + top.get("positions", 0) + top.get("embed_norm", 0) + \
        top.get("embed_gated_norm", 0)
    head_end = top.get("head", 0) + top.get("final_norm", 0) + top.get("final_gated_norm", 0)
    gathered = v["fsdp_gathered"] * costs.W_BYTES / tt  # FSDP all-gathers: layers one at a time, each end apart
    first_gemm = len(_STAGE_ROWS)
    gemm_flops = (every[first_gemm:first_gemm + len(layer_names)] * tok / tt,
                  every[first_gemm + len(layer_names):] * tok / tt)
    stage = {
        "attn_flops": rows["attn"] * tok / tt, "band_attn_flops": rows["band_attn"] * tok / tt,
        "expert_flops": rows["experts"] * routed * imb,
        "tail_attn_flops": rows["tail_attn"] * tok / tt, "tail_band_attn_flops": rows["tail_band_attn"] * tok / tt,
        "tail_expert_flops": rows["tail_experts"] * routed,
        "rec_attn_flops": rows["attn"] * tok / tt * v["recomputed_attn"],
        "rec_band_attn_flops": rows["band_attn"] * tok / tt * v["recomputed_attn"],
        "rec_expert_flops": rows["experts"] * routed * imb * full,
        "elementwise_bytes": rows["elem_bytes"] * tok * (0.0 if per_plan["counted"] else 1.0),
        "layers": rows["layers"], "moe_layers": rows["moe_layers"],
        "fsdp_bytes": rows["dense_params"] * gathered, "fsdp_embed_bytes": rows["first"] * embed_end * gathered,
        "fsdp_head_bytes": rows["last"] * head_end * gathered,
        "expert_fsdp_bytes": rows["expert_params"] / v["expert_group"] * costs.W_BYTES * v["expert_fsdp_gathered"],
        # the MTP modules' context-parallel exchanges, on the stage holding the head
        "mtp_cp_bytes": rows["last"] * costs.mtp_context_bytes(tok, spec, tt, v["context"]),
        "mtp_cp_grad_bytes": rows["last"] * costs.mtp_context_bytes(tok, spec, tt, v["context"], backward=True),
    }
    grouped, tail_grouped = (costs.GemmShape(*(_col(x) for x in s)) for s in shapes)
    fwd, rec, elem, _ = stage_compute_s(stage.get, gemm_seconds(rates, *gemm_flops), grouped, tail_grouped,
                                        kind_cores(spec, tok, tt, v["context"]), full, topo, precision)
    return stage, gemm_flops, np.where(np.arange(width) < v["pipeline"], 3 * fwd + rec + elem, -np.inf)


def _picked(prefix: str, stage: dict, gemm_flops: tuple, spec: ModelSpec, index) -> dict:
    """STAGE_KEYS prefixed `prefix` of one stage per plan (`index`: each plan's, against the stage axis)."""
    at = (np.arange(len(index)), index[:, 0]) if index.ndim == 2 else (index[0],)  # each plan's stage
    shape = index.shape[:-1] + next(iter(stage.values())).shape[-1:]
    return {prefix + k: np.broadcast_to(x, shape)[at] for k, x in stage.items()} | \
        _gemm_features(prefix, spec, gemm_flops, lambda f: f[(slice(None),) + at])


def _mean(prefix: str, stage: dict, gemm_flops: tuple, spec: ModelSpec, weights) -> dict:
    """STAGE_KEYS prefixed `prefix`: each stage's value times its `weights` (against the stage axis), summed."""
    out = {prefix + k: (np.broadcast_to(x, weights.shape) * weights).sum(axis=-1) for k, x in stage.items()}
    return out | _gemm_features(prefix, spec, gemm_flops, lambda f: np.einsum("g...w,...w->g...", f, weights))


def _gemm_features(prefix: str, spec: ModelSpec, gemm_flops: tuple, reduce) -> dict:
    """The "gemm:" and "gemm_end:" STAGE_KEYS prefixed `prefix`: `reduce` over the stage axis of every name's
    FLOPs at once (gemm_flops: layer names', end names'); names the model lacks are zero."""
    out = {}
    for key, names, flops in zip(("gemm:", "gemm_end:"), names_used(spec), gemm_flops):
        picked = reduce(flops)
        for n in GEMM_NAMES:
            out[prefix + key + n] = picked[names.index(n)] if n in names else 0.0
    return out


def stage_features(spec: ModelSpec, plan: Plan | PlanArrays, topo: Topology, per_plan: dict, dense_shapes: dict,
                   grouped_shapes: tuple) -> dict:
    """The module docstring's features of a plan (PlanArrays: arrays, one element per plan). per_plan: each plan's
    tokens_mb, routed_mb (what one rank dispatches to the experts), imbalance (routing's max load factor), tensor,
    context, pipeline and expert_group degrees, full and recomputed_attn (1: full recomputation; any), fsdp_gathered
    and expert_fsdp_gathered (1: FSDP-gathered weights), counted (the counted eager bytes replace the elementwise
    traffic); dense_shapes the rank's GEMM shapes by name (simulator.gemms.rank_shape), grouped_shapes the routed
    experts' and the multi-token-prediction blocks' grouped GEMM shapes."""
    width = int(np.max(plan.parallel.pipeline))  # every plan's stages padded to the deepest pipeline
    layer_names, end_names = names_used(spec)
    rates = gemm_rates(layer_names, end_names, {n: costs.GemmShape(*(_col(x) for x in s))
                                                 for n, s in dense_shapes.items()}, topo, plan.precision)

    def priced(first_chunks: bool, rows=None):
        take = (lambda x: x) if rows is None else (lambda x: x if np.ndim(x) == 0 else np.asarray(x)[rows])
        table = per_key_table(plan, _STAGE_FIELDS, lambda p: _stage_rows(spec, p, width, first_chunks), rows)
        return _priced_columns(spec, table, {k: take(x) for k, x in per_plan.items()},
                               rates if rows is None else rates.take(rows),
                               tuple(tuple(take(x) for x in s) for s in grouped_shapes), topo, plan.precision, width)

    stage, gemm_flops, cost = priced(False)
    heavy = np.argmax(cost, axis=-1)[..., None]  # the slowest stage sets the steady state
    others = (np.arange(width) < _col(per_plan["pipeline"])) & (np.arange(width) != heavy)
    n_others = np.maximum(others.sum(axis=-1), 1)[..., None]
    features = _picked("", stage, gemm_flops, spec, heavy) | _mean("o_", stage, gemm_flops, spec, others / n_others)
    # paced at two or more chunks per rank only (schedule_formulas.pacing_coefficients)
    paced = np.isin(plan.schedule, tuple(INTERLEAVED_SCHEDULES)) & (np.asarray(plan.parallel.virtual) >= 2)
    rows = np.flatnonzero(paced) if is_arrays(plan) else None
    if not np.any(paced):
        return features | {p + k: 0.0 for p in FIRST_CHUNK_PREFIXES for k in STAGE_KEYS} | {"paced": paced}
    if rows is not None and len(rows) == len(plan):
        rows = None
    stage, gemm_flops, cost = priced(True, rows)
    pick = (lambda x: x) if rows is None else (lambda x: x[rows])  # noqa: E731
    first = _picked("h1_", stage, gemm_flops, spec, pick(heavy)) | \
        _mean("o1_", stage, gemm_flops, spec, pick(others) / pick(n_others)) | \
        _picked("x1_", stage, gemm_flops, spec, np.argmax(cost, axis=-1)[..., None]) | \
        _picked("e1_", stage, gemm_flops, spec, np.zeros_like(heavy if rows is None else heavy[rows]))
    if rows is not None:  # zero for the plans that are not interleaved
        keys = [k for k, x in first.items() if np.ndim(x)]
        block = np.zeros((len(keys), len(plan)))
        block[:, rows] = np.stack([first[k] for k in keys])
        first.update(zip(keys, block))
    return features | first | {"paced": paced}
