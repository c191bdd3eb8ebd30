"""Force-balanced routing (expert_transport.routing: balanced): every expert gets exactly its share of the
tokens x top_k assignments, so the estimate's max-load factor is 1, the simulator's most loaded rank is the mean,
capacity mode drops nothing, a balanced step is no slower than a uniform draw's, and the trainer refuses it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from conftest import PLANS
from rackcast.capabilities import EVERYTHING, refusals
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


def test_the_trainer_refuses_balanced_routing_in_one_line_and_the_estimate_accepts_it():
    plan = replace(load_plan(str(PLANS / "tiny-2proc-ep.yaml")), expert_transport=BALANCED)
    lines = refusals(plan, plan.model_spec())
    assert len(lines) == 1 and lines[0].startswith("expert_transport.routing: balanced")
    assert refusals(plan, plan.model_spec(), EVERYTHING) == []


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
