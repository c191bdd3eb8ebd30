"""Force-balanced routing (expert_transport.routing: balanced): every expert gets exactly its share of the
tokens x top_k assignments, so the estimate's max-load factor is 1, the simulator's most loaded rank is the mean,
capacity mode drops nothing, a balanced step is no slower than a uniform draw's, and the trainer runs it
(backend.moe.balanced_assignment): exact counts, the router still trained through the combine weights, expert
parallelism training what one process trains, and a loss that falls.

    .venv/bin/pytest -q tests/test_balanced_routing.py
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import PLANS
from rackcast.capabilities import EVERYTHING, TRAINER, refusals
from rackcast.cli import main
from rackcast.plan import ExpertTransport, load_plan
from rackcast.simulator.estimate import estimate
from rackcast.simulator.routing import balanced_counts, expected_max_load_factor
from rackcast.simulator.step import simulate
from rackcast.simulator.workload import Workload
from rackcast.vocab import ROUTINGS

BALANCED = ExpertTransport(routing="balanced")


def test_balanced_is_a_routing_name_of_the_vocabulary():
    assert "balanced" in ROUTINGS


@pytest.mark.parametrize("assignments, experts, ep, offset", [(4096 * 8, 256, 64, 0), (1000, 64, 8, 0),
                                                               (1000, 64, 8, 37), (7, 16, 4, 5)])
def test_balanced_counts_give_every_expert_its_share_in_closed_form(assignments, experts, ep, offset):
    counts = balanced_counts(assignments, experts, ep, offset)
    assert counts.sum() == assignments
    share, rest = divmod(assignments, experts)
    assert sorted(counts) == [share] * (experts - rest) + [share + 1] * rest
    ranks = counts.reshape(ep, experts // ep).sum(axis=1)
    assert ranks.max() - ranks.min() <= 1  # the remainder is striped over the ranks


def test_consecutive_sources_together_stay_balanced():
    total = sum(balanced_counts(1000, 64, 8, s * 1000) for s in range(3))
    assert np.array_equal(total, balanced_counts(3000, 64, 8))


@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_the_estimates_max_load_factor_is_one_and_nothing_drops(mode):
    factor, drops = expected_max_load_factor(replace(BALANCED, mode=mode), experts=256, top_k=8, ep=64,
                                             tokens_group=4096)
    assert factor == 1.0 and drops == 0.0
    uniform, _ = expected_max_load_factor(ExpertTransport(), experts=256, top_k=8, ep=64, tokens_group=4096)
    assert uniform > 1.0


def test_the_simulators_most_loaded_rank_is_the_mean():
    plan = replace(load_plan(str(PLANS / "tiny-2proc-ep.yaml")), expert_transport=BALANCED)
    spec = plan.model_spec()
    loads = Workload(spec, plan, plan.topology_spec()).loads
    received = loads.rows.sum(axis=2)  # (micro-batch, layer, rank)
    assert np.array_equal(received.max(axis=2), received.min(axis=2))
    assert loads.drop_fraction == 0.0


def test_capacity_mode_with_balanced_routing_drops_nothing():
    plan = load_plan(str(PLANS / "tiny-2proc-ep.yaml"))
    capped = simulate(replace(plan, expert_transport=replace(BALANCED, mode="capacity", capacity_factor=1.0)),
                      seed=3, record=False)
    assert capped.drop_fraction == 0.0


@pytest.mark.parametrize("name", ["tiny-2proc-ep.yaml", "marin-535b-hero.yaml"])
def test_a_balanced_step_is_no_slower_than_a_uniform_draw(name):
    plan = load_plan(str(PLANS / name))
    balanced = replace(plan, expert_transport=BALANCED)
    assert estimate(balanced).step_time_s <= estimate(plan).step_time_s
    if name.startswith("tiny"):  # the hero's simulation takes seconds; the tiny plan's is the simulator check
        assert simulate(balanced, record=False).step_time_s <= simulate(plan, record=False).step_time_s


def test_the_trainer_runs_balanced_routing_and_an_executor_without_it_refuses_in_one_line():
    plan = replace(load_plan(str(PLANS / "tiny-2proc-ep.yaml")), expert_transport=BALANCED)
    assert refusals(plan, plan.model_spec()) == [] and refusals(plan, plan.model_spec(), EVERYTHING) == []
    lines = refusals(plan, plan.model_spec(), replace(TRAINER, balanced_routing=False))
    assert len(lines) == 1 and lines[0].startswith("expert_transport.routing: balanced")


@pytest.mark.parametrize("tokens", [256, 24])  # 256 x 2 / 8 exact; 24 x 2 = 48 = 6 per expert
def test_every_expert_gets_exactly_its_share_and_the_router_still_gets_a_gradient(tokens):
    from rackcast.backend.model import build_model
    from rackcast.presets import load_model

    spec = load_model("tiny-moe")
    moe = build_model(spec).moe_layers()[0]
    moe.balanced_routing = True
    x = torch.randn(tokens, spec.d_model, generator=torch.Generator().manual_seed(0))
    ids, weights = moe.route(x)
    share = tokens * spec.moe.top_k // spec.moe.experts
    assert moe.last_routing_counts.tolist() == [share] * spec.moe.experts
    assert all(len(set(row)) == spec.moe.top_k for row in ids.tolist())  # distinct experts per token
    expected = torch.sigmoid(moe.router(x).gather(1, ids))  # the router's scores at the forced experts
    torch.testing.assert_close(weights, expected / expected.sum(-1, keepdim=True))
    moe(x).square().sum().backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0


@pytest.mark.slow
def test_expert_parallel_balanced_training_equals_one_process_and_its_loss_falls(tmp_path):
    from rackcast.backend.checkpoint import full_model_state, latest_complete
    from trainer_helpers import losses, routing, run_worker, write_plan

    steps, runs = 20, {}
    for name, parallel, world in (("one", {}, 1), ("ep2", {"data": 2, "expert": 2}, 2)):
        plan = write_plan(tmp_path / f"{name}.yaml", parallel, expert_transport={"routing": "balanced"})
        done = run_worker(plan, tmp_path / name, steps, world=world)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = tmp_path / name
    one, ep2 = losses(runs["one"]), losses(runs["ep2"])
    assert ep2 == pytest.approx(one, rel=1e-5)
    want, have = full_model_state(latest_complete(runs["one"])), full_model_state(latest_complete(runs["ep2"]))
    for key, value in want.items():
        torch.testing.assert_close(have[key], value, atol=1e-5, rtol=0, msg=key)
    assert sum(one[-5:]) / 5 < sum(one[:5]) / 5 - 0.1  # it learns
    counts = routing(runs["ep2"])
    for layer in set(counts["layer"]):  # every training forward balanced, so their sum is too
        per_expert = [c for li, c in zip(counts["layer"], counts["count"]) if li == layer]
        assert len(set(per_expert)) == 1


def test_a_bad_routing_name_is_one_line_naming_file_and_field(tmp_path, capsys):
    text = (PLANS / "tiny-2proc-ep.yaml").read_text() + "expert_transport: {routing: balance}\n"
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    try:
        code = main(["estimate", str(path)])
    except SystemExit as exc:
        code = exc.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in lines[0]
    assert "plan.yaml" in lines[0] and "expert_transport.routing" in lines[0] and "balanced" in lines[0]
