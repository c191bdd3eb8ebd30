"""Memory model: bytes per GPU for weights, gradients, fp32 master, optimizer state and activations of a plan.

The partition follows the plan's layout (see rackcast/plan.py): dense matrices split by `tensor`, layers by
`pipeline`, experts by `expert x expert_tensor`; parameters, gradients and optimizer state of the dense part are
sharded `fsdp` ways (ZeRO-3), the experts' by the FSDP part of their expert-data group. The heaviest pipeline rank
is reported (rank 0 holds the embedding and the most in-flight micro-batches).

Activations per layer per token are the tensors a layer saves for its backward pass, counted component by
component. For a dense GPT layer with materialised attention and dropout this is Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models", eq. 1-5): s*b*h*(34 + 5*a*s/h) bytes without
tensor parallelism, s*b*h*(10 + 24/t + 5*a*s/(h*t)) with tensor parallelism t, and s*b*h/t*(34 + 5*a*s/h) with
sequence parallelism too. Selective recomputation drops the attention-core terms (the 5as/h part); full
recomputation keeps only each layer's input and the working set of the one layer being recomputed.

    python -m simulator.memory examples/plans/marin-535b-hero.yaml
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from rackcast.modelspec import ModelSpec
from rackcast.plan import Plan
from simulator.schedule_formulas import peak_in_flight

BYTES = {"bf16": 2, "fp8": 1, "fp32": 4}
FP32 = 4
MASK_BYTES = 1  # dropout masks are stored as one byte per element


@dataclass(frozen=True)
class RankParams:
    """Parameters held by the heaviest pipeline rank, before FSDP sharding, split by optimizer group."""

    dense: float  # non-expert matrices and vectors on this rank (after tensor/pipeline split)
    expert: float  # routed-expert parameters on this rank (after expert / expert_tensor split)
    adam_only: float  # part of `dense` that any optimizer keeps in Adam (embeddings, router, gates, norms, convs)
    head: float  # output head part of `dense` (AdamH in MuonH)
    layers: int  # transformer layers on this rank
    dense_layer_max: float  # the largest single layer's dense params on this rank (FSDP gather buffer)
    expert_layer_max: float


@dataclass(frozen=True)
class MemoryBreakdown:
    weights: float
    gradients: float
    master: float
    optimizer: float
    activations: float
    buffers: float  # FSDP gather buffers and the full-recompute working set
    host: float  # bytes this GPU keeps in host memory (optimizer state and master when offloaded)
    inflight_microbatches: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.master + self.optimizer + self.activations + self.buffers

    def as_dict(self) -> dict[str, float]:
        return {"weights": self.weights, "gradients": self.gradients, "master": self.master,
                "optimizer": self.optimizer, "activations": self.activations, "buffers": self.buffers,
                "total": self.total, "host": self.host}


def rank_layers(spec: ModelSpec, plan: Plan, rank: int = 0) -> list[int]:
    """Layer indices held by pipeline rank `rank`: chunk c of `pipeline x virtual` holds consecutive layers;
    rank r holds chunks r, r + p, ... (interleaved) or r and 2p-1-r (the V shape of dualpipev)."""
    p, v = plan.parallel.pipeline, plan.parallel.virtual
    per_chunk = spec.layers // (p * v)
    if plan.schedule == "dualpipev":
        chunks = [rank, 2 * p - 1 - rank]
    else:
        chunks = [rank + i * p for i in range(v)]
    return [c * per_chunk + j for c in chunks for j in range(per_chunk)]


def _adam_part(spec: ModelSpec, layer: int) -> int:
    """Parameters of a layer that MuonH leaves to Adam: router (+bias), attention gate, norms, convolutions."""
    parts = spec.layer_param_breakdown(layer)
    keys = ("router", "attn_gate", "attn_norm", "mlp_norm", "conv")
    return sum(parts.get(k, 0) for k in keys)


def rank_params(spec: ModelSpec, plan: Plan, rank: int = 0) -> RankParams:
    par = plan.parallel
    t, experts_split = par.tensor, par.expert * par.expert_tensor
    layers = rank_layers(spec, plan, rank)
    dense = expert = adam = 0.0
    dense_max = expert_max = 0.0
    for i in layers:
        parts = spec.layer_param_breakdown(i)
        e = parts.get("experts", 0) / experts_split
        d = (spec.layer_params(i) - parts.get("experts", 0)) / t
        dense += d
        expert += e
        adam += _adam_part(spec, i) / t
        dense_max, expert_max = max(dense_max, d), max(expert_max, e)
    top = spec.top_param_breakdown()
    first = rank == 0
    last = rank == par.pipeline - 1 or plan.schedule == "dualpipev" and rank == 0
    embed = (top.get("embedding", 0) + top.get("positions", 0)) / t if first else 0.0
    head = top.get("head", 0) / t if last else 0.0
    norms = sum(v for k, v in top.items() if k not in ("embedding", "positions", "head")) / t
    if spec.tied_embeddings and last and not first:
        head = top.get("embedding", 0) / t  # the last stage keeps its own copy of a tied embedding
    dense += embed + head + norms
    adam += embed + norms
    return RankParams(dense=dense, expert=expert, adam_only=adam, head=head, layers=len(layers),
                      dense_layer_max=dense_max, expert_layer_max=expert_max)


def expert_fsdp(plan: Plan) -> int:
    """How many ways expert parameters are sharded ZeRO-3 style (the FSDP part of the expert-data group)."""
    par = plan.parallel
    inner = par.fsdp * par.context * par.tensor
    split = par.expert * par.expert_tensor
    return inner // split if inner % split == 0 and inner >= split else 1


def layer_activation_bytes_per_token(spec: ModelSpec, layer: int, plan: Plan) -> float:
    """Bytes one layer saves for backward per token of a micro-batch on one rank (no recomputation)."""
    par = plan.parallel
    t = par.tensor
    sp = t if par.sequence_parallel else 1  # sequence parallelism shards the d-wide tensors too
    e = BYTES[plan.precision if plan.precision != "fp8" else "bf16"]  # activations are kept in bf16
    a, d = spec.attention, spec.d_model
    q_dim, kv_dim = a.heads * a.head_dim, spec.kv_heads_stored(layer) * a.head_dim
    r = spec.gated_norm_rank
    # Attention block.
    total = e * d / sp  # norm input
    total += e * (d + 2 * r) / sp if r else 0.0  # gated norm: input, hidden pre/post activation
    total += e * d / sp  # QKV projection input
    total += e * (q_dim + 2 * kv_dim) / t  # Q, K, V
    if plan.attention_kernel == "materialized":
        ctx = spec.context(layer)
        total += (e + MASK_BYTES * plan.dropout + e * plan.dropout) * a.heads * ctx / t  # softmax, mask, out
    else:
        total += FP32 * a.heads / t  # flash attention keeps only its log-sum-exp (the output is the O input)
    if a.exclusive:
        total += e * q_dim / t  # output before the exclusive projection
    if a.output_gate:
        total += e * a.heads / t
    total += e * q_dim / t  # output projection input
    total += MASK_BYTES * d / sp if plan.dropout else 0.0
    if spec.conv:
        widths = {"k": kv_dim / t, "v": kv_dim / t, "attn": d / sp, "mlp": d / sp}
        total += sum(e * widths[s] for s in spec.conv.sites)
    # MLP block.
    total += e * d / sp  # norm input
    total += e * (d + 2 * r) / sp if r else 0.0
    gated = spec.activation == "swiglu"
    if spec.is_moe(layer):
        m = spec.moe
        x = spec.expert_input_dim
        et = par.expert_tensor
        total += e * d / sp  # MoE input (router, latent projection, shared experts read it)
        total += FP32 * m.experts  # router logits in fp32
        if m.latent_dim:
            total += 2 * e * m.latent_dim  # latent norm input and W_up input
        # Per routed copy: its input and output rows on each of the et expert-tensor ranks, and the hidden
        # activations (gate, up, act) of width expert_ffn / et on each of them.
        per_copy = et * e * x * 2 + e * m.expert_ffn * (3 if gated else 2)
        total += m.top_k * per_copy
        total += m.shared_experts * e * m.shared_ffn / t * (3 if gated else 2)
    else:
        total += e * d / sp  # MLP input
        total += e * spec.ffn / t * (3 if gated else 2)  # hidden: gate/up/act (SwiGLU) or GELU in/out
    total += MASK_BYTES * d / sp if plan.dropout else 0.0
    return total


def attention_core_bytes_per_token(spec: ModelSpec, layer: int, plan: Plan) -> float:
    """The part selective recomputation avoids storing (the materialised attention core)."""
    if plan.attention_kernel != "materialized":
        return 0.0
    e = BYTES["bf16"]
    return (e + MASK_BYTES * plan.dropout + e * plan.dropout) * spec.attention.heads * spec.context(layer) / \
        plan.parallel.tensor


def inflight_chunk_microbatches(schedule: str, p: int, m: int, v: int) -> float:
    """Peak (micro-batch x model chunk) activations held by pipeline rank 0 (the worst rank)."""
    if p == 1:
        return 1.0  # gradient accumulation without a pipeline runs each micro-batch's backward right away
    return float(peak_in_flight(schedule, p, m, v))


def optimizer_state_bytes(rp: RankParams, plan: Plan) -> tuple[float, float]:
    """(fp32 master, optimizer state) bytes per GPU for this rank's shard of the parameters."""
    shard = rp.dense / plan.parallel.fsdp + rp.expert / expert_fsdp(plan)
    master = FP32 * shard if plan.optimizer.master_weights else 0.0
    if plan.optimizer.name == "adamw":
        return master, 2 * FP32 * shard
    # MuonH: 1 momentum buffer for matrices, Adam (2) for adam-only groups, AdamH (2) for the head.
    return master, FP32 * (shard + (rp.adam_only + rp.head) / plan.parallel.fsdp)


def static_bytes(rp: RankParams, plan: Plan) -> dict[str, float]:
    """Bytes per GPU that live for the whole step: weights, gradients, master, optimizer state (HBM) and what is
    kept in host memory instead when the plan offloads the optimizer."""
    par = plan.parallel
    shard = rp.dense / par.fsdp + rp.expert / expert_fsdp(plan)
    g_bytes = BYTES[plan.grad_dtype]
    master, states = optimizer_state_bytes(rp, plan)
    out = {"weights": BYTES[plan.precision if plan.precision != "fp8" else "bf16"] * shard,
           "gradients": g_bytes * (shard if par.fsdp > 1 else rp.dense + rp.expert),
           "master": master, "optimizer": states, "host": 0.0}
    if plan.optimizer.state_location == "host":
        out.update(host=master + states, master=0.0, optimizer=0.0)
    return out


def memory_breakdown(spec: ModelSpec, plan: Plan) -> MemoryBreakdown:
    par, b = plan.parallel, plan.batch
    rp = rank_params(spec, plan, rank=0)
    w_bytes = BYTES[plan.precision if plan.precision != "fp8" else "bf16"]
    g_bytes = BYTES[plan.grad_dtype]
    efsdp = expert_fsdp(plan)
    static = static_bytes(rp, plan)
    weights, gradients, master, states, host = (static[k] for k in ("weights", "gradients", "master",
                                                                     "optimizer", "host"))
    # FSDP gathers one layer while the next is prefetched: two layers of unsharded weights and one of gradients.
    buffers = 0.0
    if par.fsdp > 1:
        buffers += 2 * w_bytes * rp.dense_layer_max + g_bytes * rp.dense_layer_max
    if efsdp > 1:
        buffers += 2 * w_bytes * rp.expert_layer_max + g_bytes * rp.expert_layer_max
    tokens_mb = b.micro_batch * spec.seq_len / par.context
    layers = rank_layers(spec, plan, 0)
    per_layer = [layer_activation_bytes_per_token(spec, i, plan) * tokens_mb for i in layers]
    inflight = inflight_chunk_microbatches(plan.schedule, par.pipeline, plan.microbatches, par.virtual)
    chunk_layers = len(layers) / (2 if plan.schedule == "dualpipev" else par.virtual)
    act_e = BYTES["bf16"]
    if plan.recompute == "full":
        kept = act_e * spec.d_model / (par.tensor if par.sequence_parallel else 1) * tokens_mb
        activations = kept * chunk_layers * inflight
        buffers += max(per_layer)  # the layer being recomputed holds its full activations
    else:
        if plan.recompute == "selective":
            per_layer = [x - attention_core_bytes_per_token(spec, i, plan) * tokens_mb
                         for x, i in zip(per_layer, layers)]
        activations = sum(per_layer) / len(layers) * chunk_layers * inflight
    # Embedding output and the head's input (the fused loss keeps no full logits).
    activations += 2 * act_e * spec.d_model * tokens_mb
    return MemoryBreakdown(weights=weights, gradients=gradients, master=master, optimizer=states,
                           activations=activations, buffers=buffers, host=host, inflight_microbatches=inflight)


if __name__ == "__main__":
    from rackcast.plan import load_plan

    loaded = load_plan(sys.argv[1])
    for key, value in memory_breakdown(loaded.model_spec(), loaded).as_dict().items():
        print(f"{key:12s} {value / 2**30:10.2f} GiB")
