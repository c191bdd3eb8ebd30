"""The parallel layout (rackcast.layout.ParallelSpec): the sizes it derives, the chunk placement, and the plan
validator's command line.

    .venv/bin/pytest -q tests/test_layout.py
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import PLANS, ROOT

from rackcast.layout import ParallelSpec, chunk_ranks
from rackcast.plan import load_plan
from rackcast.presets import load_model


def test_hero_layout_derives_its_group_sizes():
    par = load_plan(str(PLANS / "marin-535b-hero.yaml")).parallel
    assert (par.gpus, par.stage_ranks, par.batch_shards) == (704, 704, 704)
    assert (par.expert_group, par.expert_data, par.expert_fsdp, par.expert_replicas) == (64, 11, 1, 11)
    assert (par.reduction_inner, par.reduction_outer) == (64, 11)


def test_expert_group_counts_expert_tensor_ranks_and_the_copies_divide_the_rest():
    par = ParallelSpec(data=2, fsdp=4, tensor=2, expert=4, expert_tensor=2)
    assert par.expert_group == 8
    assert par.expert_data == par.stage_ranks // 8 == 2
    assert par.expert_fsdp == 1  # fsdp x context x tensor = 8 = the expert group: no room to shard
    wide = ParallelSpec(data=1, fsdp=16, expert=4)
    assert (wide.expert_fsdp, wide.expert_replicas) == (4, 1)
    # no FSDP: context ranks replicate the experts (the trainer's DDP over the dp x cp token ranks)
    assert ParallelSpec(context=2).expert_fsdp == 1


def test_expert_coordinates_put_expert_tensor_ranks_innermost_in_each_expert_block():
    par = ParallelSpec(data=8, expert=2, expert_tensor=2)  # two expert groups of 4 token ranks
    assert [par.expert_coordinates(u) for u in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert [ParallelSpec(data=4, expert=4).expert_coordinates(u) for u in (0, 3)] == [(0, 0, 0), (0, 3, 0)]


def test_micro_batches_and_tokens_per_micro_batch():
    par = ParallelSpec(data=2, fsdp=4, context=2)
    assert par.microbatches(global_batch=64, micro_batch=2) == 4
    assert par.tokens_per_microbatch(micro_batch=2, seq_len=4096) == 4096


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("interleaved_1f1b", 3), ("zb_h1", 2), ("dualpipev", 2)])
def test_rank_chunks_inverts_chunk_ranks(schedule, virtual):
    par = ParallelSpec(pipeline=4, virtual=virtual)
    owner = par.chunk_ranks(schedule)
    assert len(owner) == par.chunks == 4 * virtual
    for rank in range(4):
        assert sorted(par.rank_chunks(rank, schedule)) == [c for c, r in enumerate(owner) if r == rank]


def test_the_v_shape_puts_the_first_and_last_chunk_on_rank_zero():
    assert chunk_ranks("dualpipev", 3, 2) == [0, 1, 2, 2, 1, 0]
    assert ParallelSpec(pipeline=2, virtual=2).rank_layers(0, "dualpipev", 8) == [0, 1, 6, 7]


def test_check_names_the_field_of_the_first_problem():
    spec = load_model("marin-535b-a23b")
    problems = []
    ParallelSpec(data=11, fsdp=64, expert=7).check(spec, 704, "1f1b", lambda f, m: problems.append((f, m)))
    assert problems[0] == ("parallel.expert", "384 experts are not divisible by expert=7")


def test_the_plan_validator_prints_one_line_and_exits_2_on_a_refusal(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((PLANS / "marin-535b-hero.yaml").read_text().replace("expert: 64", "expert: 7"))
    out = subprocess.run([sys.executable, "-m", "rackcast.plan", str(bad)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"rackcast.plan: error: {bad}: parallel.expert: 384 experts are not "
                                               "divisible by expert=7"]
    ok = subprocess.run([sys.executable, "-m", "rackcast.plan", str(PLANS / "tiny-1proc.yaml")], capture_output=True,
                        text=True, cwd=ROOT)
    assert ok.returncode == 0 and ok.stdout.strip().endswith(": ok")


# ------------------------------------------------------------------------------------------- uneven layer splits
def test_uneven_split_spreads_the_remainder_by_rule():
    from rackcast.layout import uneven_split

    assert uneven_split(61, 16, "front") == (4,) * 13 + (3,) * 3
    assert uneven_split(61, 16, "back") == (3,) * 3 + (4,) * 13
    assert uneven_split(61, 16, "middle") == (3,) + (4,) * 13 + (3,) * 2
    for rule in ("front", "middle", "back"):
        split = uneven_split(94, 8, rule)
        assert sum(split) == 94 and max(split) - min(split) == 1


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("interleaved_1f1b", 2), ("dualpipev", 2)])
def test_stage_layers_assign_consecutive_layers_to_chunks_and_ranks(schedule, virtual):
    split = (5, 3, 4, 2, 1, 6)[: 3 * virtual] if virtual == 2 else (5, 3, 4)
    layers = sum(split)
    par = ParallelSpec(pipeline=3, virtual=virtual, stage_layers=split)
    ranges = [par.chunk_layer_range(c, layers) for c in range(par.chunks)]
    assert [len(r) for r in ranges] == list(split)
    assert [i for r in ranges for i in r] == list(range(layers))  # consecutive, in chunk order
    owner = par.layer_ranks(schedule, layers)
    for rank in range(3):
        held = par.rank_layers(rank, schedule, layers)
        assert sorted(held) == [i for i, r in enumerate(owner) if r == rank]
        assert len(held) == sum(split[c] for c in par.rank_chunks(rank, schedule))


def test_an_empty_split_is_the_even_one():
    even = ParallelSpec(pipeline=4, virtual=2)
    listed = ParallelSpec(pipeline=4, virtual=2, stage_layers=(2,) * 8)
    assert even.layer_ranks("interleaved_1f1b", 16) == listed.layer_ranks("interleaved_1f1b", 16)
    assert even.rank_layers(1, "interleaved_1f1b", 16) == [2, 3, 10, 11]


@pytest.mark.parametrize("split,message", [
    ("[1, 1, 2]", "parallel.stage_layers: lists 3 chunks, but pipeline x virtual = 2 x 1 = 2"),
    ("[2, 1]", "parallel.stage_layers: sums to 3 layers, but model tiny-moe has 4"),
    ("[4, 0]", "parallel.stage_layers[1]: "),
])
def test_a_bad_split_is_refused_with_one_line_naming_the_file_and_field(tmp_path, split, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text((PLANS / "tiny-2proc-pp.yaml").read_text().replace("  pipeline: 2\n",
                                                                      f"  pipeline: 2\n  stage_layers: {split}\n"))
    out = subprocess.run([sys.executable, "-m", "rackcast.plan", str(bad)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rackcast.plan: error: {bad}: {message}"), lines
    good = tmp_path / "good.yaml"
    good.write_text(bad.read_text().replace(split, "[3, 1]"))
    assert load_plan(str(good)).parallel.stage_layers == (3, 1)


def test_zero_shards_over_the_data_and_context_replicas():
    """Context ranks hold the same weights and average their gradients like data replicas, so ZeRO shards over
    data x context (backend.zero over the token ranks) and the memory model prices that split; fsdp shards alone."""
    assert ParallelSpec(data=2, context=2, zero=1).state_shards == 4
    assert ParallelSpec(data=2, context=2, zero=1).grad_shards == 1
    assert ParallelSpec(data=2, context=2, zero=2).grad_shards == 4
    assert ParallelSpec(fsdp=2, context=2).state_shards == ParallelSpec(fsdp=2, context=2).grad_shards == 2


def test_sequence_parallelism_splits_the_tokens_a_rank_routes_and_the_simulator_prices_that():
    """With tensor x expert the expert groups fold over the tensor ranks, and under sequence parallelism each tensor
    rank routes its 1/tensor of the sequence (Megatron-Core; backend.tensor_parallel): the estimate's all-to-all
    bytes and routed-expert FLOPs and the event simulator's dispatch halve at TP2; without it every tensor rank
    routes all its tokens (balanced routing, so that the draw's expected imbalance does not change with the
    tokens)."""
    from dataclasses import replace

    from rackcast.simulator.estimate import plan_features
    from rackcast.simulator.workload import Workload

    sp = load_plan(str(PLANS / "tiny-2proc-tp-ep.yaml"))
    sp = replace(sp, expert_transport=replace(sp.expert_transport, routing="balanced"))  # no draw's imbalance
    whole = replace(sp, parallel=replace(sp.parallel, sequence_parallel=False))
    spec, topo = sp.model_spec(), sp.topology_spec()
    assert sp.parallel.tensor == 2 and sp.parallel.sequence_parallel
    assert sp.routed_tokens_per_microbatch(spec) * 2 == whole.routed_tokens_per_microbatch(spec) == \
        whole.tokens_per_microbatch(spec)
    halved, full = plan_features(spec, sp, topo), plan_features(spec, whole, topo)
    for key in ("a2a_bytes", "expert_flops"):
        assert halved[key] * 2 == pytest.approx(full[key]), key
    assert Workload(spec, sp, topo).loads.rows.sum() * 2 == Workload(spec, whole, topo).loads.rows.sum()
