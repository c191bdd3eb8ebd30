"""What the estimate and the simulator price for the frontier recipes' features, against closed forms and against
rackcast's own backend: multi-head latent attention's saved tensors (simulator.activations), the multi-token-
prediction modules' parameters, optimizer state and activations on the stage holding the head (simulator.memory),
and node-limited routing's cross-node all-to-all bytes, one formula (simulator.costs.cross_domain_a2a_share) in the
estimate and the simulator.

    .venv/bin/pytest -q tests/test_frontier_pricing.py
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import simpy
import torch
from torch import nn

from conftest import PLANS
from test_activations import _batch, _plan, saved_bytes
from rackcast.backend.model import build_model
from rackcast.backend.optim import build_optimizer, optimizer_state_numel
from rackcast.plan import Plan, load_plan
from rackcast.presets import load_model
from rackcast.simulator.activations import (FP32, latent_attention_bytes_per_token, layer_activation_bytes_per_token,
                                   mtp_activation_bytes_per_token)
from rackcast.simulator import costs
from rackcast.simulator.estimate import estimate, plan_features
from rackcast.simulator.memory import memory_breakdown, rank_params, static_bytes
from rackcast.simulator.stepnet import StepNetwork
from rackcast.simulator.workload import Workload
from rackcast.strict import from_data


def _gpu_plan(model: str, **parallel) -> Plan:
    return from_data(Plan, {"name": "t", "model": model, "topology": {"name": "gb200-nvl72", "domains": 4},
                            "parallel": parallel, "batch": {"global_batch": 256, "micro_batch": 1},
                            "optimizer": {"name": "adamw"}})


# ------------------------------------------------------------------------------------------ latent attention
def test_fused_mla_bytes_equal_the_latents_their_norms_the_rope_key_and_the_expanded_qkv_of_deepseek_v3():
    spec, plan = load_model("deepseek-v3"), _gpu_plan("deepseek-v3")
    # DeepSeek-V3 config.json: hidden 7168, q_lora_rank 1536, kv_lora_rank 512, 128 heads of nope 128 + rope 64
    # keys, v_head_dim 128. Saved in bf16: the input; the query latent and its normalised copy; [c_kv | k_rope] and
    # the normalised c_kv; Q and K (128 x 192), V (128 x 128); the fp32 log-sum-exp per head; O's input (128 x 128).
    elements = 7168 + 2 * 1536 + (512 + 64) + 512 + 2 * 128 * 192 + 128 * 128 + 128 * 128
    assert latent_attention_bytes_per_token(spec, plan, 2) == 2 * elements + FP32 * 128
    tp = _gpu_plan("deepseek-v3", tensor=4, sequence_parallel=True)  # latents whole, heads split, input sharded
    split = 7168 / 4 + 2 * 1536 + (512 + 64) + 512 + (2 * 128 * 192 + 2 * 128 * 128) / 4
    assert latent_attention_bytes_per_token(spec, tp, 2) == 2 * split + FP32 * 128 / 4


def test_an_mla_layer_counts_its_latent_attention_in_place_of_the_gqa_terms():
    spec, plan = load_model("deepseek-v3"), _gpu_plan("deepseek-v3")
    dense_layer = layer_activation_bytes_per_token(spec, 0, plan)
    without = dataclasses.replace(spec, attention=dataclasses.replace(spec.attention, mla=None, head_dim=128))
    # the MLP block is the same; the attention block differs by the MLA count less a GQA count (input, Q, K, V, LSE, O)
    e, d, h = 2, 7168, 128
    gqa = e * d + e * 3 * h * 128 + FP32 * h + e * h * 128
    assert dense_layer - layer_activation_bytes_per_token(without, 0, plan) == \
        pytest.approx(latent_attention_bytes_per_token(spec, plan, e) - gqa)


@pytest.mark.parametrize("equal_head_dims", [False, True], ids=["math-sdpa", "flash-sdpa"])
def test_eager_mla_bytes_equal_what_autograd_saves_in_the_backends_latent_attention(equal_head_dims):
    spec, micro_batch = load_model("tiny-deepseek-v3"), 2
    if equal_head_dims:  # q/k head 8 + 8 = v head 16: SDPA's flash kernel instead of the math path
        a = spec.attention
        mla = dataclasses.replace(a.mla, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16)
        spec = dataclasses.replace(spec, attention=dataclasses.replace(a, mla=mla, head_dim=16))
    plan, model = _plan("tiny-deepseek-v3", micro_batch), build_model(spec, seed=0)
    x = torch.randn(micro_batch, spec.seq_len, spec.d_model, requires_grad=True)
    for block in model.layers:
        got = saved_bytes(block.attn, x, counted=(x,)) / (micro_batch * spec.seq_len)
        assert latent_attention_bytes_per_token(spec, plan, FP32, "eager") == got


# ------------------------------------------------------------------------------------ multi-token prediction
def test_the_last_rank_holds_the_mtp_modules_parameters():
    spec = load_model("deepseek-v3")
    one = _gpu_plan("deepseek-v3")
    held = rank_params(spec, one)
    assert held.dense + held.expert == spec.params_total  # params_mtp (11.6B) included
    piped = _gpu_plan("deepseek-v3", pipeline=4, stage_layers=[16, 15, 15, 15])
    ranks = [rank_params(spec, piped, r) for r in range(4)]
    without = dataclasses.replace(spec, mtp=None)
    assert [r.dense + r.expert for r in ranks[:3]] == \
        [rank_params(without, piped, r).dense + rank_params(without, piped, r).expert for r in range(3)]
    last_without = rank_params(without, piped, 3)
    assert ranks[3].dense + ranks[3].expert - last_without.dense - last_without.expert == spec.params_mtp


def test_weights_gradients_and_optimizer_state_with_mtp_equal_what_the_backends_whole_model_keeps():
    plan = load_plan(PLANS / "tiny-deepseek-v3.yaml")
    spec = plan.model_spec()
    model = nn.ModuleList([build_model(spec, seed=0)])  # the whole model, its MTP module included
    optimizer = build_optimizer(model, plan.optimizer.name)
    trained = [p for p in model.parameters() if p.requires_grad]
    for p in trained:
        p.grad = torch.ones_like(p)
    optimizer.step()
    static = static_bytes(rank_params(spec, plan), plan, "fp32")
    assert static["weights"] == 4 * sum(p.numel() for p in model.parameters())
    assert static["gradients"] == 4 * sum(p.numel() for p in trained)
    assert static["optimizer"] == 4 * sum(optimizer_state_numel(optimizer).values())


def test_eager_mtp_bytes_match_what_autograd_saves_in_the_backends_mtp_module():
    spec, micro_batch = load_model("tiny-deepseek-v3"), 2
    plan, model = _plan("tiny-deepseek-v3", micro_batch), build_model(spec, seed=0)
    tokens, _ = _batch(spec, micro_batch)
    hidden = torch.randn(micro_batch, spec.seq_len, spec.d_model, requires_grad=True)
    logits = torch.randn(micro_batch, spec.seq_len, spec.vocab, requires_grad=True)
    got = saved_bytes(lambda h: model.mtp.attach(logits, h, tokens, model.embed.tok, model.head.weight), hidden)
    # within 1%: the count takes the block's attention probabilities over seq_len positions, the module runs seq_len - 1
    assert mtp_activation_bytes_per_token(spec, plan, "fp32", "eager") == \
        pytest.approx(got / (micro_batch * spec.seq_len), rel=0.01)


def test_fused_mtp_bytes_are_one_last_layer_and_the_modules_d_wide_tensors_on_the_last_stage():
    spec, plan = load_model("deepseek-v3"), _gpu_plan("deepseek-v3")
    e, d, s = 2, spec.d_model, spec.seq_len
    # embedding norm input, projection input (2d), the block, final norm input, head input; seq_len - 1 positions
    module = e * d + 2 * e * d + layer_activation_bytes_per_token(spec, spec.layers - 1, plan) + 2 * e * d
    assert mtp_activation_bytes_per_token(spec, plan) == pytest.approx(module * (s - 1) / s)
    without = dataclasses.replace(spec, mtp=None)
    tokens = plan.tokens_per_microbatch(spec)
    assert memory_breakdown(spec, plan).activations - memory_breakdown(without, plan).activations == \
        pytest.approx(mtp_activation_bytes_per_token(spec, plan) * tokens)


# ---------------------------------------------------------------------------------------- node-limited routing
@pytest.mark.parametrize("domains, reached", [(2, 2), (3, 3), (4, 4), (8, 4), (16, 8), (32, 8)])
def test_node_limited_copies_are_at_most_node_limit_groups_of_domains_and_top_k(domains, reached):
    spec = load_model("deepseek-v3")  # top_k 8 of 256 experts in 8 groups, node limit 4
    # min(top_k, domains, 4 x the domains one group touches): 1 up to 8 domains (3 straddles: 2), 2 at 16, 4 at 32
    assert costs.node_limited_copies(spec, domains) == reached
    assert costs.cross_domain_a2a_share(spec, domains) == reached / 8
    assert costs.cross_domain_a2a_share(spec, 1) == 1.0  # one domain: nothing crosses
    unlimited = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, node_limit=0))
    assert costs.node_limited_copies(unlimited, domains) == 8 and costs.cross_domain_a2a_share(unlimited, domains) == 1


def _a2a_plan(node_limit: bool) -> tuple:
    """DeepSeek-V3 with its experts over 64 H100s in 8 HGX nodes (8 domains), force-balanced routing."""
    plan = from_data(Plan, {"name": "t", "model": "deepseek-v3", "topology": {"name": "h100-hgx", "domains": 8},
                            "parallel": {"expert": 64, "pipeline": 1}, "batch": {"global_batch": 64, "micro_batch": 1},
                            "optimizer": {"name": "adamw"}, "expert_transport": {"routing": "balanced"}})
    spec = plan.model_spec()
    if not node_limit:
        spec = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, node_limit=0))
    return plan, spec


def _port_bytes(plan, spec) -> tuple[np.ndarray, np.ndarray]:
    """Per-rank (send, recv) bytes by pair category (local, same rail, other rail) of one MoE layer's dispatch."""
    topo = plan.topology_spec()
    work = Workload(spec, plan, topo, seed=0)
    cats = StepNetwork(simpy.Environment(), plan, topo, reduce=False).a2a_categories(0)
    layer = work.loads.layers[0]
    return work.loads.port_bytes(layer, 0, "d", cats)


def test_simulator_sends_node_limit_copies_across_nodes_and_forwards_the_rest_over_nvlink():
    plan, limited = _a2a_plan(True)
    send, recv = _port_bytes(plan, limited)
    free_send, free_recv = _port_bytes(*_a2a_plan(False))
    share = costs.cross_domain_a2a_share(limited, 8)
    assert share == 0.5  # 4 nodes of 8 reached, not top_k = 8 copies
    np.testing.assert_allclose(send[:, 1:], share * free_send[:, 1:])  # across the NICs
    np.testing.assert_allclose(recv[:, 1:], share * free_recv[:, 1:])
    forwarded = (1 - share) * free_recv[:, 1:].sum(axis=1)
    np.testing.assert_allclose(recv[:, 0], free_recv[:, 0] + forwarded)  # inside the node
    np.testing.assert_allclose(recv.sum(), free_recv.sum())  # every routed row still arrives


def test_estimate_and_simulator_price_the_same_cross_node_a2a_share():
    plan, limited = _a2a_plan(True)
    free = _a2a_plan(False)[1]
    topo = plan.topology_spec()
    est = plan_features(limited, plan, topo)["a2a_bytes"] / plan_features(free, plan, topo)["a2a_bytes"]
    send, _ = _port_bytes(plan, limited)
    free_send, _ = _port_bytes(plan, free)
    sim = send[:, 1:].sum() / free_send[:, 1:].sum()
    assert est == pytest.approx(sim) == 0.5
    assert estimate(plan, spec=limited).step_time_s < estimate(plan, spec=free).step_time_s
