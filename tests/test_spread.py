"""Measurement spread (rackcast.spread): closed forms, the too-noisy flag in record.json and in validate, and the
trainer's core pinning."""

from __future__ import annotations

import math
import os

import pytest

from rackcast.spread import SPREAD_LIMIT, quartile_spread_of, spread_of


def test_spread_is_median_with_range_and_relative_width():
    s = spread_of([0.10, 0.12, 0.09, float("nan")])
    assert (s.centre, s.low, s.high, s.n) == (0.10, 0.09, 0.12, 3)
    assert s.relative == pytest.approx(0.3) and s.too_wide
    assert not spread_of([1.0, 1.0, 1.0]).too_wide and spread_of([1.0, 1.0]).relative == 0.0
    assert math.isnan(spread_of([]).relative) and not spread_of([]).too_wide


def test_quartile_spread_ignores_one_slow_step():
    steps = [1.0] * 9 + [5.0]  # one step five times slower: the range is wide, the quartiles are not
    assert spread_of(steps).too_wide
    q = quartile_spread_of(steps)
    assert q.centre == 1.0 and q.relative == 0.0 and not q.too_wide
    assert quartile_spread_of([1.0, 2.0, 3.0, 4.0, 5.0]).relative == pytest.approx((4.0 - 2.0) / 3.0)


def test_record_summary_reports_the_step_spread_of_its_steady_steps():
    from rackcast.backend.record import summary

    nan = float("nan")
    rows = [{"step": i, "loss": 1.0, "eval_loss": nan, "step_time_s": t, "tokens_per_s": 1.0, "mfu": 0.1,
             "peak_memory_bytes": nan, "peak_rss_bytes": 1.0, "drop_fraction": 0.0}
            for i, t in enumerate([9.0, 1.0, 1.1, 1.0, 1.2, 1.0])]  # the first (warm-up) step is left out
    s = summary(rows)["step_time_spread"]
    assert s["n"] == 5 and s["median"] == 1.0 and s["relative"] == pytest.approx(0.1) and not s["too_wide"]


def test_validate_flags_a_plan_whose_repeats_or_steps_disagree_too_much():
    from rackcast.validation.validate import PlanResult

    def result(runs, step_spread):
        return PlanResult("p", "", spread_of(runs).centre, runs, {}, 1.0,
                          repeat_spread=spread_of(runs).as_dict(), step_spread=step_spread)

    assert not result([1.0, 1.05, 1.02], 0.05).too_noisy
    assert result([1.0, 1.3, 1.02], 0.05).too_noisy  # the repeats disagree by 30%
    assert result([1.0], SPREAD_LIMIT * 2).too_noisy  # one run whose steps disagree
    assert not result([1.0], math.nan).too_noisy


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_pin_cores_pins_each_local_rank_to_its_own_cores_and_wraps():
    from rackcast.backend.cpu_runtime import pin_cores

    usable = sorted(os.sched_getaffinity(0))
    try:
        assert pin_cores(0, 1) == [usable[0]] and os.sched_getaffinity(0) == {usable[0]}
        os.sched_setaffinity(0, usable)
        assert pin_cores(len(usable) + 1, 1) == [usable[1 % len(usable)]]  # wraps round the usable cores
    finally:
        os.sched_setaffinity(0, usable)


def test_a_cpu_process_takes_one_torch_thread_by_default():
    """local-cpu prices one process as one core; more intra-op threads oversubscribe a shared machine."""
    import torch

    from rackcast.backend.cpu_runtime import configure_cpu_process

    before, affinity = torch.get_num_threads(), os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        assert configure_cpu_process() == 1 and torch.get_num_threads() == 1
        assert configure_cpu_process(requested_threads=2) == 2 and torch.get_num_threads() == 2  # --threads N
    finally:
        torch.set_num_threads(before)
        if affinity is not None:
            os.sched_setaffinity(0, affinity)


def test_undisturbed_is_the_fastest_finite_sample():
    from rackcast.spread import undisturbed

    assert undisturbed([0.3, 0.1, float("nan"), 0.2]) == 0.1
    assert math.isnan(undisturbed([]))


def test_fastest_mean_averages_the_fastest_fifth_and_ignores_slowed_steps():
    from rackcast.spread import fastest, fastest_mean

    steps = [1.0 + 0.01 * i for i in range(19)] + [9.0]  # twenty steps, one slowed by the machine
    assert fastest(steps) == [0, 1, 2, 3]  # a fifth of twenty
    assert fastest_mean(steps) == pytest.approx(1.015)
    assert len(fastest(steps[:19])) == 4 and len(fastest(steps[:7])) == 1  # 3.8 and 1.4 round to 4 and 1
    assert fastest([5.0, 4.0, float("nan")]) == [1]  # at least one, NaN left out
    assert fastest([]) == [] and math.isnan(fastest_mean([]))


def test_halves_spread_compares_the_figure_on_even_and_odd_steps():
    from rackcast.spread import halves_spread

    assert halves_spread([1.0, 1.0, 1.0, 1.0]) == 0.0
    # even steps fastest 1.0, odd steps fastest 1.3: the figure (1.0) moves by 30% between the halves
    assert halves_spread([1.0, 1.3, 1.0, 1.3, 1.1, 1.4]) == pytest.approx(0.3)
    assert math.isnan(halves_spread([1.0]))


def _rows(times, phase=None):
    nan = float("nan")
    return [{"step": i, "loss": 1.0, "eval_loss": nan, "step_time_s": t, "tokens_per_s": 1.0, "mfu": 0.1,
             "peak_memory_bytes": nan, "peak_rss_bytes": 1.0, "drop_fraction": 0.0,
             "phase_compute_s": (phase or {}).get(i, t / 2)} for i, t in enumerate(times)]


def test_record_fastest_takes_the_phases_of_the_same_fastest_steps():
    from rackcast.backend.record import measured_figure, summary

    times = [9.0] + [2.0] * 5 + [1.0] + [2.0] * 3  # warm-up, then ten steady steps: one fast (index 6)
    rec = summary(_rows(times, phase={6: 0.7}))
    fast = rec["fastest"]
    assert fast["steps"] == 2 and fast["step_time_s"] == pytest.approx(1.5)  # the fastest fifth of 9 steady: 2
    assert fast["phases_s"]["compute"] == pytest.approx((0.7 + 1.0) / 2)  # step 6's phase and one 2.0 step's
    assert measured_figure(rec) is fast
    old = {k: v for k, v in rec.items() if k != "fastest"}  # a record written before `fastest` existed
    figure = measured_figure(old)
    assert (figure["step_time_s"], figure["phases_s"], figure["steps"]) == (rec["step_time_s"], rec["phases_s"], 0)


def test_measured_figure_of_a_record_without_steady_steps_has_no_step_time_and_keeps_its_phases():
    from rackcast.backend.record import measured_figure

    figure = measured_figure({"phases_s": {"compute": 0.5}})  # a run that ended before a steady step
    assert figure["step_time_s"] is None and figure["phases_s"] == {"compute": 0.5} and figure["steps"] == 0


def test_an_older_record_gets_its_fastest_figure_from_the_runs_metrics(tmp_path):
    from rackcast.backend.record import summary, with_fastest, write_metrics

    rows = _rows([5.0, 1.2, 1.0, 1.4, 1.1, 3.0, 1.3])  # six steady steps: the fastest fifth is one, 1.0
    write_metrics(tmp_path, rows)
    old = {k: v for k, v in summary(rows).items() if k != "fastest"}
    fast = with_fastest(old, tmp_path)["fastest"]
    assert fast["steps"] == 1 and fast["step_time_s"] == 1.0 and fast["phases_s"]["compute"] == 0.5
    assert fast["halves_spread"] == pytest.approx(0.2)  # even steps' fastest 1.2, odd steps' 1.0
    assert "fastest" not in with_fastest(old, tmp_path / "no-metrics")


def test_validate_plan_figure_is_the_median_of_its_runs_figures_with_their_spreads():
    from rackcast.validation.validate import plan_result

    def record(step, halves):
        return {"peak_memory_bytes": 1.0, "step_time_s": 9.0,
                "fastest": {"steps": 3, "step_time_s": step, "phases_s": {"compute": step / 2},
                            "halves_spread": halves}}

    r = plan_result("p", "p.yaml", [record(1.0, 0.02), record(1.3, 0.04), record(1.1, float("nan"))])
    assert r.measured_step_s == 1.1 and r.measured_runs_s == [1.0, 1.3, 1.1]
    assert r.measured_phases_s == {"compute": 0.55} and r.step_spread == 0.04
    assert r.repeat_spread["relative"] == pytest.approx(0.3 / 1.1) and r.too_noisy
    assert r.scatter == pytest.approx(0.3 / 1.1 / 2)  # half the wider spread: what the fit weighs it by


def test_leave_one_out_error_is_each_value_against_the_median_of_the_others():
    from rackcast.spread import leave_one_out_error

    assert leave_one_out_error([2.0, 2.0, 2.0]) == 0.0
    # 1 against median(2, 3) = 2.5, 2 against 2.0, 3 against 1.5: errors 0.6, 0, 1
    assert leave_one_out_error([3.0, 1.0, 2.0]) == pytest.approx((0.6 + 0.0 + 1.0) / 3)
    assert math.isnan(leave_one_out_error([1.0])) and math.isnan(leave_one_out_error([1.0, math.nan]))


def test_validate_repeat_floor_uses_repeats_and_falls_back_to_run_halves_with_one_run_each():
    from rackcast.validation.validate import PlanResult, repeat_floor

    def result(runs, step_spread=math.nan):
        return PlanResult("p", "", spread_of(runs).centre, runs, {}, 1.0, step_spread=step_spread)

    floor = repeat_floor([result([1.0, 1.0, 1.0]), result([1.0, 2.0]), result([5.0])])  # the one-run plan adds nothing
    assert floor == {"mape": pytest.approx((0.0 + 0.75) / 2), "from": "repeats", "plans": 2}
    quick = repeat_floor([result([1.0], 0.1), result([2.0], 0.3)])
    assert quick == {"mape": pytest.approx(0.2), "from": "run halves", "plans": 2}


def test_record_keeps_the_speed_probe_at_its_fastest_steps_and_its_median():
    from rackcast.backend.record import summary

    times = [9.0] + [2.0] * 5 + [1.0] + [2.0] * 3  # the fastest fifth of the nine steady steps: index 6 and 1
    probes = [5.0, 3.0, 2.0, 2.0, 2.0, 2.0, 4.0, 2.0, 2.0, 2.0]
    rows = [dict(r, probe_s=p) for r, p in zip(_rows(times), probes)]
    rec = summary(rows)
    assert rec["fastest"]["probe_s"] == pytest.approx((4.0 + 3.0) / 2)  # the probes at the figure's steps
    assert rec["probe_s"] == 2.0  # the median over the steady steps
    assert "probe_s" not in summary(_rows(times))["fastest"]  # a run recorded before the probe has none


def test_an_older_record_gets_its_speed_probe_from_the_runs_metrics_where_they_have_one(tmp_path):
    from rackcast.backend.record import summary, with_fastest, write_metrics

    rows = [dict(r, probe_s=p) for r, p in zip(_rows([5.0, 1.2, 1.0, 1.4]), [9.0, 2.0, 3.0, 4.0])]
    write_metrics(tmp_path, rows)
    old = {k: v for k, v in summary(rows).items() if k not in ("fastest", "probe_s")}
    filled = with_fastest(old, tmp_path)
    assert filled["fastest"]["probe_s"] == 3.0 and filled["probe_s"] == 3.0
    write_metrics(tmp_path, _rows([5.0, 1.2, 1.0, 1.4]))  # metrics from before the probe
    filled = with_fastest(old, tmp_path)
    assert "probe_s" not in filled and "probe_s" not in filled["fastest"]


def test_slowdown_is_the_probes_ratio_less_one_and_unknown_without_either_probe():
    from rackcast.spread import slowdown

    assert slowdown(2.4e-3, 2.0e-3) == pytest.approx(0.2)
    assert slowdown(1.8e-3, 2.0e-3) == pytest.approx(-0.1)
    assert all(math.isnan(slowdown(p, c)) for p, c in ((None, 2e-3), (2e-3, 0.0), (float("nan"), 2e-3)))


def test_validate_flags_a_plan_whose_median_run_had_a_slower_or_faster_machine_than_calibrated():
    from rackcast.spread import MACHINE_MISMATCH_LIMIT
    from rackcast.validation.validate import plan_result

    def record(probe):
        fast = {"steps": 3, "step_time_s": 1.0, "phases_s": {}, "halves_spread": 0.0}
        return {"peak_memory_bytes": 1.0, "fastest": fast if probe is None else dict(fast, probe_s=probe)}

    calibrated = 2.0e-3
    slow = calibrated * (1 + 2 * MACHINE_MISMATCH_LIMIT)
    one_slow = plan_result("p", "", [record(calibrated), record(slow), record(calibrated)], calibrated)
    assert one_slow.run_slowdowns[1] == pytest.approx(2 * MACHINE_MISMATCH_LIMIT) and not one_slow.machine_mismatch
    two_slow = plan_result("p", "", [record(slow), record(slow), record(calibrated)], calibrated)
    assert two_slow.machine_slowdown == pytest.approx(2 * MACHINE_MISMATCH_LIMIT) and two_slow.machine_mismatch
    fast = calibrated * (1 - 2 * MACHINE_MISMATCH_LIMIT)
    assert plan_result("p", "", [record(fast)], calibrated).machine_mismatch  # a calibration in a slow spell
    assert not plan_result("p", "", [record(slow)], 0.0).machine_mismatch  # not calibrated: not checked
    assert not plan_result("p", "", [record(None)], calibrated).machine_mismatch  # no probe recorded: not checked
