"""The PyTorch model (backend.model, backend.attention, backend.moe) and quantile balancing (backend.balancing).

    .venv/bin/pytest -q tests/test_backend_model.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rackcast.backend.balancing import QuantileBalancer, histogram_upper_quantile
from rackcast.backend.model import build_model, count_parameters, next_token_loss
from rackcast.backend.moe import MoE
from rackcast.modelspec import ModelSpec
from rackcast.presets import load_model


def _replace(spec: ModelSpec, attention: dict | None = None, moe: dict | None = None, **top) -> ModelSpec:
    if attention:
        top["attention"] = dataclasses.replace(spec.attention, **attention)
    if moe:
        top["moe"] = dataclasses.replace(spec.moe, **moe)
    return dataclasses.replace(spec, **top)


def small_marin() -> ModelSpec:
    """marin-535b-a23b at reduced width, depth and experts; every other field as the preset has it."""
    return _replace(
        load_model("marin-535b-a23b"),
        layers=4, d_model=128, vocab=512, seq_len=64, gated_norm_rank=16,
        attention=dict(heads=8, head_dim=16, kv_heads_local=4, kv_heads_global=2, kv_heads_stored=4, window=16),
        moe=dict(experts=8, top_k=2, expert_ffn=64, latent_dim=64, shared_experts=2, shared_ffn=64),
    )  # fmt: skip


def small_gpt() -> ModelSpec:
    return _replace(
        load_model("gpt-1.7b"), layers=2, d_model=128, vocab=512, seq_len=64, ffn=512,
        attention=dict(heads=4, head_dim=32, kv_heads_local=4, kv_heads_global=4),
    )  # fmt: skip


def per_layer_kv_moe() -> ModelSpec:
    """kv_heads_stored = 0: each layer stores only its own KV heads (global layers fewer)."""
    return _replace(load_model("tiny-moe"), attention=dict(kv_heads_stored=0))


def gelu_bias_moe() -> ModelSpec:
    """A non-Marin MoE: LayerNorm, GELU experts with biases, no latent projection, K/V conv, no gated norm."""
    spec = _replace(
        load_model("tiny-moe"), norm="layernorm", activation="gelu", mlp_bias=True, gated_norm_rank=0,
        moe=dict(latent_dim=0, router_bias=False),
    )  # fmt: skip
    return dataclasses.replace(spec, conv=dataclasses.replace(spec.conv, sites=["k", "v"]))


SPECS = {
    "tiny-moe": lambda: load_model("tiny-moe"),
    "tiny-moe-dense0": lambda: load_model("tiny-moe-dense0"),
    "tiny-dense": lambda: load_model("tiny-dense"),
    "marin-535b-small": small_marin,
    "gpt-1.7b-small": small_gpt,
    "tiny-moe-per-layer-kv": per_layer_kv_moe,
    "tiny-moe-gelu-bias": gelu_bias_moe,
}


def tokens_for(spec: ModelSpec, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, spec.vocab, (batch, spec.seq_len), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------ accounting
@pytest.mark.parametrize("name", list(SPECS))
def test_parameter_count_equals_spec_params_total(name):
    spec = SPECS[name]()
    assert count_parameters(build_model(spec)) == spec.params_total


@pytest.mark.parametrize("name", ["marin-535b-a23b", "gpt-1.7b"])
def test_full_size_preset_on_meta_device_counts_exactly(name):
    spec = load_model(name)
    assert count_parameters(build_model(spec, device="meta")) == spec.params_total


def test_same_seed_gives_identical_weights_and_another_seed_does_not():
    spec = load_model("tiny-moe")
    a, b, c = build_model(spec, seed=3), build_model(spec, seed=3), build_model(spec, seed=4)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.embed.tok.weight, c.embed.tok.weight)


# ------------------------------------------------------------------------------------------------ masking
@pytest.mark.parametrize("name", ["tiny-moe", "tiny-dense"])
def test_changing_future_tokens_leaves_earlier_logits_unchanged(name):
    spec = SPECS[name]()
    model = build_model(spec).eval()
    tokens = tokens_for(spec)
    cut = spec.seq_len // 2
    changed = tokens.clone()
    changed[:, cut:] = (changed[:, cut:] + 1) % spec.vocab
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :cut], after[:, :cut], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, cut:], after[:, cut:])


def local_first_layer_spec(conv: bool) -> ModelSpec:
    """tiny-moe with two layers; layer 0 is local (window 16), the last layer is global."""
    spec = _replace(load_model("tiny-moe"), layers=2, seq_len=64, attention=dict(window=16, global_every=8))
    return spec if conv else dataclasses.replace(spec, conv=None)


@pytest.mark.parametrize("conv", [False, True], ids=["no-conv", "conv-k-attn-mlp"])
def test_local_layer_ignores_tokens_beyond_its_window(conv):
    spec = local_first_layer_spec(conv)
    assert not spec.is_global(0)
    model = build_model(spec).eval()
    layer = model.layers[0]  # the model's only local layer, run on its own
    if conv:  # random taps, so each convolution really widens the receptive field
        for c in (layer.attn.conv_k, layer.conv_attn, layer.conv_mlp):
            torch.nn.init.normal_(c.weight, generator=torch.Generator().manual_seed(1))
    # A key can reach back window - 1 tokens, and each short convolution on the path adds kernel - 1.
    reach = spec.attention.window - 1 + (len(spec.conv.sites) * (spec.conv.kernel - 1) if conv else 0)
    tokens = tokens_for(spec, batch=1)
    query = spec.seq_len - 1

    def output_at_query(position: int) -> torch.Tensor:
        changed = tokens.clone()
        changed[0, position] = (changed[0, position] + 1) % spec.vocab
        with torch.no_grad():
            return layer(model.embed(changed))[0, query]

    with torch.no_grad():
        base = layer(model.embed(tokens))[0, query]
    torch.testing.assert_close(output_at_query(query - reach - 1), base, rtol=0, atol=1e-6)
    assert not torch.allclose(output_at_query(query - reach), base, atol=1e-6)


def test_global_layer_attends_with_only_the_first_kv_heads_it_stores():
    spec = load_model("tiny-moe")  # stores 2 KV heads everywhere; local layers use 2, global layers 1
    model = build_model(spec).eval()
    x = model.embed(tokens_for(spec))
    hd = spec.attention.head_dim
    for index in range(spec.layers):
        attn = model.layers[index].attn
        with torch.no_grad():
            base = attn(x)
            k_weight = attn.qkv.weight.split(attn.qkv.parts)[1]  # the K part of the fused projection (a view)
            saved = k_weight[hd:].clone()
            k_weight[hd:] += 1.0  # perturb the second stored K head
            moved = attn(x)
            k_weight[hd:] = saved
        if spec.is_global(index):
            torch.testing.assert_close(moved, base, rtol=0, atol=0)
        else:
            assert not torch.allclose(moved, base)


def test_zero_initialised_output_gate_is_the_identity():
    spec = load_model("tiny-moe")
    model = build_model(spec).eval()
    attn = model.layers[0].attn
    x = model.embed(tokens_for(spec))
    with torch.no_grad():
        gated = attn(x)
        gate, attn.gate = attn.gate, None
        ungated = attn(x)
        attn.gate = gate
    torch.testing.assert_close(gated, ungated)


def test_exclusive_attention_output_is_orthogonal_to_each_heads_own_value():
    spec = dataclasses.replace(load_model("tiny-moe"), conv=None)
    model = build_model(spec).eval()
    attn = model.layers[0].attn
    assert attn.exclusive and attn.heads * attn.head_dim == spec.d_model
    x = model.embed(tokens_for(spec))
    b, s, h, hd = x.shape[0], x.shape[1], attn.heads, attn.head_dim
    with torch.no_grad():
        torch.nn.init.eye_(attn.o.weight)  # read the per-head outputs straight through the output projection
        y = attn(x).view(b, s, h, hd)
        v = attn.project(x)[2].reshape(b, s, attn.kv_stored, hd)[:, :, : attn.kv_heads].repeat_interleave(h // attn.kv_heads, 2)
    coefficient = (y * v).sum(-1) / (v * v).sum(-1)  # how much of v is left in y (position 0's y is all v: 0)
    assert coefficient.abs().max() < 1e-4


@pytest.mark.parametrize("layer_kind", ["global", "local"])
def test_rope_only_on_local_layers(layer_kind):
    """Without RoPE (global layers, rope_on_global false) attention is blind to the order of earlier tokens."""
    spec = _replace(load_model("tiny-moe"), conv=None, seq_len=32, attention=dict(window=32, global_every=4))
    model = build_model(spec).eval()
    index = 3 if layer_kind == "global" else 0
    assert spec.is_global(index) == (layer_kind == "global")
    attn = model.layers[index].attn
    assert attn.rot_dim == (0 if layer_kind == "global" else spec.attention.head_dim // 2)
    x = torch.randn(1, spec.seq_len, spec.d_model, generator=torch.Generator().manual_seed(0))
    shuffled = x.clone()
    shuffled[:, :-1] = x[:, torch.randperm(spec.seq_len - 1, generator=torch.Generator().manual_seed(1))]
    with torch.no_grad():
        last, last_shuffled = attn(x)[0, -1], attn(shuffled)[0, -1]
    if layer_kind == "global":
        torch.testing.assert_close(last, last_shuffled, rtol=1e-5, atol=1e-6)
    else:
        assert not torch.allclose(last, last_shuffled, atol=1e-4)


# ------------------------------------------------------------------------------------------------ training step
@pytest.mark.parametrize("name", ["tiny-moe", "tiny-moe-dense0", "tiny-dense"])
def test_forward_backward_gives_finite_loss_and_gradients(name):
    spec = SPECS[name]()
    model = build_model(spec).train()
    tokens = tokens_for(spec)
    logits = model(tokens)
    assert logits.shape == (2, spec.seq_len, spec.vocab)
    loss, parts = next_token_loss(logits, tokens, z_loss_weight=1e-4)
    loss.backward()
    assert torch.isfinite(loss) and parts["z_loss"] > 0
    for pname, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    for moe in model.moe_layers().values():
        assert moe.router.bias is None or (moe.router.bias.grad is None and not moe.router.bias.requires_grad)
        assert moe.router.weight.grad.abs().sum() > 0


def test_routing_counts_are_recorded_per_layer_every_forward():
    spec = load_model("tiny-moe-dense0")
    model = build_model(spec)
    tokens = tokens_for(spec)
    with torch.no_grad():
        model(tokens)
        model(tokens)
    counts = model.routing_counts(reset=True)
    assert sorted(counts) == [i for i in range(spec.layers) if spec.is_moe(i)]
    for c in counts.values():
        assert c.shape == (spec.moe.experts,) and int(c.sum()) == 2 * tokens.numel() * spec.moe.top_k
    assert model.routing_counts() == {}


def test_combine_weights_are_sigmoid_of_unbiased_logits_renormalised():
    spec = load_model("tiny-moe")
    moe = build_model(spec).moe_layers()[0]
    with torch.no_grad():
        moe.router.bias.copy_(torch.linspace(-1, 1, spec.moe.experts))
    x = torch.randn(32, spec.d_model, generator=torch.Generator().manual_seed(0))
    ids, weights = moe.route(x)
    logits = moe.router(x)
    biased_top = (logits + moe.router.bias).topk(spec.moe.top_k, dim=-1).indices
    assert torch.equal(ids, biased_top)
    expected = torch.sigmoid(logits.gather(1, ids))
    torch.testing.assert_close(weights, expected / expected.sum(-1, keepdim=True))


# ------------------------------------------------------------------------------------------------ balancing
def test_histogram_quantile_matches_the_exact_upper_quantile_within_a_bin():
    margins = torch.randn(4000, 8, generator=torch.Generator().manual_seed(0)) * torch.arange(1, 9)
    top_k, bins = 2, 1000
    beta = histogram_upper_quantile(margins, top_k, bins=bins)
    exact = torch.quantile(margins, 1 - top_k / 8, dim=0)
    width = (margins.max() - margins.min()) / bins
    assert (beta - exact).abs().max() <= 2 * width


def test_histogram_hooks_pool_two_ranks_into_the_single_process_answer():
    both = torch.randn(600, 8, generator=torch.Generator().manual_seed(1))
    rank0, rank1 = both[:250], both[250:]

    def extremes(m):
        return torch.stack([-m.min(), m.max()])

    def max_with(other):
        return lambda t: t.copy_(torch.maximum(t, extremes(other)))

    captured = {}

    def capture(t):
        captured["packed"] = t.clone()

    histogram_upper_quantile(rank1, 2, bins=100, reduce_max=max_with(rank0), reduce_counts=capture)
    pooled = histogram_upper_quantile(
        rank0, 2, bins=100, reduce_max=max_with(rank1), reduce_counts=lambda t: t.add_(captured["packed"])
    )
    torch.testing.assert_close(pooled, histogram_upper_quantile(both, 2, bins=100))


def skewed_moe() -> tuple[MoE, torch.Tensor]:
    spec = load_model("tiny-moe")
    moe = build_model(spec).moe_layers()[0].train()
    gen = torch.Generator().manual_seed(0)
    offset = torch.randn(spec.d_model, generator=gen)
    x = torch.randn(4096, spec.d_model, generator=gen) + offset
    with torch.no_grad():  # experts 0 and 1 read the shared offset strongly: nearly every token picks them
        moe.router.weight[0] += 0.5 * offset
        moe.router.weight[1] += 0.4 * offset
    return moe, x


def test_quantile_balancing_drives_a_skewed_router_to_k_over_e_load():
    moe, x = skewed_moe()
    balancer = QuantileBalancer(moe, bins=1000)
    ratios = []
    for _ in range(8):
        with torch.no_grad():
            moe(x)
        load = moe.last_routing_counts.float()
        ratios.append(float(load.max() / load.mean()))  # 1.0 is perfectly balanced: K/E of tokens per expert
        balancer.step()
    assert ratios[0] > 3.0  # experts 0 and 1 take almost every assignment (the ceiling is E/K = 4)
    assert ratios[-1] - 1 < (ratios[0] - 1) / 20
    assert moe.router.bias.grad is None and abs(float(moe.router.bias.mean())) < 1e-5


def test_balancer_update_lags_one_step_and_ignores_eval_forwards():
    moe, x = skewed_moe()
    balancer = QuantileBalancer(moe)
    moe.eval()
    with torch.no_grad():
        moe(x)
    assert moe.margins == []  # evaluation forwards do not feed the statistics
    moe.train()
    with torch.no_grad():
        moe(x)
    assert torch.count_nonzero(moe.router.bias) == 0  # this step routed with the old (zero) bias
    balancer.step()
    assert torch.count_nonzero(moe.router.bias) > 0 and moe.margins == []
