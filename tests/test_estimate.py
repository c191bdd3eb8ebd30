"""Closed-form estimate: textbook collective and bubble forms, vectorisation, and the CLI end to end."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from conftest import PLANS
from rackcast.modelspec import FlopsConvention
from rackcast.plan import load_plan
from rackcast.simulator.costs import collective_time
from rackcast.simulator.estimate import estimate, plan_features, step_time
from rackcast.topologies import load_topology

GB200 = load_topology("gb200-nvl72", domains=2)


def test_ring_all_reduce_matches_2_n_minus_1_over_n_bytes_over_bandwidth():
    n, nbytes = 8, 4 * 2**30
    eff = GB200.efficiency.collective_efficiency("all_reduce", "scale_up", nbytes)
    bw = GB200.scale_up.bandwidth_Bps * eff
    expected = 2 * (n - 1) * GB200.link_latency_s("scale_up") + 2 * (n - 1) / n * nbytes / bw
    assert float(collective_time(GB200, "all_reduce", n, nbytes, False)) == pytest.approx(expected, rel=1e-12)


def test_collective_across_domains_is_bound_by_the_nic():
    nbytes = 2**30
    inside = float(collective_time(GB200, "all_to_all", 64, nbytes, False))
    across = float(collective_time(GB200, "all_to_all", 128, nbytes, True))
    assert across / inside > GB200.scale_up.bandwidth_Bps / GB200.scale_out.nic_bandwidth_Bps / 2


def test_single_rank_collective_costs_nothing():
    assert float(collective_time(GB200, "all_reduce", 1, 2**30, False)) == 0.0


def _pipeline_plan(schedule="1f1b", p=4, m=8, v=1):
    plan = load_plan(str(PLANS / "gpt-145b-megatron.yaml"))
    par = dataclasses.replace(plan.parallel, pipeline=p, virtual=v, data=1536 // (8 * p))
    return dataclasses.replace(plan, parallel=par, schedule=schedule,
                               batch=dataclasses.replace(plan.batch, global_batch=m * par.data))


@pytest.mark.parametrize("p", [4, 8])
def test_1f1b_fill_and_drain_are_p_minus_1_micro_batches_of_the_lighter_stages(p):
    # The slowest stage (the last: it holds the output head) is busy every micro-batch; the fill and drain run
    # through the other p - 1 stages once, whatever the number of micro-batches (Narayanan et al. 2021).
    few, many = estimate(_pipeline_plan("1f1b", p, 8)), estimate(_pipeline_plan("1f1b", p, 16))
    assert few.phases_s["pipeline_bubble"] == pytest.approx(many.phases_s["pipeline_bubble"], rel=1e-9)
    heavy_mb = (many.step_time_s - few.step_time_s) / 8
    lighter_mb = few.phases_s["pipeline_bubble"] / (p - 1)
    assert 0.8 * heavy_mb < lighter_mb < heavy_mb


def test_interleaving_shrinks_the_bubble():
    plain = estimate(_pipeline_plan("1f1b", 8, 16))
    inter = estimate(_pipeline_plan("interleaved_1f1b", 8, 16, 2))
    assert inter.phases_s["pipeline_bubble"] < plain.phases_s["pipeline_bubble"]


def test_vectorised_step_time_equals_one_at_a_time():
    plans = [load_plan(str(PLANS / name)) for name in ("marin-535b-hero.yaml", "gpt-145b-megatron.yaml")]
    # and an interleaved plan whose first chunks differ (chunk 0 two layers heavier): the paced bubble's branch
    paced = _pipeline_plan("interleaved_1f1b", 4, 8, 2)
    paced = dataclasses.replace(paced, parallel=dataclasses.replace(paced.parallel, stage_layers=(12, 8) + (10,) * 6))
    plans += [_pipeline_plan("1f1b", 4, 8), paced]
    topo = plans[1].topology_spec()
    feats = [plan_features(p.model_spec(), p, topo) for p in plans[1:]]
    stacked = {k: np.array([f[k] for f in feats]) for k in feats[0]}
    together = step_time(stacked, topo)["step_time_s"]
    alone = [float(step_time(f, topo)["step_time_s"]) for f in feats]
    assert np.allclose(together, alone, rtol=1e-12)


def test_hero_plan_fits_and_reports_mfu_under_both_conventions():
    plan = load_plan(str(PLANS / "marin-535b-hero.yaml"))
    full = estimate(plan)
    causal = estimate(plan, FlopsConvention(attention="causal"))
    assert full.fits and 0.05 < full.mfu < 1.0
    assert causal.mfu < full.mfu and causal.step_time_s == full.step_time_s
    assert full.days_to_budget == pytest.approx(18e12 / full.tokens_per_s / 86400)
    assert full.tokens_per_step == 11264 * 4096


def test_capacity_transport_caps_imbalance_and_reports_drops():
    plan = load_plan(str(PLANS / "marin-535b-hero.yaml"))
    skew = dataclasses.replace(plan.expert_transport, routing="zipf", zipf_s=1.0)
    dropless = estimate(dataclasses.replace(plan, expert_transport=skew))
    capped = estimate(dataclasses.replace(plan, expert_transport=dataclasses.replace(
        skew, mode="capacity", capacity_factor=1.15)))
    assert dropless.drop_fraction == 0 and capped.drop_fraction > 0
    assert capped.phases_s["compute"] < dropless.phases_s["compute"]


def test_estimate_cli_prints_breakdown_and_json(cli):
    out = cli("estimate", str(PLANS / "marin-535b-hero.yaml"))
    assert out.returncode == 0, out.stderr
    assert "Step time breakdown" in out.stdout and "MFU" in out.stdout and "days" in out.stdout
    js = cli("estimate", str(PLANS / "marin-535b-hero.yaml"), "--json")
    data = json.loads(js.stdout)
    assert data["fits"] and data["gpus"] == 704 and "attention=full" in data["flops_convention"]


def test_estimate_cli_bad_plan_exits_2_with_one_line(cli, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((PLANS / "marin-535b-hero.yaml").read_text().replace("expert: 64", "expert: 7"))
    out = cli("estimate", str(bad))
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "parallel.expert" in out.stderr and "bad.yaml" in out.stderr
    assert "Traceback" not in out.stderr
    missing = cli("estimate", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "file not found" in missing.stderr


def test_plan_that_does_not_fit_memory_exits_2_after_its_breakdown(cli, tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text((PLANS / "marin-535b-hero.yaml").read_text().replace("recompute: full", "recompute: none"))
    out = cli("estimate", str(big))
    assert out.returncode == 2
    assert "Memory per GPU" in out.stdout and "does not fit" in out.stdout
    assert out.stderr.count("\n") == 1 and "big.yaml: parallel: the layout does not fit memory" in out.stderr
    sim = cli("simulate", str(big))
    assert sim.returncode == 2 and "does not fit memory" in sim.stderr
