"""One capability set: every layout the planner ranks passes `rackcast train --check`, and --check names each field
the trainer cannot run, one line per reason."""

from __future__ import annotations

import pytest
import yaml

from rackcast.capabilities import EVERYTHING, TRAINER, refusals
from rackcast.cli.train import check_lines
from rackcast.plan import load_plan, save_plan

PROBLEMS = [(model, topology) for model in ("tiny-moe", "marin-ladder-d768")
            for topology in ("local-cpu", "h200-hgx", "gb200-nvl72")]


@pytest.mark.parametrize("model,topology", PROBLEMS)
def test_every_ranked_layout_passes_train_check(model, topology, tmp_path):
    from rackcast.planner.search import Request, search

    result = search(Request(model=model, topology=topology, racks=1, tokens=1e9, top=0, simulate=False, workers=1))
    assert result.ranked
    for row in result.ranked:
        plan = result.plan_for(row)
        assert check_lines(row.layout.label, plan) == [], row.layout.label
    path = tmp_path / "winner.yaml"
    save_plan(result.plan_for(result.winner), str(path))
    assert check_lines(str(path), load_plan(str(path))) == []


def _plan(tmp_path, **fields):
    data = {"name": "p", "model": "tiny-moe", "topology": {"name": "local-cpu", "domains": 1, "usable_gpus": 2},
            "parallel": {"data": 2}, "batch": {"global_batch": 8, "micro_batch": 2}, **fields}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_train_check_lists_each_refused_field_on_its_own_line(tmp_path, cli):
    path = _plan(tmp_path, dropout=True, grad_dtype="bf16", precision="fp8")
    proc = cli("train", str(path), "--check")
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 3
    for field, line in zip(("precision", "grad_dtype", "dropout"), lines):
        assert line.startswith(f"rackcast train: error: {path}: {field}: "), line


def test_train_check_accepts_a_runnable_plan_and_launches_nothing(tmp_path, cli):
    path = _plan(tmp_path, recompute="full", optimizer={"name": "muonh", "state_location": "host"})
    proc = cli("train", str(path), "--check")
    assert proc.returncode == 0, proc.stderr
    assert "can run" in proc.stdout and not (tmp_path / "runs").exists()


def test_refusals_name_master_weights_and_the_unrunnable_axes(tmp_path):
    plan = load_plan(str(_plan(tmp_path, optimizer={"name": "adamw", "master_weights": False})))
    reasons = refusals(plan, plan.model_spec())
    assert [r.split(":")[0] for r in reasons] == ["optimizer.master_weights"]
    assert refusals(plan, plan.model_spec(), EVERYTHING) == []
