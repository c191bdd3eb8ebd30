"""Work of every pipeline stage of a plan, per token of a micro-batch, as sums over layer kinds.

The closed-form estimate prices the slowest stage and the pipeline's fill and drain from these sums
(simulator.estimate); the discrete-event workload (simulator.workload) builds the same stages layer by layer. Which stage holds which
layers and chunks comes from the layout (rackcast.layout.ParallelSpec.layer_ranks / chunk_ranks): the stage holding
the first chunk runs the embedding, the one holding the last chunk the output head and loss (both on rank 0 under the
V-shaped schedules), and a stage's global-attention layers cost what their context makes them cost.

Layers are grouped into kinds (the same FLOPs by component and the same attention span: e.g. local and global
attention, MoE and dense MLP), so a stage's work is counts[stage, kind] @ per-kind work: no loop over a stage's
layers, and the arrays stack over many layouts.

    from rackcast.simulator.stage_work import stage_work
    w = stage_work(spec, plan)      # w.attn[s]: attention-core FLOPs per token on stage s (forward), ...
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rackcast.modelspec import ModelSpec
from rackcast.plan import Plan
from rackcast.simulator.activations import layer_activation_bytes_per_token
from rackcast.simulator.attention_cost import HW, layer_kind
from rackcast.simulator.gemms import embed_gemms, flops_by_name, layer_gemms, tail_work

_KINDS: dict[int, tuple] = {}  # id(spec) -> (spec, kind of each layer, representative layer of each kind, table)


@dataclass(frozen=True)
class StageWork:
    """Forward work per token of one micro-batch on each pipeline stage (arrays of length pipeline), before the
    tensor split and expert imbalance: `attn` and `band_attn` attention-core FLOPs of the layers whose core is a
    causal and a banded call (simulator.attention_cost, each priced at its own shape), `experts` routed-expert FLOPs
    (balanced routing), `elem_bytes` the elementwise traffic (activations written in forward and read in backward),
    `layers` and `moe_layers` counts, `dense_params` and `expert_params` the layers' parameters before any split;
    `first` and `last` mark the stages holding the first and the last chunk. Dense GEMMs by name (simulator.gemms, columns in
    GEMM_NAMES order, each priced at its own shape): `gemm_layers[s]` the layers' (attention projections, norms,
    convolutions, router, latent projections, shared experts, dense MLP), `gemm_ends[s]` those of the ends (the
    output head, final gated norm and multi-token-prediction modules on the stage holding the last chunk, the
    embedding's gated norm on the one holding the first); `tail_attn` and `tail_experts` the rest of the tail
    (ModelSpec.tail_flops_fwd: the multi-token-prediction blocks' attention core, in `tail_band_attn` where the last
    layer's core is banded, and routed experts)."""

    attn: np.ndarray
    experts: np.ndarray
    elem_bytes: np.ndarray
    layers: np.ndarray
    moe_layers: np.ndarray
    dense_params: np.ndarray
    expert_params: np.ndarray
    first: np.ndarray
    last: np.ndarray
    gemm_layers: np.ndarray
    gemm_ends: np.ndarray
    tail_attn: np.ndarray
    tail_experts: np.ndarray
    band_attn: np.ndarray
    tail_band_attn: np.ndarray


def layer_kinds(spec: ModelSpec) -> tuple[np.ndarray, list[int], np.ndarray]:
    """(kind of each layer, a representative layer of each kind, per-kind rows attn, band_attn, experts, moe, dense
    parameters, routed-expert parameters, then the GEMM FLOPs by name (simulator.gemms.flops_by_name)):
    layers with the same FLOPs by component are one kind. Cached per model object."""
    hit = _KINDS.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1:]
    keys: dict[tuple, int] = {}
    kind, reps, rows = [], [], []
    for i in range(spec.layers):
        parts = spec.layer_flops_breakdown(i, HW)
        key = (spec.is_global(i), layer_kind(spec, i), spec.is_moe(i), tuple(sorted(parts.items())))
        if key not in keys:
            keys[key] = len(reps)
            reps.append(i)
            expert_params = spec.layer_param_breakdown(i).get("experts", 0)
            attn, banded = parts.get("attn_scores_values", 0.0), layer_kind(spec, i) == "banded"
            rows.append((0.0 if banded else attn, attn if banded else 0.0, parts.get("experts", 0.0),
                         float(spec.is_moe(i)),
                         float(spec.layer_params(i) - expert_params), float(expert_params),
                         *flops_by_name(layer_gemms(spec, i))))
        kind.append(keys[key])
    out = (np.array(kind), reps, np.array(rows))
    _KINDS[id(spec)] = (spec,) + out
    return out


def stage_work(spec: ModelSpec, plan: Plan, first_chunks: bool = False) -> StageWork:
    """Every stage's forward work per token (see StageWork); `first_chunks`: only the chunk each rank runs first
    (ParallelSpec.rank_chunks), whose times pace an interleaved schedule's first round and cool-down
    (simulator.schedule_formulas.paced_bubble_time_s)."""
    par = plan.parallel
    p = par.pipeline
    kind, reps, table = layer_kinds(spec)
    owner = par.chunk_ranks(plan.schedule)
    leads = [c for c in range(len(owner)) if not first_chunks or par.rank_chunks(owner[c], plan.schedule)[0] == c]
    chunk_of = np.repeat(np.arange(len(owner)), par.chunk_layers(spec.layers))
    kept = np.isin(chunk_of, leads)
    counts = np.zeros((p, len(reps)))
    np.add.at(counts, (np.array(par.layer_ranks(plan.schedule, spec.layers))[kept], kind[kept]), 1.0)
    elem = np.array([2 * layer_activation_bytes_per_token(spec, i, plan) for i in reps])  # written, then read
    sums = counts @ table
    first = np.arange(p) == owner[0]
    last = (np.arange(p) == owner[-1]) & (len(owner) - 1 in leads)
    tail = tail_work(spec)
    ends = last[:, None] * flops_by_name(tail.gemms) + first[:, None] * flops_by_name(embed_gemms(spec))
    tail_banded = layer_kind(spec, spec.layers - 1) == "banded"  # the MTP blocks are shaped like the last layer
    return StageWork(attn=sums[:, 0], band_attn=sums[:, 1], experts=sums[:, 2], elem_bytes=counts @ elem,
                     layers=counts.sum(axis=1), moe_layers=sums[:, 3], dense_params=sums[:, 4],
                     expert_params=sums[:, 5], first=first, last=last, gemm_layers=sums[:, 6:], gemm_ends=ends,
                     tail_attn=np.where(last & (not tail_banded), tail.attn, 0.0),
                     tail_band_attn=np.where(last & tail_banded, tail.attn, 0.0),
                     tail_experts=np.where(last, tail.experts, 0.0))
