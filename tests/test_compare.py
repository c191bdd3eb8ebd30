"""compare on a recorded run (tests/data/run-tiny-dp2-ep2), the combined trace, Kendall tau."""

from __future__ import annotations

import json
import math

import pytest

from rackcast.validation.compare import combined_trace, compare_rows, core_wait_note, load_record, predict
from rackcast.validation.validate import kendall_tau
from rackcast.plan import load_plan

from conftest import ROOT

RUN = ROOT / "tests" / "data" / "run-tiny-dp2-ep2"



def test_compare_rows_on_recorded_run():
    plan = load_plan(str(RUN / "plan.yaml"))
    rec = load_record(RUN)
    source, result = predict(plan)
    rows = {r["metric"]: r for r in compare_rows(result, rec)}
    for name in ("step_time_s", "tokens_per_s", "mfu", "phase compute", "phase exposed_expert_a2a",
                 "phase exposed_dp_comm", "phase optimizer", "peak_memory_bytes", "drop_fraction"):
        assert name in rows
    step = rows["step_time_s"]
    # the run's figure: recorded before record.json kept it, so filled in from its metrics.parquet by load_record
    assert rec["fastest"]["steps"] > 0 and step["measured"] == pytest.approx(rec["fastest"]["step_time_s"])
    assert step["measured"] < rec["step_time_s"]  # the fastest fifth of the steps, below their median
    assert step["error"] == pytest.approx((step["predicted"] - step["measured"]) / step["measured"])
    mfu = rows["mfu"]  # measured MFU on the prediction's peak: its error mirrors the step time's
    assert mfu["measured"] == pytest.approx(rec["model_flops_per_step"] / (step["measured"] * 2 * 225e9))
    assert 1 + mfu["error"] == pytest.approx(1 / (1 + step["error"]))


def test_compare_scores_the_runs_fastest_steps_figure_where_the_record_has_it():
    plan = load_plan(str(RUN / "plan.yaml"))
    rec = load_record(RUN)
    _, result = predict(plan)
    fast = {"steps": 3, "step_time_s": rec["step_time_s"] * 0.8,
            "phases_s": {k: v * 0.8 for k, v in rec["phases_s"].items()}}
    rows = {r["metric"]: r for r in compare_rows(result, dict(rec, fastest=fast))}
    assert rows["step_time_s"]["measured"] == pytest.approx(fast["step_time_s"])
    assert rows["tokens_per_s"]["measured"] == pytest.approx(rec["tokens_per_step"] / fast["step_time_s"])
    assert rows["phase compute"]["measured"] == pytest.approx(fast["phases_s"]["compute"])
    assert 1 + rows["mfu"]["error"] == pytest.approx(1 / (1 + rows["step_time_s"]["error"]))


def test_compare_cli_json_and_trace(tmp_path, cli):
    trace = tmp_path / "t.json"
    proc = cli("compare", str(RUN / "plan.yaml"), str(RUN), "--json", "--trace", str(trace))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["prediction"] in ("simulate", "estimate")
    assert {m["metric"] for m in out["metrics"]} >= {"step_time_s", "peak_memory_bytes"}
    events = json.loads(trace.read_text())["traceEvents"]
    names = [e["args"]["name"] for e in events if e.get("name") == "process_name"]
    assert any(n.startswith("measured") for n in names) and any(not n.startswith("measured") for n in names)
    pids = {e["pid"] for e in events if e.get("ph") == "X"}
    assert len(pids) >= 2


def test_compare_estimate_table_and_bad_run(tmp_path, cli):
    proc = cli("compare", str(RUN / "plan.yaml"), str(RUN), "--estimate")
    assert proc.returncode == 0, proc.stderr
    assert "estimate" in proc.stdout and "step_time_s" in proc.stdout
    proc = cli("compare", str(RUN / "plan.yaml"), str(tmp_path))
    assert proc.returncode == 2 and "record.json" in proc.stderr


def test_core_wait_note_flags_only_cpu_runs_that_waited_for_a_core():
    waited = {"device": "cpu", "core_share": 0.4, "step_cpu_s": 0.2, "step_time_s": 0.5}
    assert "0.40 of a core" in core_wait_note(waited) and "0.2 s against 0.5 s wall" in core_wait_note(waited)
    assert core_wait_note(waited | {"core_share": 0.95}) == ""
    assert core_wait_note(waited | {"device": "cuda"}) == ""
    assert core_wait_note({"device": "cpu", "step_time_s": 0.5}) == ""  # a run recorded before core_share


def test_combined_trace_from_phases_without_trace_file():
    plan = load_plan(str(RUN / "plan.yaml"))
    source, result = predict(plan, prefer="estimate")
    tr = combined_trace(result, source, RUN, load_record(RUN))
    measured = [e for e in tr["traceEvents"] if e.get("ph") == "X" and e["pid"] >= 1000]
    assert {e["name"] for e in measured} >= {"compute", "optimizer"}


def test_kendall_tau():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    assert math.isnan(kendall_tau([1, 1], [2, 2]))


def test_validate_suite_plans_and_summary(tmp_path):
    from rackcast.validation.validate import PlanResult, summarise, write_suite

    paths = write_suite(tmp_path, "local-cpu", quick=False)
    plans = [load_plan(str(p)) for p in paths]
    assert len(plans) >= 8
    assert {p.schedule for p in plans if p.parallel.pipeline > 1} == {"1f1b", "gpipe"}
    assert any(p.parallel.expert > 1 for p in plans) and any(p.parallel.data > 1 and p.parallel.expert == 1
                                                             for p in plans)
    assert {p.expert_transport.mode for p in plans} == {"dropless", "capacity"}
    assert len({p.batch.micro_batch for p in plans}) >= 3
    results = [PlanResult(f"p{i}", "", m, [m], {}, 100.0, {"x": {"step_time_s": m * f, "peak_memory_bytes": 50.0}})
               for i, (m, f) in enumerate([(1.0, 1.1), (2.0, 0.9), (3.0, 1.0)])]
    s = summarise(results, "x")
    assert s["step_mape"] == pytest.approx((0.1 + 0.1 + 0.0) / 3)
    assert s["step_max_abs_error"] == pytest.approx(0.1)
    assert s["kendall_tau"] == 1.0
    assert s["memory_mape"] == pytest.approx(0.5) and s["memory_max_abs_error"] == pytest.approx(0.5)


def test_validate_summary_lists_plans_on_a_slower_or_faster_machine_and_scores_the_matched_ones_apart():
    from rackcast.cli.validate import machine_line
    from rackcast.validation.validate import PlanResult, machine_check, matched_summaries

    def result(name, measured, predicted, slowdowns):
        return PlanResult(name, "", measured, [measured], {}, 100.0,
                          {"sim": {"step_time_s": predicted, "peak_memory_bytes": 100.0}}, run_slowdowns=slowdowns)

    results = [result("fast", 1.0, 1.1, [0.01, 0.02]), result("slow", 2.0, 1.0, [0.3, 0.25]),
               result("same", 3.0, 3.0, [-0.02])]
    s = machine_check(results, 2e-3)
    assert s["machine_mismatch_plans"] == ["slow"] and s["machine_slowdown"]["slow"] == pytest.approx(0.275)
    [matched] = matched_summaries(results)
    assert matched["profile"] == "sim (machine-matched plans)" and matched["plans"] == 2
    assert matched["step_mape"] == pytest.approx(0.1 / 2)  # fast's 10% and same's 0%; slow's 50% left out
    assert "slow ran on a machine more than 10.0% slower than calibrated" in machine_line(s)
    quicker = machine_check(results[:1] + [result("quick", 2.0, 3.0, [-0.3])], 2e-3)  # a calibration in a slow spell
    assert quicker["machine_mismatch_plans"] == ["quick"] and "more than 10.0% faster" in machine_line(quicker)
    assert matched_summaries(results[::2]) == []  # every machine matched: the rows over all plans say it
    assert machine_line(machine_check(results[::2], 2e-3)).startswith("machine speed: every plan ran within")
    assert "not checked" in machine_line(machine_check(results, 0.0))
