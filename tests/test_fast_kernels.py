"""The trainer's fast kernels against their references: grouped-GEMM experts against the per-expert loop
(backend.moe.GroupedExperts.reference_forward), windowed attention against dense masked SDPA, batched Newton-Schulz
against one matrix at a time.

    .venv/bin/pytest -q tests/test_fast_kernels.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rackcast.backend.attention import banded_attention, window_mask
from rackcast.backend.layers import make_normal
from rackcast.backend.moe import GroupedExperts
from rackcast.backend.optim import MuonH, hyperball_step_, newton_schulz

REL = 1e-5


def _experts(n_experts: int, dim: int, width: int, activation: str, bias: bool) -> GroupedExperts:
    ex = GroupedExperts(n_experts, dim, width, activation, bias)
    ex.init_weights(make_normal(0.3, torch.Generator().manual_seed(1)))
    if bias:  # non-zero biases, so their gathering is checked too
        with torch.no_grad():
            for name, p in ex.named_parameters():
                if name.startswith("b_"):
                    p.normal_(generator=torch.Generator().manual_seed(2))
    return ex


def _loss_and_grads(ex: GroupedExperts, fn, x: torch.Tensor, counts) -> tuple[torch.Tensor, dict]:
    ex.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = fn(x, counts)
    loss = (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum() + y.pow(2).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in ex.named_parameters()}
    grads["x"] = x.grad.clone() if x.grad is not None else torch.zeros_like(x)  # no rows: x is not in the graph
    return loss.detach(), grads


@pytest.mark.parametrize("activation,bias", [("swiglu", False), ("swiglu", True), ("gelu", True)])
@pytest.mark.parametrize("counts", [[3, 0, 5, 2, 0, 1], [0, 0, 7, 0, 0, 0], [2, 2, 2, 2, 2, 2]])
@pytest.mark.parametrize("dim,width", [(8, 16), (6, 10)])  # 6 x 10: rows not 16-byte aligned, padded
def test_grouped_gemm_experts_equal_the_per_expert_loop_with_empty_experts(activation, bias, counts, dim, width):
    ex = _experts(len(counts), dim, width, activation, bias)
    x = torch.randn(sum(counts), dim, generator=torch.Generator().manual_seed(3))
    loss, grads = _loss_and_grads(ex, ex, x, torch.tensor(counts))
    ref_loss, ref_grads = _loss_and_grads(ex, ex.reference_forward, x, counts)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=REL)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=REL, atol=1e-6, msg=name)
    empty = [e for e, n in enumerate(counts) if n == 0]
    w_in = "w_gate_up" if activation == "swiglu" else "w_up"
    assert all(grads[w_in][e].abs().sum() == 0 for e in empty)  # an empty expert gets a zero gradient


def test_grouped_gemm_experts_with_no_rows_keep_zero_gradients():
    ex = _experts(4, 8, 16, "swiglu", False)
    loss, grads = _loss_and_grads(ex, ex, torch.zeros(0, 8), torch.zeros(4, dtype=torch.int64))
    assert loss.item() == 0.0 and all(g.abs().sum() == 0 for g in grads.values())


def test_grouped_gemm_experts_reject_counts_of_the_wrong_length():
    with pytest.raises(ValueError, match="counts has 3 entries for 4 experts"):
        _experts(4, 8, 16, "swiglu", False)(torch.zeros(3, 8), torch.ones(3, dtype=torch.int64))


def test_grouped_gemm_experts_under_bf16_autocast_track_fp32():
    ex = _experts(4, 8, 16, "swiglu", False)
    x, counts = torch.randn(9, 8, generator=torch.Generator().manual_seed(4)), torch.tensor([4, 0, 3, 2])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ex(x, counts)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ex.reference_forward(x, counts), rtol=0.05, atol=0.02)


@pytest.mark.parametrize("seq,window", [(64, 16), (70, 16), (33, 7), (40, 39), (16, 1)])
def test_windowed_attention_equals_dense_masked_attention(seq, window):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, seq, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    y = banded_attention(q, k, v, window)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(seq, window, q.device))
    torch.testing.assert_close(y, ref)
    w = torch.randn(y.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((y * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_batched_newton_schulz_equals_one_matrix_at_a_time():
    g = torch.randn(6, 12, 20, generator=torch.Generator().manual_seed(6))
    batched = newton_schulz(g)
    for i in range(g.shape[0]):
        torch.testing.assert_close(batched[i], newton_schulz(g[i]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("nesterov", [True, False])
def test_muonh_batched_over_shapes_equals_the_per_matrix_step(nesterov):
    gen = torch.Generator().manual_seed(7)
    shapes = [(12, 20), (3, 12, 20), (20, 12), (12, 20), (4, 8, 8)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    twins = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(t) for t in twins]
    lr, mu = 0.05, 0.95
    opt = MuonH([{"params": params, "kind": "muonh", "lr": lr}], momentum=mu, nesterov=nesterov)
    for _ in range(3):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for t, b, g in zip(twins, bufs, grads):  # the reference: one parameter (and its matrices) at a time
            b.mul_(mu).add_(g)
            hyperball_step_(t, newton_schulz(g + mu * b if nesterov else b), lr)
    for p, t in zip(params, twins):
        torch.testing.assert_close(p.detach(), t, rtol=1e-5, atol=1e-6)
