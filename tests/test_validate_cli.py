"""`rackcast validate` end to end through the CLI on recorded runs (--reuse, tests/data/validate-quick-r1): it
predicts, fits and scores them and reports the repeat floor; a missing run is one line and exit 2."""

from __future__ import annotations

import json
import math
import shutil

from conftest import ROOT

DATA = ROOT / "tests" / "data" / "validate-quick-r1"


def _copy(tmp_path):
    out = tmp_path / "validate"
    shutil.copytree(DATA / "runs", out / "runs")
    return out


def test_validate_quick_reuse_scores_recorded_runs_and_reports_the_run_halves_floor(cli, tmp_path):
    out = _copy(tmp_path)
    proc = cli("validate", "--quick", "--reuse", "--topology", str(DATA / "calibrated.yaml"), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "Validation summary" in proc.stdout and "repeat floor: the two halves of a run differ by" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reused_runs"] and summary["repeats"] == 1
    floor = summary["repeat_floor"]
    assert floor["from"] == "run halves" and floor["plans"] == 8 and 0 < floor["mape"] < 1
    by_profile = {s["profile"]: s for s in summary["summaries"]}
    assert by_profile["fitted (held-out plans)"]["plans"] == 8 - len(summary["fit_on"])
    assert all(math.isfinite(s["step_mape"]) for s in summary["summaries"])
    assert (out / "results.parquet").exists() and (out / "fitted-topology.yaml").exists()


def test_validate_reuse_without_a_recorded_run_is_one_line_naming_the_run(cli, tmp_path):
    out = _copy(tmp_path)
    shutil.rmtree(out / "runs" / "dp2-mb2-r0")
    proc = cli("validate", "--quick", "--reuse", "--topology", str(DATA / "calibrated.yaml"), "--out", str(out))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]  # the rest is validate's progress
    assert len(errors) == 1 and "dp2-mb2-r0" in errors[0] and "--reuse" in errors[0]
    assert not (out / "summary.json").exists()
