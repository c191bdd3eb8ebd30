"""The PyTorch language model built from a ModelSpec, parameter for parameter (module count == spec.params_total).

    from rackcast.backend.model import build_model, next_token_loss
    model = build_model(load_model("tiny-moe"), seed=0)
    logits = model(tokens)                                   # [B, S, vocab]
    loss, parts = next_token_loss(logits, tokens, z_loss_weight=1e-4)

Structure (Marin 535B-A23B block: marin-community/marin issue 8435 and experiments/grug/moe_hero_ep/model.py;
GPT models use the same skeleton):
    x = embed(tokens) [+ learned positions] [-> embed norm -> gated norm]
    per layer: x += conv_attn(attn(gnorm(norm(x))));  h = gnorm(norm(x));  x += conv_mlp(moe(h) or mlp(h))
    logits = head(gnorm(norm(x)))   (untied matrix, or the embedding when tied)
`model.embed`, `model.layers` (an nn.ModuleList of Block) and `model.head` are separate so a pipeline can split them.

Choices not fixed by the ModelSpec (all keyword arguments of build_model):
- qk_norm: parameter-free RMS q/k norm. Default: on for RMSNorm models (Marin), off for LayerNorm (GPT) models.
- init: truncated normal (+-3 std), std 0.5/sqrt(d_model) (Marin) unless init_std is given; biases 0, norm gains 1,
  attention gate 0 (gate = 1), short convolutions identity, router bias 0. Deterministic given `seed`.
- combine_sum: per-token sum of the MoE combine weights (1.0; Marin uses 2.5), see backend.moe.
The model is built on the meta device and then materialised, so `device="meta"` gives a full-size model (e.g. the
535B preset) for counting without allocating memory.

    .venv/bin/pytest -q tests/test_backend_model.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rackcast.backend.attention import Attention
from rackcast.backend.latent_attention import LatentAttention
from rackcast.backend.layers import Mlp, Norm, ShortConv, default_init_std, init_module, make_normal
from rackcast.backend.moe import MoE
from rackcast.backend.mtp import MultiTokenPrediction
from rackcast.modelspec import ModelSpec

MARIN_Z_LOSS_WEIGHT = 1e-4  # removing z-loss made Marin's loss turn upward as output-norm gains grew


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, *, qk_norm: bool, combine_sum: float):
        super().__init__()
        self.layer_index = layer
        self.attn_norm = Norm(spec.d_model, spec.norm, spec.gated_norm_rank)
        self.attn = LatentAttention(spec, layer) if spec.attention.mla is not None else \
            Attention(spec, layer, qk_norm=qk_norm)
        self.mlp_norm = Norm(spec.d_model, spec.norm, spec.gated_norm_rank)
        if spec.is_moe(layer):
            self.mlp: nn.Module = MoE(spec, combine_sum=combine_sum)
        else:
            self.mlp = Mlp(spec.d_model, spec.ffn, spec.activation, spec.mlp_bias)
        sites = spec.conv.sites if spec.conv is not None else []
        self.conv_attn = ShortConv(spec.d_model, spec.conv.kernel) if "attn" in sites else None
        self.conv_mlp = ShortConv(spec.d_model, spec.conv.kernel) if "mlp" in sites else None

    def forward(self, x: Tensor) -> Tensor:
        a = self.attn(self.attn_norm(x))
        if self.conv_attn is not None:
            a = self.conv_attn(a)
        x = x + a
        m = self.mlp(self.mlp_norm(x))
        if self.conv_mlp is not None:
            m = self.conv_mlp(m)
        return x + m


class Embedder(nn.Module):
    cp = None  # backend.context_parallel.ContextShard: the tokens are one chunk of the sequence

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.tok = nn.Embedding(spec.vocab, spec.d_model)
        self.pos = nn.Embedding(spec.seq_len, spec.d_model) if spec.positional == "learned" else None
        self.norm = Norm(spec.d_model, spec.norm, spec.gated_norm_rank) if spec.embed_norm else None

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.tok(tokens)
        if self.pos is not None:
            start = self.cp.start(tokens.shape[1]) if self.cp is not None else 0
            x = x + self.pos(torch.arange(start, start + tokens.shape[1], device=tokens.device))
        return self.norm(x) if self.norm is not None else x


class LMHead(nn.Linear):
    """The untied output matrix (trained with AdamH, backend.optim)."""

    OPTIM_GROUP = "adamh"


class OutputHead(nn.Module):
    """Final norm (+ gated norm), then the output projection; `tied` reads the input embedding instead."""

    def __init__(self, spec: ModelSpec, tied: nn.Embedding | None):
        super().__init__()
        self.norm = Norm(spec.d_model, spec.norm, spec.gated_norm_rank)
        self.proj = None if tied is not None else LMHead(spec.d_model, spec.vocab, bias=False)
        self._tied = [tied]  # a list, so the tied embedding is not registered twice as a submodule

    @property
    def weight(self) -> Tensor:
        """The output projection [vocab, d_model] (the embedding when tied)."""
        return self.proj.weight if self.proj is not None else self._tied[0].weight

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(self.norm(x), self.weight)


class RackcastLM(nn.Module):
    def __init__(self, spec: ModelSpec, *, qk_norm: bool, combine_sum: float):
        super().__init__()
        self.spec = spec
        self.embed = Embedder(spec)
        self.layers = nn.ModuleList(
            Block(spec, i, qk_norm=qk_norm, combine_sum=combine_sum) for i in range(spec.layers)
        )
        self.head = OutputHead(spec, self.embed.tok if spec.tied_embeddings else None)
        self.mtp = MultiTokenPrediction(
            spec, lambda: Block(spec, spec.layers - 1, qk_norm=qk_norm, combine_sum=combine_sum)
        ) if spec.mtp is not None else None

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens [B, S] (S <= spec.seq_len) -> logits [B, S, vocab] (carrying the MTP loss, backend.mtp)."""
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        if self.mtp is not None:
            logits = self.mtp.attach(logits, x, tokens, self.embed.tok, self.head.weight)
        return logits

    def moe_layers(self) -> dict[int, MoE]:
        return {b.layer_index: b.mlp for b in self.layers if isinstance(b.mlp, MoE)}

    def routing_counts(self, reset: bool = False) -> dict[int, Tensor]:
        """Tokens routed to each expert [E] per MoE layer, summed over forwards since the last reset."""
        out = {i: m.routing_counts_sum for i, m in self.moe_layers().items() if m.routing_counts_sum is not None}
        if reset:
            for m in self.moe_layers().values():
                m.reset_routing_counts()
        return out

    def init_weights(self, seed: int, init_std: float | None = None) -> None:
        """(Re)initialise every parameter deterministically from `seed` (see the module docstring)."""
        # Draw on the CPU whatever the model's device, so every device (and every rank) gets the same weights.
        generator = torch.Generator(device="cpu").manual_seed(seed)
        normal = make_normal(init_std or default_init_std(self.spec.d_model), generator)
        for name, module in self.named_modules():
            if module is self:
                continue
            if not init_module(module, normal):
                raise TypeError(f"no initialisation rule for {name} ({type(module).__name__})")


def build_model(
    spec: ModelSpec,
    *,
    seed: int = 0,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    init_std: float | None = None,
    qk_norm: bool | None = None,
    combine_sum: float = 1.0,
) -> RackcastLM:
    """Build and initialise the model a ModelSpec describes (see the module docstring for the choices)."""
    if qk_norm is None:
        qk_norm = spec.norm == "rmsnorm"
    with torch.device("meta"):
        model = RackcastLM(spec, qk_norm=qk_norm, combine_sum=combine_sum)
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "meta":
        return model.to(dtype)
    model = model.to_empty(device=device).to(dtype)
    model.init_weights(seed, init_std)
    return model


def count_parameters(model: nn.Module) -> int:
    """Every stored parameter once (tied weights once, non-trainable ones included), as ModelSpec counts."""
    return sum(p.numel() for p in model.parameters())


def shifted_targets(tokens: Tensor) -> Tensor:
    """Next-token targets of tokens [B, S]: tokens[:, 1:], and -100 (ignored) at the last position."""
    t = torch.full_like(tokens, -100)
    t[:, :-1] = tokens[:, 1:]
    return t


def next_token_loss(
    logits: Tensor, tokens: Tensor, *, z_loss_weight: float = MARIN_Z_LOSS_WEIGHT, targets: Tensor | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean next-token cross-entropy plus logit z-loss, in fp32.

    logits [B, S, V] predict tokens[:, 1:] (or `targets` [B, S] when given; -100 entries are ignored).
    z-loss = z_loss_weight * mean(logsumexp(logits)^2) (PaLM; Marin's logsumexp_weight 1e-4).
    Returns (total, {"ce": ..., "z_loss": ...}), the parts detached.
    """
    if targets is None:
        logits, targets = logits[:, :-1], tokens[:, 1:]
    flat = logits.reshape(-1, logits.shape[-1]).float()
    tgt = targets.reshape(-1)
    ce = F.cross_entropy(flat, tgt, ignore_index=-100)
    valid = tgt != -100
    lse = torch.logsumexp(flat[valid], dim=-1)
    z = z_loss_weight * lse.pow(2).mean() if z_loss_weight else flat.new_zeros(())
    return ce + z, {"ce": ce.detach(), "z_loss": z.detach()}
