"""ModelSpec accounting against the Marin acceptance figures and hand-derived closed forms."""

from __future__ import annotations

import dataclasses

import pytest

from rackcast.errors import RackcastError
from rackcast.modelspec import FlopsConvention, ModelSpec
from rackcast.presets import list_models, load_model
from rackcast.strict import from_data, to_data

MARIN = load_model("marin-535b-a23b")


def test_marin_total_params_match_reference_exactly():
    assert abs(MARIN.params_total - 535_477_106_688) / 535_477_106_688 < 0.0005
    assert MARIN.params_total == 535_477_106_688


def test_marin_active_params_within_one_percent_of_reference():
    assert abs(MARIN.params_active - 22.76e9) / 22.76e9 < 0.01


def test_marin_training_flops_for_18t_tokens_within_five_percent():
    total = MARIN.flops_per_token_train() * 18e12
    assert abs(total - 2.70e24) / 2.70e24 < 0.05
    causal = MARIN.flops_per_token_train(FlopsConvention(attention="causal")) * 18e12
    assert abs(causal - 2.70e24) / 2.70e24 < 0.05
    assert causal < total


def test_marin_attention_pattern_is_3_local_to_1_global_with_last_global():
    kinds = [MARIN.is_global(i) for i in range(48)]
    assert sum(kinds) == 12
    assert kinds[3] and kinds[47] and not kinds[0]
    assert MARIN.kv_heads(0) == 12 and MARIN.kv_heads(3) == 6
    assert MARIN.context(0) == 2048 and MARIN.context(3) == 4096


def test_marin_layer_components_match_closed_forms():
    d, h, n, kv, r, E, f, lat = 6144, 128, 48, 12, 128, 384, 3072, 3072
    parts = MARIN.layer_param_breakdown(0)
    assert parts["attn_q"] == d * n * h
    assert parts["attn_kv"] == 2 * d * kv * h
    assert parts["attn_o"] == n * h * d
    assert parts["attn_gate"] == d * n
    assert parts["attn_gated_norm"] == parts["mlp_gated_norm"] == 2 * d * r
    assert parts["conv"] == 4 * (kv * h + d + d)  # keys, attention output, MLP output
    assert parts["router"] == d * E + E
    assert parts["latent"] == 2 * d * lat + lat
    assert parts["experts"] == E * 3 * lat * f
    assert parts["shared_experts"] == 2 * 3 * d * f
    assert MARIN.params_embedding == 2 * 128256 * d


def test_flops_components_match_closed_forms_on_a_local_and_a_global_layer():
    conv = FlopsConvention()
    local, glob = MARIN.layer_flops_breakdown(0, conv), MARIN.layer_flops_breakdown(3, conv)
    assert local["attn_scores_values"] == 4 * 48 * 128 * 2048
    assert glob["attn_scores_values"] == 4 * 48 * 128 * 4096
    assert local["experts"] == 2 * 8 * 3 * 3072 * 3072
    assert local["router"] == 2 * 6144 * 384
    assert local["latent"] == 2 * 2 * 6144 * 3072
    assert local["conv"] == 2 * 4 * (1536 + 6144 + 6144)
    seq = MARIN.layer_flops_breakdown(0, FlopsConvention(window="sequence"))
    assert seq["attn_scores_values"] == glob["attn_scores_values"]


def test_causal_context_average_matches_closed_form():
    # A query at position i sees min(i+1, w) keys: mean = (w(w+1)/2 + (s-w)w)/s.
    s, w = 4096, 2048
    expected = (w * (w + 1) / 2 + (s - w) * w) / s
    assert MARIN.attention_context(0, FlopsConvention(attention="causal")) == pytest.approx(expected)
    assert MARIN.attention_context(3, FlopsConvention(attention="causal")) == pytest.approx((s + 1) / 2)


@pytest.mark.parametrize("name", ["gpt-1.7b", "gpt-530b", "gpt-1t"])
def test_megatron_gpt_params_match_narayanan_formula(name):
    spec = load_model(name)
    h, l, V, s = spec.d_model, spec.layers, spec.vocab, spec.seq_len
    # Per layer 12h^2 + 13h (QKV/O/MLP matrices and biases, two LayerNorms); embeddings V h + s h; final LN 2h.
    assert spec.params_total == l * (12 * h * h + 13 * h) + V * h + s * h + 2 * h


def test_dense_gpt_forward_flops_are_24_h_squared_plus_attention_per_layer():
    spec = load_model("gpt-1.7b")
    h, s = spec.d_model, spec.seq_len
    assert spec.layer_flops_fwd(0) == 24 * h * h + 4 * h * s


def test_moe_active_params_count_top_k_experts():
    spec = load_model("tiny-moe")
    per_expert = 3 * spec.moe.latent_dim * spec.moe.expert_ffn
    inactive = spec.layers * (spec.moe.experts - spec.moe.top_k) * per_expert
    assert spec.params_total - spec.params_embedding - spec.params_active == inactive


def test_dense_layers_in_moe_model_use_dense_mlp():
    spec = load_model("tiny-moe-dense0")
    assert not spec.is_moe(0) and spec.is_moe(1)
    assert "dense_mlp" in spec.layer_param_breakdown(0)
    assert "experts" not in spec.layer_param_breakdown(0)


@pytest.mark.parametrize("name", list_models())
def test_every_preset_round_trips_through_plain_data(name):
    spec = load_model(name)
    assert from_data(ModelSpec, to_data(spec)) == spec


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(RackcastError, match="unknown model preset 'nope'.*marin-535b-a23b"):
        load_model("nope")


def test_bad_model_field_is_named():
    data = to_data(MARIN)
    data["attention"]["heads"] = 47
    with pytest.raises(RackcastError, match="kv_heads_local=12 must divide heads=47"):
        from_data(ModelSpec, data, where="m.yaml")
    data = to_data(MARIN)
    data["moe"]["top_k"] = "eight"
    with pytest.raises(RackcastError, match=r"m.yaml: moe.top_k: expected int"):
        from_data(ModelSpec, data, where="m.yaml")


def test_flops_convention_parse_and_label():
    conv = FlopsConvention.parse("attention=causal,head=out")
    assert conv == FlopsConvention(attention="causal", head=False)
    assert conv.label == "attention=causal,window=window,head=out"
    with pytest.raises(RackcastError):
        FlopsConvention.parse("attention=half")


def test_head_convention_removes_head_flops():
    with_head = MARIN.flops_per_token_fwd()
    without = MARIN.flops_per_token_fwd(FlopsConvention(head=False))
    assert with_head - without == pytest.approx(2 * 6144 * 128256)


def test_replace_keeps_accounting_consistent():
    small = dataclasses.replace(MARIN, layers=4)
    assert small.num_global_layers == 1
