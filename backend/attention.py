"""Marin-style causal self-attention built from a ModelSpec layer.

Per layer: grouped-query attention whose K/V projections store `spec.kv_heads_stored(layer)` heads and attend with
the first `spec.kv_heads(layer)` of them (Marin scans one uniform block and slices global layers' heads at run
time); a sliding window on local layers (a query at position i sees keys j with 0 <= i - j < window), computed
blockwise so a local layer does window-sized work (banded_attention), and the whole causal prefix on global layers;
RoPE on `rope_fraction` of each head's dims (none on global layers unless rope_on_global); optional parameter-free
RMS q/k norm and a q multiplier; exclusive self-attention (each head's output loses its component along the token's
own value vector, "XSA" in Marin's CausalSelfAttention); the per-head 2*sigmoid(x W_g) output gate, zero-initialised
so it starts as the identity; causal short convolutions after the K and/or V projections. GPT models get biases on
Q, K, V and O instead. Q, K and V are one fused projection (layers.FusedLinear `qkv`, its parts
kept apart by the optimizer). Frontier options from the spec: learned per-head RMS q/k norms
(ModelSpec.qk_norm, Qwen3) and a learned sink logit per head that joins every softmax (attention.sinks, GPT-OSS;
backend.sinks).

    .venv/bin/pytest -q tests/test_backend_model.py -k mask
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rackcast.backend.context_parallel import context_keys, context_mask
from rackcast.backend.layers import FusedLinear, Normal, RMSNorm, ShortConv, apply_rope, rms_norm, rotary_dims
from rackcast.backend.sinks import SinkLogits, attention_with_sinks
from rackcast.modelspec import ModelSpec
from rackcast.simulator.op_counts import window_query_block

XSA_EPS = 1e-6  # Marin: z = y - (y.v / (|v|^2 + 1e-6)) v


class HeadGate(nn.Linear):
    """W_g: d_model -> heads, no bias; the gate is 2*sigmoid(x W_g), so zero weights give exactly 1 at init."""

    OPTIM_GROUP = "adam"

    def __init__(self, d_model: int, heads: int):
        super().__init__(d_model, heads, bias=False)

    def init_weights(self, normal: Normal) -> None:
        nn.init.zeros_(self.weight)


_BAND_CACHE: dict[tuple, Tensor] = {}


def window_mask(seq: int, window: int, device: torch.device) -> Tensor:
    """Boolean [seq, seq] mask, True where query i may attend key j: 0 <= i - j < window (the dense reference)."""
    i = torch.arange(seq, device=device)[:, None]
    j = torch.arange(seq, device=device)[None, :]
    return (j <= i) & (i - j < window)


def band_mask(blocks: int, block: int, window: int, device: torch.device) -> Tensor:
    """Boolean [blocks, 1, block, window + block - 1] mask of banded_attention, cached: query a of block n sees key
    slot b (absolute position n*block - window + 1 + b) when a <= b < a + window and that position is >= 0."""
    key = (blocks, block, window, str(device))
    if key not in _BAND_CACHE:
        a = torch.arange(block, device=device)[:, None]
        b = torch.arange(window + block - 1, device=device)[None, :]
        first = torch.arange(blocks, device=device)[:, None, None] * block - window + 1
        _BAND_CACHE[key] = ((b >= a) & (b < a + window) & (first + b >= 0))[:, None]
    return _BAND_CACHE[key]


def banded_operands(q: Tensor, k: Tensor, v: Tensor, window: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The operands of banded_attention's one SDPA call for q, k, v [B, H, S, D]: queries [blocks, B*H, block, D]
    (the last block zero-padded), each block's window + block - 1 keys and values [blocks, B*H, span, D] (an unfold
    of the left-padded keys) and band_mask. `rackcast calibrate` times that call on these."""
    b, h, s, d = q.shape
    block = window_query_block(window)
    blocks = -(-s // block)
    tail = blocks * block - s
    span = window + block - 1
    if tail:
        q = F.pad(q, (0, 0, 0, tail))

    def windows(t: Tensor) -> Tensor:  # [B, H, S, D] -> [blocks, B*H, span, D]: block n's keys
        t = F.pad(t, (0, 0, window - 1, tail)).unfold(2, span, block)  # [B, H, blocks, D, span]
        return t.permute(2, 0, 1, 4, 3).reshape(blocks, b * h, span, d)

    qb = q.view(b, h, blocks, block, d).permute(2, 0, 1, 3, 4).reshape(blocks, b * h, block, d)
    return qb, windows(k), windows(v), band_mask(blocks, block, window, q.device)


def banded_attention(q: Tensor, k: Tensor, v: Tensor, window: int) -> Tensor:
    """Sliding-window causal attention (query i sees keys j with 0 <= i - j < window) of q, k, v [B, H, S, D] that
    does window-sized work: queries in blocks of window_query_block(window) (rackcast.simulator.op_counts;
    simulator.activations' eager memory count follows these tensors), each block against only the window + block - 1
    keys it can see, as one SDPA call with the blocks as its batch (banded_operands); a layer
    costs S x (window + block - 1) scores instead of S x S."""
    b, h, s, d = q.shape
    qb, kb, vb, mask = banded_operands(q, k, v, window)
    blocks, _, block, _ = qb.shape
    y = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask)
    # One copy into [B, S, H, D] (what the output projection reads), returned as the [B, H, S, D] view SDPA gives.
    y = y.view(blocks, b, h, block, d).permute(1, 0, 3, 2, 4).reshape(b, blocks * block, h, d)
    return (y[:, :s] if blocks * block > s else y).transpose(1, 2)


def context_attention(q: Tensor, k: Tensor, v: Tensor, cp, start: int, window: int, group: int = 1,
                      sinks=None) -> Tensor:
    """Attention of this context chunk's queries [B, S_chunk, H, D] over the keys and values (the layer's KV heads,
    exchanged before they are repeated for the `group` query heads of each) that context_keys fetches, masked
    causally at the chunk's offset `start` (and to `window` on local layers; 0: global) -> [B, S_chunk, H, Dv].
    `sinks`: the layer's SinkLogits or None."""
    s = q.shape[1]
    ck, cv, k_start = context_keys(k, v, window, cp)
    ck, cv = ck.repeat_interleave(group, dim=2), cv.repeat_interleave(group, dim=2)
    if sinks is None and window:
        # Banded attention (window-sized work) over the up to window - 1 keys before this chunk and the chunk's
        # own, with zero queries standing for those earlier positions (their outputs are dropped).
        first = max(k_start, 0, start - window + 1)  # the earliest key position any query here sees
        h, lo = start - first, first - k_start
        kh, vh = ck[:, lo: lo + h + s], cv[:, lo: lo + h + s]
        qh = torch.cat([q.new_zeros(q.shape[0], h, *q.shape[2:]), q], dim=1) if h else q
        y = banded_attention(qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2), window)
        return y.transpose(1, 2)[:, h:]
    # Keys after this chunk are never seen: drop them. (Ranks are not load-balanced: the last rank's queries see
    # the whole sequence; Llama 3 gives each rank two chunks, i and 2 x cp - 1 - i, to even that out.)
    ck, cv = ck[:, : start + s - k_start], cv[:, : start + s - k_start]
    mask = context_mask(start, s, k_start, ck.shape[1], window, q.device)
    qt, kt, vt = q.transpose(1, 2), ck.transpose(1, 2), cv.transpose(1, 2)
    if sinks is not None:
        y = attention_with_sinks(qt, kt, vt, sinks.logits, mask)
    else:
        y = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
    return y.transpose(1, 2)


class Attention(nn.Module):
    cp = None  # backend.context_parallel.ContextShard: this rank's queries are one chunk of the sequence

    def __init__(self, spec: ModelSpec, layer: int, *, qk_norm: bool):
        super().__init__()
        a, d = spec.attention, spec.d_model
        self.heads, self.head_dim = a.heads, a.head_dim
        self.kv_stored, self.kv_heads = spec.kv_heads_stored(layer), spec.kv_heads(layer)
        self.is_global = spec.is_global(layer)
        self.window = 0 if self.is_global else spec.context(layer)
        q_dim, kv_dim = a.heads * a.head_dim, self.kv_stored * a.head_dim
        self.qkv = FusedLinear(d, (q_dim, kv_dim, kv_dim), a.bias)  # Q, K, V as one matmul (parts: q, k, v)
        self.o = nn.Linear(q_dim, d, bias=a.bias)
        self.gate = HeadGate(d, a.heads) if a.output_gate else None
        sites = spec.conv.sites if spec.conv is not None else []
        self.conv_k = ShortConv(kv_dim, spec.conv.kernel) if "k" in sites else None
        self.conv_v = ShortConv(kv_dim, spec.conv.kernel) if "v" in sites else None
        roped = spec.positional == "rope" and (not self.is_global or a.rope_on_global)
        self.rot_dim = rotary_dims(a.head_dim, a.rope_fraction) if roped else 0
        self.rope_theta = spec.rope_theta
        self.qk_norm = qk_norm
        # Learned per-head q/k gains (Qwen3) replace the parameter-free norm.
        self.q_norm = RMSNorm(a.head_dim) if spec.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim) if spec.qk_norm else None
        self.sinks = SinkLogits(a.heads) if a.sinks else None
        self.qk_multiplier = a.qk_multiplier
        self.exclusive = a.exclusive

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Q, K, V projections of x [B, S, d_model] (stored widths), one fused matmul."""
        return self.qkv.split(self.qkv(x))

    def reference_project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """project with one matmul per projection (the test oracle)."""
        return self.qkv.reference_forward(x)

    def forward(self, x: Tensor) -> Tensor:  # x: [B, S, d_model], already normed
        b, s, _ = x.shape
        q, k, v = self.project(x)
        q = q.view(b, s, self.heads, self.head_dim)
        if self.conv_k is not None:
            k = self.conv_k(k)
        if self.conv_v is not None:
            v = self.conv_v(v)
        # Slice the stored heads to the layer's logical count (Marin: projection[:, :, :num_kv_heads, :]).
        k = k.view(b, s, self.kv_stored, self.head_dim)[:, :, : self.kv_heads]
        v = v.view(b, s, self.kv_stored, self.head_dim)[:, :, : self.kv_heads]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.qk_norm:
            q, k = rms_norm(q), rms_norm(k)
        cp = self.cp if self.cp is not None and self.cp.size > 1 else None
        start = cp.start(s) if cp is not None else 0
        if self.rot_dim:
            q, k = (apply_rope(q, self.rot_dim, self.rope_theta, start),
                    apply_rope(k, self.rot_dim, self.rope_theta, start))
        if self.qk_multiplier != 1.0:
            q = q * self.qk_multiplier
        group = self.heads // self.kv_heads  # query head h reads KV head h // group
        if cp is not None:  # keys from the neighbouring window or the whole sequence (backend.context_parallel)
            y = context_attention(q, k, v, cp, start, self.window, group, self.sinks)
            v = v.repeat_interleave(group, dim=2)
        else:
            k = k.repeat_interleave(group, dim=2)
            v = v.repeat_interleave(group, dim=2)
            y = self._attention(q, k, v)
        if self.exclusive:
            dot = (y * v).sum(-1, keepdim=True)
            y = y - dot / ((v * v).sum(-1, keepdim=True) + XSA_EPS) * v
        if self.gate is not None:
            y = y * (2.0 * torch.sigmoid(self.gate(x)))[..., None]
        return self.o(y.reshape(b, s, self.heads * self.head_dim))

    def _attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Causal (or sliding-window) attention of a whole sequence, q, k, v [B, S, H, D] -> [B, S, H, D]."""
        s = q.shape[1]
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.sinks is not None:
            y = attention_with_sinks(qt, kt, vt, self.sinks.logits, window_mask(s, self.window or s, q.device))
        elif self.window and self.window < s:
            y = banded_attention(qt, kt, vt, self.window)
        else:
            y = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        return y.transpose(1, 2)  # [B, S, H, hd]
