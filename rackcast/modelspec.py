"""ModelSpec: a language model's architecture and its exact parameter and FLOP accounting.

One definition serves the simulator (what each op costs), the planner (what fits), and the trainer (what to build).
The spec covers the Marin 535B-A23B features (per-layer local/global attention with their own KV-head counts, a
sliding window, latent MoE, shared experts, dense layers, low-rank gated norms, short depthwise convolutions,
an attention output gate, untied embeddings) and classic dense GPT models (LayerNorm, biases, GELU MLP, learned
positions, tied embeddings).

Counting rules (match the reference implementations parameter for parameter):
- every matrix is counted once; the attention K/V projections store `kv_heads_stored` heads on every layer when it
  is set (Marin scans one uniform block and slices the global layers' heads at run time), else the layer's own count;
- params_embedding = input embedding + learned positions + output head (when untied);
- params_active = everything else, with routed experts counted top_k of `experts` times.
FLOPs (forward, per token) count 2 per multiply-add of every matrix product, 4 x heads x head_dim x context for
attention scores and values, and 2 x kernel x channels for each convolution; elementwise work (norms, activations,
softmax) is not counted. Backward is twice forward. The MFU convention (see FlopsConvention) decides the attention
context: by default a local layer counts its window and a global layer the whole sequence, without causal halving.

    rackcast models show marin-535b-a23b     # prints the accounting of a preset
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Annotated, Literal

from rackcast.errors import RackcastError
from rackcast.vocab import BALANCE_BINS
from rackcast.bounds import Items, Range, Text

ConvSite = Literal["k", "v", "attn", "mlp"]


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
    router_bias: bool = True  # a per-expert balancing bias (no gradient in Marin, but a stored parameter)
    # Quantile balancing sets that bias every step from a histogram of router margins, this many bins per expert,
    # pooled over the ranks that see different tokens (rackcast.vocab.BALANCE_BINS by default).
    balance_bins: Annotated[int, Range(1, 2**20)] = BALANCE_BINS

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
        if self.gated_norm_rank < 0:
            raise ValueError("gated_norm_rank must be >= 0")

    # ---------------------------------------------------------------- layer structure
    def is_global(self, layer: int) -> bool:
        a = self.attention
        return a.window == 0 or (layer + 1) % a.global_every == 0 or layer == self.layers - 1

    def is_moe(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers

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

    def layer_param_breakdown(self, layer: int) -> dict[str, int]:
        """Parameters of one layer by component (routed experts are all of them, not top_k)."""
        d, a = self.d_model, self.attention
        q_dim, kv_dim = a.heads * a.head_dim, self.kv_heads_stored(layer) * a.head_dim
        parts = {
            "attn_norm": self._norm_params(d),
            "attn_gated_norm": self._gated_norm_params(),
            "attn_q": d * q_dim + (q_dim if a.bias else 0),
            "attn_kv": 2 * (d * kv_dim + (kv_dim if a.bias else 0)),
            "attn_o": q_dim * d + (d if a.bias else 0),
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

    def top_param_breakdown(self) -> dict[str, int]:
        """Parameters outside the layers."""
        d = self.d_model
        parts = {
            "embedding": self.vocab * d,
            "positions": self.seq_len * d if self.positional == "learned" else 0,
            "head": 0 if self.tied_embeddings else d * self.vocab,
            "embed_norm": self._norm_params(d) if self.embed_norm else 0,
            "embed_gated_norm": self._gated_norm_params() if self.embed_norm else 0,
            "final_norm": self._norm_params(d),
            "final_gated_norm": self._gated_norm_params(),
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
        """Parameters used per token, excluding the embedding and output head."""
        top_other = sum(self.top_param_breakdown().values()) - self.params_embedding
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
        q_dim, kv_dim = a.heads * a.head_dim, self.kv_heads_stored(layer) * a.head_dim
        parts = {
            "attn_gated_norm": 2.0 * self._gated_norm_params(),
            "attn_qkvo": 2.0 * (2 * d * q_dim + 2 * d * kv_dim),
            "attn_scores_values": 4.0 * q_dim * self.attention_context(layer, convention),
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

    def flops_per_token_fwd(self, convention: FlopsConvention = FlopsConvention()) -> float:
        layers = sum(self.layer_flops_fwd(i, convention) for i in range(self.layers))
        return layers + self.head_flops_fwd(convention)

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
            "flops_per_token_fwd": self.flops_per_token_fwd(convention),
            "flops_per_token_train": self.flops_per_token_train(convention),
            "flops_convention": convention.label,
            "layers": [vars(row) for row in self.layer_table(convention)],
        }

