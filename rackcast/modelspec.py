"""ModelSpec: a language model's architecture and its exact parameter and FLOP accounting.

One definition serves the simulator (what each op costs), the planner (what fits), and the trainer (what to build).
The spec covers the Marin 535B-A23B features (per-layer local/global attention with their own KV-head counts, a
sliding window, latent MoE, shared experts, dense layers, low-rank gated norms, short depthwise convolutions,
an attention output gate, untied embeddings), classic dense GPT models (LayerNorm, biases, GELU MLP, learned
positions, tied embeddings) and today's frontier MoE recipes: multi-head latent attention and multi-token prediction
(DeepSeek-V3), dense layers before the first MoE layer, node-limited routing, attention sinks and alternating
sliding-window / full attention (GPT-OSS), and the balancing method as its own field (quantile balancing (Marin),
aux-loss-free bias (DeepSeek-V3), auxiliary loss, none).

Counting rules (match the reference implementations parameter for parameter):
- every matrix is counted once; the attention K/V projections store `kv_heads_stored` heads on every layer when it
  is set (Marin scans one uniform block and slices the global layers' heads at run time), else the layer's own count;
- params_embedding = input embedding + learned positions + output head (when untied);
- params_active = everything else, with routed experts counted top_k of `experts` times, and without the
  multi-token-prediction modules (params_mtp; they are stored and trained, so params_total includes them, but the
  published totals and active counts of DeepSeek-V3 leave them out).
FLOPs (forward, per token) count 2 per multiply-add of every matrix product, 4 x heads x head_dim x context for
attention scores and values (2 x heads x (query/key head dim + value head dim) x context under latent attention),
and 2 x kernel x channels for each convolution; each multi-token-prediction module adds its projection, its block
and one more pass of the output head; elementwise work (norms, activations,
softmax) is not counted. Backward is twice forward. The MFU convention (see FlopsConvention) decides the attention
context: by default a local layer counts its window and a global layer the whole sequence, without causal halving.

    rackcast models show marin-535b-a23b     # prints the accounting of a preset
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Annotated, Literal

from rackcast.errors import RackcastError
from rackcast.bounds import Range, Text
from rackcast.model_parts import (  # noqa: F401 - the parts, re-exported with the spec
    AttentionSpec, Balancing, ConvSite, ConvSpec, FlopsConvention, LatentAttentionSpec, LayerAttention, MTPSpec,
    MoESpec, Recipe)


@dataclass(frozen=True)
class LayerInfo:
    """One row of the per-layer table."""

    index: int
    attention: Literal["local", "global"]
    context: int  # tokens a query attends to at most
    kv_heads: int
    mlp: Literal["moe", "dense"]
    params: int
    params_active: int
    flops_fwd: float  # per token, under the convention the table was made with


@dataclass(frozen=True)
class ModelSpec:
    name: Annotated[str, Text()]
    layers: Annotated[int, Range(1, 1024)]
    d_model: Annotated[int, Range(1, 2**17)]
    vocab: Annotated[int, Range(1, 2**22)]
    seq_len: Annotated[int, Range(1, 2**22)]
    attention: AttentionSpec
    # dense MLP intermediate width (dense models, and dense layers of MoE models)
    ffn: Annotated[int, Range(0, 2**20)] = 0
    activation: Literal["swiglu", "gelu"] = "swiglu"
    mlp_bias: bool = False
    moe: MoESpec | None = None
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    embed_norm: bool = False  # a norm (and gated norm, if any) right after the embedding
    # 0: none; r: after each norm, x * sigmoid(silu(x W_down) W_up), W_down: d x r
    gated_norm_rank: Annotated[int, Range(0, 2**17)] = 0
    conv: ConvSpec | None = None
    tied_embeddings: bool = False
    positional: Literal["rope", "learned", "none"] = "rope"
    rope_theta: Annotated[float, Range(0, 1e12, above=True)] = 10000.0
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3): 2 x head_dim gains per layer
    mtp: MTPSpec | None = None  # multi-token prediction modules
    family: Annotated[str, Text()] = ""
    description: str = ""
    recipe: Recipe | None = None  # the training recipe plans of this model carry (None: the optimizer defaults)

    def __post_init__(self):
        for name in ("layers", "d_model", "vocab", "seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.attention.window > self.seq_len:
            raise ValueError(f"attention.window={self.attention.window} exceeds seq_len={self.seq_len}")
        if self.moe is None and self.ffn <= 0:
            raise ValueError("ffn must be positive for a dense model (no moe block)")
        if self.moe is not None:
            bad = [i for i in self.moe.dense_layers if not 0 <= i < self.layers]
            if bad:
                raise ValueError(f"moe.dense_layers: layer {bad[0]} is outside 0..{self.layers - 1}")
            if self.moe.dense_layers and self.ffn <= 0:
                raise ValueError("ffn must be positive when moe.dense_layers is set")
            if self.moe.latent_dim > self.d_model:
                raise ValueError(f"moe.latent_dim={self.moe.latent_dim} exceeds d_model={self.d_model}")
            if self.moe.first_k_dense >= self.layers:
                raise ValueError(f"moe.first_k_dense={self.moe.first_k_dense} leaves no MoE layer of {self.layers}")
            if self.moe.first_k_dense and self.ffn <= 0:
                raise ValueError("ffn must be positive when moe.first_k_dense is set (the dense layers' width)")
        if self.conv is not None and self.attention.mla is not None and {"k", "v"} & set(self.conv.sites):
            raise ValueError("conv.sites k and v are not defined under latent attention")
        if self.gated_norm_rank < 0:
            raise ValueError("gated_norm_rank must be >= 0")

    # ---------------------------------------------------------------- layer structure
    def is_global(self, layer: int) -> bool:
        a = self.attention
        if a.pattern:
            return a.pattern[layer % len(a.pattern)] == "full"
        return a.window == 0 or (layer + 1) % a.global_every == 0 or layer == self.layers - 1

    def is_moe(self, layer: int) -> bool:
        m = self.moe
        return m is not None and layer >= m.first_k_dense and layer not in m.dense_layers

    def kv_heads(self, layer: int) -> int:
        """KV heads a layer attends with (its logical count)."""
        return self.attention.kv_heads_global if self.is_global(layer) else self.attention.kv_heads_local

    def kv_heads_stored(self, layer: int) -> int:
        return self.attention.kv_heads_stored or self.kv_heads(layer)

    def context(self, layer: int) -> int:
        return self.seq_len if self.is_global(layer) else min(self.attention.window, self.seq_len)

    @property
    def num_global_layers(self) -> int:
        return sum(self.is_global(i) for i in range(self.layers))

    @property
    def expert_input_dim(self) -> int:
        """Width of the rows the expert all-to-all carries (the latent width for a latent MoE)."""
        assert self.moe is not None
        return self.moe.latent_dim or self.d_model

    # ---------------------------------------------------------------- parameters
    def _norm_params(self, dim: int) -> int:
        return dim * (2 if self.norm == "layernorm" else 1)

    def _gated_norm_params(self) -> int:
        return 2 * self.d_model * self.gated_norm_rank

    def _mlp_params(self, d_in: int, width: int) -> int:
        matrices = 3 if self.activation == "swiglu" else 2
        bias = (width * (matrices - 1) + d_in) if self.mlp_bias else 0
        return matrices * d_in * width + bias

    def _latent_attention_params(self) -> dict[str, int]:
        """Q, KV and output projections of multi-head latent attention, with the latents' RMSNorm gains."""
        d, a, mla = self.d_model, self.attention, self.attention.mla
        q_out = a.heads * mla.qk_head_dim
        if mla.q_lora_rank:
            q = d * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * q_out
        else:
            q = d * q_out
        kv = (d * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank
              + mla.kv_lora_rank * a.heads * (mla.qk_nope_head_dim + mla.v_head_dim))
        return {"attn_q": q, "attn_kv": kv, "attn_o": a.heads * mla.v_head_dim * d}

    def _attention_matrix_params(self, layer: int) -> dict[str, int]:
        """Q, K/V and output projections of one layer, with their biases."""
        if self.attention.mla is not None:
            return self._latent_attention_params()
        d, a = self.d_model, self.attention
        q_dim, kv_dim = a.heads * a.head_dim, self.kv_heads_stored(layer) * a.head_dim
        return {
            "attn_q": d * q_dim + (q_dim if a.bias else 0),
            "attn_kv": 2 * (d * kv_dim + (kv_dim if a.bias else 0)),
            "attn_o": q_dim * d + (d if a.bias else 0),
        }

    def layer_param_breakdown(self, layer: int) -> dict[str, int]:
        """Parameters of one layer by component (routed experts are all of them, not top_k)."""
        d, a = self.d_model, self.attention
        parts = {
            "attn_norm": self._norm_params(d),
            "attn_gated_norm": self._gated_norm_params(),
            **self._attention_matrix_params(layer),
            "attn_qk_norm": 2 * a.head_dim if self.qk_norm else 0,
            "attn_sinks": a.heads if a.sinks else 0,
            "attn_gate": d * a.heads if a.output_gate else 0,
            "mlp_norm": self._norm_params(d),
            "mlp_gated_norm": self._gated_norm_params(),
            "conv": self._conv_params(layer),
        }
        if self.is_moe(layer):
            m = self.moe
            parts["router"] = d * m.experts + (m.experts if m.router_bias else 0)
            if m.latent_dim:
                parts["latent"] = 2 * d * m.latent_dim + m.latent_dim  # down, up, and the latent RMSNorm gain
            parts["experts"] = m.experts * self._mlp_params(self.expert_input_dim, m.expert_ffn)
            parts["shared_experts"] = m.shared_experts * self._mlp_params(d, m.shared_ffn)
        else:
            parts["dense_mlp"] = self._mlp_params(d, self.ffn)
        return {k: v for k, v in parts.items() if v}

    def _conv_params(self, layer: int) -> int:
        if self.conv is None:
            return 0
        widths = self._conv_widths(layer)
        return sum(self.conv.kernel * widths[s] for s in self.conv.sites)

    def _conv_widths(self, layer: int) -> dict[str, int]:
        kv_dim = self.kv_heads_stored(layer) * self.attention.head_dim
        return {"k": kv_dim, "v": kv_dim, "attn": self.d_model, "mlp": self.d_model}

    def layer_params(self, layer: int) -> int:
        return sum(self.layer_param_breakdown(layer).values())

    def layer_params_active(self, layer: int) -> int:
        total = self.layer_params(layer)
        if self.is_moe(layer):
            per_expert = self._mlp_params(self.expert_input_dim, self.moe.expert_ffn)
            total -= (self.moe.experts - self.moe.top_k) * per_expert
        return total

    def mtp_param_breakdown(self) -> dict[str, int]:
        """Parameters of the multi-token-prediction modules (all `depth` of them; embedding and head are shared)."""
        if self.mtp is None:
            return {}
        d, depth = self.d_model, self.mtp.depth
        parts = {
            "mtp_norms": depth * 3 * self._norm_params(d),  # hidden-state and embedding norms, final norm
            "mtp_proj": depth * 2 * d * d,
            "mtp_block": depth * self.layer_params(self.layers - 1),
        }
        return {k: v for k, v in parts.items() if v}

    @cached_property
    def params_mtp(self) -> int:
        return sum(self.mtp_param_breakdown().values())

    def top_param_breakdown(self) -> dict[str, int]:
        """Parameters outside the layers (the multi-token-prediction modules included)."""
        d = self.d_model
        parts = {
            "embedding": self.vocab * d,
            "positions": self.seq_len * d if self.positional == "learned" else 0,
            "head": 0 if self.tied_embeddings else d * self.vocab,
            "embed_norm": self._norm_params(d) if self.embed_norm else 0,
            "embed_gated_norm": self._gated_norm_params() if self.embed_norm else 0,
            "final_norm": self._norm_params(d),
            "final_gated_norm": self._gated_norm_params(),
            **self.mtp_param_breakdown(),
        }
        return {k: v for k, v in parts.items() if v}

    @cached_property
    def params_embedding(self) -> int:
        top = self.top_param_breakdown()
        return top.get("embedding", 0) + top.get("positions", 0) + top.get("head", 0)

    @cached_property
    def params_total(self) -> int:
        return sum(self.layer_params(i) for i in range(self.layers)) + sum(self.top_param_breakdown().values())

    @cached_property
    def params_active(self) -> int:
        """Parameters used per token, excluding the embedding, the output head and the multi-token prediction."""
        top_other = sum(self.top_param_breakdown().values()) - self.params_embedding - self.params_mtp
        return sum(self.layer_params_active(i) for i in range(self.layers)) + top_other

    # ---------------------------------------------------------------- FLOPs
    def attention_context(self, layer: int, convention: FlopsConvention) -> float:
        """Average keys a query is charged for under `convention`."""
        s = self.seq_len
        w = s if (self.is_global(layer) or convention.window == "sequence") else self.context(layer)
        if convention.attention == "full":
            return float(w)
        # Causal mask: query i (0-based) sees min(i + 1, w) keys; average over the sequence.
        return (w * (w + 1) / 2 + (s - w) * w) / s

    def layer_flops_breakdown(self, layer: int, convention: FlopsConvention = FlopsConvention()) -> dict[str, float]:
        """Forward FLOPs per token of one layer by component."""
        d, a = self.d_model, self.attention
        if a.mla is not None:
            # The latent norms' gains are not matrix products; every other parameter is one multiply-add.
            mla = a.mla
            qkvo = sum(self._latent_attention_params().values()) - mla.kv_lora_rank - mla.q_lora_rank
        else:
            q_dim, kv_dim = a.heads * a.head_dim, self.kv_heads_stored(layer) * a.head_dim
            qkvo = 2 * d * q_dim + 2 * d * kv_dim
        parts = {
            "attn_gated_norm": 2.0 * self._gated_norm_params(),
            "attn_qkvo": 2.0 * qkvo,
            # Scores: 2 x heads x key width per key; values: 2 x heads x value width per key.
            "attn_scores_values": 2.0 * a.heads * (a.head_dim + a.v_head_dim) * self.attention_context(layer,
                                                                                                        convention),
            "attn_gate": 2.0 * d * a.heads if a.output_gate else 0.0,
            "mlp_gated_norm": 2.0 * self._gated_norm_params(),
            "conv": 2.0 * self._conv_params(layer),
        }
        matrices = 3 if self.activation == "swiglu" else 2
        if self.is_moe(layer):
            m = self.moe
            parts["router"] = 2.0 * d * m.experts
            if m.latent_dim:
                parts["latent"] = 2.0 * 2 * d * m.latent_dim
            parts["experts"] = 2.0 * m.top_k * matrices * self.expert_input_dim * m.expert_ffn
            parts["shared_experts"] = 2.0 * m.shared_experts * matrices * d * m.shared_ffn
        else:
            parts["dense_mlp"] = 2.0 * matrices * d * self.ffn
        return {k: v for k, v in parts.items() if v}

    def layer_flops_fwd(self, layer: int, convention: FlopsConvention = FlopsConvention()) -> float:
        return sum(self.layer_flops_breakdown(layer, convention).values())

    def embed_flops_fwd(self) -> float:
        """The embedding end's work per token: its gated norm when the model has one (the lookup itself is a
        gather, no FLOPs). Part of head_flops_fwd, which counts both ends for the model's FLOPs."""
        return 2.0 * self._gated_norm_params() if self.embed_norm else 0.0

    def head_flops_fwd(self, convention: FlopsConvention = FlopsConvention()) -> float:
        """Output head (logits) plus the final and embedding gated norms (embed_flops_fwd is the latter)."""
        gated = 2.0 * self._gated_norm_params() * (2 if self.embed_norm else 1)
        return (2.0 * self.d_model * self.vocab if convention.head else 0.0) + gated

    def mtp_flops_fwd(self, convention: FlopsConvention = FlopsConvention()) -> float:
        """All multi-token-prediction modules per token: projection, block and one more output-head pass each."""
        if self.mtp is None:
            return 0.0
        d = self.d_model
        head = 2.0 * d * self.vocab if convention.head else 0.0
        return self.mtp.depth * (2.0 * 2 * d * d + self.layer_flops_fwd(self.layers - 1, convention) + head)

    def tail_flops_fwd(self, convention: FlopsConvention = FlopsConvention()) -> float:
        """What the stage holding the last layer runs after it, per token: the output head and final norm
        (head_flops_fwd without the embedding end) and the multi-token-prediction modules."""
        return self.head_flops_fwd(convention) - self.embed_flops_fwd() + self.mtp_flops_fwd(convention)

    def flops_per_token_fwd(self, convention: FlopsConvention = FlopsConvention()) -> float:
        layers = sum(self.layer_flops_fwd(i, convention) for i in range(self.layers))
        return layers + self.head_flops_fwd(convention) + self.mtp_flops_fwd(convention)

    def flops_per_token_train(self, convention: FlopsConvention = FlopsConvention()) -> float:
        """Forward plus backward (backward = 2 x forward); recomputation is not model FLOPs."""
        return 3.0 * self.flops_per_token_fwd(convention)

    def layer_table(self, convention: FlopsConvention = FlopsConvention()) -> list[LayerInfo]:
        return [
            LayerInfo(
                index=i,
                attention="global" if self.is_global(i) else "local",
                context=self.context(i),
                kv_heads=self.kv_heads(i),
                mlp="moe" if self.is_moe(i) else "dense",
                params=self.layer_params(i),
                params_active=self.layer_params_active(i),
                flops_fwd=self.layer_flops_fwd(i, convention),
            )
            for i in range(self.layers)
        ]

    def summary(self, convention: FlopsConvention = FlopsConvention()) -> dict:
        """The accounting as plain data (the `models show --json` output)."""
        return {
            "name": self.name,
            "family": self.family,
            "params_total": self.params_total,
            "params_active": self.params_active,
            "params_embedding": self.params_embedding,
            "params_mtp": self.params_mtp,
            "flops_per_token_fwd": self.flops_per_token_fwd(convention),
            "flops_per_token_train": self.flops_per_token_train(convention),
            "flops_convention": convention.label,
            "layers": [vars(row) for row in self.layer_table(convention)],
        }

