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
from typing import Literal

from rackcast.errors import RackcastError

ConvSite = Literal["k", "v", "attn", "mlp"]
# Attention of one layer in an explicit per-layer pattern: "full" attends to the whole causal context, "window" to
# the last `attention.window` tokens (a sliding window: GPT-3's and GPT-OSS's "locally banded" attention).
LayerAttention = Literal["full", "window"]
# How the router is kept balanced: Marin's quantile balancing (sets a bias each step from a histogram of router
# margins), DeepSeek-V3's auxiliary-loss-free bias (nudges a bias by the sign of each expert's load error), an
# auxiliary load-balancing loss (Switch/GShard style), or nothing.
Balancing = Literal["quantile", "aux_free_bias", "aux_loss", "none"]


@dataclass(frozen=True)
class LatentAttentionSpec:
    """Multi-head latent attention (DeepSeek-V2/V3): queries and keys/values pass through low-rank latents, and
    each query/key head has `qk_nope_head_dim` dims without RoPE plus `qk_rope_head_dim` with it (the RoPE key part
    is one shared head, projected from the input beside the KV latent). Values have `v_head_dim` per head.

        q = W_qb RMSNorm(W_qa x)            W_qa: d x q_lora_rank, W_qb: q_lora_rank x heads (nope + rope)
        [c_kv, k_rope] = W_kva x            W_kva: d x (kv_lora_rank + rope)
        [k_nope, v] = W_kvb RMSNorm(c_kv)   W_kvb: kv_lora_rank x heads (nope + v_head_dim)
        out = W_o attn                      W_o: heads v_head_dim x d
    """

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0  # 0: queries projected at full rank (DeepSeek-V2-Lite)

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"attention.mla.{name} must be positive, got {getattr(self, name)}")
        if self.q_lora_rank < 0:
            raise ValueError(f"attention.mla.q_lora_rank must be >= 0, got {self.q_lora_rank}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class AttentionSpec:
    heads: int
    head_dim: int
    kv_heads_local: int
    kv_heads_global: int
    kv_heads_stored: int = 0  # 0: each layer stores its own KV heads; >0: every layer stores this many
    window: int = 0  # sliding window of local layers, in tokens; 0 means every layer attends globally
    global_every: int = 1  # layer i is global when (i + 1) % global_every == 0; the last layer always is
    output_gate: bool = False  # per-head 2*sigmoid(x W_g) output gate, W_g: d_model x heads
    exclusive: bool = False  # exclusive self-attention (removes each head output's component along its value)
    rope_fraction: float = 1.0  # fraction of each head's dims rotated on local layers
    rope_on_global: bool = True
    qk_multiplier: float = 1.0
    bias: bool = False  # biases on Q, K, V and output projections (GPT/Megatron style)
    mla: LatentAttentionSpec | None = None  # multi-head latent attention; head_dim is then the query/key head width
    sinks: bool = False  # a learned sink logit per head joins every softmax (GPT-OSS): `heads` parameters per layer
    # Explicit per-layer attention, repeated over the layers (layer i uses pattern[i % len]); empty: the
    # window / global_every rule. GPT-OSS: [window, full].
    pattern: list[LayerAttention] = field(default_factory=list)

    def __post_init__(self):
        for name in ("heads", "head_dim", "kv_heads_local", "kv_heads_global", "global_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"attention.{name} must be positive, got {getattr(self, name)}")
        for name in ("kv_heads_local", "kv_heads_global"):
            if self.heads % getattr(self, name):
                raise ValueError(f"attention.{name}={getattr(self, name)} must divide heads={self.heads}")
        if self.kv_heads_stored and self.kv_heads_stored < max(self.kv_heads_local, self.kv_heads_global):
            raise ValueError("attention.kv_heads_stored must be at least the larger of the local and global counts")
        if self.window < 0:
            raise ValueError(f"attention.window must be >= 0, got {self.window}")
        if not 0.0 <= self.rope_fraction <= 1.0:
            raise ValueError(f"attention.rope_fraction must lie in [0, 1], got {self.rope_fraction}")
        if self.pattern:
            if self.global_every != 1:
                raise ValueError("attention.pattern and attention.global_every are two ways to say the same thing; "
                                 "give one")
            if "window" in self.pattern and self.window <= 0:
                raise ValueError("attention.pattern has window layers, so attention.window must be positive")
        if self.mla is not None:
            if self.head_dim != self.mla.qk_head_dim:
                raise ValueError(f"attention.head_dim={self.head_dim} must equal mla.qk_nope_head_dim + "
                                 f"mla.qk_rope_head_dim = {self.mla.qk_head_dim} under latent attention")
            if self.kv_heads_local != self.heads or self.kv_heads_global != self.heads or self.kv_heads_stored:
                raise ValueError("latent attention expands keys and values to every head: kv_heads_local and "
                                 "kv_heads_global must equal heads, and kv_heads_stored stay 0")
            if self.bias or self.output_gate or self.exclusive:
                raise ValueError("latent attention is modelled without bias, output_gate and exclusive")

    @property
    def v_head_dim(self) -> int:
        """Width of one head's values (and of the attention output per head)."""
        return self.mla.v_head_dim if self.mla is not None else self.head_dim


@dataclass(frozen=True)
class MoESpec:
    experts: int
    top_k: int
    expert_ffn: int  # intermediate width of each routed SwiGLU expert
    latent_dim: int = 0  # 0: experts see d_model-wide tokens; >0: latent MoE (down-project, RMSNorm, experts, up)
    shared_experts: int = 0
    shared_ffn: int = 0  # intermediate width of each shared SwiGLU expert (full width input)
    dense_layers: list[int] = field(default_factory=list)  # layers with a dense MLP (width ModelSpec.ffn) instead
    router_bias: bool = True  # a per-expert bias on the router logits (a stored parameter)
    # Quantile balancing sets that bias every step from a histogram of router margins, this many bins per expert,
    # pooled over the ranks that see different tokens (Marin's qb_hist_bins; 1,000 by default).
    balance_bins: int = 1000
    # How the router is balanced (see Balancing); quantile and aux_free_bias set router_bias (no gradient). Unset:
    # quantile balancing when the router has a bias (Marin), else none, as before the field existed.
    balancing: Balancing | None = None
    aux_loss_weight: float = 0.0  # balancing: aux_loss, the loss's weight (Switch: alpha E sum_e f_e P_e)
    bias_update_rate: float = 0.001  # balancing: aux_free_bias, the bias step per update (DeepSeek-V3's gamma)
    first_k_dense: int = 0  # the first k layers have a dense MLP (width ModelSpec.ffn) before the MoE layers
    # Node-limited routing (DeepSeek-V3): the experts form `expert_groups` equal groups (one per node when expert
    # parallelism spans that many nodes) and each token picks its top_k experts inside at most `node_limit` groups.
    expert_groups: int = 0
    node_limit: int = 0  # 0: no limit

    def __post_init__(self):
        for name in ("experts", "top_k", "expert_ffn"):
            if getattr(self, name) <= 0:
                raise ValueError(f"moe.{name} must be positive, got {getattr(self, name)}")
        if self.top_k >= self.experts:
            raise ValueError(f"moe.top_k={self.top_k} must be below experts={self.experts}")
        if self.latent_dim < 0 or self.shared_experts < 0 or self.shared_ffn < 0:
            raise ValueError("moe.latent_dim, shared_experts and shared_ffn must be >= 0")
        if self.balance_bins <= 0:
            raise ValueError(f"moe.balance_bins must be positive, got {self.balance_bins}")
        if self.shared_experts and not self.shared_ffn:
            raise ValueError("moe.shared_ffn must be positive when shared_experts > 0")
        if self.balance_method in ("quantile", "aux_free_bias") and not self.router_bias:
            raise ValueError(f"moe.balancing={self.balancing} sets a router bias, so moe.router_bias must be true")
        if self.aux_loss_weight < 0 or self.bias_update_rate <= 0:
            raise ValueError("moe.aux_loss_weight must be >= 0 and moe.bias_update_rate positive")
        if self.balance_method == "aux_loss" and not self.aux_loss_weight:
            raise ValueError("moe.balancing=aux_loss needs a positive moe.aux_loss_weight")
        if self.first_k_dense < 0:
            raise ValueError(f"moe.first_k_dense must be >= 0, got {self.first_k_dense}")
        if self.expert_groups < 0 or self.node_limit < 0:
            raise ValueError("moe.expert_groups and moe.node_limit must be >= 0")
        if self.node_limit:
            if not self.expert_groups or self.experts % self.expert_groups:
                raise ValueError(f"moe.node_limit needs moe.expert_groups dividing experts={self.experts}")
            if self.node_limit > self.expert_groups:
                raise ValueError(f"moe.node_limit={self.node_limit} exceeds expert_groups={self.expert_groups}")
            if self.top_k > self.node_limit * (self.experts // self.expert_groups):
                raise ValueError(f"moe.top_k={self.top_k} experts do not fit in node_limit={self.node_limit} groups")

    @property
    def balance_method(self) -> str:
        """The balancing method in force (the field, or what an unset field means)."""
        if self.balancing is not None:
            return self.balancing
        return "quantile" if self.router_bias else "none"

    @property
    def sets_router_bias(self) -> bool:
        """The router bias is set by the balancing rule (no gradient, no optimizer state), not learned."""
        return self.balance_method in ("quantile", "aux_free_bias")


@dataclass(frozen=True)
class MTPSpec:
    """Multi-token prediction (DeepSeek-V3): `depth` sequential modules, module k predicting token i + k + 1.
    Each module normalises its input hidden state and the embedding of token i + k (two norms), projects their
    concatenation (2 d x d), runs one transformer block shaped like the model's last layer, normalises again and
    shares the embedding and output head with the main model. Its loss is added with weight `loss_weight`."""

    depth: int = 1
    loss_weight: float = 0.3  # DeepSeek-V3: 0.3 for the first 10T tokens, then 0.1

    def __post_init__(self):
        if self.depth <= 0:
            raise ValueError(f"mtp.depth must be positive, got {self.depth}")
        if self.loss_weight < 0:
            raise ValueError(f"mtp.loss_weight must be >= 0, got {self.loss_weight}")


@dataclass(frozen=True)
class ConvSpec:
    kernel: int
    sites: list[ConvSite]

    def __post_init__(self):
        if self.kernel <= 0:
            raise ValueError(f"conv.kernel must be positive, got {self.kernel}")
        if len(set(self.sites)) != len(self.sites):
            raise ValueError("conv.sites must not repeat")


@dataclass(frozen=True)
class FlopsConvention:
    """How model FLOPs (the MFU numerator) count attention and the output head.

    attention: "full" counts every query against its whole context (window or sequence); "causal" halves it as a
    causal mask does on average. window: "window" counts a local layer's context as its window; "sequence" counts
    it as the whole sequence (as frameworks that ignore sliding windows do). head: whether the output head counts.
    """

    attention: Literal["full", "causal"] = "full"
    window: Literal["window", "sequence"] = "window"
    head: bool = True

    @property
    def label(self) -> str:
        return f"attention={self.attention},window={self.window},head={'in' if self.head else 'out'}"

    @classmethod
    def parse(cls, text: str) -> "FlopsConvention":
        """Parse 'attention=causal,window=sequence,head=out' (any subset; 'default' for the defaults)."""
        values: dict = {}
        if text.strip() in ("", "default"):
            return cls()
        for part in text.split(","):
            key, _, value = part.partition("=")
            key, value = key.strip(), value.strip()
            if key == "attention" and value in ("full", "causal"):
                values["attention"] = value
            elif key == "window" and value in ("window", "sequence"):
                values["window"] = value
            elif key == "head" and value in ("in", "out"):
                values["head"] = value == "in"
            else:
                raise RackcastError(
                    f"flops convention: cannot read {part!r} "
                    "(use attention=full|causal, window=window|sequence, head=in|out)"
                )
        return cls(**values)


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
    name: str
    layers: int
    d_model: int
    vocab: int
    seq_len: int
    attention: AttentionSpec
    ffn: int = 0  # dense MLP intermediate width (dense models, and dense layers of MoE models)
    activation: Literal["swiglu", "gelu"] = "swiglu"
    mlp_bias: bool = False
    moe: MoESpec | None = None
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    embed_norm: bool = False  # a norm (and gated norm, if any) right after the embedding
    gated_norm_rank: int = 0  # 0: none; r: after each norm, x * sigmoid(silu(x W_down) W_up), W_down: d x r
    conv: ConvSpec | None = None
    tied_embeddings: bool = False
    positional: Literal["rope", "learned", "none"] = "rope"
    rope_theta: float = 10000.0
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3): 2 x head_dim gains per layer
    mtp: MTPSpec | None = None  # multi-token prediction modules
    family: str = ""
    description: str = ""

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

    def head_flops_fwd(self, convention: FlopsConvention = FlopsConvention()) -> float:
        """Output head (logits) plus the final and embedding gated norms."""
        gated = 2.0 * self._gated_norm_params() * (2 if self.embed_norm else 1)
        return (2.0 * self.d_model * self.vocab if convention.head else 0.0) + gated

    def mtp_flops_fwd(self, convention: FlopsConvention = FlopsConvention()) -> float:
        """All multi-token-prediction modules per token: projection, block and one more output-head pass each."""
        if self.mtp is None:
            return 0.0
        d = self.d_model
        head = 2.0 * d * self.vocab if convention.head else 0.0
        return self.mtp.depth * (2.0 * 2 * d * d + self.layer_flops_fwd(self.layers - 1, convention) + head)

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

