"""One capability set: every layout the planner ranks passes `rackcast train --check`, and --check names each field
the trainer cannot run, one line per reason."""

from __future__ import annotations

import pytest
import yaml

from rackcast.capabilities import EVERYTHING, TRAINER, refusals
from rackcast.cli.train import check_lines
from conftest import PLANS
from rackcast.plan import load_plan, save_plan

PROBLEMS = [(model, topology) for model in ("tiny-moe", "marin-ladder-d768")
            for topology in ("local-cpu", "h200-hgx", "gb200-nvl72")] + [("tiny-llama-3.1", "local-cpu")]


@pytest.mark.parametrize("model,topology", PROBLEMS)
def test_every_ranked_layout_passes_train_check(model, topology, tmp_path):
    from rackcast.planner.search import Request, search

    result = search(Request(model=model, topology=topology, racks=1, tokens=1e9, top=0, simulate=False, workers=1))
    assert result.ranked
    for row in result.ranked:
        plan = result.plan_for(row)
        assert check_lines(row.layout.label, plan) == [], row.layout.label
    path = tmp_path / "winner.yaml"
    save_plan(result.plan_for(result.winner), str(path))
    assert check_lines(str(path), load_plan(str(path))) == []


def _plan(tmp_path, **fields):
    data = {"name": "p", "model": "tiny-moe", "topology": {"name": "local-cpu", "domains": 1, "usable_gpus": 2},
            "parallel": {"data": 2}, "batch": {"global_batch": 8, "micro_batch": 2}, **fields}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_train_check_lists_each_refused_field_on_its_own_line(tmp_path, cli):
    path = _plan(tmp_path, dropout=True, grad_dtype="bf16", precision="fp8")
    proc = cli("train", str(path), "--check")
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 3
    for field, line in zip(("precision", "grad_dtype", "dropout"), lines):
        assert line.startswith(f"rackcast train: error: {path}: {field}: "), line


def test_train_check_accepts_a_runnable_plan_and_launches_nothing(tmp_path, cli):
    path = _plan(tmp_path, recompute="full", optimizer={"name": "muonh", "state_location": "host"})
    proc = cli("train", str(path), "--check")
    assert proc.returncode == 0, proc.stderr
    assert "can run" in proc.stdout and not (tmp_path / "runs").exists()


def test_refusals_name_master_weights_and_the_unrunnable_axes(tmp_path):
    plan = load_plan(str(_plan(tmp_path, optimizer={"name": "adamw", "master_weights": False})))
    reasons = refusals(plan, plan.model_spec())
    assert [r.split(":")[0] for r in reasons] == ["optimizer.master_weights"]
    assert refusals(plan, plan.model_spec(), EVERYTHING) == []


def test_the_planner_offers_uneven_splits_only_where_the_layers_do_not_divide_and_the_trainer_runs_them():
    from dataclasses import replace

    from rackcast.planner.space import SpaceOptions, enumerate_space, layer_splits
    from rackcast.presets import load_model

    spec = load_model("deepseek-v3-class")  # 61 layers: no pipeline depth > 1 divides them
    assert layer_splits(64, 8) == [()]
    assert layer_splits(61, 4) == [(16, 15, 15, 15), (15, 16, 15, 15), (15, 15, 15, 16)]
    options = SpaceOptions(global_batch=2048, contexts=(1,), expert_tensors=(1,), micro_batches=(1,))
    offered = enumerate_space(spec, 32, 8, 8, options, 1e12).layouts
    piped = [lay for lay in offered if lay.parallel.pipeline > 1]
    assert piped and all(sum(lay.parallel.stage_layers) == 61 for lay in piped)
    assert {len(set(lay.parallel.stage_layers)) for lay in piped} == {2}  # base and base + 1 layers
    no_uneven = replace(TRAINER, uneven_pipeline=False)
    plan = load_plan(str(PLANS / "tiny-2proc-pp.yaml"))
    uneven = replace(plan, parallel=replace(plan.parallel, stage_layers=(3, 1)))
    assert refusals(uneven, uneven.model_spec()) == []
    assert refusals(uneven, uneven.model_spec(), no_uneven) == [
        "parallel.stage_layers: uneven pipeline splits are not implemented by the trainer"]
    fewer = enumerate_space(spec, 32, 8, 8, replace(options, capabilities=no_uneven), 1e12).layouts
    assert not [lay for lay in fewer if lay.parallel.pipeline > 1]


def test_tensor_parallel_layouts_are_offered_and_their_limits_refused(tmp_path):
    from rackcast.planner.search import Request, search

    result = search(Request(model="tiny-llama-3.1", topology="local-cpu", racks=1, tokens=1e9, top=0, simulate=False,
                            workers=1))
    assert any(row.layout.parallel.tensor > 1 for row in result.ranked)  # backend.tensor_parallel runs them
    plan = load_plan(str(_plan(tmp_path, parallel={"tensor": 2, "expert": 2, "sequence_parallel": True})))
    reasons = refusals(plan, plan.model_spec())
    assert [r.split(": ")[1][:40] for r in reasons] == [
        "short convolutions on the block outputs ",  # tiny-moe's conv.sites attn and mlp
        "the trainer splits KV heads over the ten",  # tiny-moe's global layers attend with 1 of 2 stored heads
    ]
    assert refusals(plan, plan.model_spec(), EVERYTHING) == []


def test_context_parallelism_is_refused_with_what_the_trainer_does_not_combine_it_with(tmp_path):
    """The trainer runs context parallelism (backend.context_parallel) with data and expert parallelism, with fsdp
    (backend.parallel.dense_fsdp_mesh), with ZeRO (backend.zero) and with pipeline parallelism (backend.train's
    _pipeline_loss), so nothing refuses C2 x F2, D2 x C2 x ZeRO-2 or C2 x PP2; with tensor parallelism it is
    refused, one "parallel.tensor" line, and the simulator prices it."""
    from dataclasses import replace

    from rackcast.layout import ParallelSpec

    runnable = load_plan(str(_plan(tmp_path, parallel={"data": 2, "context": 2, "expert": 4},
                                   topology={"name": "local-cpu", "domains": 1, "usable_gpus": 4})))
    assert refusals(runnable, runnable.model_spec()) == []
    for sharded in (ParallelSpec(fsdp=2, context=2), ParallelSpec(data=2, context=2, zero=2),
                    ParallelSpec(context=2, pipeline=2)):
        assert refusals(replace(runnable, parallel=sharded), runnable.model_spec()) == []
    plan = replace(runnable, parallel=ParallelSpec(data=2, fsdp=2, tensor=2, context=2, pipeline=2, zero=1))
    reasons = refusals(plan, plan.model_spec())
    lines = [r for r in reasons if r.startswith("parallel.context:")]
    assert lines == []
    assert "parallel.tensor: tensor parallelism together with context > 1 is not implemented by the trainer" in reasons
    assert not [r for r in refusals(plan, plan.model_spec(), EVERYTHING) if r.startswith("parallel.context:")]


def test_expert_tensor_plans_pass_train_check_and_its_untried_combinations_are_refused(tmp_path, cli):
    """The trainer runs expert tensor parallelism (backend.expert_tensor) with data, expert and context parallelism,
    FSDP, pipelines and ZeRO, so `rackcast train PLAN --check` accepts EP2 x ETP2 and FSDP4 x ETP2 and the planner
    offers ETP layouts; with tensor it is refused, one "parallel.expert_tensor" line, and the simulator prices it."""
    from dataclasses import replace

    from rackcast.layout import ParallelSpec
    from rackcast.planner.space import SpaceOptions, enumerate_space

    four = {"name": "local-cpu", "domains": 1, "usable_gpus": 4}
    for parallel in ({"data": 4, "expert": 2, "expert_tensor": 2}, {"data": 2, "expert_tensor": 2, "pipeline": 2},
                     {"context": 2, "data": 2, "expert_tensor": 2}, {"fsdp": 4, "expert_tensor": 2}):
        path = _plan(tmp_path, parallel=parallel, topology=four)
        proc = cli("train", str(path), "--check")
        assert proc.returncode == 0 and "can run" in proc.stdout, proc.stderr

    refused = _plan(tmp_path, parallel={"tensor": 2, "data": 2, "expert_tensor": 2}, topology=four)
    proc = cli("train", str(refused), "--check")
    assert proc.returncode == 2 and proc.stdout == ""
    assert [line for line in proc.stderr.strip().splitlines() if "parallel.expert_tensor:" in line] == [
        f"rackcast train: error: {refused}: parallel.expert_tensor: expert tensor parallelism together with tensor "
        "parallelism (parallel.tensor > 1) is not implemented by the trainer"]

    plan = load_plan(str(path))
    every = replace(plan, parallel=ParallelSpec(data=2, fsdp=2, tensor=2, context=2, pipeline=2, zero=1,
                                                expert_tensor=2))
    lines = [r for r in refusals(every, every.model_spec()) if r.startswith("parallel.expert_tensor:")]
    assert [w for w in ("tensor", "context", "fsdp", "pipeline", "zero") if any(f"(parallel.{w} " in r
                                                                               for r in lines)] == \
        ["tensor"]
    assert not [r for r in refusals(every, every.model_spec(), EVERYTHING) if r.startswith("parallel.expert_tensor:")]

    spec = plan.model_spec()
    offered = enumerate_space(spec, 1, 4, 4, SpaceOptions(global_batch=8), 1e9).layouts
    etp = [lay.parallel for lay in offered if lay.parallel.expert_tensor > 1]
    assert etp and all(p.tensor == 1 for p in etp) and any(p.fsdp > 1 for p in etp)
    assert any(p.pipeline > 1 for p in etp) and any(p.zero > 0 for p in etp)


def test_tensor_with_experts_passes_train_check_with_fsdp_zero_and_pipelines(tmp_path, cli):
    """The trainer folds the expert groups over the tensor ranks (backend.parallel.Groups.expert_mesh), so the
    example TP2 x EP2 plan passes `rackcast train PLAN --check` and nothing refuses tensor with expert, with fsdp,
    with ZeRO or with a pipeline (backend.pipeline's static stage shapes); an executor without the pipeline case
    refuses it in one "parallel.tensor" line, and the simulator prices it."""
    from dataclasses import replace

    from rackcast.layout import ParallelSpec

    path = PLANS / "tiny-2proc-tp-ep.yaml"
    proc = cli("train", str(path), "--check")
    assert proc.returncode == 0, proc.stderr
    assert "can run this plan (2 processes)" in proc.stdout
    plan = load_plan(str(path))
    spec = plan.model_spec()
    assert plan.parallel.tensor == plan.parallel.expert == 2 and refusals(plan, spec) == []
    for parallel in (ParallelSpec(tensor=2, expert=2, fsdp=2), ParallelSpec(tensor=2, expert=2, data=2, zero=2)):
        assert refusals(replace(plan, parallel=parallel), spec) == []
    piped = replace(plan, parallel=ParallelSpec(tensor=2, expert=2, pipeline=2))
    assert refusals(piped, spec) == []
    without = replace(TRAINER, tensor_experts_with_pipeline=False)
    assert refusals(piped, spec, without) == ["parallel.tensor: tensor parallelism together with expert > 1 and "
                                              "pipeline > 1 is not implemented by the trainer"]
    assert refusals(piped, spec, EVERYTHING) == []
