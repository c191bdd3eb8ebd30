"""Building blocks shared by the attention, MoE and model modules: norms, the low-rank gated norm, causal depthwise
short convolutions, dense MLPs, rotary embeddings, and the deterministic initialiser.

Every module here that owns parameters either is a torch builtin handled by `init_module` (nn.Linear, nn.Embedding,
nn.LayerNorm) or defines `init_weights(normal)`, so a model built on the meta device can be materialised and
initialised from one seeded generator (backend.model.build_model).

Layouts follow Marin's grug MoE (marin-community/marin experiments/grug/moe_hero_ep/model.py).

    .venv/bin/pytest -q tests/test_backend_model.py
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rackcast.backend.context_parallel import previous_tail

Normal = Callable[[Tensor], None]  # fills a tensor in place from the model's seeded truncated normal

RMS_EPS = 1e-5  # Marin's layer_norm_eps
QK_NORM_EPS = 1e-6  # Marin's parameter-free rms_norm default


def rms_norm(x: Tensor, eps: float = QK_NORM_EPS) -> Tensor:
    """Parameter-free RMS norm over the last dim, computed in fp32 (Marin's q/k norm)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """RMS norm with a learned gain (one parameter per channel), computed in fp32."""

    def __init__(self, dim: int, eps: float = RMS_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def init_weights(self, normal: Normal) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


class GatedNorm(nn.Module):
    """Low-rank gate after a norm: x * sigmoid(silu(x W_down) W_up), W_down: d x r, W_up: r x d.

    Compensates for the bounded activation norms of hyperball optimizers (arXiv 2601.22966; Marin GatedNorm).
    """

    def __init__(self, dim: int, rank: int):
        super().__init__()
        self.down = nn.Linear(dim, rank, bias=False)
        self.up = nn.Linear(rank, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(self.up(F.silu(self.down(x))))


class Norm(nn.Module):
    """The model's pre-norm (RMSNorm or LayerNorm, per ModelSpec.norm) followed by the gated norm when rank > 0."""

    def __init__(self, dim: int, kind: str, gated_rank: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=RMS_EPS) if kind == "layernorm" else RMSNorm(dim)
        self.gated = GatedNorm(dim, gated_rank) if gated_rank > 0 else None

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm(x)
        return self.gated(x) if self.gated is not None else x


class ShortConv(nn.Module):
    """Causal depthwise convolution over the sequence: out[t] = sum_lag weight[lag] * x[t - lag], per channel.

    weight is [kernel, channels]; identity-initialised (weight[0] = 1, other taps 0) so it is a pass-through at step 0
    (Marin ShortConv, "Inkling-style SConv"). Trained with plain Adam (backend.optim.param_groups).
    """

    OPTIM_GROUP = "adam"
    cp = None  # backend.context_parallel.ContextShard: this rank holds one chunk of the sequence

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.empty(kernel, channels))

    def init_weights(self, normal: Normal) -> None:
        with torch.no_grad():
            self.weight.zero_()
            self.weight[0].fill_(1.0)

    def forward(self, x: Tensor) -> Tensor:  # x: [B, S, C]
        # A shifted copy per tap: measured faster on CPU, forward + backward, than one depthwise conv1d or an
        # unfold with a sum at tiny-moe's and marin-cpu-d512's shapes (README, trainer section).
        w = self.weight
        w = (w.to_local() if hasattr(w, "to_local") else w).to(x.dtype)  # a tensor-parallel channel shard: its own
        out = x * w[0]
        seq = x.shape[1]
        if self.cp is not None and self.cp.size > 1 and self.kernel > 1:
            # Context parallelism: the previous rank's last kernel - 1 inputs stand where the zero padding was.
            halo = self.kernel - 1
            ext = torch.cat([previous_tail(x, halo, self.cp), x], dim=1)
            for lag in range(1, self.kernel):
                out = out + ext[:, halo - lag: halo - lag + seq] * w[lag]
            return out
        for lag in range(1, min(self.kernel, seq)):
            shifted = F.pad(x, (0, 0, lag, 0))[:, :seq]
            out = out + shifted * w[lag]
        return out


class FusedLinear(nn.Linear):
    """Several projections of one input as one matrix: the parts' output rows stacked, [sum(parts), in], so one
    matmul computes them all (fused QKV, fused SwiGLU gate/up); `split` returns the parts' outputs as views.

    Each part stays a matrix of its own where it matters: `matrix_parts` tells backend.optim's MuonH to
    orthogonalise and hyperball-step each part separately (the reference models' per-matrix treatment, e.g. Marin's
    separate q, k, v and gate, up), and init_weights draws each part in order from the model's generator, so a fused
    model starts from the same numbers as one with separate projections. `reference_forward` is the unfused oracle
    (one matmul per part)."""

    def __init__(self, in_features: int, parts: tuple[int, ...], bias: bool):
        super().__init__(in_features, sum(parts), bias=bias)
        self.parts = tuple(parts)
        self.split_sizes = self.parts  # this rank's share of each part (backend.tensor_parallel divides them)
        self.matrix_parts = {"weight": (-2, self.parts)}  # parameter -> (dim along which it splits, part sizes)

    def init_weights(self, normal: Normal) -> None:
        with torch.no_grad():
            for part in self.weight.split(self.parts, 0):
                normal(part)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    def split(self, y: Tensor) -> tuple[Tensor, ...]:
        return y.split(self.split_sizes, -1)

    def reference_forward(self, x: Tensor) -> tuple[Tensor, ...]:
        biases = self.bias.split(self.parts) if self.bias is not None else [None] * len(self.parts)
        return tuple(F.linear(x, w, b) for w, b in zip(self.weight.split(self.parts, 0), biases))


class Mlp(nn.Module):
    """Dense MLP: SwiGLU (gate and up fused into one matrix, `gate_up`, then down) or GELU (up, down), with optional
    biases (GPT style)."""

    def __init__(self, dim: int, width: int, activation: str, bias: bool):
        super().__init__()
        self.activation = activation
        self.gate_up = FusedLinear(dim, (width, width), bias) if activation == "swiglu" else None
        self.up = nn.Linear(dim, width, bias=bias) if activation != "swiglu" else None
        self.down = nn.Linear(width, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up.split(self.gate_up(x))
            return self.down(F.silu(gate) * up)
        return self.down(F.gelu(self.up(x)))

    def reference_forward(self, x: Tensor) -> Tensor:
        """forward with separate gate and up matmuls (the test oracle)."""
        if self.gate_up is not None:
            gate, up = self.gate_up.reference_forward(x)
            return self.down(F.silu(gate) * up)
        return self.down(F.gelu(self.up(x)))


# ---------------------------------------------------------------------------------------------------- rotary
def rotary_dims(head_dim: int, fraction: float) -> int:
    """Rotated dims per head: `fraction` of head_dim, rounded down to an even count (RoPE rotates pairs)."""
    return int(head_dim * fraction) // 2 * 2


_ROPE_CACHE: dict[tuple, tuple[Tensor, Tensor]] = {}


def rope_tables(seq: int, rot_dim: int, theta: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos/sin tables [seq, rot_dim / 2] in fp32, cached per (seq, rot_dim, theta, device)."""
    key = (seq, rot_dim, theta, str(device))
    if key not in _ROPE_CACHE:
        half = rot_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(half, dtype=torch.float64, device=device) / half))
        angles = torch.arange(seq, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
        _ROPE_CACHE[key] = (angles.cos().float(), angles.sin().float())
    return _ROPE_CACHE[key]


def apply_rope(x: Tensor, rot_dim: int, theta: float, start: int = 0) -> Tensor:
    """Rotate the first `rot_dim` dims of each head of x [B, S, H, D], whose first position is `start` (a context-
    parallel chunk's offset); the rest pass through (Marin half-RoPE).

    Pairs split halves (i, i + rot_dim/2) within the rotated part, Marin's non-fused convention.
    """
    if rot_dim == 0:
        return x
    cos, sin = rope_tables(start + x.shape[1], rot_dim, theta, x.device)
    cos, sin = cos[start:], sin[start:]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    half = rot_dim // 2
    xf = x.float()
    x1, x2, rest = xf[..., :half], xf[..., half:rot_dim], xf[..., rot_dim:]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
    return rotated.to(x.dtype)


# ---------------------------------------------------------------------------------------------------- init
def default_init_std(d_model: int) -> float:
    """Marin's init: truncated normal with std 0.5 / sqrt(hidden) (marin experiments/grug/moe_hero_ep/model.py)."""
    return 0.5 / math.sqrt(d_model)


def make_normal(std: float, generator: torch.Generator) -> Normal:
    """A truncated-normal filler (cut at +-3 std, as Marin's jax.random.truncated_normal(-3, 3))."""

    def normal(t: Tensor) -> None:
        with torch.no_grad():
            if t.device.type == generator.device.type:
                nn.init.trunc_normal_(t, std=std, a=-3 * std, b=3 * std, generator=generator)
            else:  # draw on the generator's device so results do not depend on where the model lives
                tmp = torch.empty(t.shape, dtype=t.dtype, device=generator.device)
                nn.init.trunc_normal_(tmp, std=std, a=-3 * std, b=3 * std, generator=generator)
                t.copy_(tmp)

    return normal


def init_module(module: nn.Module, normal: Normal) -> bool:
    """Initialise `module`'s own parameters; returns False when it owns parameters and no rule covers it."""
    if hasattr(module, "init_weights"):
        module.init_weights(normal)
    elif isinstance(module, nn.Linear):
        normal(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        normal(module.weight)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
    else:
        return not any(True for _ in module.parameters(recurse=False))
    return True
