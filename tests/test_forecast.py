"""Tests of the run forecast (planner.forecast, planner.forecast_sim, planner.forecast_formulas, the reliability
figures and `rackcast forecast`).

    .venv/bin/pytest tests/test_forecast.py -q
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import replace

import numpy as np
import pytest

from rackcast.planner.forecast import checkpoint_bytes, forecast, forecast_days, run_many, search_intervals
from rackcast.planner.forecast_formulas import daly_expected_wall_s, daly_interval_s, young_interval_s
from rackcast.planner.forecast_sim import SHRINK, WAIT_POLICY, SimInputs, simulate, simulate_reference
from rackcast.errors import RackcastError
from rackcast.plan import load_plan
from rackcast.simulator.estimate import estimate
from rackcast.units import SECONDS_PER_DAY
from rackcast.topologies.reliability import FailureRates, load_reliability

from conftest import PLANS

HERO = PLANS / "marin-535b-hero.yaml"
DAY = SECONDS_PER_DAY


@pytest.fixture(scope="module")
def hero():
    return load_plan(str(HERO))


@pytest.fixture(scope="module")
def no_failures():
    return replace(load_reliability(), rates=FailureRates())


def one_domain(work_s: float, interval_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float) -> SimInputs:
    """Daly's setting: one job-wide exponential failure process, fixed costs, no spares involved."""
    return SimInputs(work_s=work_s, interval_s=interval_s, restart_s=restart_s, repair_s=0.0, domains=1, spares=0,
                     rate_per_domain_s=1.0 / mtbf_s, class_probs=(0.0, 0.0, 1.0, 0.0, 0.0),
                     class_units=(1, 4, 0, 0, 0), rate_factor=(0.0, 1.0), checkpoint_s=(0.0, checkpoint_s))


def test_zero_failure_rates_without_checkpoints_equal_steady_state_days_exactly(hero, no_failures):
    result = forecast(hero, 18e12, "2026-09-01", "2026-11-20", runs=50, reliability=no_failures, interval_s=0)
    steady = estimate(replace(hero, tokens=18e12)).days_to_budget
    assert np.all(result.days == steady)
    assert result.p50_days == steady and result.expected_days == steady
    assert result.goodput == 1.0 and all(v == 0 for v in result.lost_days.values())
    assert result.interval is None  # nothing fails: no interval is best


def test_zero_failure_rates_with_checkpoints_add_only_the_write_time(hero, no_failures):
    result = forecast(hero, 18e12, "2026-09-01", runs=20, reliability=no_failures, interval_s=3600.0)
    s = result.setup
    writes = math.ceil(s.steady_days * DAY / 3600.0)  # every segment, the last included, ends with a checkpoint
    assert result.days == pytest.approx(s.steady_days + writes * s.checkpoint_write_s / DAY, rel=1e-12)
    assert result.lost_days["checkpoint"] == pytest.approx(writes * s.checkpoint_write_s / DAY, rel=1e-9)


def test_monte_carlo_mean_matches_daly_expected_wall_time_within_2_percent():
    m, c, r, tau = DAY, 300.0, 1200.0, 7200.0
    work = 240 * tau  # 20 days, a whole number of segments as Daly's formula assumes
    outcome = simulate(one_domain(work, tau, c, r, m), seed=3, runs=4000)
    expected = daly_expected_wall_s(work, tau, c, r, m)
    assert outcome.wall_s.mean() == pytest.approx(expected, rel=0.02)
    assert outcome.wall_s.mean() == pytest.approx(expected, rel=0.005)  # in fact much closer


def test_best_checkpoint_interval_agrees_with_young_and_daly_within_10_percent():
    m, c = DAY, 60.0  # C << M: the regime of Young's first-order formula
    search = search_intervals(one_domain(30 * DAY, 3600.0, c, 600.0, m), c, m, seed=1, runs=2000)
    assert search.best_s == pytest.approx(young_interval_s(c, m), rel=0.10)
    assert search.best_s == pytest.approx(daly_interval_s(c, m), rel=0.10)
    assert search.best_expected_days == min(search.grid_expected_days)


def test_same_seed_gives_identical_forecast_and_another_seed_differs(hero):
    a = forecast(hero, 18e12, "2026-09-01", "2026-10-12", runs=300, seed=5, search_runs=200)
    b = forecast(hero, 18e12, "2026-09-01", "2026-10-12", runs=300, seed=5, search_runs=200)
    c = forecast(hero, 18e12, "2026-09-01", "2026-10-12", runs=300, seed=6, search_runs=200)
    assert np.array_equal(a.days, b.days) and a.as_dict() == b.as_dict()
    assert not np.array_equal(a.days, c.days)


@pytest.mark.parametrize("policy", [SHRINK, WAIT_POLICY])
def test_numba_model_equals_simpy_reference_run_by_run(policy):
    # Frequent failures, one spare GPU per domain and trays of two: domains go out, shrink and rejoin, or wait.
    x = SimInputs(work_s=3 * DAY, interval_s=3600.0, restart_s=1200.0, repair_s=DAY, domains=3, spares=1,
                  rate_per_domain_s=2 / DAY, class_probs=(0.5, 0.2, 0.2, 0.05, 0.05), class_units=(1, 2, 0, 0, 0),
                  rate_factor=(0.0, 0.0, 0.6, 1.0), checkpoint_s=(0.0, 120.0, 60.0, 40.0), policy=policy)
    fast, ref = simulate(x, seed=11, runs=60), simulate_reference(x, seed=11, runs=60)
    assert np.array_equal(fast.fails, ref.fails)
    np.testing.assert_allclose(fast.times, ref.times, rtol=1e-9, atol=1e-6)
    assert not fast.unfinished.any()
    causes = fast.times[:, 1:]
    np.testing.assert_allclose(causes.sum(axis=1), fast.times[:, 0], rtol=1e-9)  # the causes add up to wall time
    np.testing.assert_allclose(causes[:, -1], x.work_s, rtol=1e-9)  # useful time is the work
    assert causes[:, 1 if policy == WAIT_POLICY else 4].sum() > 0  # waited for repair / ran degraded


def _many_domains(policy: int, domains: int, spares: int, rate_day: float, repair_s: float,
                  probs=(0.5, 0.2, 0.2, 0.05, 0.05), tray: int = 2, checkpoint_s: float = 6000.0,
                  restart_s: float = 900.0) -> SimInputs:
    n = domains
    return SimInputs(work_s=(20 if domains < 1000 else 2) * DAY, interval_s=3600.0, restart_s=restart_s,
                     repair_s=repair_s, domains=n, spares=spares, rate_per_domain_s=rate_day / DAY,
                     class_probs=probs, class_units=(1, tray, 0, 0, 0),
                     rate_factor=tuple([0.0] * (n // 2) + [k / n for k in range(n // 2, n)] + [1.0]),
                     checkpoint_s=tuple([0.0] + [checkpoint_s / k for k in range(1, n + 1)]), policy=policy)


@pytest.mark.parametrize("inputs, seed, runs, digest", [
    (_many_domains(SHRINK, 64, 1, 0.5, 2 * DAY), 7, 40,
     "2023e157e94c9a7779213e6a23a7d96502f6060b4d3ffeb63b5ce1a7e4556583"),
    (_many_domains(WAIT_POLICY, 64, 1, 0.05, 0.2 * DAY), 7, 40,
     "909120e9826c63244989a84a1cb10d02a5fa300f2a785fe03c9fe2c9d6fbdd96"),
    (_many_domains(SHRINK, 2048, 0, 61.0 / 2048, 2 * DAY, probs=(0.081, 0.014, 0.874, 0.013, 0.019), tray=8,
                   checkpoint_s=120.0 * 2048, restart_s=600.0), 3, 20,
     "4ec226f2aa41e676bbe4eb426359318107601aa83d8df860c6c16e57d3849d1a"),
])
def test_fixed_seed_runs_are_unchanged_bit_for_bit(inputs, seed, runs, digest):
    # Digests of the numba model's outputs taken before the healthy-domain pick went from a scan over all domains to
    # the sorted list of domains out (issue 17): many domains, some out of service, both policies.
    out = simulate(inputs, seed=seed, runs=runs)
    got = hashlib.sha256(out.times.tobytes() + out.fails.tobytes() + out.unfinished.tobytes()).hexdigest()
    assert not out.unfinished.any() and got == digest


def test_chunked_runs_equal_one_call():
    x = one_domain(5 * DAY, 3600.0, 60.0, 600.0, DAY / 2)
    times, fails, _ = run_many(x, seed=2, runs=2500)
    whole = simulate(x, seed=2, runs=2500)
    assert np.array_equal(times, whole.times) and np.array_equal(fails, whole.fails)


def test_checkpoint_size_counts_fp32_master_and_muonh_state(hero):
    spec = hero.model_spec()
    nbytes = checkpoint_bytes(spec, hero)
    params = spec.params_total
    assert 8 * params <= nbytes <= 8.1 * params  # fp32 master + fp32 momentum, Adam groups a little more


def test_forecast_days_returns_p50_and_deadline_probability(hero):
    p50, prob = forecast_days(hero, 18e12, deadline_days=60.0, runs=200)
    steady = estimate(replace(hero, tokens=18e12)).days_to_budget
    assert steady < p50 < 60.0 and prob == 1.0
    p50_tight, prob_tight = forecast_days(hero, 18e12, deadline_days=steady, runs=200)
    assert p50_tight == p50 and prob_tight == 0.0
    assert math.isnan(forecast_days(hero, 18e12, runs=50)[1])


def test_wait_policy_is_never_faster_than_shrink_on_the_same_failures(hero):
    rel = replace(load_reliability(), rates=load_reliability().rates.scaled(20.0))  # domains run out of spares
    shrink = forecast(hero, 18e12, "2026-09-01", runs=300, reliability=rel, policy="shrink", search=False)
    wait = forecast(hero, 18e12, "2026-09-01", runs=300, reliability=rel, policy="wait", search=False)
    assert shrink.lost_days["degraded"] > 0 and wait.lost_days["wait_repair"] > 0
    assert wait.expected_days > shrink.expected_days


@pytest.mark.parametrize("kwargs, message", [
    ({"policy": "pray"}, "spares policy"),
    ({"start": "2026-09-01", "deadline": "2026-08-01"}, "not after the start"),
    ({"start": "2026-13-01"}, "ISO date"),
    ({"deadline": "2026-11-20"}, "needs a start"),
    ({"interval_s": 0.0}, "checkpointing is disabled"),
    ({"runs": 0}, "runs"),
    ({"tokens": -1.0}, "token budget"),
])
def test_bad_input_raises_rackcast_error(hero, kwargs, message):
    args = {"tokens": 18e12, "runs": 10, "search": False, **kwargs}
    with pytest.raises(RackcastError, match=message):
        forecast(hero, **args)


def test_reliability_file_is_strict_and_sourced(tmp_path):
    spec = load_reliability()
    assert spec.rates.gpu_per_gpu_day == pytest.approx(268 / (16384 * 54), rel=0.01)
    assert spec.checkpoint_interval_s == 3600.0 and spec.spares_policy in ("shrink", "wait")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nrates: {gpu_per_gpu_day: 1e-4, gpus_per_day: 1}\ndetection_s: 1\nreschedule_s: 1\n")
    with pytest.raises(RackcastError, match="unknown key"):
        load_reliability(str(bad))
    with pytest.raises(RackcastError, match="unknown reliability"):
        load_reliability("no-such-figures")


def test_cli_forecast_marin_hero_end_to_end(cli, tmp_path):
    out = tmp_path / "forecast.json"
    proc = cli("forecast", str(HERO), "--tokens", "18e12", "--start", "2026-09-01", "--deadline", "2026-11-20",
               "--runs", "300", "--seed", "1", "--json", "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data == json.loads(out.read_text())
    assert data["plan"] == "marin-535b-hero" and data["runs"] == 300 and data["gpus"] == 704
    assert data["steady_state_days"] < data["p10_days"] <= data["p50_days"] <= data["p90_days"]
    assert 0.0 <= data["probability_by_deadline"] <= 1.0 and 0.0 < data["goodput"] < 1.0
    assert set(data["lost_days"]) == {"restart", "wait_repair", "lost_work", "checkpoint", "degraded"}
    assert data["best_checkpoint_interval_s"] > 0
    text = cli("forecast", str(HERO), "--tokens", "18e12", "--start", "2026-09-01", "--runs", "100")
    assert text.returncode == 0 and "P50" in text.stdout and "days" in text.stdout


def test_cli_forecast_bad_values_exit_2_with_one_line(cli):
    for extra in (["--deadline", "2026-08-01"], ["--spares-policy", "pray"], ["--runs", "ten"]):
        proc = cli("forecast", str(HERO), "--tokens", "18e12", "--start", "2026-09-01", *extra)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_rack_fabric_faults_stop_nvl72_racks_but_not_single_baseboard_hgx_nodes(hero):
    from rackcast.planner.forecast import prepare

    nvl72 = prepare(hero, 18e12, exact_shrink=False)
    dgx = prepare(load_plan(str(PLANS / "gpt-145b-megatron.yaml")), 1e12, exact_shrink=False)
    rates = load_reliability().rates
    assert nvl72.job_failures_per_day["domain"] == pytest.approx(rates.rack_per_rack_day * nvl72.domains)
    assert dgx.job_failures_per_day["domain"] == 0.0
    assert dgx.job_failures_per_day["gpu"] == pytest.approx(rates.gpu_per_gpu_day * dgx.gpus)
