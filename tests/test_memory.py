"""Memory model against closed forms: Korthikanti et al. 2022 activations, optimizer state by optimizer."""

from __future__ import annotations

import pytest

from rackcast.plan import Plan
from rackcast.presets import load_model
from rackcast.strict import from_data
from simulator.memory import layer_activation_bytes_per_token, memory_breakdown, rank_params

GPT = load_model("gpt-1.7b")


def gpt_plan(**overrides) -> Plan:
    data = {"name": "t", "model": "gpt-1.7b", "topology": {"name": "a100-dgx", "domains": 1},
            "parallel": {"data": 8}, "batch": {"global_batch": 8, "micro_batch": 1},
            "attention_kernel": "materialized", "dropout": True, "optimizer": {"name": "adamw"}}
    for key, value in overrides.items():
        if isinstance(value, dict):
            data[key] = {**data.get(key, {}), **value}
        else:
            data[key] = value
    return from_data(Plan, data)


def test_dense_gpt_layer_activations_match_korthikanti_without_parallelism():
    h, a, s = GPT.d_model, GPT.attention.heads, GPT.seq_len
    got = layer_activation_bytes_per_token(GPT, 0, gpt_plan())
    assert got == pytest.approx(34 * h + 5 * a * s)  # s*b*h*(34 + 5as/h) divided by s*b tokens


@pytest.mark.parametrize("t", [2, 4, 8])
def test_dense_gpt_layer_activations_match_korthikanti_with_tensor_parallelism(t):
    h, a, s = GPT.d_model, GPT.attention.heads, GPT.seq_len
    plan = gpt_plan(parallel={"data": 8 // t, "tensor": t})
    assert layer_activation_bytes_per_token(GPT, 0, plan) == pytest.approx(10 * h + 24 * h / t + 5 * a * s / t)


@pytest.mark.parametrize("t", [2, 8])
def test_dense_gpt_layer_activations_match_korthikanti_with_sequence_parallelism(t):
    h, a, s = GPT.d_model, GPT.attention.heads, GPT.seq_len
    plan = gpt_plan(parallel={"data": 8 // t, "tensor": t, "sequence_parallel": True})
    assert layer_activation_bytes_per_token(GPT, 0, plan) == pytest.approx((34 * h + 5 * a * s) / t)


def test_selective_recompute_drops_the_attention_core_terms():
    h, s, b, L = GPT.d_model, GPT.seq_len, 1, GPT.layers
    full = memory_breakdown(GPT, gpt_plan())
    selective = memory_breakdown(GPT, gpt_plan(recompute="selective"))
    a = GPT.attention.heads
    assert full.activations - selective.activations == pytest.approx(L * 5 * a * s * s * b)
    assert selective.activations - 2 * 2 * h * s == pytest.approx(L * 34 * h * s * b)


def test_full_recompute_keeps_layer_inputs_and_one_layer_working_set():
    h, s, L = GPT.d_model, GPT.seq_len, GPT.layers
    mem = memory_breakdown(GPT, gpt_plan(recompute="full"))
    assert mem.activations == pytest.approx(L * 2 * h * s + 2 * 2 * h * s)
    assert mem.buffers == pytest.approx(layer_activation_bytes_per_token(GPT, 0, gpt_plan()) * s)


def test_adam_keeps_two_fp32_states_and_master_per_parameter():
    mem = memory_breakdown(GPT, gpt_plan())
    n = GPT.params_total
    assert mem.weights == pytest.approx(2 * n)
    assert mem.master == pytest.approx(4 * n)
    assert mem.optimizer == pytest.approx(8 * n)
    assert mem.gradients == pytest.approx(4 * n)


def test_fsdp_shards_weights_gradients_and_state():
    plain = memory_breakdown(GPT, gpt_plan())
    sharded = memory_breakdown(GPT, gpt_plan(parallel={"data": 1, "fsdp": 8}))
    assert sharded.weights == pytest.approx(plain.weights / 8)
    assert sharded.optimizer == pytest.approx(plain.optimizer / 8)
    assert sharded.gradients == pytest.approx(plain.gradients / 8)
    assert sharded.buffers > 0


def test_muonh_keeps_one_state_for_matrices_and_two_for_adam_groups():
    spec = load_model("tiny-moe")
    plan = from_data(Plan, {"name": "t", "model": "tiny-moe", "topology": {"name": "local-cpu", "usable_gpus": 1},
                            "parallel": {}, "batch": {"global_batch": 4, "micro_batch": 4},
                            "optimizer": {"name": "muonh"}})
    rp = rank_params(spec, plan)
    mem = memory_breakdown(spec, plan)
    assert mem.optimizer == pytest.approx(4 * (rp.dense + rp.expert) + 4 * (rp.adam_only + rp.head))
    assert rp.dense + rp.expert == pytest.approx(spec.params_total)


def test_host_offload_moves_master_and_state_out_of_hbm():
    spec = load_model("marin-535b-a23b")
    from rackcast.plan import load_plan
    from conftest import PLANS
    plan = load_plan(str(PLANS / "marin-535b-hero.yaml"))
    mem = memory_breakdown(spec, plan)
    assert mem.master == 0 and mem.optimizer == 0 and mem.host > 0
    # 6 experts per GPU on each of 48 layers: 8.15e9 expert parameters; MuonH keeps 1 state + fp32 master.
    rp = rank_params(spec, plan)
    assert rp.expert == pytest.approx(48 * 6 * 3 * 3072 * 3072)


def test_gpipe_holds_all_microbatches_and_1f1b_holds_pipeline_depth():
    plan = gpt_plan(parallel={"data": 2, "pipeline": 4}, batch={"global_batch": 32, "micro_batch": 1},
                    schedule="gpipe")
    gpipe = memory_breakdown(GPT, plan)
    one_f = memory_breakdown(GPT, gpt_plan(parallel={"data": 2, "pipeline": 4},
                                           batch={"global_batch": 32, "micro_batch": 1}))
    assert gpipe.inflight_microbatches == 16
    assert one_f.inflight_microbatches == 4
