"""Op counts on the structural twin (simulator.op_counts.structural_twin, backend.opcount.count_ops): the twin keeps
the structure and is small, it counts exactly what the full model counts, expert ops do not grow with the experts, a 535B
preset counts in seconds, the key ignores widths that keep the structure, and the table packaged with the simulator
(simulator/op_counts.json) holds what the backend counts today for every preset.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from rackcast.backend.layers import rotary_dims as backend_rotary_dims  # noqa: E402
from rackcast.backend.opcount import count_ops  # noqa: E402
from rackcast.errors import RackcastError  # noqa: E402
from rackcast.presets import list_models, load_model  # noqa: E402
from rackcast.simulator import op_counts as oc  # noqa: E402

PRESETS = list_models()
TWIN_WIDTH_MAX = 400  # the widest twin width of any preset (gpt-1t's 160 heads x 2) is 321; far below real widths


def _same_counts(a: dict, b: dict) -> None:
    assert {k: v for k, v in a.items() if k != "model"} == {k: v for k, v in b.items() if k != "model"}


def _medium_d768(layers: int):
    """marin-ladder-d768 at its real d_model, heads, head_dim and 192 experts, with a short vocabulary and sequence
    and narrow experts and gated norm (still narrower than d_model, so the same structure): a full count's backward
    materialises a full [E, in, hidden] gradient per routed expert (E^2 x in x hidden per stack), so the real
    384-wide experts take about 15 s for two layers on a CPU."""
    d = load_model("marin-ladder-d768")
    return replace(d, name="medium-d768", layers=layers, vocab=4096, seq_len=256, gated_norm_rank=32,
                   attention=replace(d.attention, window=128),
                   moe=replace(d.moe, latent_dim=48, expert_ffn=48, shared_ffn=48))


def test_rotary_dims_restates_the_backend():
    for head_dim in range(1, 200):
        for fraction in (0.0, 0.1, 0.25, 0.3, 0.5, 0.75, 1.0):
            assert oc.rotary_dims(head_dim, fraction) == backend_rotary_dims(head_dim, fraction)


LATENT = [name for name in PRESETS if load_model(name).attention.mla is not None]


@pytest.mark.parametrize("name", LATENT)
def test_twin_of_a_latent_attention_model_is_refused_with_one_line(name):
    with pytest.raises(RackcastError, match="latent attention"):
        oc.structural_twin(load_model(name))


@pytest.mark.parametrize("name", [name for name in PRESETS if name not in LATENT])
def test_twin_keeps_the_structure_and_is_small(name):
    spec = load_model(name)
    twin = oc.structural_twin(spec)
    assert oc.structural_twin(twin) == twin  # idempotent: counting a twin counts the same twin
    assert oc.structure(twin) == oc.structure(spec)
    a, t = spec.attention, twin.attention
    assert (t.heads, t.kv_heads_local, t.kv_heads_global, t.kv_heads_stored) == \
        (a.heads, a.kv_heads_local, a.kv_heads_global, a.kv_heads_stored)
    assert (t.global_every, t.output_gate, t.exclusive, t.rope_fraction, t.bias) == \
        (a.global_every, a.output_gate, a.exclusive, a.rope_fraction, a.bias)
    assert (twin.layers, twin.conv, twin.norm, twin.tied_embeddings, twin.positional, twin.embed_norm) == \
        (spec.layers, spec.conv, spec.norm, spec.tied_embeddings, spec.positional, spec.embed_norm)
    assert bool(twin.gated_norm_rank) == bool(spec.gated_norm_rank) and bool(twin.ffn) == bool(spec.ffn)
    if spec.moe:
        m, tm = spec.moe, twin.moe
        assert (tm.experts, tm.top_k, tm.shared_experts, tm.dense_layers, tm.router_bias) == \
            (m.experts, m.top_k, m.shared_experts, m.dense_layers, m.router_bias)
        assert bool(tm.latent_dim) == bool(m.latent_dim)
        assert (tm.latent_dim < twin.d_model) == (m.latent_dim < spec.d_model)
    assert twin.seq_len <= oc.COUNT_SEQ and (t.window == 0) == (a.window == 0)
    full, small = oc.widths(spec), oc.widths(twin)
    assert small.keys() == full.keys()
    assert all(small[k] <= full[k] for k in full) and max(small.values()) <= TWIN_WIDTH_MAX
    assert twin.params_total <= spec.params_total


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-dense", "tiny-moe-dense0"])
@pytest.mark.parametrize("optimizer", ["muonh", "adamw"])
def test_twin_counts_what_the_full_model_counts(name, optimizer):
    spec = load_model(name)
    full = count_ops(spec, optimizer, twin=False)
    _same_counts(count_ops(oc.structural_twin(spec), optimizer, twin=False), full)
    assert count_ops(spec, optimizer) == full  # the default counts on the twin, named as the model


@pytest.mark.slow
def test_twin_counts_what_a_medium_model_counts():
    """192 experts at d_model 768 (two sequences counted so that every expert gets a row), three local layers and a
    global one: the full count takes about 4 s on a CPU. Its twin is marin-ladder-d768's (at 4 layers)."""
    spec = _medium_d768(layers=4)
    assert [spec.is_global(i) for i in range(4)] == [False, False, False, True]
    twin = oc.structural_twin(spec)
    assert twin == replace(oc.structural_twin(replace(load_model("marin-ladder-d768"), layers=4)),
                           name=spec.name)
    full = count_ops(spec, "muonh", twin=False)
    small = count_ops(twin, "muonh", twin=False)
    # DDP's hook runs per bucket (two ops); the full model's dense gradients fill more buckets (DDP's bucket_cap_mb)
    # than the twin's one: the one count that depends on bytes (backend.opcount.count_grad_reduction)
    assert (full["ddp_ops"] - small["ddp_ops"]) % 2 == 0 and 0 <= full["ddp_ops"] - small["ddp_ops"] <= 2 * 4
    _same_counts({**small, "ddp_ops": 0}, {**full, "ddp_ops": 0})
    assert count_ops(spec, "muonh") == {**full, "ddp_ops": small["ddp_ops"]}
    assert len(set(full["fwd_experts"])) == 1 and full["fwd_experts"][0] > 0  # grouped GEMMs: the same in every layer


def test_expert_ops_do_not_grow_with_the_number_of_experts():
    """The routed experts are grouped GEMMs (backend.moe.GroupedExperts): 96 experts make the ops 8 do, although
    only the 96-expert count needs two 32-token sequences for every expert to get a row (no empty groups)."""
    spec = load_model("tiny-moe")
    few = count_ops(spec, "muonh")
    many = count_ops(replace(spec, moe=replace(spec.moe, experts=96)), "muonh")
    assert few["fwd_experts"][0] > 0
    assert many["fwd_experts"] == few["fwd_experts"]


@pytest.mark.slow
def test_a_535b_preset_counts_every_layer_and_its_grouped_experts():
    spec = load_model("marin-535b-a23b")
    counts = count_ops(spec, "muonh")  # on the structural twin: the full model would not fit this machine
    assert len(counts["fwd_layers"]) == len(counts["fwd_experts"]) == spec.layers == 48
    assert counts["model"] == "marin-535b-a23b" and counts["experts"] == 384
    assert len(set(counts["fwd_experts"])) == 1 and counts["fwd_experts"][0] > 0  # grouped GEMMs in every layer
    assert counts["optimizer_ops"] > 0 and counts["bwd_over_fwd"] > 1


def test_cache_key_ignores_widths_and_labels_not_structure():
    spec = load_model("tiny-moe")
    a, m = spec.attention, spec.moe
    wider = replace(spec, name="wide", description="", d_model=128, vocab=512, seq_len=512, gated_norm_rank=16,
                    attention=replace(a, head_dim=32, window=64),
                    moe=replace(m, expert_ffn=64, latent_dim=64, shared_ffn=64))
    assert oc.structural_twin(wider) == replace(oc.structural_twin(spec), name="wide", description="")
    assert oc.cache_key(wider, "muonh") == oc.cache_key(spec, "muonh")
    for other in (replace(spec, layers=3), replace(spec, moe=replace(m, experts=16)),
                  replace(spec, moe=replace(m, latent_dim=0)), replace(spec, attention=replace(a, window=0)),
                  replace(spec, attention=replace(a, window=8)),  # masked local attention on the counted tokens
                  replace(spec, moe=replace(m, expert_ffn=64))):  # expert matrices now tall: another optimizer path
        assert oc.cache_key(other, "muonh") != oc.cache_key(spec, "muonh")


def test_the_twin_is_valid_data():
    """The twin's data (what the key hashes) reads back strictly as the same spec."""
    from rackcast.strict import from_data

    for name in ("marin-ladder-d768", "marin-535b-a23b", "gpt-1t"):
        twin = oc.structural_twin(load_model(name))
        assert from_data(type(twin), oc.spec_data(twin)) == twin


def test_the_packaged_table_has_its_models_with_both_optimizers():
    table = oc._table()
    missing = [f"{name} ({opt})" for name in oc.TABLE_MODELS for opt in ("muonh", "adamw")
               if oc.cache_key(load_model(name), opt) not in table]
    assert not missing, f"simulator/op_counts.json lacks {', '.join(missing)}: rackcast calibrate --op-counts-table"


@pytest.mark.parametrize("name", oc.TABLE_MODELS)
@pytest.mark.parametrize("optimizer", ["muonh", "adamw"])
def test_the_packaged_table_matches_a_fresh_count(name, optimizer):
    """What the simulator reads is what the installed torch and backend count now (regenerate the table with
    `rackcast calibrate --op-counts-table` when this fails after a torch or model change)."""
    spec = load_model(name)
    fresh = count_ops(spec, optimizer)
    packed = oc._table()[oc.cache_key(spec, optimizer)]
    drop = ("model", "torch")
    assert {k: v for k, v in packed.items() if k not in drop} == {k: v for k, v in fresh.items() if k not in drop}


def test_the_expert_parallel_path_adds_the_same_ops_at_any_expert_degree_and_local_experts():
    """backend.opcount.count_ep_dispatch on the real ExpertParallelMoE (collectives looped back): the ops it adds
    over the one-process MoE do not depend on ep (2, 4, 8: 4, 2, 1 local experts) nor on the tokens, nor capacity
    mode's (ep 1 too), so the table stores one forward and one backward count of each per model (count_ops:
    simulator.op_counts.DISPATCH_KEYS); a dense model adds none."""
    import torch.distributed as dist

    from rackcast.backend.opcount import count_ep_dispatch

    real = dist.all_to_all_single
    spec = oc.structural_twin(load_model("tiny-moe"))
    counts = {(ep, tokens): count_ep_dispatch(spec, ep, tokens) for ep in (2, 4, 8) for tokens in (32, 64)}
    assert dist.all_to_all_single is real  # the loopback is gone after the count
    first = counts[2, 32]
    assert first["ep_fwd"] > 0 and first["ep_bwd"] > 0 and first["capacity_fwd"] > 0
    assert all(c == first for c in counts.values())
    one = count_ep_dispatch(spec, 1, 32)
    assert one == {**first, "ep_fwd": 0, "ep_bwd": 0}  # ep 1: the capacity cut alone
    counted = count_ops(spec, "muonh")
    assert {k: counted[k] for k in oc.DISPATCH_KEYS} == first
    dense = count_ops(load_model("tiny-dense"), "muonh")
    assert {k: dense[k] for k in oc.DISPATCH_KEYS} == dict.fromkeys(oc.DISPATCH_KEYS, 0)


def test_ddp_adds_two_ops_per_dense_parameter_and_its_hook_two_per_bucket():
    """backend.opcount.count_grad_reduction on the real DDP wrapper (backend.parallel.wrap_data_parallel, one-rank
    gloo group): each dense parameter's gradient is copied into its bucket and re-viewed there (gradients as bucket
    views, after zero_grad set them to None), the trainer's comm hook averages and all-reduces the one bucket a
    tiny model's gradients fill, DDP's forward records itself; the flat expert reduction concatenates, averages and
    copies back each expert gradient."""
    from rackcast.backend.model import build_model
    from rackcast.backend.opcount import count_grad_reduction
    from rackcast.backend.parallel import is_expert_param

    spec = oc.structural_twin(load_model("tiny-moe"))
    net = build_model(spec, seed=0, device=torch.device("cpu"))
    tokens = torch.randint(0, spec.vocab, (1, spec.seq_len))
    names = [n for n, p in net.named_parameters() if p.requires_grad]
    dense, experts = sum(not is_expert_param(n) for n in names), sum(map(is_expert_param, names))
    counted = count_grad_reduction(net, tokens)
    assert counted["ddp_ops"] == 2 * dense + 2 + 2  # and DDP's forward its record_function's enter and exit
    assert counted["expert_reduce_ops"] >= 3 * experts + 2 and counted["dense_reduce_ops"] >= 3 * dense + 2
    assert not torch.distributed.is_initialized()  # the one-rank group is gone after the count


def test_the_twin_takes_the_windowed_attention_branches_of_the_model_at_its_own_length():
    """tiny-moe's local layers (window 32) are banded at its seq_len 128; counted on 32 tokens a window of 32 would
    not be, so the twin's window is shorter (and keeps the ragged-block branch); a window as long as the sequence
    stays unbanded."""
    spec = load_model("tiny-moe")
    twin = oc.structural_twin(spec)
    assert oc.window_branches(spec.attention.window, spec.seq_len)[0]
    assert oc.window_branches(twin.attention.window, twin.seq_len) == \
        oc.window_branches(spec.attention.window, spec.seq_len)
    unbanded = replace(spec, attention=replace(spec.attention, window=spec.seq_len))
    assert not oc.window_branches(oc.structural_twin(unbanded).attention.window, oc.COUNT_SEQ)[0]


def test_a_counted_micro_batch_runs_the_ops_of_two_sequences_not_one():
    """At one sequence some reshapes are views that copy at two or more (backend.opcount.MIN_SEQUENCES): tiny-moe's
    counted layers make the ops its layers make on two sequences, which differ from one sequence's."""
    from rackcast.backend.opcount import MIN_SEQUENCES, _prepared

    spec = oc.structural_twin(load_model("tiny-moe"))

    def layer_ops(batch: int) -> list[int]:
        net, counter, tokens = _prepared(spec, batch, spec.seq_len)
        with counter:
            net(tokens)
        return [counter.counts[f"layer{i}"] + counter.counts.get(f"experts{i}", 0) for i in range(spec.layers)]

    assert MIN_SEQUENCES == 2 and layer_ops(1) != layer_ops(2)
    assert count_ops(spec, "muonh", twin=False)["fwd_layers"] == layer_ops(2)
