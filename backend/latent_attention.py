"""Multi-head latent attention (DeepSeek-V2/V3) built from a ModelSpec layer with `attention.mla` set.

Queries and keys/values pass through low-rank latents (ModelSpec's LatentAttentionSpec gives the shapes):
    q = W_qb RMSNorm(W_qa x)                      (or W_q x when q_lora_rank is 0)
    [c_kv, k_rope] = W_kva x;  [k_nope, v] = W_kvb RMSNorm(c_kv)
Each query/key head is [nope | rope]: RoPE turns the last qk_rope_head_dim dims of every query head and the one
shared k_rope head, which joins every key head. Values have v_head_dim per head; the softmax scale is
1/sqrt(qk_nope_head_dim + qk_rope_head_dim). The training form (keys and values expanded per head); the absorbed
form that caches only c_kv is an inference optimisation. Sliding windows follow the spec's per-layer pattern.
Under context parallelism the expanded keys and values are exchanged as for grouped-query attention
(backend.attention.context_attention): more bytes than the latent c_kv and k_rope would be, but no second
up-projection of the other chunks' latents on every rank; simulator.costs.context_bytes prices those bytes.

    .venv/bin/pytest -q tests/test_backend_model.py -k latent
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rackcast.backend.attention import context_attention, window_mask
from rackcast.backend.layers import RMSNorm, apply_rope
from rackcast.modelspec import ModelSpec


class LatentAttention(nn.Module):
    cp = None  # backend.context_parallel.ContextShard: this rank's queries are one chunk of the sequence

    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        a, mla, d = spec.attention, spec.attention.mla, spec.d_model
        self.heads, self.nope, self.rope, self.v_dim = a.heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim, \
            mla.v_head_dim
        self.kv_rank = mla.kv_lora_rank
        q_out = a.heads * mla.qk_head_dim
        if mla.q_lora_rank:
            self.q_a = nn.Linear(d, mla.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(mla.q_lora_rank)
            self.q_b = nn.Linear(mla.q_lora_rank, q_out, bias=False)
        else:
            self.q_a, self.q_norm, self.q_b = None, None, nn.Linear(d, q_out, bias=False)
        self.kv_a = nn.Linear(d, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(mla.kv_lora_rank)
        self.kv_b = nn.Linear(mla.kv_lora_rank, a.heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o = nn.Linear(a.heads * mla.v_head_dim, d, bias=False)
        self.window = 0 if spec.is_global(layer) else spec.context(layer)
        self.rope_theta = spec.rope_theta
        self.roped = spec.positional == "rope"

    def _rope_last(self, x: Tensor, start: int) -> Tensor:
        """RoPE on the last `rope` dims of each head of x [B, S, H, D] whose first position is `start` (apply_rope
        turns the first dims)."""
        if not self.roped:
            return x
        front, back = x[..., : -self.rope], x[..., -self.rope:]
        return torch.cat([front, apply_rope(back, self.rope, self.rope_theta, start)], dim=-1)

    def forward(self, x: Tensor) -> Tensor:  # x: [B, S, d_model], already normed
        b, s, _ = x.shape
        cp = self.cp if self.cp is not None and self.cp.size > 1 else None
        start = cp.start(s) if cp is not None else 0
        q = self.q_b(self.q_norm(self.q_a(x))) if self.q_a is not None else self.q_b(x)
        q = self._rope_last(q.view(b, s, self.heads, self.nope + self.rope), start)
        latent, k_rope = self.kv_a(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_b(self.kv_norm(latent)).view(b, s, self.heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = self._rope_last(k_rope.view(b, s, 1, self.rope), start).expand(b, s, self.heads, self.rope)
        k = torch.cat([k_nope, k_rope], dim=-1)
        if cp is not None:  # the expanded keys and values of the other chunks (backend.context_parallel)
            y = context_attention(q, k, v, cp, start, self.window)
            return self.o(y.reshape(b, s, self.heads * self.v_dim))
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.window and self.window < s:
            y = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=window_mask(s, self.window, x.device))
        else:
            y = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, self.heads * self.v_dim))
