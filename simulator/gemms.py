"""The dense matrix products of a model, each with its own shape: one home for "the GEMMs of a layer".

ModelSpec.layer_flops_breakdown counts a layer's forward FLOPs by component (attn_qkvo, router, dense_mlp, ...);
this module splits every dense-GEMM component into the matrix products the trainer runs (backend.layers,
backend.attention, backend.latent_attention, backend.moe), each as a Gemm: its output width n, reduction width k,
forward FLOPs per token (2 n k per copy, the same terms the spec sums: tests/test_gemms.py holds the two equal for
every preset) and which dimension tensor parallelism splits (backend.tensor_parallel, Megatron-LM's convention):
"n" column-parallel (fused Q/K/V, attention output gate, MLA's up-projections, dense and shared MLP gate/up, the
K/V short convolutions' channels, the output head over the vocabulary), "k" row-parallel (attention output, MLP
down), "none" replicated (gated norms, router, latent MoE projections, MLA's down-projections, block-output
convolutions, MTP projection).
A micro-batch's m is its tokens. The embedding lookup is a gather, not a GEMM. Short depthwise convolutions are
listed as GEMMs of kernel x channels (what the FLOP accounting counts them as): their small k puts them on the
HBM roofline. The multi-token-prediction modules' attention core and routed experts are no GEMMs: tail_work
returns them apart (priced at the attention and grouped-GEMM efficiencies).

Per rank, every GEMM's FLOPs are 1/tensor of its micro-batch's (the accounting the estimate and the simulator
always used) and its shape is the product those FLOPs are (rank_shape): tokens x n/tensor x k for column-parallel,
tokens x n x k/tensor for row-parallel, tokens/tensor x n x k for replicated ones, which is what a rank runs under
sequence parallelism (without it the trainer runs replicated products whole on every rank; the accounting leaves
that redundant work out).

The ends follow Megatron-LM's layout, which that 1/tensor accounting describes: the output head is its
vocabulary-parallel output layer (tokens x vocab/tensor x d_model on each rank), and the final and embedding gated
norms run on the rank's 1/tensor of the sequence (tokens/tensor x n x k). The trainer differs there: it runs the
head whole on every tensor-parallel rank, and gathers the sequence before OutputHead and splits it only after the
Embedder (backend.tensor_parallel's SequenceGather / SequenceShard), so it runs those norms whole too; pricing
them whole would charge tensor times the FLOPs the accounting charges, so this module prices the accounting's
share at the shape Megatron runs it at and, as for the replicated products above, leaves the trainer's
redundant work out.

    from rackcast.simulator.gemms import layer_gemms, rank_shape
    for g in layer_gemms(spec, 0):
        costs.gemm_time(g.flops * tokens_mb / tensor, rank_shape(g, tokens_mb, tensor), topo, precision)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from rackcast.modelspec import ModelSpec
from rackcast.simulator import costs
from rackcast.simulator.attention_cost import layer_core

# Every GEMM name a model can have (layers, then the ends): fixed, so features of different models stack.
LAYER_GEMMS = ("attn_gated_norm_down", "attn_gated_norm_up", "attn_qkv_local", "attn_qkv_global", "mla_q",
               "mla_q_down", "mla_q_up", "mla_kv_down", "mla_kv_up", "attn_o", "attn_gate", "conv_k_local",
               "conv_k_global", "conv_v_local", "conv_v_global", "conv_attn", "conv_mlp", "mlp_gated_norm_down",
               "mlp_gated_norm_up", "router", "latent_down", "latent_up", "shared_gate_up", "shared_down",
               "dense_gate_up", "dense_down")
END_GEMMS = ("head", "final_gated_norm_down", "final_gated_norm_up", "embed_gated_norm_down", "embed_gated_norm_up",
             "mtp_proj")
GEMM_NAMES = LAYER_GEMMS + END_GEMMS
SHARED_GEMMS = ("shared_gate_up", "shared_down")
# Layer components (ModelSpec.layer_flops_breakdown keys) that are no dense GEMMs: the attention core and the routed
# experts (every other component is split into this module's GEMMs).
NON_GEMM = ("attn_scores_values", "experts")
# Layer components (ModelSpec.layer_flops_breakdown keys) that run after the attention block: the MLP side, the
# shared experts last.
MLP_PARTS = ("router", "latent", "dense_mlp", "shared_experts")
_CACHE: dict[int, tuple] = {}  # id(spec) -> (spec, {key: value}); holding spec keeps its id from being reused
_CACHE_MODELS = 64  # models cached at most (then the cache starts over, as simulator.gemm_surface's grids)


class Gemm(NamedTuple):
    """One forward matrix product per token: x [m, k] @ W [k, n], `flops` per token (2 n k x the copies: shared
    experts), `split` the dimension tensor parallelism splits ("n", "k" or "none"), `part` the
    ModelSpec.layer_flops_breakdown component (or tail part) it belongs to."""

    name: str
    part: str
    n: int
    k: int
    flops: float
    split: str


def _gemm(name: str, part: str, n: int, k: int, split: str, copies: int = 1) -> Gemm:
    return Gemm(name, part, n, k, 2.0 * copies * n * k, split)


def _cached(spec: ModelSpec, key, build):
    hit = _CACHE.get(id(spec))
    if hit is None or hit[0] is not spec:
        if len(_CACHE) >= _CACHE_MODELS:
            _CACHE.clear()
        hit = _CACHE[id(spec)] = (spec, {})
    if key not in hit[1]:
        hit[1][key] = build()
    return hit[1][key]


def _gated_norm(spec: ModelSpec, site: str, part: str) -> list[Gemm]:
    r, d = spec.gated_norm_rank, spec.d_model
    if not r:
        return []
    return [_gemm(f"{site}_gated_norm_down", part, r, d, "none"), _gemm(f"{site}_gated_norm_up", part, d, r, "none")]


def _mlp(spec: ModelSpec, prefix: str, part: str, width: int, copies: int) -> list[Gemm]:
    """A (SwiGLU or GELU) MLP on d_model-wide tokens: gate/up fused column-parallel, down row-parallel."""
    up = (2 if spec.activation == "swiglu" else 1) * width
    return [_gemm(f"{prefix}_gate_up", part, up, spec.d_model, "n", copies),
            _gemm(f"{prefix}_down", part, spec.d_model, width, "k", copies)]


def _attention(spec: ModelSpec, layer: int) -> list[Gemm]:
    d, a = spec.d_model, spec.attention
    span = "global" if spec.is_global(layer) else "local"
    out = [_gemm("attn_o", "attn_qkvo", d, a.heads * a.v_head_dim, "k")]
    if a.mla is None:
        qkv = a.heads * a.head_dim + 2 * spec.kv_heads_stored(layer) * a.head_dim
        return [_gemm(f"attn_qkv_{span}", "attn_qkvo", qkv, d, "n")] + out
    mla = a.mla
    q_out = a.heads * mla.qk_head_dim
    q = ([_gemm("mla_q_down", "attn_qkvo", mla.q_lora_rank, d, "none"),
          _gemm("mla_q_up", "attn_qkvo", q_out, mla.q_lora_rank, "n")] if mla.q_lora_rank else
         [_gemm("mla_q", "attn_qkvo", q_out, d, "n")])
    kv = [_gemm("mla_kv_down", "attn_qkvo", mla.kv_lora_rank + mla.qk_rope_head_dim, d, "none"),
          _gemm("mla_kv_up", "attn_qkvo", a.heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank, "n")]
    return q + kv + out


def _convs(spec: ModelSpec, layer: int) -> list[Gemm]:
    if spec.conv is None:
        return []
    span = "global" if spec.is_global(layer) else "local"
    widths = spec._conv_widths(layer)
    return [_gemm(f"conv_{s}_{span}" if s in ("k", "v") else f"conv_{s}", "conv", widths[s], spec.conv.kernel,
                  "n" if s in ("k", "v") else "none") for s in spec.conv.sites]


def layer_gemms(spec: ModelSpec, layer: int) -> tuple[Gemm, ...]:
    """Every forward dense matrix product of `layer` (see the module docstring); cached per model object."""
    return _cached(spec, ("layer", layer), lambda: tuple(_layer_gemms(spec, layer)))


def _layer_gemms(spec: ModelSpec, layer: int) -> list[Gemm]:
    d, a = spec.d_model, spec.attention
    out = _gated_norm(spec, "attn", "attn_gated_norm") + _attention(spec, layer)
    if a.output_gate:
        out.append(_gemm("attn_gate", "attn_gate", a.heads, d, "n"))
    out += _gated_norm(spec, "mlp", "mlp_gated_norm") + _convs(spec, layer)
    if not spec.is_moe(layer):
        return out + _mlp(spec, "dense", "dense_mlp", spec.ffn, 1)
    m = spec.moe
    out.append(_gemm("router", "router", m.experts, d, "none"))
    if m.latent_dim:
        out += [_gemm("latent_down", "latent", m.latent_dim, d, "none"),
                _gemm("latent_up", "latent", d, m.latent_dim, "none")]
    if m.shared_experts:
        out += _mlp(spec, "shared", "shared_experts", m.shared_ffn, m.shared_experts)
    return out


class TailWork(NamedTuple):
    """What the stage holding the last chunk runs after its layers, per token (forward): `gemms` the output head,
    the final gated norm and each multi-token-prediction module's projection, block GEMMs and head pass; `attn`
    and `experts` the MTP blocks' attention core and routed-expert FLOPs (no GEMMs of this list)."""

    gemms: tuple[Gemm, ...]
    attn: float
    experts: float


def tail_work(spec: ModelSpec) -> TailWork:
    """The tail's work (TailWork); its FLOPs sum to ModelSpec.tail_flops_fwd(costs.HW)."""
    return _cached(spec, ("tail",), lambda: _tail_work(spec))


def _tail_work(spec: ModelSpec) -> TailWork:
    head = _gemm("head", "head", spec.vocab, spec.d_model, "n")  # vocabulary-parallel (module docstring)
    gemms = [head] + _gated_norm(spec, "final", "final_gated_norm")
    if spec.mtp is None:
        return TailWork(tuple(gemms), 0.0, 0.0)
    depth, last = spec.mtp.depth, spec.layers - 1
    parts = spec.layer_flops_breakdown(last, costs.HW)
    block = [g._replace(flops=g.flops * depth) for g in layer_gemms(spec, last)]
    gemms += [_gemm("mtp_proj", "mtp", spec.d_model, 2 * spec.d_model, "none", depth), *block,
              head._replace(flops=head.flops * depth, part="mtp")]
    return TailWork(tuple(gemms), depth * parts.get("attn_scores_values", 0.0), depth * parts.get("experts", 0.0))


def embed_gemms(spec: ModelSpec) -> tuple[Gemm, ...]:
    """The embedding end's GEMMs (its gated norm when the model has one; the lookup is a gather)."""
    return tuple(_gated_norm(spec, "embed", "embed_gated_norm")) if spec.embed_norm else ()


def flops_by_name(gemms) -> np.ndarray:
    """FLOPs per token of `gemms` summed by name, in GEMM_NAMES order."""
    out = np.zeros(len(GEMM_NAMES))
    for g in gemms:
        out[GEMM_NAMES.index(g.name)] += g.flops
    return out


def shapes_by_name(spec: ModelSpec) -> dict[str, Gemm]:
    """One Gemm of each name the model has (a name has one n, k and split throughout a model)."""
    def build():
        out: dict[str, Gemm] = {}
        for g in [g for i in range(spec.layers) for g in layer_gemms(spec, i)] + \
                list(tail_work(spec).gemms) + list(embed_gemms(spec)):
            out.setdefault(g.name, g)
        return out

    return _cached(spec, ("shapes",), build)


def rank_shape(g: Gemm, tokens_mb, tensor) -> costs.GemmShape:
    """The shape of one rank's 1/tensor share of GEMM `g` over a micro-batch of `tokens_mb` tokens (arrays
    broadcast): column-parallel splits n (the output head: its vocabulary), row-parallel k, a replicated product
    its rows (as under sequence parallelism)."""
    t = np.asarray(tensor, dtype=float)
    return costs.GemmShape(tokens_mb / t if g.split == "none" else tokens_mb + 0.0 * t,
                           g.n / t if g.split == "n" else g.n + 0.0 * t, g.k / t if g.split == "k" else g.k + 0.0 * t)


def gemms_seconds(gemms, tokens_mb, tensor, topo, precision) -> float:
    """Seconds of one rank's share (1/tensor) of `gemms` over a micro-batch, each GEMM at its own shape."""
    return sum(float(costs.gemm_time(g.flops * tokens_mb / tensor, rank_shape(g, tokens_mb, tensor), topo,
                                     precision)) for g in gemms)


def tail_expert_shape(spec: ModelSpec, routed_mb, par) -> costs.GemmShape:
    """The multi-token-prediction blocks' grouped expert GEMM on one rank: balanced routing of the `routed_mb`
    tokens the rank routes (costs.expert_shape); par: the plan's ParallelSpec (fields may be arrays)."""
    return costs.expert_shape(costs.expert_rows(routed_mb, spec, par.expert_group), spec, par.expert,
                              par.expert_tensor)


def tail_seconds(spec: ModelSpec, tokens_mb: float, routed_mb: float, par, topo, precision: str) -> float:
    """One rank's tail per micro-batch (tail_work), all in costs.unquantised(precision): its GEMMs each at its own
    shape, the MTP blocks' attention core as the last layer's (simulator.attention_cost) and their routed experts
    at the grouped-GEMM efficiency of tail_expert_shape."""
    tail, unq = tail_work(spec), costs.unquantised(precision)
    experts = costs.grouped_gemm_time(tail.experts * routed_mb, tail_expert_shape(spec, routed_mb, par), topo, unq)
    return gemms_seconds(tail.gemms, tokens_mb, par.tensor, topo, unq) + float(experts) + \
        float(costs.attention_time(tail.attn * tokens_mb / par.tensor, topo, precision,
                                   layer_core(spec, spec.layers - 1, tokens_mb, par.tensor, par.context)))


def names_used(spec: ModelSpec) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the GEMM names the model's layers have, those its ends have: tail and embedding), in GEMM_NAMES order."""
    def build():
        layers = {g.name for i in range(spec.layers) for g in layer_gemms(spec, i)}
        ends = {g.name for g in tail_work(spec).gemms + embed_gemms(spec)}
        return tuple(n for n in GEMM_NAMES if n in layers), tuple(n for n in GEMM_NAMES if n in ends)

    return _cached(spec, ("names",), build)


class GemmRates(NamedTuple):
    """Seconds per FLOP of a plan's dense GEMMs, stacked on a leading axis: `layers` in the order of `names` (the
    layers' GEMMs, in the plan's precision), `ends` in that of `end_names` (output head, final and embedding norms,
    multi-token prediction: costs.unquantised). Every name at the GEMM efficiency of its own shape (shapes[name],
    simulator.gemms.rank_shape), all names in one costs.gemm_time call each: every stage shares them."""

    names: tuple
    layers: object
    end_names: tuple
    ends: object

    def take(self, rows) -> "GemmRates":
        """The rates of the plans `rows` (an index array into the plan axis, the one after the names'; rates
        without one, a single plan's or no names' zero, serve every row)."""
        pick = lambda a: a[:, rows] if np.ndim(a) > 1 else np.broadcast_to(a[:, None], (len(a), len(rows)))  # noqa: E731
        return GemmRates(self.names, pick(self.layers), self.end_names, pick(self.ends))


def gemm_rates(names: tuple, end_names: tuple, shapes: dict, topo, precision) -> GemmRates:
    """The GemmRates of these names: shapes[name] a costs.GemmShape (arrays broadcast), topo a Topology."""
    def rate(ns, prec):
        if not ns:
            return np.zeros(1)
        stacked = costs.GemmShape(*(np.stack(np.broadcast_arrays(*(shapes[n][i] for n in ns))) for i in range(3)))
        return costs.gemm_time(1.0, stacked, topo, prec)

    return GemmRates(names, rate(names, precision), end_names, rate(end_names, costs.unquantised(precision)))


def gemm_seconds(rates: GemmRates, flops, end_flops) -> tuple:
    """(layer GEMMs, end GEMMs, shared experts) seconds of one stage's micro-batch from its GEMM FLOPs stacked in
    the order of rates.names (`flops`) and rates.end_names (`end_flops`)."""
    layers = flops * rates.layers
    shared = [i for i, n in enumerate(rates.names) if n in SHARED_GEMMS]
    return layers.sum(axis=0), (end_flops * rates.ends).sum(axis=0), layers[shared].sum(axis=0) if shared else 0.0
