"""The shape-aware GEMM model (simulator.costs.gemm_seconds and the efficiencies built on it) against closed forms:
tile and wave quantisation on the accelerator's SMs, the HBM roofline, the launch floor, small against large grouped
GEMMs, measured curves winning over the model, and the stack profiles that scale it (topologies.profiles)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from conftest import PLANS
from rackcast.errors import RackcastError
from rackcast.plan import load_plan
from rackcast.simulator import costs
from rackcast.simulator.estimate import estimate
from rackcast.strict import load_yaml
from rackcast.topologies import load_topology
from rackcast.topologies.profiles import apply_profile, list_profiles, load_profile

H100 = load_topology("h100-hgx")
GB200 = load_topology("gb200-nvl72")


def _tile_s(topo, k, ceiling):
    """One wave: every SM computes one tile_m x tile_n x k tile at its share of peak x ceiling."""
    a = topo.accelerator
    return 2.0 * a.tile_m * a.tile_n * k / (topo.peak_flops("bf16") / a.sms * ceiling)


@pytest.mark.parametrize("topo", [H100, GB200], ids=["h100", "gb200"])
def test_one_tile_more_than_a_multiple_of_the_sms_costs_a_full_extra_wave(topo):
    a, ceil, k = topo.accelerator, topo.efficiency.gemm_ceiling, 8192
    full = costs.GemmShape(a.tile_m * a.sms, a.tile_n * 4, k)  # 4 x sms tiles: exactly 4 waves
    over = costs.GemmShape(a.tile_m * a.sms + 1, a.tile_n * 4, k)  # 4 more tiles: a fifth wave
    assert float(costs.gemm_seconds(full, topo, ceil, "bf16")) == pytest.approx(4 * _tile_s(topo, k, ceil), rel=1e-12)
    assert float(costs.gemm_seconds(over, topo, ceil, "bf16")) == pytest.approx(5 * _tile_s(topo, k, ceil), rel=1e-12)
    # a full wave of tiles runs at the ceiling, the padded one at 4/5 of it (for almost the same FLOPs)
    assert float(costs.gemm_efficiency(full, topo, "bf16")) == pytest.approx(ceil, rel=1e-12)
    assert float(costs.gemm_efficiency(over, topo, "bf16")) == pytest.approx(ceil * 4 / 5, rel=1e-3)


def test_small_m_grouped_gemm_is_priced_below_a_large_one():
    # 37 local experts of 2048 x 1536: 48 rows per expert against 4096 (37 x 32 x 16 tiles = 128 full waves on 148 SMs)
    small = costs.GemmShape(48, 2048, 1536, 37)
    large = costs.GemmShape(4096, 2048, 1536, 37)
    e_small, e_large = (float(costs.grouped_gemm_efficiency(s, GB200, "bf16")) for s in (small, large))
    assert e_large == pytest.approx(GB200.efficiency.grouped_gemm_ceiling, rel=1e-12)
    assert e_small < 0.5 * e_large
    # 48 rows fill 48/128 of every tile row: compute-bound part at that fill, unless the weights' bytes bind
    a = GB200.accelerator
    assert e_small <= e_large * 48 / a.tile_m + 1e-12


def test_memory_bound_small_gemm_hits_the_hbm_roofline():
    shape = costs.GemmShape(8, 16384, 16384)  # a few rows through a large weight: bytes bind
    nbytes = costs.W_BYTES * (8 * 16384 + 16384 * 16384 + 8 * 16384)
    roof = nbytes / (GB200.accelerator.hbm_bandwidth_Bps * GB200.efficiency.memory_bound)
    seconds = costs.gemm_seconds(shape, GB200, GB200.efficiency.gemm_ceiling, "bf16")
    assert float(seconds) == pytest.approx(roof, rel=1e-12)
    flops = 2.0 * 8 * 16384 * 16384
    assert float(costs.gemm_time(flops, shape, GB200, "bf16")) == pytest.approx(roof, rel=1e-12)


def test_the_model_is_vectorised_and_the_launch_floor_binds_tiny_kernels():
    m = np.array([1.0, 128.0, 65536.0])
    times = costs.gemm_seconds(costs.GemmShape(m, 4096.0, 4096.0), GB200, GB200.efficiency.gemm_ceiling,
                               "bf16")
    for i, mi in enumerate(m):
        one = costs.gemm_seconds(costs.GemmShape(mi, 4096.0, 4096.0), GB200, GB200.efficiency.gemm_ceiling,
                                 "bf16")
        assert float(times[i]) == float(one)
    eager = load_topology("gb200-nvl72", profile="eager-pytorch")
    tiny = costs.GemmShape(16, 64, 64)
    assert float(costs.gemm_seconds(tiny, eager, eager.efficiency.gemm_ceiling, "bf16")) == eager.efficiency.launch_s > 0


def test_a_measured_curve_wins_over_the_shape_model():
    cpu = load_topology("local-cpu")  # measured curves
    shape = costs.GemmShape(256, 256, 256)
    assert float(costs.gemm_efficiency(shape, cpu, "fp32")) == pytest.approx(
        float(costs.efficiency(cpu.efficiency.gemm, 2.0 * 256 ** 3)), rel=1e-12)


def test_profiles_load_scale_the_ceilings_and_name_themselves():
    assert {"eager-pytorch", "megatron-te"} <= set(list_profiles())
    base = load_topology("h100-hgx", profile="megatron-te")
    eager = load_topology("h100-hgx", profile="eager-pytorch")
    prof = load_profile("eager-pytorch")
    assert (base.efficiency.stack, eager.efficiency.stack) == ("megatron-te", "eager-pytorch")
    assert eager.efficiency.attention == pytest.approx(base.efficiency.attention * prof.attention)
    assert eager.efficiency.launch_s == prof.launch_s and eager.efficiency.error_band == prof.error_band
    # measured topologies keep their measurements: only the name and the band change
    cpu = load_topology("local-cpu")
    cpu_eager = apply_profile(cpu, prof)
    assert cpu_eager.efficiency.attention == cpu.efficiency.attention and cpu_eager.efficiency.launch_s == 0.0
    with pytest.raises(RackcastError, match="unknown stack profile"):
        load_profile("no-such-stack")


def test_a_plan_names_its_profile_round_trips_and_rejects_an_unknown_one(tmp_path):
    from rackcast.plan import plan_to_yaml

    plan = load_plan(str(PLANS / "marin-535b-hero.yaml"))
    assert plan.topology.profile == "megatron-te"  # the default
    eager = replace(plan, topology=replace(plan.topology, profile="eager-pytorch"))
    path = tmp_path / "eager.yaml"
    path.write_text(plan_to_yaml(eager))
    assert load_yaml(str(path))["topology"]["profile"] == "eager-pytorch"
    back = load_plan(str(path))
    assert back == eager
    assert back.topology_spec().efficiency.stack == "eager-pytorch"
    assert estimate(back).step_time_s > estimate(plan).step_time_s  # slower attention kernels
    bad = tmp_path / "bad.yaml"
    bad.write_text(plan_to_yaml(replace(plan, topology=replace(plan.topology, profile="tpu-jax"))))
    out = subprocess.run([sys.executable, "-m", "rackcast.plan", str(bad)], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "topology.profile" in out.stderr and "tpu-jax" in out.stderr


def test_estimate_and_simulate_carry_the_profiles_error_band(capsys):
    from rackcast.cli import main
    from rackcast.simulator.step import simulate

    plan = load_plan(str(PLANS / "marin-535b-hero.yaml"))
    b = load_profile("megatron-te").error_band
    est = estimate(plan)
    assert est.band["relative"] == b > 0 and est.band["stack"] == "megatron-te"
    assert est.band["step_time_s"] == pytest.approx([est.step_time_s * (1 - b), est.step_time_s * (1 + b)])
    assert est.band["mfu"] == pytest.approx([est.mfu / (1 + b), est.mfu / (1 - b)])
    assert est.band["days_to_budget"] == pytest.approx([est.days_to_budget * (1 - b), est.days_to_budget * (1 + b)])
    assert est.as_dict()["band"] == est.band
    sim = simulate(plan, record=False)
    assert sim.band["step_time_s"] == pytest.approx([sim.step_time_s * (1 - b), sim.step_time_s * (1 + b)])
    assert main(["estimate", str(PLANS / "marin-535b-hero.yaml")]) == 0
    assert f"band +-{100 * b:.0f}% (stack profile megatron-te" in capsys.readouterr().out.replace("\n", " ")


def test_planned_plan_file_json_and_summary_carry_the_winners_error_band(tmp_path):
    from rackcast.planner import search as S
    from rackcast.planner.report import result_json, summary_lines, write_best_plan
    from rackcast.plan import PredictedBand

    result = S.search(S.Request(model="tiny-moe", topology="local-cpu", racks=1, tokens=1e9, top=0, simulate=False,
                                workers=1))
    out = tmp_path / "p.yaml"
    written = write_best_plan(result, out)
    band = written.predicted.band
    b = result.topo.efficiency.error_band
    assert isinstance(band, PredictedBand) and band.relative == b > 0
    step = written.predicted.step_time_s
    assert band.step_time_s == pytest.approx((step * (1 - b), step * (1 + b)))
    assert band.mfu == pytest.approx((written.predicted.mfu / (1 + b), written.predicted.mfu / (1 - b)))
    assert load_plan(str(out)) == written  # the band round-trips through YAML
    assert result_json(result)["ranked"][0]["band"]["relative"] == b
    assert any(line.startswith(f"winner's band +-{100 * b:.0f}%") for line in summary_lines(result))
