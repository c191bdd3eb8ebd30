"""The trainer's frontier features on the reduced-width twins of today's presets: latent attention, attention sinks,
learned QK-norm, multi-token prediction, dense-first layers, node-limited routing, the auxiliary loss and the
auxiliary-loss-free bias (backend.latent_attention, backend.sinks, backend.mtp, backend.frontier_routing).

    .venv/bin/pytest -q tests/test_backend_frontier.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from rackcast.backend.attached_loss import AttachedLoss
from rackcast.backend.attention import window_mask
from rackcast.backend.balancing import AuxFreeBiasBalancer
from rackcast.backend.frontier_routing import group_limited, switch_aux_loss
from rackcast.backend.latent_attention import LatentAttention
from rackcast.backend.model import build_model, count_parameters, next_token_loss
from rackcast.backend.sinks import attention_with_sinks
from rackcast.presets import load_model
from test_backend_model import skewed_moe, tokens_for

TWINS = ["tiny-deepseek-v3", "tiny-qwen3", "tiny-gpt-oss", "tiny-mixtral", "tiny-llama-3.1"]


@pytest.mark.parametrize("name", TWINS)
def test_twin_parameter_count_equals_spec_params_total(name):
    spec = load_model(name)
    assert count_parameters(build_model(spec)) == spec.params_total


@pytest.mark.parametrize("name", ["deepseek-v3", "gpt-oss-120b"])
def test_full_size_frontier_preset_on_meta_device_counts_exactly(name):
    spec = load_model(name)
    assert count_parameters(build_model(spec, device="meta")) == spec.params_total


@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-gpt-oss"])  # latent attention + MTP; sinks + windows
def test_twin_changing_future_tokens_leaves_earlier_logits_unchanged(name):
    spec = load_model(name)
    model = build_model(spec).eval()
    tokens = tokens_for(spec)
    cut = spec.seq_len // 2
    changed = tokens.clone()
    changed[:, cut:] = (changed[:, cut:] + 1) % spec.vocab
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :cut], after[:, :cut], rtol=0, atol=1e-5)
    assert not torch.allclose(before[:, cut:], after[:, cut:])


@pytest.mark.parametrize("name", TWINS)
def test_twin_forward_backward_reaches_every_trained_parameter(name):
    spec = load_model(name)
    model = build_model(spec).train()
    loss, _ = next_token_loss(model(tokens_for(spec)), tokens_for(spec))
    loss.backward()
    assert torch.isfinite(loss)
    for pname, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, pname


def test_latent_attention_layer_has_the_config_shapes():
    spec = load_model("tiny-deepseek-v3")
    attn = build_model(spec).layers[0].attn
    mla = spec.attention.mla
    assert isinstance(attn, LatentAttention)
    assert attn.q_a.weight.shape == (mla.q_lora_rank, spec.d_model)
    assert attn.kv_a.weight.shape == (mla.kv_lora_rank + mla.qk_rope_head_dim, spec.d_model)
    assert attn.kv_b.weight.shape == (4 * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)
    assert sum(p.numel() for p in attn.parameters()) == sum(
        v for k, v in spec.layer_param_breakdown(0).items() if k in ("attn_q", "attn_kv", "attn_o"))


def test_sinks_rescale_attention_by_the_share_the_sink_takes():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=gen) for _ in range(3))
    mask = window_mask(6, 6, q.device)
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(attention_with_sinks(q, k, v, torch.full((2,), -1e4), mask), plain)
    # A sink logit equal to every score would take exactly half of the first query's weight (it sees one key).
    scores0 = (q[0, :, 0] * k[0, :, 0]).sum(-1) / 8 ** 0.5
    out = attention_with_sinks(q, k, v, scores0, mask)
    torch.testing.assert_close(out[0, :, 0], 0.5 * v[0, :, 0])


def test_group_limited_routing_keeps_each_token_inside_its_best_groups():
    scores = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    limited = group_limited(scores, groups=4, limit=2)
    chosen = limited.topk(4, dim=-1).indices
    assert all(len(set((row // 4).tolist())) <= 2 for row in chosen)
    spec = load_model("tiny-deepseek-v3")
    moe = build_model(spec).moe_layers()[1]
    ids, _ = moe.route(torch.randn(256, spec.d_model, generator=torch.Generator().manual_seed(1)))
    per_group = spec.moe.experts // spec.moe.expert_groups
    assert max(len(set((row // per_group).tolist())) for row in ids) <= spec.moe.node_limit


def test_switch_aux_loss_is_its_weight_when_routing_is_uniform_and_grows_with_skew():
    logits = torch.zeros(8, 4)
    ids = torch.arange(8).view(4, 2) % 4
    assert float(switch_aux_loss(logits, ids, 0.01)) == pytest.approx(0.01)
    skewed = torch.zeros(8, 4)
    skewed[:, 0] = 5.0
    assert float(switch_aux_loss(skewed, torch.zeros(8, 2, dtype=torch.long), 0.01)) > 0.03


def test_aux_loss_reaches_the_router_through_the_layer_output():
    spec = load_model("tiny-mixtral")
    moe = build_model(spec).moe_layers()[0].train()
    x = torch.randn(2, 16, spec.d_model, generator=torch.Generator().manual_seed(0))
    moe(x).sum().mul(0.0).backward()  # the main loss contributes nothing: any router gradient is the aux loss's
    assert moe.router.weight.grad.abs().sum() > 0


def test_aux_free_bias_moves_load_toward_the_mean_without_a_gradient():
    moe, x = skewed_moe()
    balancer = AuxFreeBiasBalancer(moe, rate=0.5)  # the skew puts experts 0 and 1 tens of logits ahead
    ratios = []
    for _ in range(60):
        with torch.no_grad():
            moe(x)
        load = moe.last_routing_counts.float()
        ratios.append(float(load.max() / load.mean()))  # 1.0 is balanced; E/K = 4 when two experts take all
        balancer.step()
    assert ratios[0] == 4.0 and sum(ratios[-10:]) / 10 < 2.2  # sign steps settle into a small oscillation
    assert moe.router.bias.grad is None and float(moe.router.bias[0]) < 0 < float(moe.router.bias[-1])


def test_mtp_loss_trains_the_mtp_module_and_leaves_logits_unchanged():
    spec = load_model("tiny-deepseek-v3")
    model = build_model(spec).train()
    tokens = tokens_for(spec)
    AttachedLoss.backward_scale = 1.0
    logits = model(tokens)
    without = dataclasses.replace(spec, mtp=None)
    plain = build_model(without).train()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")})
    torch.testing.assert_close(plain(tokens), logits)
    logits.sum().mul(0.0).backward()  # only the attached MTP loss has a gradient
    assert float(model.mtp.last_loss) > 0
    assert model.mtp.modules_by_depth[0].proj.weight.grad.abs().sum() > 0
