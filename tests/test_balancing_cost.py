"""Quantile balancing's per-step reductions (simulator.optimizer_cost.balancing_reductions,
simulator.estimate.balancing_time): sizes from the spec, zero without data parallelism, the same in the estimate and
the discrete-event simulator."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rackcast.plan import load_plan
from rackcast.simulator.costs import collective_time
from rackcast.simulator.estimate import estimate, plan_features
from rackcast.simulator.optimizer_cost import balancing_reductions
from rackcast.simulator.step import simulate

from conftest import PLANS


def test_balancing_reductions_follow_the_spec():
    plan = load_plan(str(PLANS / "tiny-1proc.yaml"))
    spec = plan.model_spec()
    moe_layers = sum(spec.is_moe(i) for i in range(spec.layers))
    count, hist, extremes = balancing_reductions(spec, list(range(spec.layers)))
    assert count == 1  # the MoE layers are balanced as one stacked problem (backend.balancing.QuantileBalancer)
    assert hist == (moe_layers * spec.moe.experts * spec.moe.balance_bins + 1) * 8  # int64 counts, token count
    assert extremes == moe_layers * 2 * 4  # min and max margins per layer, fp32
    no_bias = replace(spec, moe=replace(spec.moe, router_bias=False))
    assert balancing_reductions(no_bias, list(range(spec.layers))) == (0, 0.0, 0.0)


@pytest.mark.parametrize("method, expected", [
    ("quantile", lambda m, layers: (1, (layers * m.experts * m.balance_bins + 1) * 8, layers * 8)),  # one stacked
    ("aux_free_bias", lambda m, layers: (layers, m.experts * 8, 0)),  # DeepSeek-V3's bias: each layer's loads
    ("aux_loss", None),  # nothing to reduce: the loss is computed where the tokens are
    ("none", None),
])
def test_balancing_is_priced_by_the_method_not_by_the_router_bias(method, expected):
    spec = load_plan(str(PLANS / "tiny-1proc.yaml")).model_spec()
    spec = replace(spec, moe=replace(spec.moe, balancing=method, aux_loss_weight=0.01))
    assert spec.moe.router_bias
    count, hist, extremes = balancing_reductions(spec, list(range(spec.layers)))
    if expected is None:
        assert (count, hist, extremes) == (0, 0.0, 0.0)
    else:
        assert (count, hist, extremes) == expected(spec.moe, spec.layers)


def test_data_parallel_plan_pays_one_all_reduce_pair_for_its_moe_layers():
    one = load_plan(str(PLANS / "tiny-1proc.yaml"))
    dp2 = replace(one, parallel=replace(one.parallel, data=2),
                  topology=replace(one.topology, usable_gpus=2))
    topo = dp2.topology_spec()
    spec = dp2.model_spec()
    f = plan_features(spec, dp2, topo)
    count, hist, extremes = balancing_reductions(spec, list(range(spec.layers)))
    expected = count * (collective_time(topo, "all_reduce", 2, hist, False) +
                        collective_time(topo, "all_reduce", 2, extremes, False))
    assert f["inner_n"] == 1 and expected > 0
    no_bal = estimate(dp2, spec=replace(spec, moe=replace(spec.moe, router_bias=False)), topo=topo)
    with_bal = estimate(dp2, topo=topo)
    # Dropping the router bias also drops its few parameters' optimizer traffic (about 1e-5 of this term).
    assert with_bal.phases_s["optimizer"] - no_bal.phases_s["optimizer"] == pytest.approx(float(expected), rel=1e-4)
    sim_gap = simulate(dp2, topo=topo, record=False).phases_s["optimizer"] - \
        simulate(dp2, spec=replace(spec, moe=replace(spec.moe, router_bias=False)), topo=topo,
                 record=False).phases_s["optimizer"]
    assert sim_gap == pytest.approx(float(expected), rel=1e-4)
    one_f = plan_features(one.model_spec(), one, one.topology_spec())
    assert one_f["bal_count"] == count  # counted, but a group of one reduces nothing
    assert estimate(one).phases_s["optimizer"] == pytest.approx(
        estimate(one, spec=replace(spec, moe=replace(spec.moe, router_bias=False))).phases_s["optimizer"], rel=1e-4)
