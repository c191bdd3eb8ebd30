"""The attention core's shape and kind, and its efficiency: how the trainer calls attention in a layer
(backend.attention), the work that call executes, and the measured efficiency of that call's shape
(topologies.spec.AttentionPoint, written by `rackcast calibrate`) or, without a surface, the one `attention` figure.

Kinds: a global layer (and a local one whose window covers the sequence) calls causal SDPA over the whole sequence
("causal"); a local layer calls backend.attention.banded_attention ("banded"): one masked SDPA with the query blocks
as its batch, every block of window_query_block(window) queries against window + block - 1 keys, masked entries
included. The core is that kernel call; the reshaping around it (pad, unfold, copies) is eager ops, priced with
the others (simulator.op_counts, op_bytes). Work executed, in score-value pairs (each 4 x head_dim FLOPs forward):
- causal: queries x (queries + 1) / 2, the count simulator.costs.HW charges. PyTorch's fused CPU kernel skips the
  key blocks wholly above the diagonal (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp: `num_keys = is_causal ?
  std::min(m + qBlockSize, kvSize) : kvSize`), so it does the triangle plus part of the diagonal blocks; that excess
  is part of the measured efficiency at each shape;
- banded: blocks x block x (window + block - 1): an explicit attn_mask computes every entry (the same kernel skips
  nothing without is_causal; a profiled tiny-moe step, benchmarks/step_terms.py, runs all its calls, masked and
  causal, through aten::_scaled_dot_product_flash_attention_for_cpu), about 1.4 x the causal-over-window count
  HW charges at window 32, sequence 128. The cost model's FLOPs stay HW's (the MFU's numerator is another
  convention again); pricing multiplies them by Core.ratio, executed over counted.
Approximations: context-parallel ranks are priced as calls of their chunk's queries (ratio 1 for causal), attention
with sinks (backend.sinks, a dense masked call) as causal.

    from rackcast.simulator.attention_cost import layer_core
    core = layer_core(spec, layer, tokens_mb, tensor, context)      # costs.attention_time(flops, topo, p, core)
"""

from __future__ import annotations

from typing import NamedTuple

from rackcast.modelspec import FlopsConvention, ModelSpec
from rackcast.simulator.op_counts import window_branches, window_query_block
from rackcast.simulator.gemm_surface import grid_efficiency
from rackcast.topologies.spec import ATTENTION_KINDS, Topology, attention_axes

# The hardware-work convention the cost model counts FLOPs in (simulator.costs re-exports it): attention causal over
# each layer's window, the output head included.
HW = FlopsConvention(attention="causal", window="window", head=True)
SCORE_VALUE_FLOPS = 4  # per score-value pair and head dim: 2 for the score's multiply-adds, 2 for the value's


class Core(NamedTuple):
    """One layer's attention-core call on one rank (fields may be arrays, one element per plan): `kind`, `rows`
    sequences (batch x heads) of `queries` positions, `keys` (causal: the queries; banded: the window), `head_dim`,
    and `ratio`: pairs the kernel executes over those simulator.costs.HW counts."""

    kind: str
    rows: object
    queries: object
    keys: object
    head_dim: float
    ratio: object = 1.0


def layer_kind(spec: ModelSpec, layer: int) -> str:
    """How the trainer calls `layer`'s attention (backend.attention.Attention._attention): banded where the op count's
    window_branches say the layer takes the banded branch on the spec's seq_len, unless sinks make it dense."""
    banded, _, _ = window_branches(0 if spec.is_global(layer) else spec.context(layer), spec.seq_len)
    return "banded" if banded and not spec.attention.sinks else "causal"


def executed_pairs(kind: str, queries, keys):
    """Score-value pairs one sequence's call of `kind` executes (module docstring); `keys` the window if banded."""
    if kind == "causal":
        return queries * (queries + 1) / 2
    block = window_query_block(int(keys))
    return -(-queries // block) * block * (keys + block - 1)


def executed_flops(kind: str, rows, queries, keys, head_dim):
    """Forward FLOPs of one call of `kind` on `rows` sequences (what `rackcast calibrate` divides time into)."""
    return SCORE_VALUE_FLOPS * head_dim * rows * executed_pairs(kind, queries, keys)


def layer_core(spec: ModelSpec, layer: int, tokens_mb, tensor, context=1) -> Core:
    """`layer`'s attention core on one rank of a micro-batch of `tokens_mb` tokens (its share of the sequence
    under `context` parallelism), heads split over `tensor` ranks."""
    kind, queries = layer_kind(spec, layer), spec.seq_len / context
    keys = queries if kind == "causal" else spec.context(layer)
    ratio = 1.0 if kind == "causal" else \
        executed_pairs(kind, queries, keys) / queries / spec.attention_context(layer, HW)
    return Core(kind, tokens_mb / queries * spec.attention.heads / tensor, queries, keys, spec.attention.head_dim,
                ratio)


def core_efficiency(core: Core | None, topo: Topology):
    """The measured surface's efficiency at `core`'s kind and shape where the topology has points of that kind,
    else the topology's one attention figure."""
    points = topo.efficiency.attention_surface
    if core is None or not any(p.kind == core.kind for p in points):
        return topo.efficiency.attention
    coords = {"rows": core.rows, "queries": core.queries, "keys": core.keys, "head_dim": core.head_dim}
    axes = attention_axes(core.kind)
    return grid_efficiency(points, axes, tuple(coords[a] for a in axes), core.kind)


CORE_FIELDS = ("rows", "queries", "keys", "head_dim", "ratio")  # a Core's shape fields, as estimate features


def kind_cores(spec: ModelSpec, tokens_mb, tensor, context=1) -> tuple[Core, ...]:
    """One Core per kind of ATTENTION_KINDS on one rank (as layer_core; fields may be arrays): the first layer's of
    that kind, or for a kind the model has no layer of (its FLOPs are zero), the causal shape under that name."""
    first = {layer_kind(spec, i): i for i in reversed(range(spec.layers))}
    out = []
    for kind in ATTENTION_KINDS:
        if kind in first:
            out.append(layer_core(spec, first[kind], tokens_mb, tensor, context))
        else:
            queries = spec.seq_len / context
            out.append(Core(kind, tokens_mb / queries * spec.attention.heads / tensor, queries, queries,
                            spec.attention.head_dim))
    return tuple(out)
