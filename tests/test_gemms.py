"""The per-GEMM listing of a model (simulator.gemms) against ModelSpec's FLOP accounting, and its per-rank shapes."""

from __future__ import annotations

import pytest

from rackcast.presets import list_models, load_model
from rackcast.simulator.costs import HW
from rackcast.simulator.gemms import GEMM_NAMES, NON_GEMM, embed_gemms, layer_gemms, rank_shape, tail_work


@pytest.mark.parametrize("name", list_models())
def test_each_layers_gemms_sum_to_its_dense_gemm_flops_component_by_component(name):
    spec = load_model(name)
    for i in range(spec.layers):
        parts = {k: v for k, v in spec.layer_flops_breakdown(i, HW).items() if k not in NON_GEMM}
        listed: dict[str, float] = {}
        for g in layer_gemms(spec, i):
            listed[g.part] = listed.get(g.part, 0.0) + g.flops
        assert listed == parts, f"{name} layer {i}"


@pytest.mark.parametrize("name", list_models())
def test_tail_and_embedding_work_sum_to_the_specs_tail_and_embedding_flops(name):
    spec = load_model(name)
    tail = tail_work(spec)
    assert sum(g.flops for g in tail.gemms) + tail.attn + tail.experts == pytest.approx(spec.tail_flops_fwd(HW),
                                                                                       rel=1e-12)
    assert sum(g.flops for g in embed_gemms(spec)) == spec.embed_flops_fwd()


def test_latent_attention_and_gated_norm_models_list_their_low_rank_products():
    names = {g.name for g in layer_gemms(load_model("deepseek-v3"), 5)}
    assert {"mla_q_down", "mla_q_up", "mla_kv_down", "mla_kv_up", "router", "shared_gate_up"} <= names
    marin = load_model("marin-535b-a23b")
    gemms = {g.name: g for g in layer_gemms(marin, 0)}
    assert gemms["latent_down"].n == marin.moe.latent_dim and gemms["attn_gated_norm_down"].n == marin.gated_norm_rank
    assert gemms["router"].n == marin.moe.experts and gemms["router"].split == "none"
    assert all(g.name in GEMM_NAMES for i in range(marin.layers) for g in layer_gemms(marin, i))


@pytest.mark.parametrize("name", ["marin-535b-a23b", "deepseek-v3", "gpt-145b"])
def test_a_ranks_shape_holds_exactly_its_share_of_each_gemms_flops(name):
    spec, tokens, tensor = load_model(name), 8192.0, 4
    for g in list(layer_gemms(spec, spec.layers - 1)) + list(tail_work(spec).gemms):
        m, n, k, _ = rank_shape(g, tokens, tensor)
        copies = g.flops / (2.0 * g.n * g.k)
        assert 2.0 * m * n * k * copies == pytest.approx(g.flops * tokens / tensor, rel=1e-12), g.name
        assert (n < g.n) == (g.split == "n") and (k < g.k) == (g.split == "k") and (m < tokens) == (g.split == "none")


def test_the_output_head_is_vocabulary_parallel_and_the_end_gated_norms_run_on_a_ranks_share_of_the_sequence():
    spec, tokens, tensor = load_model("marin-535b-a23b"), 8192.0, 8
    ends = {g.name: g for g in list(tail_work(spec).gemms) + list(embed_gemms(spec))}
    assert tuple(rank_shape(ends["head"], tokens, tensor)[:3]) == (tokens, spec.vocab / tensor, spec.d_model)
    for name in ("final_gated_norm_down", "final_gated_norm_up", "embed_gated_norm_down", "embed_gated_norm_up"):
        g = ends[name]
        assert tuple(rank_shape(g, tokens, tensor)[:3]) == (tokens / tensor, g.n, g.k), name


def test_the_estimate_prices_a_tensor_parallel_plans_head_at_the_vocabulary_parallel_shape():
    from pathlib import Path

    from rackcast.plan import load_plan
    from rackcast.simulator.estimate import plan_features

    plan = load_plan(str(Path(__file__).resolve().parent.parent / "examples" / "plans" / "gpt-145b-megatron.yaml"))
    spec, tensor = plan.model_spec(), plan.parallel.tensor
    assert tensor > 1
    f = plan_features(spec, plan, plan.topology_spec())
    assert (f["gemm_m:head"], f["gemm_n:head"], f["gemm_k:head"]) == (
        plan.tokens_per_microbatch(spec), spec.vocab / tensor, spec.d_model)


def test_the_gemm_cache_holds_a_bounded_number_of_models():
    import copy

    from rackcast.simulator import gemms

    spec = load_model("tiny-moe")
    copies = [copy.copy(spec) for _ in range(2 * gemms._CACHE_MODELS)]  # kept alive: each a distinct id
    for c in copies:
        assert layer_gemms(c, 0) == layer_gemms(spec, 0)
    assert len(gemms._CACHE) <= gemms._CACHE_MODELS


def test_the_simulators_layer_prices_each_gemm_at_its_own_shape_and_skinny_ones_below_the_square_rate():
    from pathlib import Path

    from rackcast.plan import load_plan
    from rackcast.simulator import costs
    from rackcast.simulator.workload import Workload

    plan = load_plan(str(Path(__file__).resolve().parent.parent / "examples" / "plans" / "marin-535b-hero.yaml"))
    spec, topo = plan.model_spec(), plan.topology_spec()
    tokens, tensor = plan.tokens_per_microbatch(spec), plan.parallel.tensor
    layer = Workload(spec, plan, topo).stages[0].chunks[0][0]
    seconds = {g.name: float(costs.gemm_time(g.flops * tokens / tensor, rank_shape(g, tokens, tensor), topo,
                                             plan.precision)) for g in layer_gemms(spec, 0)}
    assert layer.router_s == pytest.approx(seconds["router"] + seconds["latent_down"] + seconds["latent_up"],
                                           rel=1e-12)
    attention = [g.name for g in layer_gemms(spec, 0) if g.part not in ("router", "latent", "shared_experts")]
    assert layer.attn_s - layer.core_s == pytest.approx(sum(seconds[n] for n in attention), rel=1e-12)
    square = float(costs.gemm_efficiency(costs.GemmShape(tokens, spec.d_model / tensor, spec.d_model), topo,
                                         plan.precision))
    for name in ("attn_gated_norm_down", "attn_gated_norm_up", "attn_gate"):  # rank 128, 48 heads
        g = next(g for g in layer_gemms(spec, 0) if g.name == name)
        assert float(costs.gemm_efficiency(rank_shape(g, tokens, tensor), topo, plan.precision)) < square / 2
