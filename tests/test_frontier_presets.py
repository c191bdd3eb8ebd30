"""Exact accounting of today's frontier presets against their public configs and published figures, and the
ModelSpec features they need (latent attention, multi-token prediction, dense-first layers, attention sinks,
per-layer attention patterns, node-limited routing, the balancing method).

Published totals and active counts are rounded (or, for Llama 3.1 405B, truncated: 405.85B is called 405B) to the
digits they are quoted with, so a preset passes when its exact count lies within one unit of the last quoted digit.
Publishers count "active" differently; each test states the convention its publisher used.

    .venv/bin/python -m pytest -q tests/test_frontier_presets.py
"""

from __future__ import annotations

import dataclasses

import pytest

from rackcast.errors import RackcastError
from rackcast.modelspec import FlopsConvention, ModelSpec
from rackcast.presets import load_model
from rackcast.strict import from_data, to_data

DSV3 = load_model("deepseek-v3")


def _within_last_digit(exact: int, published: float, unit: float) -> bool:
    return abs(exact - published) < unit


def _head(spec: ModelSpec) -> int:
    return spec.top_param_breakdown().get("head", 0)


# (preset, published total, unit of its last digit, published active, unit, active convention)
PUBLISHED = [
    # DeepSeek-V3 report: 671B total (without the 14B MTP module), 37B activated per token (output head included).
    ("deepseek-v3", 671e9, 1e9, 37e9, 1e9, "head"),
    # Qwen3 report Table 2: 235B total, 22B activated (embedding and head included).
    ("qwen3-235b-a22b", 235e9, 1e9, 22e9, 1e9, "embedding+head"),
    # gpt-oss model card Table 1: 116.83B total, 5.13B active (unembedding counted, embedding not).
    ("gpt-oss-120b", 116.83e9, 0.01e9, 5.13e9, 0.01e9, "head"),
    # Mistral: 141B total, 39B active.
    ("mixtral-8x22b", 141e9, 1e9, 39e9, 1e9, "embedding+head"),
    # Meta: 405B (405.85B counted exactly), dense: every parameter is active.
    ("llama-3.1-405b", 405e9, 1e9, 405e9, 1e9, "embedding+head"),
]


@pytest.mark.parametrize("name, total, total_unit, active, active_unit, convention", PUBLISHED)
def test_preset_params_match_published_total_and_active(name, total, total_unit, active, active_unit, convention):
    spec = load_model(name)
    main_model = spec.params_total - spec.params_mtp
    assert _within_last_digit(main_model, total, total_unit), f"{name}: total {main_model:,} vs {total:.4g}"
    extra = _head(spec) if convention == "head" else spec.params_embedding
    assert _within_last_digit(spec.params_active + extra, active, active_unit), \
        f"{name}: active {spec.params_active + extra:,} vs {active:.4g}"


@pytest.mark.parametrize("name, exact", [
    ("deepseek-v3", 671_026_419_200),      # main model; the HF checkpoint adds the MTP layer and FP8 scales
    ("qwen3-235b-a22b", 235_093_634_560),
    ("gpt-oss-120b", 116_829_156_672),     # the model card's 116.83B
    ("mixtral-8x22b", 140_620_634_112),
    ("llama-3.1-405b", 405_853_388_800),
])
def test_preset_main_model_params_are_exact(name, exact):
    spec = load_model(name)
    assert spec.params_total - spec.params_mtp == exact


def test_deepseek_v3_latent_attention_matches_config_closed_form():
    d, h, qr, kvr, nope, rope, v = 7168, 128, 1536, 512, 128, 64, 128
    parts = DSV3.layer_param_breakdown(0)
    assert parts["attn_q"] == d * qr + qr + qr * h * (nope + rope)  # q_a_proj, q_a_layernorm, q_b_proj
    assert parts["attn_kv"] == d * (kvr + rope) + kvr + kvr * h * (nope + v)  # kv_a_proj_with_mqa, norm, kv_b_proj
    assert parts["attn_o"] == h * v * d
    flops = DSV3.layer_flops_breakdown(0, FlopsConvention())
    assert flops["attn_qkvo"] == 2 * (d * qr + qr * h * (nope + rope) + d * (kvr + rope) + kvr * h * (nope + v)
                                      + h * v * d)
    assert flops["attn_scores_values"] == 2 * h * ((nope + rope) + v) * 4096


def test_deepseek_v3_first_three_layers_are_dense_with_their_own_width():
    assert [DSV3.is_moe(i) for i in range(5)] == [False, False, False, True, True]
    assert DSV3.layer_param_breakdown(2)["dense_mlp"] == 3 * 7168 * 18432
    assert DSV3.layer_param_breakdown(3)["experts"] == 256 * 3 * 7168 * 2048
    assert DSV3.layer_param_breakdown(3)["router"] == 7168 * 256 + 256  # gate and e_score_correction_bias


def test_deepseek_v3_mtp_params_and_flops():
    d = 7168
    assert DSV3.mtp_param_breakdown() == {"mtp_norms": 3 * d, "mtp_proj": 2 * d * d,
                                          "mtp_block": DSV3.layer_params(60)}
    conv = FlopsConvention()
    assert DSV3.mtp_flops_fwd(conv) == 2 * 2 * d * d + DSV3.layer_flops_fwd(60, conv) + 2 * d * 129280
    without = dataclasses.replace(DSV3, mtp=None)
    assert DSV3.flops_per_token_fwd(conv) - without.flops_per_token_fwd(conv) == DSV3.mtp_flops_fwd(conv)
    assert DSV3.params_active == without.params_active  # MTP is not in the published active count
    assert DSV3.params_total - without.params_total == DSV3.params_mtp
    deeper = dataclasses.replace(DSV3, mtp=dataclasses.replace(DSV3.mtp, depth=2))
    assert deeper.params_mtp == 2 * DSV3.params_mtp


def test_deepseek_v3_node_limited_routing_and_aux_free_balancing():
    m = DSV3.moe
    assert (m.expert_groups, m.node_limit, m.balancing, m.sets_router_bias) == (8, 4, "aux_free_bias", True)
    with pytest.raises(ValueError, match="do not fit in node_limit"):
        dataclasses.replace(m, node_limit=1, expert_groups=128)
    with pytest.raises(ValueError, match="exceeds expert_groups"):
        dataclasses.replace(m, node_limit=16)


def test_gpt_oss_alternates_banded_window_and_full_attention_with_sinks():
    spec = load_model("gpt-oss-120b")
    assert [spec.is_global(i) for i in range(4)] == [False, True, False, True]
    assert spec.context(0) == 128 and spec.context(1) == 4096
    assert spec.layer_param_breakdown(0)["attn_sinks"] == 64
    assert spec.layer_param_breakdown(0)["experts"] == 128 * (3 * 2880 * 2880 + 3 * 2880)  # with biases
    assert spec.num_global_layers == 18
    three_to_one = dataclasses.replace(spec.attention, pattern=["window", "window", "window", "full"])
    assert dataclasses.replace(spec, attention=three_to_one).num_global_layers == 9


def test_qwen3_has_qk_norm_and_no_router_bias():
    spec = load_model("qwen3-235b-a22b")
    parts = spec.layer_param_breakdown(0)
    assert parts["attn_qk_norm"] == 2 * 128 and parts["router"] == 4096 * 128
    assert spec.moe.balancing == "aux_loss" and not spec.moe.sets_router_bias


def test_unset_balancing_keeps_the_old_meaning_of_router_bias():
    moe = load_model("tiny-moe").moe
    assert moe.balancing is None and moe.balance_method == "quantile" and moe.sets_router_bias
    bias_free = dataclasses.replace(moe, router_bias=False)
    assert bias_free.balance_method == "none" and not bias_free.sets_router_bias


@pytest.mark.parametrize("change, message", [
    ({"attention": {"pattern": ["window", "full"], "window": 0}}, "window must be positive"),
    ({"attention": {"pattern": ["full"], "global_every": 2}}, "give one"),
    ({"attention": {"pattern": ["banded"]}}, "attention.pattern"),
    ({"attention": {"head_dim": 128}}, "must equal mla.qk_nope_head_dim"),
    ({"moe": {"balancing": "quantile", "router_bias": False}}, "router_bias must be true"),
    ({"moe": {"balancing": "sinkhorn"}}, "moe.balancing"),
    ({"moe": {"first_k_dense": 61}}, "leaves no MoE layer"),
    ({"mtp": {"depth": 0}}, r"mtp.depth: 0 is outside \[1, 64\]"),
])
def test_bad_frontier_field_is_named(change, message):
    data = to_data(DSV3)
    for section, values in change.items():
        data[section].update(values)
    with pytest.raises(RackcastError, match=message):
        from_data(ModelSpec, data, where="m.yaml")


def test_mtp_modules_are_priced_on_the_last_stage_in_estimate_and_simulator():
    """The step pays for the multi-token-prediction modules its FLOPs count (ModelSpec.tail_flops_fwd), in the
    closed form and in the discrete-event step alike."""
    from pathlib import Path

    from rackcast.plan import load_plan
    from rackcast.simulator.estimate import estimate
    from rackcast.simulator.step import simulate

    plan = load_plan(str(Path(__file__).resolve().parent.parent / "examples" / "plans" / "tiny-deepseek-v3.yaml"))
    spec = load_model(plan.model)
    assert spec.mtp is not None and spec.mtp_flops_fwd(FlopsConvention()) > 0
    without = dataclasses.replace(spec, mtp=None)
    assert spec.tail_flops_fwd() - without.tail_flops_fwd() == spec.mtp_flops_fwd()
    est_with, est_without = estimate(plan, spec=spec), estimate(plan, spec=without)
    sim_with = simulate(plan, spec=spec, record=False)
    sim_without = simulate(plan, spec=without, record=False)
    assert est_with.phases_s["compute"] > est_without.phases_s["compute"]
    assert sim_with.step_time_s > sim_without.step_time_s
