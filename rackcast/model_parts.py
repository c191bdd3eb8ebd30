"""The parts of a ModelSpec (rackcast.modelspec): attention (with latent attention), MoE, multi-token prediction,
short convolutions, the published training recipe, and the FLOP-counting convention. Each is a frozen dataclass
validated on construction and bounded field by field (rackcast.bounds); rackcast.modelspec re-exports them.

    from rackcast.modelspec import AttentionSpec, MoESpec   # the usual import
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from rackcast.bounds import Items, Range, Text
from rackcast.errors import RackcastError
from rackcast.vocab import BALANCE_BINS

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

    kv_lora_rank: Annotated[int, Range(1, 2**17)]
    qk_rope_head_dim: Annotated[int, Range(1, 1024)]
    qk_nope_head_dim: Annotated[int, Range(1, 1024)]
    v_head_dim: Annotated[int, Range(1, 1024)]
    q_lora_rank: Annotated[int, Range(0, 2**17)] = 0  # 0: queries projected at full rank (DeepSeek-V2-Lite)

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
    heads: Annotated[int, Range(1, 1024)]
    head_dim: Annotated[int, Range(1, 1024)]
    kv_heads_local: Annotated[int, Range(1, 1024)]
    kv_heads_global: Annotated[int, Range(1, 1024)]
    # 0: each layer stores its own KV heads; >0: every layer stores this many
    kv_heads_stored: Annotated[int, Range(0, 1024)] = 0
    # sliding window of local layers, in tokens; 0 means every layer attends globally
    window: Annotated[int, Range(0, 2**22)] = 0
    # layer i is global when (i + 1) % global_every == 0; the last layer always is
    global_every: Annotated[int, Range(1, 1024)] = 1
    output_gate: bool = False  # per-head 2*sigmoid(x W_g) output gate, W_g: d_model x heads
    exclusive: bool = False  # exclusive self-attention (removes each head output's component along its value)
    rope_fraction: Annotated[float, Range(0, 1)] = 1.0  # fraction of each head's dims rotated on local layers
    rope_on_global: bool = True
    qk_multiplier: Annotated[float, Range(0, 1000, above=True)] = 1.0
    bias: bool = False  # biases on Q, K, V and output projections (GPT/Megatron style)
    mla: LatentAttentionSpec | None = None  # multi-head latent attention; head_dim is then the query/key head width
    sinks: bool = False  # a learned sink logit per head joins every softmax (GPT-OSS): `heads` parameters per layer
    # Explicit per-layer attention, repeated over the layers (layer i uses pattern[i % len]); empty: the
    # window / global_every rule. GPT-OSS: [window, full].
    pattern: Annotated[list[LayerAttention], Items(1024)] = field(default_factory=list)

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
    experts: Annotated[int, Range(1, 16384)]
    top_k: Annotated[int, Range(1, 1024)]
    expert_ffn: Annotated[int, Range(1, 2**20)]  # intermediate width of each routed SwiGLU expert
    # 0: experts see d_model-wide tokens; >0: latent MoE (down-project, RMSNorm, experts, up)
    latent_dim: Annotated[int, Range(0, 2**17)] = 0
    shared_experts: Annotated[int, Range(0, 64)] = 0
    # intermediate width of each shared SwiGLU expert (full width input)
    shared_ffn: Annotated[int, Range(0, 2**20)] = 0
    # layers with a dense MLP (width ModelSpec.ffn) instead
    dense_layers: Annotated[list[Annotated[int, Range(0, 1023)]], Items(1024)] = field(default_factory=list)
    router_bias: bool = True  # a per-expert bias on the router logits (a stored parameter)
    # Quantile balancing sets that bias every step from a histogram of router margins, this many bins per expert,
    # pooled over the ranks that see different tokens (rackcast.vocab.BALANCE_BINS by default).
    balance_bins: Annotated[int, Range(1, 2**20)] = BALANCE_BINS
    # How the router is balanced (see Balancing); quantile and aux_free_bias set router_bias (no gradient). Unset:
    # quantile balancing when the router has a bias (Marin), else none, as before the field existed.
    balancing: Balancing | None = None
    # balancing: aux_loss, the loss's weight (Switch: alpha E sum_e f_e P_e)
    aux_loss_weight: Annotated[float, Range(0, 10)] = 0.0
    # balancing: aux_free_bias, the bias step per update (DeepSeek-V3's gamma)
    bias_update_rate: Annotated[float, Range(0, 10)] = 0.001
    # the first k layers have a dense MLP (width ModelSpec.ffn) before the MoE layers
    first_k_dense: Annotated[int, Range(0, 1024)] = 0
    # Node-limited routing (DeepSeek-V3): the experts form `expert_groups` equal groups (one per node when expert
    # parallelism spans that many nodes) and each token picks its top_k experts inside at most `node_limit` groups.
    expert_groups: Annotated[int, Range(0, 16384)] = 0
    node_limit: Annotated[int, Range(0, 16384)] = 0  # 0: no limit

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

    depth: Annotated[int, Range(1, 64)] = 1
    loss_weight: Annotated[float, Range(0, 100)] = 0.3  # DeepSeek-V3: 0.3 for the first 10T tokens, then 0.1

    def __post_init__(self):
        if self.depth <= 0:
            raise ValueError(f"mtp.depth must be positive, got {self.depth}")
        if self.loss_weight < 0:
            raise ValueError(f"mtp.loss_weight must be >= 0, got {self.loss_weight}")


@dataclass(frozen=True)
class ConvSpec:
    kernel: Annotated[int, Range(1, 64)]
    sites: Annotated[list[ConvSite], Items(4)]

    def __post_init__(self):
        if self.kernel <= 0:
            raise ValueError(f"conv.kernel must be positive, got {self.kernel}")
        if len(set(self.sites)) != len(self.sites):
            raise ValueError("conv.sites must not repeat")


@dataclass(frozen=True)
class Recipe:
    """A model's published (or documented) training recipe. `rackcast plan` takes its default global batch from it
    (planner.batch; 0: none published, the batch law decides) and copies the rest into the plan it writes (the
    optimizer block, plus z_loss_weight and combine_sum), which the trainer runs. The learning-rate schedule is a
    linear warmup over warmup_fraction of the steps, then a linear decay to lr_floor x lr
    (backend.optim.marin_lr_lambda)."""

    global_batch: Annotated[int, Range(0, 2**24)] = 0  # sequences per optimizer step; 0: not published
    source: str = ""  # where the figures come from (paper, issue, config file)
    optimizer: Literal["adamw", "muonh"] = "adamw"
    lr: Annotated[float, Range(0, 10, above=True)] = 3e-4  # AdamW's rate; MuonH: the MuonH and AdamH groups' rate
    adam_lr: Annotated[float, Range(0, 10, above=True)] = 3e-4  # MuonH: the Adam groups' rate
    betas: tuple[Annotated[float, Range(0, 1)], Annotated[float, Range(0, 1)]] = (0.9, 0.95)
    eps: Annotated[float, Range(0, 1, above=True)] = 1e-8  # Adam epsilon
    momentum: Annotated[float, Range(0, 1)] = 0.95  # MuonH Nesterov momentum
    weight_decay: Annotated[float, Range(0, 10)] = 0.1  # AdamW only (MuonH has none)
    warmup_fraction: Annotated[float, Range(0, 1)] = 0.01
    lr_floor: Annotated[float, Range(0, 1)] = 0.05
    z_loss_weight: Annotated[float, Range(0, 10)] = 1e-4  # logit z-loss weight
    combine_sum: Annotated[float, Range(0, 1024, above=True)] = 1.0  # per-token sum of the MoE combine weights

    def __post_init__(self):
        for name in ("lr", "adam_lr", "eps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"recipe.{name} must be positive, got {getattr(self, name)}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"recipe.betas must lie in [0, 1), got {self.betas}")
        if not 0.0 <= self.warmup_fraction < 1.0 or not 0.0 <= self.lr_floor <= 1.0:
            raise ValueError("recipe.warmup_fraction must lie in [0, 1) and recipe.lr_floor in [0, 1]")
        if self.global_batch < 0:
            raise ValueError(f"recipe.global_batch must not be negative, got {self.global_batch}")
        if self.global_batch and not self.source.strip():
            raise ValueError("recipe.source must name where the recipe's global batch comes from")


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
