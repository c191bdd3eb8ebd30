"""One-process trainer features: full and selective recomputation and host-resident optimizer state train exactly
what the plain run trains (losses, parameters and routing counts), with MuonH and with Adam on every group; the plan's
recipe, precision and attention kernel are honoured.

    .venv/bin/pytest -q tests/test_trainer_features.py        (about a minute on 2 cores)
"""

from __future__ import annotations

import json

import pytest
import torch

from rackcast.backend.checkpoint import full_model_state, latest_complete
from trainer_helpers import losses, optimizer_cases, reference_run, routing, run_worker, write_plan

pytestmark = pytest.mark.slow

STEPS = 5
VARIANTS = {"full": {"recompute": "full"}, "selective": {"recompute": "selective"},
            "host": {"optimizer_extra": {"state_location": "host"}}}


def _ok(result):
    assert result.returncode == 0, result.stderr[-3000:]


def _run(tmp_path_factory, name: str, optimizer: str, **extra):
    d = tmp_path_factory.mktemp(f"{name}-{optimizer}")
    _ok(run_worker(write_plan(d / f"{name}.yaml", {}, optimizer=optimizer, **extra), d / "run", STEPS))
    return d / "run"


# recompute changes no optimizer state: Adam on every group only with the state on the host
@pytest.mark.parametrize("optimizer,variant", optimizer_cases(VARIANTS, adamw_too={"host"}))
def test_variant_trains_what_the_plain_run_trains(optimizer, variant, tmp_path_factory):
    ref = reference_run(tmp_path_factory, optimizer, STEPS)
    run = _run(tmp_path_factory, variant, optimizer, **VARIANTS[variant])
    assert losses(run) == pytest.approx(losses(ref), rel=1e-5)
    params, ref_params = full_model_state(latest_complete(run)), full_model_state(latest_complete(ref))
    assert params.keys() == ref_params.keys()
    for key, value in ref_params.items():
        torch.testing.assert_close(params[key], value, atol=1e-5, rtol=0, msg=key)
    assert routing(run) == routing(ref)  # a recomputed forward does not count its tokens twice


def test_plan_recipe_precision_and_kernel_are_honoured(tmp_path_factory):
    ref = reference_run(tmp_path_factory, "muonh", STEPS)
    bf16 = _run(tmp_path_factory, "bf16", "muonh", precision="bf16")
    record = json.loads((bf16 / "record.json").read_text())
    assert record["peak_dtype"] == "bf16" and record["activation_dtype"] == "bf16"
    assert losses(bf16) != losses(ref) and losses(bf16) == pytest.approx(losses(ref), rel=2e-2)
    math_kernel = _run(tmp_path_factory, "math", "muonh", attention_kernel="materialized")
    assert losses(math_kernel) == pytest.approx(losses(ref), rel=1e-4)
    recipe = _run(tmp_path_factory, "recipe", "muonh", combine_sum=2.5, z_loss_weight=0.0,
                  optimizer_extra={"eps": 1e-12, "warmup_fraction": 0.5})
    assert losses(recipe)[0] != pytest.approx(losses(ref)[0], rel=1e-6)  # combine_sum and z-loss change step 1
