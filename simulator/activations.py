"""Activation bytes per token: what a layer, the embedding and the head save for backward, in two modes.

`activations="fused"` (the default; the planner, the estimators and every published figure use it) is the count a
production trainer with fused kernels keeps, component by component. For a dense GPT layer with materialised
attention and dropout it is Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", eq. 1-5): s*b*h*(34 + 5*a*s/h) bytes without tensor parallelism, s*b*h*(10 + 24/t + 5*a*s/(h*t)) with
tensor parallelism t, and s*b*h/t*(34 + 5*a*s/h) with sequence parallelism too. Beyond the dense GPT layer it covers
what each component's backward reads (gated norms, exclusive attention, the output gate, convolutions, latent MoE
with its routed copies), at the minimum a fused implementation keeps, and outside the layers two d-wide tensors.

`activations="eager"` is what rackcast's own PyTorch backend (backend/layers.py, attention.py, moe.py, model.py)
saves for backward when run eagerly, op by op, as torch.autograd.graph.saved_tensors_hooks counts it (unique
storages; tests/test_activations.py checks it against one backend layer). On top of the fused count it has the
tensors that count leaves out (the gated norm's sigmoid gate, the q/k norms' inputs and fp32 statistics, the output
gate's other input, per routed copy its combine weight and int64 token indices, the embedding and final norms and
the loss) and what eager PyTorch adds: RMSNorm keeps its normalised output, ShortConv a shifted copy of its input per
tap, grouped-query attention K and V repeated to every query head (a local layer's blocked windows of them, and SDPA
an fp32 copy of the band mask),
exclusive attention three per-head scalars, the output gate both sigmoid and 2*sigmoid, SwiGLU a fourth hidden
tensor, the router its top-(k+1) indices and the normalisation of the combine weights, the loss a log-softmax and a
copy of the logits (both fp32). `eager_*` below also gives what the backend holds besides saved tensors: the loss
backward's logits-sized temporaries, the quantile balancer's router margins, the token ids and targets, and the
pipeline stages' receive buffers and cached outputs (simulator.memory.memory_breakdown adds them). The eager count
follows the elements the backend saves at `dtype` bytes each (fp32 on the CPU trainer); under bf16 autocast the
fp32 copies autocast and the fp32 norms make are not counted.

    from rackcast.simulator.activations import layer_activation_bytes_per_token
    layer_activation_bytes_per_token(spec, 0, plan, dtype="fp32", activations="eager")
"""

from __future__ import annotations

from typing import Literal

from rackcast.modelspec import ModelSpec
from rackcast.plan import Plan
from rackcast.simulator.op_counts import rotary_dims, window_query_block

Activations = Literal["fused", "eager"]
MODES = ("fused", "eager")

BYTES = {"bf16": 2, "fp8": 1, "fp32": 4}
FP32 = 4
MASK_BYTES = 1  # dropout masks and boolean masks are stored as one byte per element
INDEX_BYTES = 8  # token and expert indices are int64 (torch.argsort's, torch.topk's output)


def activation_bytes(dtype: str | None = None) -> int:
    """Bytes per saved activation element: `dtype` when given, else bf16 (also under fp8, which quantises inputs
    to the matmuls on the fly)."""
    return BYTES[dtype or "bf16"]


def check_mode(activations: str) -> str:
    if activations not in MODES:
        raise ValueError(f"activations must be one of {MODES}, got {activations!r}")
    return activations


def has_qk_norm(spec: ModelSpec) -> bool:
    """Whether attention RMS-normalises q and k: Marin's parameter-free q/k norm, which the backend applies to every
    RMSNorm model (backend.model.build_model's default; ModelSpec has no field for it)."""
    return spec.norm == "rmsnorm"


def _hidden_tensors(spec: ModelSpec, eager: bool) -> int:
    """d_ff-wide tensors one MLP keeps: SwiGLU keeps gate, up and act (fused) and eagerly the silu's output and the
    product too (backend Mlp / GroupedExperts: silu(gate) * up: silu reads gate, the product reads silu(gate) and
    up, W_down reads the product); GELU its input and output either way."""
    if spec.activation != "swiglu":
        return 2
    return 4 if eager else 3


# ------------------------------------------------------------------------------------------------------- norms
def pre_norm_bytes_per_token(spec: ModelSpec, e: float, sp: int = 1, activations: Activations = "fused") -> float:
    """What one pre-norm (backend.layers.Norm) saves per token. Fused: its input, and with the low-rank gated norm
    y = x * g, g = sigmoid(silu(x W_down) W_up), also x and the rank-r hidden before and after the silu (the norm's
    own per-token statistic, one fp32, is neglected, as Korthikanti et al. do). Eager adds the gate g (the product's
    backward needs g for dx, sigmoid's backward reads its output), the statistic and the normalised output RMSNorm
    keeps (LayerNorm's native kernel keeps its mean and rstd instead)."""
    d, r = spec.d_model, spec.gated_norm_rank
    if check_mode(activations) == "fused":
        return e * d / sp + (e * (d + 2 * r) / sp if r else 0.0)
    if spec.norm == "layernorm":
        total = e * d / sp + 2 * FP32  # native_layer_norm: input, mean, rstd
    else:  # RMSNorm.forward: input (read by pow and the product), rsqrt statistic, normalised output (gain's mul)
        total = e * d / sp + FP32 + e * d / sp
    if r:  # GatedNorm: its input (the norm's output: product, W_down), the sigmoid gate, silu input, W_up input
        total += e * (2 * d + 2 * r) / sp
    return total


# ------------------------------------------------------------------------------------------------------- layers
def conv_bytes_per_token(spec: ModelSpec, width: float, e: float, activations: Activations = "fused") -> float:
    """One causal ShortConv of `width` channels. Fused: its input. Eager: the input (read by x * w[0]) and, per
    further tap `lag`, the shifted copy F.pad(x)[:, :seq] (its storage keeps seq + lag rows) that shifted * w[lag]
    reads."""
    if check_mode(activations) == "fused":
        return e * width
    s, taps = spec.seq_len, min(spec.conv.kernel, spec.seq_len)
    return e * width * sum((s + lag) / s for lag in range(taps))


def latent_attention_bytes_per_token(spec: ModelSpec, plan: Plan, e: float, activations: Activations = "fused") -> float:
    """What one multi-head latent attention (attention.mla) saves per token, its input included; the latents are
    whole on every tensor rank (the down-projections are replicated, as in Megatron-Core's MLA), the per-head
    tensors split `tensor` ways. Fused: the input (read by W_qa and W_kva), the query latent (its RMSNorm's input)
    and its normalised copy (W_qb's input), the W_kva output [c_kv | k_rope] (the KV norm's input, of which the
    decoupled RoPE key is the tail) and the normalised c_kv (W_kvb's input), the expanded Q and K (heads x
    (nope + rope)) and V (heads x v_head_dim), flash attention's fp32 log-sum-exp per head, and the output
    projection's input (heads x v_head_dim). Eager (backend.latent_attention.LatentAttention.forward run op by op):
    each latent RMSNorm also keeps its fp32 statistic and normalised output. SDPA's flash kernel needs one head
    width for Q, K and V: then it keeps Q, K, V (a view of the W_kvb output [k_nope | v], kept whole), its output (O's
    input: the reshape is a view) and log-sum-exp; when qk_head_dim != v_head_dim (DeepSeek's 192 / 128) PyTorch's
    CPU SDPA takes its math path, which keeps the scaled Q, K and V as copies and the softmax probabilities (heads x
    seq_len per token, the causal mask applied to the full square), and O its own input."""
    a, d, mla = spec.attention, spec.d_model, spec.attention.mla
    t = plan.parallel.tensor
    sp = t if plan.parallel.sequence_parallel else 1
    qk, v = a.heads * mla.qk_head_dim / t, a.heads * mla.v_head_dim / t
    eager = check_mode(activations) == "eager"
    norm_copies, stat = (2, FP32) if eager else (1, 0.0)  # per latent norm: input, [statistic, normalised], output
    total = e * d / sp
    if mla.q_lora_rank:
        total += e * mla.q_lora_rank * (1 + norm_copies) + stat
    total += e * (mla.kv_lora_rank + mla.qk_rope_head_dim) + e * mla.kv_lora_rank * norm_copies + stat
    if eager and mla.qk_head_dim != mla.v_head_dim:  # SDPA's math path: Q, K, V copies, the probabilities
        return total + e * (2 * qk + v) + e * a.heads * spec.seq_len / t + e * v
    values = a.heads * (mla.qk_nope_head_dim + mla.v_head_dim) / t if eager else v
    total += e * 2 * qk + e * values  # SDPA's Q, K, V
    return total + FP32 * a.heads / t + e * v  # log-sum-exp; the output (O's input)


def _attention_eager(spec: ModelSpec, layer: int, plan: Plan, e: float) -> float:
    """backend.attention.Attention.forward's saved tensors per token (its input included), without the conv sites."""
    a, d = spec.attention, spec.d_model
    if a.mla is not None:
        return latent_attention_bytes_per_token(spec, plan, e, "eager")
    t = plan.parallel.tensor
    sp = t if plan.parallel.sequence_parallel else 1
    q_dim = a.heads * a.head_dim
    total = e * d / sp  # x, read by the Q, K, V projections and the output gate's W_g
    kv_dim = spec.kv_heads_stored(layer) * a.head_dim
    k_conv = spec.conv is not None and "k" in spec.conv.sites
    if has_qk_norm(spec):
        # rms_norm's inputs (pow and the product read them): Q, a view of the fused Q/K/V projection
        # (backend.layers.FusedLinear), keeps all of it; K's is that view too, or its convolution's output (the
        # slice to the layer's heads is a view); and one fp32 rsqrt per head.
        total += e * (q_dim + 2 * kv_dim + (kv_dim if k_conv else 0)) / t
        total += FP32 * (a.heads + spec.kv_heads(layer)) / t
    if not spec.is_global(layer) and spec.context(layer) < spec.seq_len:
        # backend.attention.banded_attention: SDPA over query blocks keeps the blocked query copy, the keys and
        # values left-padded by window - 1 (each block's window + block - 1 of them is a strided view into those),
        # its output and log-sum-exp, and its fp32 copy of the boolean band mask ([blocks, block, span] per call of
        # micro_batch sequences); the output is copied back to [B, S, H, hd] for what follows. Sequences pad to
        # whole blocks.
        window, s = spec.context(layer), spec.seq_len
        block = window_query_block(window)
        padded = -(-s // block) * block / s
        span = window + block - 1
        total += e * q_dim / t * (padded + 2 * (padded + (window - 1) / s))
        total += (e * q_dim / t + FP32 * a.heads / t) * padded + e * q_dim / t
        total += FP32 * padded * span / plan.batch.micro_batch
        if a.exclusive:
            total += e * q_dim / t
    else:
        total += 3 * e * q_dim / t  # SDPA's query, key and value: K and V repeat_interleave'd to every query head
        total += e * q_dim / t + FP32 * a.heads / t  # SDPA's output and log-sum-exp
        roped = spec.positional == "rope" and (not spec.is_global(layer) or a.rope_on_global) and \
            rotary_dims(a.head_dim, a.rope_fraction) > 0
        if not has_qk_norm(spec) and not spec.qk_norm and not roped and a.qk_multiplier == 1.0:
            total += 2 * e * kv_dim / t  # SDPA's query is a view of the fused projection: K and V parts kept too
    if a.exclusive:  # y - (y.v / (v.v + eps)) v: the dot, the denominator and their ratio per head; the output
        total += 3 * e * a.heads / t + e * q_dim / t
    if a.output_gate:  # sigmoid(x W_g) (sigmoid's backward) and 2*sigmoid (the product's); the product (O's input)
        total += 2 * e * a.heads / t + e * q_dim / t
    return total  # without XSA and gate, O reads SDPA's output (stored [B, S, H, hd], the reshape is a view)


def _moe_eager(spec: ModelSpec, plan: Plan, e: float) -> float:
    """backend.moe.MoE.forward's saved tensors per token (its input included)."""
    m, d, x = spec.moe, spec.d_model, spec.expert_input_dim
    sp = plan.parallel.tensor if plan.parallel.sequence_parallel else 1
    k = m.top_k
    total = e * d / sp  # input: router, W_down (latent) and the shared experts read it
    routed = FP32 * m.experts  # router logits (fp32), read by gather's backward
    routed += INDEX_BYTES * (k + 1)  # topk(k + 1) indices; gather reads the first k (a view)
    routed += FP32 * (k + 2)  # sigmoid of the chosen logits; 1 / their sum and combine_sum / their sum
    if m.latent_dim:  # latent_norm (RMSNorm): input, statistic, normalised output; W_up's input
        routed += e * m.latent_dim + FP32 + e * m.latent_dim + e * m.latent_dim
    # Per routed copy: its token index (index_select), the gathered row (the experts' input), the expert's hidden
    # tensors, its output row (torch.cat), the sort order (weights[order]), its combine weight, the weighted row
    # (index_add_'s source) and index_add_'s token index.
    per_copy = INDEX_BYTES + e * x + e * m.expert_ffn * _hidden_tensors(spec, True) + e * x
    per_copy += INDEX_BYTES + e + e * x + INDEX_BYTES
    if plan.parallel.expert > 1:
        # backend.expert_parallel: the received rows regrouped by expert are the experts' input (the sender's
        # gathered rows go to the all-to-all, which saves nothing), the returned rows the weighted product's; on top
        # the regrouping index and the experts' output rows, which index_copy's backward keeps.
        per_copy += INDEX_BYTES + e * x
    routed += k * per_copy
    total += routed / sp  # the router and routed experts run on 1/sp of the tokens (routed_tokens_per_microbatch)
    total += m.shared_experts * e * m.shared_ffn / plan.parallel.tensor * _hidden_tensors(spec, True)
    return total


def _mlp_block_fused(spec: ModelSpec, layer: int, plan: Plan, e: float) -> float:
    """The fused count of a layer's MLP block: its pre-norm, the MLP or MoE, its dropout mask."""
    par = plan.parallel
    t = par.tensor
    sp = t if par.sequence_parallel else 1
    d = spec.d_model
    total = pre_norm_bytes_per_token(spec, e, sp)
    if spec.is_moe(layer):
        m = spec.moe
        x = spec.expert_input_dim
        et = par.expert_tensor
        total += e * d / sp  # MoE input (router, latent projection, shared experts read it)
        routed = FP32 * m.experts  # router logits in fp32
        if m.latent_dim:
            routed += 2 * e * m.latent_dim  # latent norm input and W_up input
        # Per routed copy: its input and output rows on each of the et expert-tensor ranks, and the hidden
        # activations (gate, up, act) of width expert_ffn / et on each of them.
        per_copy = et * e * x * 2 + e * m.expert_ffn * _hidden_tensors(spec, False)
        routed += m.top_k * per_copy
        total += routed / sp  # the router and routed experts run on 1/sp of the tokens (routed_tokens_per_microbatch)
        total += m.shared_experts * e * m.shared_ffn / t * _hidden_tensors(spec, False)
    else:
        total += e * d / sp  # MLP input
        total += e * spec.ffn / t * _hidden_tensors(spec, False)  # hidden: gate/up/act (SwiGLU) or GELU in/out
    total += MASK_BYTES * d / sp if plan.dropout else 0.0
    return total


def layer_activation_bytes_per_token(spec: ModelSpec, layer: int, plan: Plan, dtype: str | None = None,
                                     activations: Activations = "fused") -> float:
    """Bytes one layer saves for backward per token of a micro-batch on one rank (no recomputation); activations
    in `dtype` when given, else bf16; `activations`: "fused" or "eager" (see the module docstring)."""
    par = plan.parallel
    t = par.tensor
    sp = t if par.sequence_parallel else 1  # sequence parallelism shards the d-wide tensors too
    e = activation_bytes(dtype)
    a, d = spec.attention, spec.d_model
    q_dim, kv_dim = a.heads * a.head_dim, spec.kv_heads_stored(layer) * a.head_dim
    widths = {"k": kv_dim / t, "v": kv_dim / t, "attn": d / sp, "mlp": d / sp}
    convs = sum(conv_bytes_per_token(spec, widths[s], e, activations) for s in spec.conv.sites) if spec.conv else 0.0
    if check_mode(activations) == "eager":
        total = 2 * pre_norm_bytes_per_token(spec, e, sp, "eager") + _attention_eager(spec, layer, plan, e) + convs
        if spec.is_moe(layer):
            return total + _moe_eager(spec, plan, e)
        return total + e * d / sp + e * spec.ffn / t * _hidden_tensors(spec, True)  # MLP input, hidden
    # Attention block.
    total = pre_norm_bytes_per_token(spec, e, sp)
    if a.mla is not None:
        total += latent_attention_bytes_per_token(spec, plan, e)
        if plan.attention_kernel == "materialized":  # the softmax (and dropout) replace flash's log-sum-exp
            total += attention_core_bytes_per_token(spec, layer, plan, dtype) - FP32 * a.heads / t
        total += convs + (MASK_BYTES * d / sp if plan.dropout else 0.0)
        return total + _mlp_block_fused(spec, layer, plan, e)
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
        total += e * a.heads / t  # the per-head gate
    total += e * q_dim / t  # output projection input
    total += MASK_BYTES * d / sp if plan.dropout else 0.0
    total += convs
    return total + _mlp_block_fused(spec, layer, plan, e)


def attention_module_bytes_per_token(spec: ModelSpec, layer: int, plan: Plan, dtype: str | None = None) -> float:
    """What the attention module saves per token when run eagerly (_attention_eager; its input included)."""
    return _attention_eager(spec, layer, plan, activation_bytes(dtype))


def attention_core_bytes_per_token(spec: ModelSpec, layer: int, plan: Plan, dtype: str | None = None) -> float:
    """The part selective recomputation avoids storing (the materialised attention core)."""
    if plan.attention_kernel != "materialized":
        return 0.0
    e = activation_bytes(dtype)
    return (e + MASK_BYTES * plan.dropout + e * plan.dropout) * spec.attention.heads * spec.context(layer) / \
        plan.parallel.tensor


# ------------------------------------------------------------------------------------------------------- edges
def _target_fraction(spec: ModelSpec) -> float:
    """Share of positions with a next-token target (backend.train._targets: the last position's is -100)."""
    return (spec.seq_len - 1) / spec.seq_len


def edge_activation_bytes_per_token(spec: ModelSpec, plan: Plan, first: bool = True, last: bool = True,
                                    dtype: str | None = None, activations: Activations = "fused") -> float:
    """Bytes saved per token outside the layers. Fused: two d-wide tensors wherever the stage is (the embedding
    output and the head input; Korthikanti et al. count the final norm's input and the head's input, 2sbh each in
    16 bit, plus logits that a fused cross-entropy does not keep). Eager, by a stage holding the embedding (`first`)
    and/or the head (`last`): the embedding norm when the model has one (without it the embedding's output is the
    first layer's input, counted there, and its backward needs only the token ids), the final norm, the head's
    input, and backend.model.next_token_loss's saved tensors (fp32 whatever the activation dtype)."""
    e = activation_bytes(dtype)
    if check_mode(activations) == "fused":
        return 2 * e * spec.d_model
    total = pre_norm_bytes_per_token(spec, e, activations="eager") if first and spec.embed_norm else 0.0
    if first and spec.positional == "learned":  # the position ids (int64 [seq]) per micro-batch, for nn.Embedding
        total += INDEX_BYTES / plan.batch.micro_batch
    if last:
        total += pre_norm_bytes_per_token(spec, e, activations="eager") + e * spec.d_model  # final norm, head input
        valid = _target_fraction(spec)
        total += FP32 * spec.vocab  # cross_entropy's log_softmax output (its backward and nll_loss read it)
        total += FP32 * spec.vocab * valid  # z-loss: flat[valid], the logits with a target, copied for logsumexp
        total += FP32 * valid + MASK_BYTES  # logsumexp's output (read by pow too); the boolean `valid` mask
    return total


def mtp_activation_bytes_per_token(spec: ModelSpec, plan: Plan, dtype: str | None = None,
                                   activations: Activations = "fused") -> float:
    """Bytes the multi-token-prediction modules (spec.mtp, on the stage holding the head) save per token of a
    micro-batch, as backend.mtp runs them: module k (1..depth) on the seq_len - k positions that have a target k + 1
    ahead. Per module: the two norms' inputs (the hidden state's is already kept, as the main final norm's or the
    previous module's; the embedding's is new), the projection's input (2 d_model), one layer shaped like the last
    (layer_activation_bytes_per_token), the final norm's input and the head's input; eager adds the norms' fp32
    statistics and normalised outputs (pre_norm_bytes_per_token) and the loss: log_softmax's fp32 output over the
    vocabulary and the int64 targets (the sliced targets are a copy)."""
    if spec.mtp is None:
        return 0.0
    e, d, s = activation_bytes(dtype), spec.d_model, spec.seq_len
    eager = check_mode(activations) == "eager"
    norm = pre_norm_bytes_per_token(spec, e, activations=activations)
    hidden_norm = norm - e * d  # its input is kept already
    block = layer_activation_bytes_per_token(spec, spec.layers - 1, plan, dtype, activations)
    module = hidden_norm + norm + 2 * e * d + block + norm + e * d
    loss = FP32 * spec.vocab + INDEX_BYTES if eager else 0.0
    return sum(module * (s - k) / s + loss * (s - k - 1) / s for k in range(1, spec.mtp.depth + 1))


def eager_loss_backward_bytes_per_token(spec: ModelSpec) -> float:
    """Transient on top of the saved tensors where the eager backend peaks, in the z-loss's logsumexp backward:
    grad * (x - lse).exp() holds x - lse, its exp and the product at once, three fp32 [positions with a target,
    vocab] tensors (the last stage, per token of the micro-batch being differentiated)."""
    return 3 * FP32 * spec.vocab * _target_fraction(spec)


def eager_step_bytes_per_token(spec: ModelSpec, moe_layers: int) -> float:
    """What the eager backend holds per token of every micro-batch of the step, from its forward to the optimizer
    step: the token ids and targets (int64; backend.train) and, per MoE layer under quantile balancing, the router
    margins s - a_t (fp32 [tokens, experts]) that the quantile balancer reads after the optimizer
    (backend.moe.MoE.route, backend.balancing)."""
    quantile = spec.moe is not None and spec.moe.balance_method == "quantile"
    margins = FP32 * spec.moe.experts * moe_layers if quantile else 0.0
    return 2 * INDEX_BYTES + margins


def eager_pipeline_bytes_per_token(spec: ModelSpec, e: float, first: bool, last: bool, microbatches: int,
                                   inflight: float) -> float:
    """What one pipeline chunk of the eager backend holds besides saved tensors (torch.distributed.pipelining
    PipelineStage), per token of a micro-batch: a non-first chunk one receive buffer per micro-batch, allocated once
    (the in-flight ones are its first layer's saved input, counted there); a non-last chunk one gradient receive
    buffer per micro-batch and, per in-flight micro-batch, its output in fwd_cache (the last layer's output, which
    no op of the chunk saves); the last chunk the logits of every micro-batch of the step (output_chunks: the
    schedule's step returns them unless return_outputs=False, which backend.pipeline does not pass)."""
    d = spec.d_model
    total = e * d * max(0.0, microbatches - inflight) if not first else 0.0
    if not last:
        total += e * d * (microbatches + inflight)
    else:
        total += e * spec.vocab * microbatches
    return total
