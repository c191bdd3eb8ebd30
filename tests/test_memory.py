"""Memory model against closed forms: Korthikanti et al. 2022 activations, optimizer state by optimizer, the
tiny MoE in the CPU trainer's fp32, and the optimizer state and gradients the backend really keeps."""

from __future__ import annotations

import pytest

from rackcast.plan import Plan
from rackcast.presets import load_model
from rackcast.strict import from_data
from rackcast.simulator.memory import layer_activation_bytes_per_token, memory_breakdown, rank_params

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


def test_fsdp_under_split_backward_schedules_keeps_the_ranks_whole_weights_gathered():
    from rackcast.simulator.memory import BYTES, fsdp_kept_gathered

    base = {"parallel": {"data": 1, "fsdp": 4, "pipeline": 2, "virtual": 2}, "batch": {"global_batch": 16}}
    rolling = gpt_plan(schedule="interleaved_1f1b", **base)
    kept = gpt_plan(schedule="zb_h1", **base)
    assert not fsdp_kept_gathered(rolling) and fsdp_kept_gathered(kept)
    rp = rank_params(GPT, kept)
    w = BYTES[kept.precision]
    # two layers in flight (and the chunk's embedding or head end) against the rank's every weight, gathered
    extra = w * rp.dense - (2 * w * rp.dense_layer_max + w * max(rp.embed_end, rp.head_end))
    assert extra > 0
    assert memory_breakdown(GPT, kept).buffers - memory_breakdown(GPT, rolling).buffers == pytest.approx(extra)


def test_muonh_keeps_one_state_for_matrices_and_two_for_adam_groups():
    spec = load_model("tiny-moe")
    plan = from_data(Plan, {"name": "t", "model": "tiny-moe", "topology": {"name": "local-cpu", "usable_gpus": 1},
                            "parallel": {}, "batch": {"global_batch": 4, "micro_batch": 4},
                            "optimizer": {"name": "muonh"}})
    rp = rank_params(spec, plan)
    mem = memory_breakdown(spec, plan)
    assert mem.optimizer == pytest.approx(4 * (rp.dense + rp.expert - rp.frozen) + 4 * (rp.adam_only + rp.head))
    assert rp.dense + rp.expert == pytest.approx(spec.params_total)
    assert rp.frozen == spec.layers * spec.moe.experts  # the balancing biases: no gradient, no state


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


def tiny_plan(**overrides) -> Plan:
    data = {"name": "t", "model": "tiny-moe", "topology": {"name": "local-cpu", "usable_gpus": 1}, "parallel": {},
            "batch": {"global_batch": 8, "micro_batch": 4}, "optimizer": {"name": "muonh"}}
    return from_data(Plan, {**data, **overrides})


def test_fp32_breakdown_of_the_tiny_moe_equals_its_closed_form():
    """memory_breakdown(dtype="fp32"), the fused count in the CPU trainer's dtype: every tensor at 4 bytes, no
    master copy, every activation a fused layer's backward reads."""
    spec, plan, e = load_model("tiny-moe"), tiny_plan(), 4
    d, r, L, V = spec.d_model, spec.gated_norm_rank, spec.layers, spec.vocab  # 64, 8, 4, 256
    a, m = spec.attention, spec.moe
    q, kv = a.heads * a.head_dim, a.kv_heads_stored * a.head_dim  # 64, 32
    params, frozen = spec.params_total, L * m.experts  # the balancing biases get no gradient and no state
    adam = (V * d + 2 * L * d + 2 * d + L * m.experts * d + L * d * a.heads  # embedding, norm gains, router, gate
            + L * spec.conv.kernel * (kv + 2 * d) + L * m.latent_dim)  # convolutions (k, attn, mlp), latent gain
    mem = memory_breakdown(spec, plan, dtype="fp32")
    assert mem.weights == e * params and mem.master == 0
    assert mem.gradients == e * (params - frozen)
    assert mem.optimizer == e * (params - frozen + adam + V * d)  # momentum; 2nd moment for Adam and AdamH (head)

    norm = e * d + e * (d + 2 * r)  # norm input; gated norm: input, rank-r hidden before/after silu
    attn = norm + e * d + e * (q + 2 * kv)  # QKV input, Q K V
    attn += 4 * a.heads + e * q + e * a.heads + e * q  # lse, pre-XSA output, gate, o input
    attn += e * (kv + 2 * d)  # convolution inputs (k, attn, mlp sites)
    per_copy = 2 * e * m.latent_dim + 3 * e * m.expert_ffn  # rows in/out, SwiGLU hidden
    moe = norm + e * d + 4 * m.experts + 2 * e * m.latent_dim + m.top_k * per_copy + 3 * e * m.shared_ffn
    edge = 2 * e * d  # embedding output and head input, once
    tokens = plan.batch.micro_batch * spec.seq_len
    assert mem.activations == pytest.approx((L * (attn + moe) + edge) * tokens, rel=1e-12)
    assert mem.buffers == 0 and mem.total == pytest.approx(mem.weights + mem.gradients + mem.optimizer
                                                           + mem.activations)


def test_eager_breakdown_of_the_tiny_moe_adds_the_backends_step_terms():
    """activations="eager": the same static bytes; the eager layers, embedding and head per in-flight micro-batch,
    the token ids, targets and router margins of every micro-batch; the loss backward's temporaries as a buffer."""
    from rackcast.simulator.activations import (eager_loss_backward_bytes_per_token, eager_step_bytes_per_token,
                                       edge_activation_bytes_per_token)

    spec, plan = load_model("tiny-moe"), tiny_plan()
    fused, eager = (memory_breakdown(spec, plan, dtype="fp32", activations=x) for x in ("fused", "eager"))
    assert (eager.weights, eager.gradients, eager.optimizer) == (fused.weights, fused.gradients, fused.optimizer)
    tokens = plan.batch.micro_batch * spec.seq_len
    per_token = sum(layer_activation_bytes_per_token(spec, i, plan, "fp32", "eager") for i in range(spec.layers))
    per_token += edge_activation_bytes_per_token(spec, plan, dtype="fp32", activations="eager")
    step = eager_step_bytes_per_token(spec, spec.layers) * plan.microbatches
    assert eager_step_bytes_per_token(spec, 1) == 2 * 8 + 4 * spec.moe.experts  # ids and targets; margins
    assert eager.activations == pytest.approx((per_token + step) * tokens, rel=1e-12)
    assert eager.buffers == pytest.approx(eager_loss_backward_bytes_per_token(spec) * tokens, rel=1e-12)
    assert eager_loss_backward_bytes_per_token(spec) == 3 * 4 * spec.vocab * (spec.seq_len - 1) / spec.seq_len
    assert 1.9 < eager.total / fused.total < 2.1


def test_fused_is_the_default_and_keeps_the_published_hero_figure():
    from conftest import PLANS
    from rackcast.plan import load_plan

    plan = load_plan(str(PLANS / "marin-535b-hero.yaml"))
    spec = plan.model_spec()
    default = memory_breakdown(spec, plan)
    assert default == memory_breakdown(spec, plan, activations="fused")
    assert round(default.total / 2**30, 1) == 116.1
    assert memory_breakdown(spec, plan, activations="eager").total > default.total
    with pytest.raises(ValueError, match="activations"):
        memory_breakdown(spec, plan, activations="complete")


def test_the_default_dtype_is_the_plans_precision_and_fp32_only_widens_it():
    spec, plan = load_model("tiny-moe"), tiny_plan()
    default, bf16, fp32 = (memory_breakdown(spec, plan, dtype=x) for x in (None, "bf16", "fp32"))
    assert default == bf16
    assert fp32.weights == 2 * default.weights and fp32.master == 0 and default.master == 2 * default.weights
    assert fp32.gradients == default.gradients and fp32.optimizer == default.optimizer  # fp32 already
    assert 1.9 < fp32.activations / default.activations < 2.0  # router logits and lse were fp32 already


@pytest.mark.parametrize("plan_name", ["tiny-1proc", "tiny-2proc-pp", "tiny-qwen3", "tiny-gpt-oss", "tiny-mixtral"])
def test_optimizer_state_and_gradients_equal_what_the_backend_keeps(plan_name):
    import torch
    from torch import nn

    from rackcast.backend.model import build_model
    from rackcast.backend.optim import build_optimizer, optimizer_state_numel
    from rackcast.backend.parallel import Layout
    from rackcast.backend.pipeline import build_chunks
    from conftest import PLANS
    from rackcast.plan import load_plan
    from rackcast.simulator.memory import static_bytes

    plan = load_plan(PLANS / f"{plan_name}.yaml")
    spec = plan.model_spec()
    for stage in range(plan.parallel.pipeline):
        chunks = nn.ModuleList(build_chunks(build_model(spec, seed=0), Layout.of(plan, stage), plan.parallel,
                                            plan.schedule))
        optimizer = build_optimizer(chunks, "muonh")
        trained = [p for p in chunks.parameters() if p.requires_grad]
        for p in trained:
            p.grad = torch.ones_like(p)
        optimizer.step()
        static = static_bytes(rank_params(spec, plan, stage), plan, "fp32")
        assert static["optimizer"] == 4 * sum(optimizer_state_numel(optimizer).values())
        assert static["gradients"] == 4 * sum(p.numel() for p in trained)
        assert static["weights"] == 4 * sum(p.numel() for p in chunks.parameters())


def test_pipeline_ranks_split_the_embedding_and_head_activations():
    from rackcast.simulator.activations import (eager_loss_backward_bytes_per_token, eager_pipeline_bytes_per_token,
                                       eager_step_bytes_per_token, edge_activation_bytes_per_token)

    spec = load_model("tiny-moe")
    plan = tiny_plan(parallel={"pipeline": 2}, schedule="gpipe", topology={"name": "local-cpu", "usable_gpus": 2})
    m, tokens_mb = plan.microbatches, plan.batch.micro_batch * spec.seq_len
    for rank, layers, first, last in ((0, (0, 1), True, False), (1, (2, 3), False, True)):
        mem = memory_breakdown(spec, plan, rank=rank, activations="eager")
        assert mem.inflight_microbatches == m  # GPipe: every micro-batch in flight
        per_token = sum(layer_activation_bytes_per_token(spec, i, plan, activations="eager") for i in layers)
        per_token += edge_activation_bytes_per_token(spec, plan, first=first, last=last, activations="eager")
        step = eager_step_bytes_per_token(spec, len(layers))
        assert mem.activations == pytest.approx((per_token + step) * tokens_mb * m, rel=1e-12)
        stage = eager_pipeline_bytes_per_token(spec, 2, first, last, m, m)
        loss = eager_loss_backward_bytes_per_token(spec) if last else 0.0
        assert mem.buffers == pytest.approx((stage + loss) * tokens_mb, rel=1e-12)
    # Stage 0 keeps a gradient receive buffer per micro-batch and its in-flight outputs; stage 1 every logits tensor.
    assert eager_pipeline_bytes_per_token(spec, 2, True, False, m, m) == 2 * spec.d_model * 2 * m
    assert eager_pipeline_bytes_per_token(spec, 2, False, True, m, 1) == 2 * (spec.d_model * (m - 1) + spec.vocab * m)
