"""Memory model: bytes per GPU for weights, gradients, fp32 master, optimizer state and activations of a plan.

The partition follows the plan's layout (see rackcast/plan.py): dense matrices split by `tensor`, layers by
`pipeline`, experts by `expert x expert_tensor`; parameters, gradients and optimizer state of the dense part are
sharded `fsdp` ways (ZeRO-3), the experts' by the FSDP part of their expert-data group; `parallel.zero` shards the
optimizer state and master (ZeRO-1) and the gradients (ZeRO-2) over the data replicas as well (Rajbhandari et al.,
ZeRO: Memory Optimizations Toward Training Trillion Parameter Models, arXiv:1910.02054, section 5 and figure 1).
The heaviest pipeline rank is reported by default (memory_breakdown with rank=None; `rank` picks one): the largest
total over the ranks that can be heaviest (HEAVIEST_CANDIDATES: rank 0, which holds the embedding and the most
in-flight micro-batches; the last, which holds the head; the first rank whose layers hold the most parameters, which
an uneven split, parallel.stage_layers, or a dense-first prefix makes another rank), the same for one Plan and for
PlanArrays. A rank is an int, or a function of the plan (per plan for PlanArrays).

Activations per layer per token are the tensors a layer saves for its backward pass, counted component by
component in simulator.activations, in one of two modes (`activations`): "fused" (the default, what a production
trainer with fused kernels keeps; the planner and all published figures use it) or "eager" (what rackcast's own
PyTorch backend saves when run eagerly, as the CPU trainer's measured peak shows; memory_breakdown then adds what
that backend holds besides saved tensors: the loss backward's logits-sized temporaries, the router margins, token
ids and targets, pipeline receive buffers and cached stage outputs). Selective recomputation drops the
attention-core terms; full recomputation keeps only each layer's input and the working set of the one layer being
recomputed.

`dtype` (memory_breakdown and the functions it calls): the dtype a trainer keeps weights and activations in, e.g.
"fp32" for the CPU trainer, which runs without autocast; the default (None) is the plan's precision (bf16 weights
and activations, grad_dtype gradients, an fp32 master). Optimizer state follows backend.optim's groups: MuonH keeps
one momentum buffer per matrix and two Adam moments for everything else (embeddings, norm gains, router weight,
gates, convolutions, biases) and for the head (AdamH); parameters without a gradient (the balancing bias) keep none.

    from rackcast.simulator.memory import memory_breakdown
    memory_breakdown(plan.model_spec(), plan, "fp32", activations="eager").as_dict()   # as the CPU trainer keeps it
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import numpy as np

from rackcast.modelspec import ModelSpec
from rackcast.plan import Plan
from rackcast.simulator.activations import (BYTES, FP32, Activations, activation_bytes,  # noqa: F401
                                   attention_core_bytes_per_token, check_mode, eager_loss_backward_bytes_per_token,
                                   eager_pipeline_bytes_per_token, eager_step_bytes_per_token,
                                   edge_activation_bytes_per_token, layer_activation_bytes_per_token,
                                   mtp_activation_bytes_per_token)
from rackcast.simulator.plan_arrays import LAYER_SET, PlanArrays, is_arrays, per_key, state_location
from rackcast.simulator.schedule_formulas import peak_in_flight
from rackcast.vocab import SPLIT_BACKWARD_SCHEDULES


Rank = Union[int, Callable[[Plan], int]]  # a pipeline rank, or a function of the plan that names one


def _rank(p: Plan, rank: Rank) -> int:
    return rank(p) if callable(rank) else rank


def heaviest_layers_rank(spec: ModelSpec, p: Plan) -> int:
    """The first pipeline rank whose layers hold the most parameters (the layer count under uniform layers)."""
    held = [sum(spec.layer_params(i) for i in p.rank_layers(spec, r)) for r in range(p.parallel.pipeline)]
    return held.index(max(held))


def heaviest_candidates(spec: ModelSpec) -> tuple[Callable[[Plan], int], ...]:
    """The ranks that can be heaviest (module docstring): rank 0, the last, the one with the most layer parameters."""
    return (lambda p: 0, lambda p: p.parallel.pipeline - 1, lambda p: heaviest_layers_rank(spec, p))


def weight_bytes(plan: Plan, dtype: str | None = None) -> int:
    """Bytes per stored weight: `dtype` when given (the trainer's dtype), else the plan's precision (fp8 runs keep
    bf16 weights and quantise on the fly)."""
    return BYTES[dtype] if dtype else BYTES[plan.precision if plan.precision != "fp8" else "bf16"]


def grad_bytes(plan: Plan, dtype: str | None = None) -> int:
    """Bytes per gradient element: the plan's grad_dtype, or the wider of it and `dtype` when given (an fp32
    trainer accumulates fp32 gradients)."""
    return max(BYTES[plan.grad_dtype], BYTES[dtype]) if dtype else BYTES[plan.grad_dtype]


def keeps_master(plan: Plan, dtype: str | None = None) -> bool:
    """An fp32 master copy exists when the plan asks for one and the weights themselves are narrower than fp32."""
    return plan.optimizer.master_weights and weight_bytes(plan, dtype) < FP32


@dataclass(frozen=True)
class RankParams:
    """Parameters held by one pipeline rank (rank_params), before FSDP sharding, split by optimizer group."""

    dense: float  # non-expert matrices and vectors on this rank (after tensor/pipeline split)
    expert: float  # routed-expert parameters on this rank (after expert / expert_tensor split)
    adam_only: float  # part of `dense` that MuonH keeps in Adam (embeddings, router, gates, norms, convs, biases)
    head: float  # output head part of `dense` (AdamH in MuonH)
    layers: int  # transformer layers on this rank
    dense_layer_max: float  # the largest single layer's dense params on this rank (FSDP gather buffer)
    expert_layer_max: float
    expert_adam: float = 0.0  # part of `expert` that MuonH keeps in Adam (the experts' biases)
    frozen: float = 0.0  # part of `dense` that gets no gradient and no optimizer state (the balancing bias)
    embed_end: float = 0.0  # part of `dense` at the embedding end (embedding, positions, their norms): first chunk
    head_end: float = 0.0  # part of `dense` at the head end (head, final norms): last chunk


@dataclass(frozen=True)
class MemoryBreakdown:
    weights: float
    gradients: float
    master: float
    optimizer: float
    activations: float
    buffers: float  # FSDP gather buffers, the full-recompute working set (eager: transients, pipeline buffers)
    host: float  # bytes this GPU keeps in host memory (optimizer state and master when offloaded)
    inflight_microbatches: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.master + self.optimizer + self.activations + self.buffers

    def as_dict(self) -> dict[str, float]:
        return {"weights": self.weights, "gradients": self.gradients, "master": self.master,
                "optimizer": self.optimizer, "activations": self.activations, "buffers": self.buffers,
                "total": self.total, "host": self.host}


def _biases(spec: ModelSpec, d_in: int, width: int) -> int:
    """Bias parameters of one MLP (ModelSpec._mlp_params's bias term): every matrix but the last has `width`."""
    matrices = 3 if spec.activation == "swiglu" else 2
    return (width * (matrices - 1) + d_in) if spec.mlp_bias else 0


def _frozen_part(spec: ModelSpec, layer: int) -> int:
    """Parameters of a layer without a gradient: the router's balancing bias where the balancer sets it (quantile
    balancing, the auxiliary-loss-free bias: MoESpec.sets_router_bias); a learned router bias (GPT-OSS) trains."""
    m = spec.moe
    return m.experts if spec.is_moe(layer) and m.sets_router_bias else 0


def _adam_part(spec: ModelSpec, layer: int) -> tuple[int, int]:
    """(dense, expert) parameters of a layer that MuonH leaves to Adam: everything but the matrices (the router
    weight, attention gate, norm gains, convolutions, the latent norm's gain and all biases), as backend.optim
    groups them, the learned q/k norms' gains, attention sinks and latent attention's norm gains included. The gated
    norms' low-rank matrices are MuonH matrices; the balancing bias has no state."""
    parts, a, d = spec.layer_param_breakdown(layer), spec.attention, spec.d_model
    dense = sum(parts.get(k, 0) for k in ("attn_gate", "attn_norm", "mlp_norm", "conv", "attn_qk_norm", "attn_sinks"))
    if a.mla is not None:  # the latent RMSNorms' gains
        dense += a.mla.q_lora_rank + a.mla.kv_lora_rank
    dense += parts.get("router", 0) - _frozen_part(spec, layer)
    if a.bias:
        dense += a.heads * a.head_dim + 2 * spec.kv_heads_stored(layer) * a.head_dim + d
    expert = 0
    if spec.is_moe(layer):
        m = spec.moe
        dense += m.latent_dim + m.shared_experts * _biases(spec, d, m.shared_ffn)
        expert = m.experts * _biases(spec, spec.expert_input_dim, m.expert_ffn)
    else:
        dense += _biases(spec, d, spec.ffn)
    return dense, expert


def _layer_set_params(spec: ModelSpec, layers) -> tuple:
    """Parameters of a set of layers before any split: (layers, dense, expert, adam-only dense, adam-only expert,
    frozen, the largest layer's dense, the largest layer's expert)."""
    dense = expert = adam = expert_adam = frozen = dense_max = expert_max = 0
    for i in layers:
        parts = spec.layer_param_breakdown(i)
        e = parts.get("experts", 0)
        d = spec.layer_params(i) - e
        layer_adam, layer_expert_adam = _adam_part(spec, i)
        dense, expert, adam, expert_adam = dense + d, expert + e, adam + layer_adam, expert_adam + layer_expert_adam
        frozen += _frozen_part(spec, i)
        dense_max, expert_max = max(dense_max, d), max(expert_max, e)
    return len(layers), dense, expert, adam, expert_adam, frozen, dense_max, expert_max


def _mtp_params(spec: ModelSpec) -> tuple[int, int, int, int, int]:
    """(dense, expert, adam-only dense, adam-only expert, frozen) parameters of the multi-token-prediction modules
    (ModelSpec.mtp_param_breakdown): per depth two input norms, the 2 d -> d projection, one layer shaped like the
    last, a final norm; the norms' gains are Adam parameters."""
    if spec.mtp is None:
        return 0, 0, 0, 0, 0
    parts, depth = spec.mtp_param_breakdown(), spec.mtp.depth
    _, dense, expert, adam, expert_adam, frozen, _, _ = _layer_set_params(spec, [spec.layers - 1])
    norms = parts.get("mtp_norms", 0)
    return (depth * dense + parts.get("mtp_proj", 0) + norms, depth * expert, depth * adam + norms,
            depth * expert_adam, depth * frozen)


def rank_params(spec: ModelSpec, plan: Plan | PlanArrays, rank: Rank = 0) -> RankParams:
    """Parameters pipeline rank `rank` holds (arrays for PlanArrays): its layers' split `tensor` ways (dense) and
    `expert x expert_tensor` ways (experts), plus the embedding on the first rank and the head on the last."""
    par = plan.parallel
    t, experts_split = par.tensor, par.expert_group
    n, dense, expert, adam, expert_adam, frozen, dense_max, expert_max = per_key(
        plan, LAYER_SET, lambda p: _layer_set_params(spec, p.rank_layers(spec, _rank(p, rank))))
    top = spec.top_param_breakdown()
    if callable(rank):
        first, last = per_key(plan, LAYER_SET, lambda p: (_rank(p, rank) == 0, _rank(p, rank) == p.parallel.pipeline - 1
                                                         or (p.schedule == "dualpipev" and _rank(p, rank) == 0)))
        first, last = np.asarray(first) > 0, np.asarray(last) > 0
        if not is_arrays(plan):
            first, last = bool(first), bool(last)
    else:
        first = rank == 0
        last = (rank == par.pipeline - 1) | ((plan.schedule == "dualpipev") & (rank == 0))
    embed = np.where(first, (top.get("embedding", 0) + top.get("positions", 0)) / t, 0.0 * t)
    head = np.where(last, top.get("head", 0) / t, 0.0)
    if spec.tied_embeddings:  # the last stage keeps its own copy of a tied embedding
        head = np.where(last & ~np.asarray(first), top.get("embedding", 0) / t, head)
    # The embedding's norm lives with the embedding (first stage), the final norm with the head (last stage); norm
    # gains are Adam parameters, the gated norms' matrices MuonH ones.
    gains = np.where(first, top.get("embed_norm", 0), 0) + np.where(last, top.get("final_norm", 0), 0)
    gated = np.where(first, top.get("embed_gated_norm", 0), 0) + np.where(last, top.get("final_gated_norm", 0), 0)
    embed_end = embed + np.where(first, top.get("embed_norm", 0) + top.get("embed_gated_norm", 0), 0) / t
    head_end = head + np.where(last, top.get("final_norm", 0) + top.get("final_gated_norm", 0), 0) / t
    mtp = _mtp_params(spec)  # the multi-token-prediction modules live with the head
    dense = dense + np.where(last, mtp[0], 0)
    expert = expert + np.where(last, mtp[1], 0)
    adam, expert_adam = adam + np.where(last, mtp[2], 0), expert_adam + np.where(last, mtp[3], 0)
    frozen = frozen + np.where(last, mtp[4], 0)
    dense = dense / t + embed + head + (gains + gated) / t
    adam = adam / t + embed + gains / t
    out = dict(dense=dense, expert=expert / experts_split, adam_only=adam, head=head, layers=n,
               dense_layer_max=dense_max / t, expert_layer_max=expert_max / experts_split,
               expert_adam=expert_adam / experts_split, frozen=frozen / t, embed_end=embed_end, head_end=head_end)
    if not is_arrays(plan):
        out = {k: int(v) if k == "layers" else float(v) for k, v in out.items()}
    return RankParams(**out)


def inflight_chunk_microbatches(schedule: str, p: int, m: int, v: int, rank: int = 0) -> float:
    """Peak (micro-batch x model chunk) activations held by pipeline rank `rank` (rank 0 is the worst)."""
    if p == 1:
        return 1.0  # gradient accumulation without a pipeline runs each micro-batch's backward right away
    return float(peak_in_flight(schedule, p, m, v, rank))


def optimizer_state_bytes(rp: RankParams, plan: Plan | PlanArrays, dtype: str | None = None) -> tuple:
    """(fp32 master, optimizer state) bytes per GPU for this rank's shard of the parameters (no master copy when
    the weights are kept in fp32 already): sharded fsdp ways, and over the data x context replicas too from ZeRO-1 on
    (ParallelSpec.state_shards; Rajbhandari et al., ZeRO, arXiv:1910.02054, section 5.1: P_os keeps K x Psi / N_d
    bytes of optimizer state per device, K = 12 for mixed-precision Adam: master, momentum, variance)."""
    par = plan.parallel
    dense_shards, expert_shards = par.state_shards, par.expert_state_shards
    shard = rp.dense / dense_shards + rp.expert / expert_shards
    master = FP32 * shard if keeps_master(plan, dtype) else 0.0 * shard
    trained = shard - rp.frozen / dense_shards  # parameters without a gradient get no state (backend.optim)
    if plan.optimizer.name == "adamw":
        return master, 2 * FP32 * trained
    # MuonH: 1 momentum buffer for matrices, Adam (2) for adam-only groups, AdamH (2) for the head.
    return master, FP32 * (trained + (rp.adam_only + rp.head) / dense_shards + rp.expert_adam / expert_shards)


def static_bytes(rp: RankParams, plan: Plan | PlanArrays, dtype: str | None = None) -> dict:
    """Bytes per GPU that live for the whole step: weights, gradients, master, optimizer state (HBM) and what is
    kept in host memory instead when the plan offloads the optimizer. `dtype`: the dtype weights are kept in
    (default: the plan's precision, with an fp32 master). Weights are sharded fsdp ways (ZeRO-3); gradients fsdp
    ways, and over the data x context replicas too under ZeRO-2 (ParallelSpec.grad_shards; ZeRO, section 5.2: P_os+g keeps
    2 x Psi / N_d bytes of fp16 gradients); optimizer state see optimizer_state_bytes."""
    par = plan.parallel
    shard = rp.dense / par.fsdp + rp.expert / plan.parallel.expert_fsdp
    g_bytes = grad_bytes(plan, dtype)
    master, states = optimizer_state_bytes(rp, plan, dtype)
    host = state_location(plan) == "host"
    grads_sharded = (par.fsdp > 1) | (par.zero >= 2)
    grads = np.where(grads_sharded, rp.dense / par.grad_shards + rp.expert / par.expert_grad_shards,
                     rp.dense + rp.expert) - rp.frozen / par.grad_shards
    return {"weights": weight_bytes(plan, dtype) * shard, "gradients": g_bytes * grads,
            "master": np.where(host, 0.0, master), "optimizer": np.where(host, 0.0, states),
            "host": np.where(host, master + states, 0.0)}


def memory_breakdown(spec: ModelSpec, plan: Plan | PlanArrays, dtype: str | None = None, rank: Rank | None = None,
                     activations: Activations = "fused") -> MemoryBreakdown:
    """Bytes per GPU of pipeline rank `rank`, by default (None) of the heaviest one: the breakdown of the candidate
    rank (heaviest_candidates) with the largest total, the first on ties; for PlanArrays (simulator.plan_arrays)
    every field is an array, one element per plan, each plan's heaviest rank chosen on its own.
    `dtype` ("fp32", "bf16"): the dtype the trainer keeps weights and activations in
    (e.g. "fp32" for the CPU trainer, which runs without autocast); gradients are then kept in the wider of it and
    grad_dtype, and there is no separate master copy when the weights are fp32. The default (None) is the plan's
    precision: bf16 weights and activations, grad_dtype gradients, an fp32 master. `activations`: "fused" (default)
    or "eager", rackcast's own backend run eagerly (see simulator.activations): its saved tensors, the embedding and
    head's per rank and in-flight micro-batch, what it holds for the whole step (activations), and its transients
    and pipeline buffers (buffers)."""
    if rank is not None:
        return _rank_breakdown(spec, plan, dtype, rank, activations)
    arrays = is_arrays(plan)
    if not arrays and plan.parallel.pipeline == 1:
        return _rank_breakdown(spec, plan, dtype, 0, activations)
    best, seen = None, []
    for role in heaviest_candidates(spec):
        ranks, = per_key(plan, LAYER_SET, role)
        ranks = np.asarray(ranks)
        if any(np.array_equal(ranks, r) for r in seen):
            continue  # the same rank of every plan as an earlier candidate
        seen.append(ranks)
        mem = _rank_breakdown(spec, plan, dtype, role, activations)
        if best is None:
            best = mem
        elif arrays:
            heavier = mem.total > best.total
            best = MemoryBreakdown(**{k: np.where(heavier, getattr(mem, k), getattr(best, k))
                                      for k in MemoryBreakdown.__dataclass_fields__})
        elif mem.total > best.total:
            best = mem
    return best


def fsdp_kept_gathered(plan: Plan | PlanArrays):
    """Whether the trainer's FSDP keeps each unit's weights gathered from its forward until its backward (bool, or
    per plan for arrays): under the split-backward schedules (zb_h1, dualpipev) of a pipeline, whose weight-gradient
    pass needs the gathered weights after later micro-batches' forwards (backend.fsdp.reshard_after_forward)."""
    return (plan.parallel.pipeline > 1) & np.isin(plan.schedule, sorted(SPLIT_BACKWARD_SCHEDULES))


def _rank_breakdown(spec: ModelSpec, plan: Plan | PlanArrays, dtype: str | None, rank: Rank,
                    activations: Activations) -> MemoryBreakdown:
    """memory_breakdown of pipeline rank `rank` (an int, or a function of each plan)."""
    eager = check_mode(activations) == "eager"
    par = plan.parallel
    rp = rank_params(spec, plan, rank=rank)
    w_bytes = weight_bytes(plan, dtype)
    g_bytes = grad_bytes(plan, dtype)
    efsdp = plan.parallel.expert_fsdp
    static = static_bytes(rp, plan, dtype)
    weights, gradients, master, states, host = (static[k] for k in ("weights", "gradients", "master",
                                                                     "optimizer", "host"))
    # FSDP gathers one layer while the next is prefetched: two layers of unsharded weights and one of gradients;
    # the embedding or head end of a chunk stays gathered through its whole forward or backward.
    ends = np.where(par.chunks == 1, rp.embed_end + rp.head_end, np.maximum(rp.embed_end, rp.head_end))
    # Under the split-backward schedules of a pipeline every unit stays gathered from its forward to its weight
    # gradients (fsdp_kept_gathered): the rank's whole weights, unsharded, next to their shards.
    kept = fsdp_kept_gathered(plan)
    buffers = np.where(par.fsdp > 1, np.where(kept, w_bytes * rp.dense, 2 * w_bytes * rp.dense_layer_max + w_bytes * ends)
                       + g_bytes * rp.dense_layer_max, 0.0)
    buffers = buffers + np.where(efsdp > 1, np.where(kept, w_bytes * rp.expert, 2 * w_bytes * rp.expert_layer_max)
                                 + g_bytes * rp.expert_layer_max, 0.0)
    # ZeRO-2 without fsdp: one layer's whole gradients wait for their reduce-scatter (ZeRO's bucketed reduction).
    buffers = buffers + np.where((par.zero >= 2) & (par.fsdp == 1), g_bytes * rp.dense_layer_max, 0.0) + \
        np.where((par.zero >= 2) & (efsdp == 1), g_bytes * rp.expert_layer_max, 0.0)
    tokens_mb = plan.tokens_per_microbatch(spec)
    m = plan.microbatches
    # Per token of a micro-batch: the layers' saved activations (sum, largest layer) and the attention cores.
    reads = ("tensor", "sequence_parallel", "expert_tensor") + (("micro_batch", "expert") if eager else ())

    def layer_sums(p) -> tuple[float, float, float]:
        per_layer = [layer_activation_bytes_per_token(spec, i, p, dtype, activations) for i in p.rank_layers(spec, _rank(p, rank))]
        cores = sum(attention_core_bytes_per_token(spec, i, p, dtype) for i in p.rank_layers(spec, _rank(p, rank)))
        return sum(per_layer), max(per_layer), cores

    layer_sum, layer_max, cores = per_key(plan, LAYER_SET + reads, layer_sums)
    n_layers = rp.layers
    inflight, = per_key(plan, LAYER_SET + (m,), lambda p: inflight_chunk_microbatches(
        p.schedule, p.parallel.pipeline, p.microbatches, p.parallel.virtual, _rank(p, rank)))
    chunk_layers = n_layers / par.chunks_per_rank
    act_e = activation_bytes(dtype)
    full = plan.recompute == "full"
    kept = act_e * spec.d_model / np.where(par.sequence_parallel, par.tensor, 1) * tokens_mb
    buffers = buffers + np.where(full, layer_max * tokens_mb, 0.0)  # the layer being recomputed holds its all
    kept_layers = np.where(plan.recompute == "selective", layer_sum - cores, layer_sum) * tokens_mb
    saved = np.where(full, kept * chunk_layers * inflight, kept_layers / n_layers * chunk_layers * inflight)
    # Outside the layers. Fused: two d-wide tensors once, on every rank. Eager: rank 0 holds the embedding, the last
    # rank (rank 0 too in the V of dualpipev) the head, for each of its in-flight micro-batches of that chunk.

    def edges(p) -> tuple[int, bool, bool, float]:
        chunks = p.parallel.rank_chunks(_rank(p, rank), p.schedule)
        first, last = 0 in chunks, p.parallel.chunks - 1 in chunks
        edge = edge_activation_bytes_per_token(spec, p, first=first, last=last, dtype=dtype, activations=activations)
        mtp = mtp_activation_bytes_per_token(spec, p, dtype, activations) if last else 0.0
        return len(chunks), first, last, edge, mtp

    reads_mtp = reads if spec.mtp is not None else ()  # the MTP block's count reads what a layer's does
    n_chunks, _, last, edge, mtp = per_key(plan, LAYER_SET + (("micro_batch",) if eager else ()) + reads_mtp, edges)
    saved = saved + edge * tokens_mb * (inflight / n_chunks if eager else 1.0)
    # The multi-token-prediction modules run after the head, for each in-flight micro-batch of the last chunk.
    saved = saved + mtp * tokens_mb * inflight / n_chunks
    if eager:
        moe_layers, = per_key(plan, LAYER_SET, lambda p: sum(spec.is_moe(i) for i in p.rank_layers(spec, _rank(p, rank))))
        saved = saved + eager_step_bytes_per_token(spec, moe_layers) * tokens_mb * m
        buffers = buffers + np.where(last > 0, eager_loss_backward_bytes_per_token(spec) * tokens_mb, 0.0)
        # DDP (gradient_as_bucket_view, backend.parallel) keeps gradient buckets for the dense parameters across
        # steps; the no_sync micro-batches accumulate into fresh gradients that the synchronising backward then
        # copies into the buckets, so where it starts (the peak) both exist.
        ddp = (par.pipeline == 1) & (par.batch_shards > 1) & (m > 1)
        buffers = buffers + np.where(ddp, g_bytes * (rp.dense - rp.frozen), 0.0)

        def pipeline_buffers(p) -> float:
            chunks, total = p.parallel.rank_chunks(_rank(p, rank), p.schedule), p.parallel.chunks
            held = inflight_chunk_microbatches(p.schedule, p.parallel.pipeline, p.microbatches, p.parallel.virtual,
                                               _rank(p, rank)) / len(chunks)
            return sum(eager_pipeline_bytes_per_token(spec, act_e, c == 0, c == total - 1, p.microbatches, held)
                       for c in chunks)

        pipe, = per_key(plan, LAYER_SET + (m,), pipeline_buffers)
        buffers = buffers + np.where(par.pipeline > 1, pipe * tokens_mb, 0.0)
    out = dict(weights=weights, gradients=gradients, master=master, optimizer=states, activations=saved,
               buffers=buffers, host=host, inflight_microbatches=inflight)
    if is_arrays(plan):
        return MemoryBreakdown(**{k: np.broadcast_to(np.asarray(v, dtype=float), (len(plan),)) for k, v in out.items()})
    return MemoryBreakdown(**{k: float(v) for k, v in out.items()})
