"""MuonH / AdamH / Adam and AdamW (backend.optim).

    .venv/bin/pytest -q tests/test_backend_optim.py
"""

from __future__ import annotations

import pytest
import torch

from rackcast.backend.model import build_model, next_token_loss
from rackcast.backend.optim import (
    MuonH,
    build_optimizer,
    hyperball_step_,
    marin_lr_lambda,
    newton_schulz,
    optimizer_state_numel,
    param_group_names,
    param_groups,
)
from rackcast.presets import load_model


def tokens_for(spec, seed=0):
    return torch.randint(0, spec.vocab, (2, spec.seq_len), generator=torch.Generator().manual_seed(seed))


def train_steps(model, optimizer, steps, seed=0):
    losses = []
    for step in range(steps):
        tokens = tokens_for(model.spec, seed)
        optimizer.zero_grad(set_to_none=True)
        loss, _ = next_token_loss(model(tokens), tokens)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def matrix_norms(p: torch.Tensor) -> torch.Tensor:
    return torch.linalg.matrix_norm(p.detach().float())  # one norm per matrix: [E] for expert stacks


# ------------------------------------------------------------------------------------------------ hyperball
def test_muonh_and_adamh_hold_every_matrix_and_expert_norm_fixed():
    model = build_model(load_model("tiny-moe"))
    names = param_group_names(model)
    hyper = {n: p for n, p in model.named_parameters() if names[n] in ("muonh", "adamh")}
    before = {n: matrix_norms(p) for n, p in hyper.items()}
    optimizer = build_optimizer(model, "muonh", lr=0.02)
    snapshot = {n: p.detach().clone() for n, p in hyper.items()}
    train_steps(model, optimizer, 3)
    assert any(p.ndim == 3 for p in hyper.values())  # the expert stacks are covered, per expert
    for n, p in hyper.items():
        assert not torch.equal(p, snapshot[n]), n  # it moved...
        torch.testing.assert_close(matrix_norms(p), before[n], rtol=1e-5, atol=0, msg=n)  # ...on its sphere


def test_hyperball_step_moves_by_lr_of_the_norm_then_projects_back():
    w = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    u = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)) * 123.0  # the update's scale is irrelevant
    p = w.clone()
    hyperball_step_(p, u, lr=0.1)
    moved = w - 0.1 * u * w.norm() / u.norm()
    torch.testing.assert_close(p, moved * w.norm() / moved.norm())


# ------------------------------------------------------------------------------------------------ Newton-Schulz
@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (4, 48, 24)], ids=["tall", "wide", "expert-stack"])
def test_newton_schulz_output_is_near_orthogonal(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    x = newton_schulz(g, steps=5)
    assert x.shape == g.shape
    s = torch.linalg.svdvals(x)
    # The quintic trades exactness for speed: singular values land in a band around 1, not on 1.
    assert s.min() > 0.6 and s.max() < 1.2
    small = min(shape[-2:])
    gram = x @ x.mT if shape[-2] <= shape[-1] else x.mT @ x
    eye = torch.eye(small).expand_as(gram)
    assert (gram - eye).abs().max() < 0.45  # orthogonal up to that band: |s^2 - 1| < 0.44
    # and it keeps the input's singular directions (the polar factor U V^T, approximately)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    assert torch.nn.functional.cosine_similarity((u @ vh).flatten(), x.flatten(), dim=0) > 0.95


# ------------------------------------------------------------------------------------------------ grouping
def test_param_groups_put_each_parameter_in_its_group_by_rule():
    model = build_model(load_model("tiny-moe"))
    names = param_group_names(model)
    assert set(names) == {n for n, _ in model.named_parameters()}
    expect = {
        "embed.tok.weight": "adam",
        "embed.norm.norm.weight": "adam",
        "embed.norm.gated.down.weight": "muonh",
        "layers.0.attn_norm.norm.weight": "adam",
        "layers.0.attn_norm.gated.up.weight": "muonh",
        "layers.0.attn.qkv.weight": "muonh",
        "layers.0.attn.o.weight": "muonh",
        "layers.0.attn.gate.weight": "adam",
        "layers.0.attn.conv_k.weight": "adam",
        "layers.0.conv_attn.weight": "adam",
        "layers.0.conv_mlp.weight": "adam",
        "layers.0.mlp.router.weight": "adam",
        "layers.0.mlp.router.bias": "adam",
        "layers.0.mlp.latent_down.weight": "muonh",
        "layers.0.mlp.latent_norm.weight": "adam",
        "layers.0.mlp.latent_up.weight": "muonh",
        "layers.0.mlp.experts.w_gate_up": "muonh",
        "layers.0.mlp.experts.w_down": "muonh",
        "layers.0.mlp.shared.0.gate_up.weight": "muonh",
        "head.norm.norm.weight": "adam",
        "head.proj.weight": "adamh",
    }
    for name, group in expect.items():
        assert names[name] == group, name
    groups = param_groups(model)
    assert sum(len(v) for v in groups.values()) == len(list(model.parameters()))
    assert [p.ndim >= 2 for p in groups["muonh"]] == [True] * len(groups["muonh"])


def test_dense_gpt_groups_biases_and_tied_embedding_in_adam():
    model = build_model(load_model("tiny-dense"))
    names = param_group_names(model)
    assert "head.proj.weight" not in names and names["embed.tok.weight"] == "adam"  # tied head is the embedding
    assert names["embed.pos.weight"] == "adam"
    assert names["layers.0.attn.qkv.bias"] == names["layers.0.mlp.up.bias"] == "adam"
    assert names["layers.0.attn_norm.norm.bias"] == "adam"
    assert names["layers.0.mlp.down.weight"] == "muonh"
    assert param_groups(model)["adamh"] == []


# ------------------------------------------------------------------------------------------------ state and rules
def test_optimizer_state_is_one_buffer_for_muonh_and_two_for_adam():
    model = build_model(load_model("tiny-moe"))
    optimizer = build_optimizer(model, "muonh")
    train_steps(model, optimizer, 1)
    groups = param_groups(model)
    numel = {g: sum(p.numel() for p in ps if p.requires_grad) for g, ps in groups.items()}
    assert optimizer_state_numel(optimizer) == {
        "muonh": numel["muonh"],
        "adamh": 2 * numel["adamh"],
        "adam": 2 * numel["adam"],
    }
    adamw_model = build_model(load_model("tiny-moe"))
    adamw = build_optimizer(adamw_model, "adamw")
    train_steps(adamw_model, adamw, 1)
    trainable = sum(p.numel() for p in adamw_model.parameters() if p.requires_grad)
    assert sum(optimizer_state_numel(adamw).values()) == 2 * trainable
    assert {g["kind"] for g in adamw.param_groups} == {"decay", "no_decay"}


def test_adam_group_matches_torch_adam():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = MuonH([{"params": params, "kind": "adam", "lr": 0.01}], betas=(0.9, 0.95), eps=1e-8)
    ref = torch.optim.Adam(twins, lr=0.01, betas=(0.9, 0.95), eps=1e-8)
    for step in range(3):
        grads = [torch.randn_like(p) for p in params]
        for p, t, g in zip(params, twins, grads):
            p.grad, t.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    for p, t in zip(params, twins):
        torch.testing.assert_close(p, t)


@pytest.mark.parametrize("name", ["muonh", "adamw"])
def test_optimizer_lowers_loss_on_a_fixed_batch(name):
    model = build_model(load_model("tiny-moe"))
    lr = 0.02 if name == "muonh" else 3e-3
    losses = train_steps(model, build_optimizer(model, name, lr=lr, adam_lr=3e-3), 8)
    assert losses[-1] < losses[0] - 0.3


def test_marin_schedule_warms_up_then_decays_to_its_floor():
    f = marin_lr_lambda(1000)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(500) < 1.0 and f(999) == pytest.approx(0.05, abs=1e-3) and f(5000) == 0.05
