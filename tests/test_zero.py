"""ZeRO (parallel.zero): the memory model's formulas against Rajbhandari et al. (arXiv:1910.02054), the cost model's
reduce-scatter + all-gather in place of the all-reduce (estimate and simulator alike), the planner offering only
the stages the trainer runs, and the trainer's ZeRO-1 and ZeRO-2 (backend.zero) keeping optimizer state (and, under
ZeRO-2, reduced gradients) for its own parameters only. The ZeRO-1 multi-process equivalence runs are in tests/test_trainer_parallel.py (dp2-zero1,
ep2xdp2-zero1); ZeRO-2's are here, with Adam on every group and with MuonH, over five steps.

    .venv/bin/pytest -q tests/test_zero.py
"""

from __future__ import annotations

import os
import socket
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import PLANS

from rackcast.capabilities import EVERYTHING, TRAINER, refusals
from rackcast.errors import RackcastError
from rackcast.plan import load_plan, validate
from rackcast.simulator.activations import FP32
from rackcast.simulator.memory import memory_breakdown, rank_params

MEGATRON = PLANS / "gpt-145b-megatron.yaml"  # data 24, tensor 8, pipeline 8, AdamW


def _zero(plan, stage: int):
    return replace(plan, parallel=replace(plan.parallel, zero=stage))


def test_memory_follows_the_zero_paper_per_stage():
    # ZeRO section 5 / figure 1, per device with N_d data-parallel ranks: P_os divides the optimizer state (and the
    # fp32 master) by N_d, P_os+g the gradients too; the weights stay whole (fsdp is ZeRO-3).
    plan = load_plan(str(MEGATRON))
    spec, nd = plan.model_spec(), plan.parallel.data
    base, one, two = (memory_breakdown(spec, _zero(plan, z)) for z in (0, 1, 2))
    rp = rank_params(spec, plan)
    assert base.optimizer == pytest.approx(2 * FP32 * (rp.dense - rp.frozen))  # AdamW: two fp32 moments
    assert one.optimizer == pytest.approx(base.optimizer / nd) and one.master == pytest.approx(base.master / nd)
    assert one.gradients == base.gradients and one.weights == base.weights
    assert two.gradients == pytest.approx(base.gradients / nd)
    assert two.optimizer == one.optimizer and two.weights == base.weights
    assert base.total > one.total > two.total


def test_zero_swaps_the_all_reduce_for_a_reduce_scatter_and_an_all_gather_in_estimate_and_simulator():
    from rackcast.simulator import costs
    from rackcast.simulator.estimate import estimate
    from rackcast.simulator.step import simulate

    kinds = lambda z: [(c.kind, c.axis) for c in costs.gradient_reductions(8.0, 4.0, 1, 1, z)  # noqa: E731
                       if c.nbytes > 0] + [(c.kind, c.axis) for c in costs.parameter_gathers(2.0, 1.0, 1, 1, z)
                                           if c.nbytes > 0]
    assert kinds(0) == [("reduce_scatter", "inner"), ("all_reduce", "data"), ("all_reduce", "expert_replicas")]
    assert kinds(1) == [("reduce_scatter", "inner"), ("reduce_scatter", "data"),
                        ("reduce_scatter", "expert_replicas"), ("all_gather", "data"),
                        ("all_gather", "expert_replicas")]
    plan = load_plan(str(PLANS / "tiny-4proc.yaml"))
    for z in (0, 1):
        p = _zero(plan, z)
        est, sim = estimate(p), simulate(p, record=False)
        assert abs(est.phases_s["exposed_dp_comm"] / sim.phases_s["exposed_dp_comm"] - 1) < 0.05
        assert abs(est.step_time_s / sim.step_time_s - 1) < 0.05
    # the all-gather runs after the optimizer step: exposed, so ZeRO-1 changes the data-parallel time
    assert estimate(_zero(plan, 1)).phases_s["exposed_dp_comm"] != estimate(plan).phases_s["exposed_dp_comm"]


def test_zero_needs_data_replicas_and_the_trainer_runs_zero_1_and_2():
    plan = load_plan(str(PLANS / "tiny-2proc-ep.yaml"))
    spec = plan.model_spec()
    one_replica = replace(plan, parallel=replace(plan.parallel, data=1, fsdp=2, zero=1))
    with pytest.raises(RackcastError, match="parallel.zero: ZeRO-1 shards over the data replicas and needs data > 1"):
        validate(one_replica, spec, 2)
    assert refusals(_zero(plan, 1), spec) == [] and refusals(_zero(plan, 2), spec) == []
    assert refusals(_zero(plan, 2), spec, EVERYTHING) == []
    stage_one = replace(TRAINER, zero=(0, 1))  # an executor without ZeRO-2: the line names what it runs
    assert refusals(_zero(plan, 2), spec, stage_one) == ["parallel.zero: ZeRO-2 is not implemented by the trainer "
                                                         "(it runs ZeRO 0 or 1)"]


def test_the_planner_offers_the_zero_stages_the_executor_runs():
    from rackcast.planner.space import SpaceOptions, enumerate_space
    from rackcast.presets import load_model

    spec = load_model("tiny-moe")
    for caps, want in ((TRAINER, {0, 1, 2}), (EVERYTHING, {0, 1, 2})):
        layouts = enumerate_space(spec, 1, 4, 4, SpaceOptions(global_batch=16, capabilities=caps), 1e9).layouts
        assert {lay.parallel.zero for lay in layouts if lay.parallel.data > 1} == want
        assert {lay.parallel.zero for lay in layouts if lay.parallel.data == 1} == {0}
        if caps is TRAINER:
            assert not [lay for lay in layouts if lay.parallel.zero and lay.parallel.fsdp > 1]


def test_owners_are_balanced_by_size_and_deterministic():
    from rackcast.backend.zero import assign_owners

    # 10 -> rank 0, 8 -> 1, 3 -> 1 (11), 1 -> 0 (11), 1 -> 0 (tie: the lower rank): loads 12 and 11
    assert assign_owners([10, 1, 1, 8, 3], 2) == [0, 0, 0, 1, 1]
    assert assign_owners([5, 5, 5], 1) == [0, 0, 0]


def _worker(rank: int, world: int, port: int, out: str):
    from rackcast.backend.optim import build_optimizer
    from rackcast.backend.parallel import close_distributed
    from rackcast.backend.zero import Zero

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    got = {}
    for stage in (1, 2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        optimizer = build_optimizer(model, "adamw", lr=0.1)
        zero = Zero(model.named_parameters(), dist.group.WORLD, None, lambda name: False, stage=stage)
        torch.manual_seed(1 + rank)
        x = torch.randn(4, 8)
        if stage == 1:
            model(x).square().sum().backward()
            got["local"] = [p.grad.clone() for p in model.parameters()]  # this rank's, before the reduction
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        else:  # two micro-batches: between them a rank keeps the reduced gradients of its own parameters only
            model(x[:2]).square().sum().backward()
            zero.reduce_to_owners(world, last=False)
            got["between"] = [p.grad is None for p in model.parameters()]
            got["reduced"] = (zero.reduced_numel(), zero.owned_numel())
            model(x[2:]).square().sum().backward()
            zero.reduce_to_owners(world)
            got["grads"] = [p.grad for p in model.parameters()]  # after the reduction, before the step
            got["mine"] = [mine for _, _, _, mine in zero.assigned]
        zero.drop_foreign_grads()
        optimizer.step()
        zero.broadcast()
        held = sum(v.numel() for s in optimizer.state.values() for v in s.values() if v.ndim > 0)
        got[stage] = {"held": held, "owned": zero.owned_numel(), "params": [p.detach() for p in model.parameters()]}
    torch.save(got, f"{out}/{rank}.pt")
    close_distributed()


@pytest.mark.slow
def test_zero_one_and_two_keep_state_for_their_own_parameters_and_every_rank_ends_with_the_same_weights(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, str(tmp_path)), nprocs=2)
    got = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    total = 8 * 16 + 16 + 16 * 4 + 4
    for stage in (1, 2):
        assert got[0][stage]["owned"] + got[1][stage]["owned"] == total and min(g[stage]["owned"] for g in got) > 0
        for g in got:
            assert g[stage]["held"] == 2 * g[stage]["owned"]  # AdamW's two moments, for the owned parameters only
        for a, b in zip(got[0][stage]["params"], got[1][stage]["params"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # ZeRO-2: after the reduction a parameter's gradient is on its owner only, and it is the replicas' average
    assert all(all(g["between"]) and g["reduced"][0] == g["reduced"][1] for g in got)
    for i in range(4):
        owner = [g for g in got if g["mine"][i]]
        assert len(owner) == 1
        assert [g["grads"][i] is None for g in got] == [not g["mine"][i] for g in got]
        torch.testing.assert_close(owner[0]["grads"][i], (got[0]["local"][i] + got[1]["local"][i]) / 2)
    for a, b in zip(got[0][1]["params"], got[0][2]["params"]):  # the same update as ZeRO-1's
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


ZERO2_STEPS = 5


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muonh"])  # MuonH alone would miss a wrong gradient scale
def test_zero_two_trains_what_one_process_trains(optimizer, tmp_path_factory, tmp_path):
    from rackcast.backend.checkpoint import full_model_state, latest_complete
    from trainer_helpers import losses, reference_run, run_worker, write_plan

    ref = reference_run(tmp_path_factory, optimizer, ZERO2_STEPS)
    done = run_worker(write_plan(tmp_path / "z2.yaml", {"data": 2, "zero": 2}, optimizer=optimizer), tmp_path / "z2",
                      ZERO2_STEPS, world=2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert losses(tmp_path / "z2") == pytest.approx(losses(ref), rel=1e-5)
    want, have = full_model_state(latest_complete(ref)), full_model_state(latest_complete(tmp_path / "z2"))
    assert have.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(have[key], value, atol=1e-5, rtol=0, msg=key)


def test_a_candidate_too_large_to_simulate_keeps_its_estimate_instead_of_ending_the_search():
    # ZeRO-1 lets wide data-parallel layouts fit, and with them steps of more routing draws than simulator.step
    # runs (check_work): planner.verify keeps such a candidate's estimate and goes on.
    from rackcast.planner import verify

    plan = load_plan(str(PLANS / "tiny-2proc-ep.yaml"))
    big = replace(plan, batch=replace(plan.batch, global_batch=2**22, micro_batch=1))
    assert "simulate runs at most" in verify._simulate_one(big)["refused"]
    assert "refused" not in verify._simulate_one(plan)


@pytest.mark.slow
def test_zero_checkpoints_resume_across_layouts(tmp_path_factory, tmp_path):
    """One process's step-3 checkpoint continued under data 2 x ZeRO-2 (each rank loads the Adam moments of the
    parameters it owns), saved at step 4 by the owners, and that continued by one process to step 5: both end where
    the uninterrupted one-process run ends (a moment lost or loaded onto the wrong owner would show)."""
    import shutil

    from rackcast.backend.checkpoint import full_model_state, latest_complete, step_dir
    from trainer_helpers import assert_trains_like, losses, reference_run, run_worker, write_plan

    ref = reference_run(tmp_path_factory, "adamw", ZERO2_STEPS, "--checkpoint-every", "3")
    ref_losses, ref_params = losses(ref), full_model_state(latest_complete(ref))
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(step_dir(ref, 3), step_dir(run, 3))
    zero = write_plan(tmp_path / "z2.yaml", {"data": 2, "zero": 2}, optimizer="adamw")
    done = run_worker(zero, run, ZERO2_STEPS, "--resume", "--checkpoint-every", "1", world=2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_trains_like(run, ref_losses, ref_params)
    shutil.rmtree(step_dir(run, ZERO2_STEPS))  # one process continues ZeRO-2's step-4 checkpoint
    done = run_worker(write_plan(tmp_path / "one.yaml", {}, optimizer="adamw"), run, ZERO2_STEPS, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_trains_like(run, ref_losses, ref_params)
