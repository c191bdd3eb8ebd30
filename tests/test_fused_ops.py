"""Fused projections and the ops that replaced Python loops (issue 14): the fused Q/K/V and gate/up matmuls, MuonH's
per-part treatment of fused matrices and the stacked quantile balancing, each against its unfused oracle.

    .venv/bin/pytest -q tests/test_fused_ops.py
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rackcast.backend.attention import Attention
from rackcast.backend.layers import FusedLinear, Mlp, make_normal
from rackcast.backend.model import build_model, next_token_loss
from rackcast.backend.moe import GroupedExperts
from rackcast.backend.optim import build_optimizer, hyperball, muonh_update_, newton_schulz, parameter_parts
from rackcast.presets import load_model

TOL = 1e-6  # fused against unfused: the same products, summed in another order at most
MODELS = ("tiny-moe", "tiny-dense", "tiny-gpt-oss", "tiny-qwen3")  # conv + latent MoE; GELU + biases; biased
# experts + sinks + windows; learned q/k norms


def _unfused(monkeypatch) -> None:
    """Route every fused op of the model through its oracle (one matmul per projection)."""
    monkeypatch.setattr(Attention, "project", Attention.reference_project)
    monkeypatch.setattr(Mlp, "forward", Mlp.reference_forward)
    monkeypatch.setattr(GroupedExperts, "forward", GroupedExperts.reference_forward)


def _loss_and_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    loss, _ = next_token_loss(model(tokens), tokens)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", MODELS)
def test_fused_model_matches_the_unfused_oracle_in_loss_and_every_gradient(name, monkeypatch):
    spec = load_model(name)
    model = build_model(spec, seed=0)
    tokens = torch.randint(0, spec.vocab, (2, min(48, spec.seq_len)), generator=torch.Generator().manual_seed(0))
    loss, grads = _loss_and_grads(model, tokens)
    _unfused(monkeypatch)
    ref_loss, ref_grads = _loss_and_grads(model, tokens)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=TOL)
    assert grads.keys() == ref_grads.keys()
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=TOL, atol=TOL, msg=n)


def test_fused_projections_are_single_parameters_with_their_parts_recorded():
    model = build_model(load_model("tiny-moe"))
    names = dict(model.named_parameters())
    attn, spec = model.layers[0].attn, load_model("tiny-moe")
    q_dim, kv_dim = spec.attention.heads * spec.attention.head_dim, attn.kv_stored * spec.attention.head_dim
    assert names["layers.0.attn.qkv.weight"].shape == (q_dim + 2 * kv_dim, spec.d_model)
    assert not any(n.endswith((".q.weight", ".k.weight", ".v.weight", "experts.w_gate", "experts.w_up"))
                   for n in names)
    parts = parameter_parts(model)
    assert parts["layers.0.attn.qkv.weight"] == (-2, (q_dim, kv_dim, kv_dim))
    assert parts["layers.0.mlp.experts.w_gate_up"] == (-1, (spec.moe.expert_ffn, spec.moe.expert_ffn))
    assert parts["layers.0.mlp.shared.0.gate_up.weight"] == (-2, (spec.moe.shared_ffn, spec.moe.shared_ffn))


def test_fused_linear_draws_each_part_as_separate_projections_would():
    fused = FusedLinear(6, (4, 2, 2), bias=True)
    fused.init_weights(make_normal(0.1, torch.Generator().manual_seed(5)))
    normal = make_normal(0.1, torch.Generator().manual_seed(5))
    separate = [torch.empty(n, 6) for n in (4, 2, 2)]
    for t in separate:
        normal(t)
    torch.testing.assert_close(fused.weight, torch.cat(separate), rtol=0, atol=0)
    assert fused.bias.abs().sum() == 0


# ------------------------------------------------------------------------------------------------ MuonH per part
def _random(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape,parts", [((12, 8), (-2, (6, 3, 3))), ((3, 8, 10), (-1, (5, 5)))])
def test_muonh_steps_each_part_of_a_fused_matrix_as_its_own_matrix(shape, parts):
    w, u = _random(*shape, seed=0), _random(*shape, seed=1)
    fused = w.clone()
    muonh_update_([fused], [u], 0.05, 5, ["layers.attn.qkv.weight"], [parts])
    dim, sizes = parts
    pieces = [p.contiguous() for p in w.split(sizes, dim)]
    muonh_update_(pieces, [p.contiguous() for p in u.split(sizes, dim)], 0.05, 5, ["q", "k", "v"][: len(sizes)])
    torch.testing.assert_close(fused, torch.cat(pieces, dim), rtol=TOL, atol=TOL)
    # and not the fused matrix orthogonalised whole: the parts' norms are each kept
    for got, was in zip(fused.split(sizes, dim), w.split(sizes, dim)):
        torch.testing.assert_close(torch.linalg.matrix_norm(got), torch.linalg.matrix_norm(was), rtol=1e-5, atol=0)
    whole = hyperball(w, newton_schulz(u), 0.05)
    assert not torch.allclose(whole, fused, atol=1e-4)


def test_muonh_on_a_sharded_fused_matrix_equals_the_plain_step(tmp_path):
    """The FSDP2 path (DTensor parameters) orthogonalises and hyperball-steps the parts as the plain path does; one
    gloo rank, so the DTensor code runs in this process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from rackcast.backend.optim import MuonH

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        w, g = _random(12, 8, seed=0), _random(12, 8, seed=1)
        parts = (-2, (6, 3, 3))
        results = []
        for sharded in (False, True):
            p = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)]) if sharded else w.clone())
            p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)]) if sharded else g.clone()
            MuonH([{"params": [p], "kind": "muonh", "roles": ["r"], "parts": [parts]}], lr=0.05).step()
            results.append(p.detach().full_tensor() if sharded else p.detach())
        torch.testing.assert_close(results[1], results[0], rtol=TOL, atol=TOL)
    finally:
        if owned:
            dist.destroy_process_group()


def test_two_muonh_steps_of_the_fused_model_track_the_unfused_oracle(monkeypatch):
    """The parameters after two MuonH steps of the fused model equal those of the model run through the unfused
    oracles: the fused ops' rounding does not grow through the optimizer."""
    spec = load_model("tiny-moe")
    tokens = torch.randint(0, spec.vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    params = []
    for unfused in (False, True):
        if unfused:
            _unfused(monkeypatch)
        model = build_model(spec, seed=0)
        opt = build_optimizer(model, "muonh", lr=0.02, adam_lr=0.003)
        for _ in range(2):
            _loss_and_grads(model, tokens)
            opt.step()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    for n, p in params[1].items():
        torch.testing.assert_close(params[0][n], p, rtol=1e-5, atol=1e-6, msg=n)


def test_quantile_balancing_of_stacked_layers_equals_one_layer_at_a_time():
    from rackcast.backend.balancing import histogram_upper_quantile

    layers = [torch.randn(300, 8, generator=torch.Generator().manual_seed(i)) * (i + 1) for i in range(3)]
    stacked = histogram_upper_quantile(torch.stack(layers), 2, bins=100)
    assert stacked.shape == (3, 8)
    for got, m in zip(stacked, layers):
        torch.testing.assert_close(got, histogram_upper_quantile(m, 2, bins=100), rtol=0, atol=0)
