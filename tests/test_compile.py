"""The plan's `compile` field: validated, kept through YAML, refused in one line where the trainer cannot compile,
and a one-process run with compile on trains the eager run's losses.

    .venv/bin/pytest -q tests/test_compile.py            # the run itself is marked slow (compiling takes minutes)
"""

from __future__ import annotations

import json

import pytest
import yaml

from rackcast.backend import compiled
from rackcast.backend.tiny_runs import losses, run_worker, write_plan
from rackcast.capabilities import refusals
from rackcast.errors import RackcastError
from rackcast.plan import load_plan, save_plan


def _plan(tmp_path, parallel: dict | None = None, name: str = "p", **fields):
    gpus = (parallel or {}).get("data", 1)
    data = {"name": "p", "model": "tiny-moe", "topology": {"name": "local-cpu", "domains": 1, "usable_gpus": gpus},
            "parallel": parallel or {}, "batch": {"global_batch": 8, "micro_batch": 4}, **fields}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_compile_defaults_to_eager_and_survives_a_yaml_round_trip(tmp_path):
    assert load_plan(str(_plan(tmp_path))).compile is False
    plan = load_plan(str(_plan(tmp_path, compile=True)))
    assert plan.compile is True
    save_plan(plan, str(tmp_path / "again.yaml"))
    assert load_plan(str(tmp_path / "again.yaml")).compile is True


def test_a_compile_value_that_is_not_a_boolean_is_refused_naming_the_field(tmp_path):
    with pytest.raises(RackcastError, match="compile"):
        load_plan(str(_plan(tmp_path, compile="sometimes")))


def test_compile_with_several_processes_is_refused_in_one_line(tmp_path, cli):
    path = _plan(tmp_path, {"data": 2}, compile=True)
    plan = load_plan(str(path))
    assert [r.split(":")[0] for r in refusals(plan, plan.model_spec())] == ["compile"]
    assert refusals(load_plan(str(_plan(tmp_path, {"data": 2}, name="eager"))), plan.model_spec()) == []
    proc = cli("train", str(path), "--check")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # one line, no traceback
    assert proc.stderr.startswith(f"rackcast train: error: {path}: compile: ")


def test_compile_on_a_cpu_without_a_cxx_compiler_is_refused(tmp_path, monkeypatch):
    from rackcast.backend.parallel import validate_trainable

    monkeypatch.setenv(compiled.CXX_ENV, "no-such-compiler-here")
    assert "C++ compiler" in compiled.compile_problem(cuda=False)
    assert compiled.compile_problem(cuda=True) == ""
    monkeypatch.setattr(compiled.torch.cuda, "is_available", lambda: False)
    with pytest.raises(RackcastError, match="^.*compile: torch.compile on CPU needs a C\\+\\+ compiler"):
        validate_trainable(load_plan(str(_plan(tmp_path, compile=True))))
    validate_trainable(load_plan(str(_plan(tmp_path))))  # eager plans do not need one


def test_compile_targets_leave_the_routed_experts_eager():
    from rackcast.backend.model import build_model
    from rackcast.backend.moe import GroupedExperts
    from rackcast.presets import load_model

    model = build_model(load_model("tiny-moe"))
    targets = compiled.compile_targets(model)
    assert len(targets) == 4 * len(model.layers)  # attention, its norm, the MLP norm, the shared expert
    assert not any(isinstance(m, GroupedExperts) for t in targets for m in t.modules())


@pytest.mark.slow
@pytest.mark.timeout(2400)  # compiling took 6 minutes on this machine under load (README, trainer section)
def test_a_one_process_run_with_compile_trains_the_eager_losses(tmp_path):
    if compiled.compile_problem():
        pytest.skip(compiled.compile_problem())
    runs = {}
    for on in (False, True):
        plan = write_plan(tmp_path / f"compile-{on}.yaml", {}, global_batch=4, micro_batch=4, compile=on)
        proc = run_worker(plan, tmp_path / f"run-{on}", 3, timeout=1800)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[on] = losses(tmp_path / f"run-{on}")
    assert json.loads((tmp_path / "run-True" / "record.json").read_text())["compile"] is True
    assert runs[True] == pytest.approx(runs[False], rel=1e-4)  # compiled kernels sum in another order
