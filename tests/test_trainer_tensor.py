"""Tensor-parallel layouts train what one process trains (5 steps; losses to 1e-5 relative, parameters to 1e-5
absolute), with MuonH and with Adam on every group: TP2 (column / row parallel attention, dense MLP and shared
experts; fused Q/K/V and gate/up rows stored rank-major, backend.tensor_parallel), TP2 with sequence parallelism
(norms, router and routed experts on half the sequence; their gradients summed over the tp ranks), and TP2 inside
each of two pipeline stages; with selective and full recomputation (whose wrappers rename the modules that
checkpoints must still save in the one-process row order); and TP2 resuming the one-process run's checkpoint.

The model is tiny-moe with every layer attending with its two stored KV heads (kv_heads_global 2; the trainer
splits KV heads over the tensor ranks) and the short convolution after K only (block-output convolutions need the
whole sequence that sequence parallelism splits): rackcast.capabilities refuses the rest.

    .venv/bin/pytest -q tests/test_trainer_tensor.py -m slow     (8 tests: 2 min alone on 2 cores, 7 min shared)
"""

from __future__ import annotations

import shutil

import pytest

from rackcast.backend.checkpoint import full_model_state, latest_complete, step_dir
from trainer_helpers import (assert_trains_like, inline_preset, losses, optimizer_cases, reference_run, run_worker,
                             write_plan)

pytestmark = pytest.mark.slow

STEPS = 5
RESUME_AT = 3
LAYOUTS = {  # name: (parallel, processes, other plan fields)
    "t2": ({"tensor": 2}, 2, {}),
    "t2sp": ({"tensor": 2, "sequence_parallel": True}, 2, {"recompute": "selective"}),
    "t2p2": ({"tensor": 2, "pipeline": 2}, 4, {"recompute": "full"}),  # tp innermost: stage s holds ranks 2s, 2s + 1
}


def _model() -> dict:
    spec = inline_preset("tiny-moe", "tiny-moe-tp")
    spec["attention"]["kv_heads_global"] = 2
    spec["conv"]["sites"] = ["k"]
    return spec


def _ok(result):
    assert result.returncode == 0, result.stderr[-3000:]


def reference(tmp_path_factory, optimizer: str):
    """The one-process run (checkpointed at RESUME_AT for the resume tests): losses, whole parameters, folder."""
    run = reference_run(tmp_path_factory, optimizer, STEPS, "--checkpoint-every", str(RESUME_AT), model=_model())
    return losses(run), full_model_state(latest_complete(run)), run


# Adam too with sequence parallelism (its norm and router gradients summed over the tp ranks); plain TP2 runs with
# Adam in the resume test below, and t2p2 places state as t2 does on each stage
@pytest.mark.parametrize("optimizer,name", optimizer_cases(LAYOUTS, adamw_too={"t2sp"}))
def test_tensor_layout_trains_what_one_process_trains(optimizer, name, tmp_path_factory, tmp_path):
    ref_losses, ref_params, _ = reference(tmp_path_factory, optimizer)
    parallel, world, extra = LAYOUTS[name]
    plan = write_plan(tmp_path / f"{name}.yaml", parallel, optimizer=optimizer, model=_model(), **extra)
    _ok(run_worker(plan, tmp_path / "run", STEPS, world=world, timeout=600))
    assert_trains_like(tmp_path / "run", ref_losses, ref_params)


@pytest.mark.parametrize("optimizer", ["muonh", "adamw"])
def test_tensor_layout_resumes_a_one_process_checkpoint(optimizer, tmp_path_factory, tmp_path):
    """The one-process checkpoint of step 3 continued under TP2: the fused rows go back into the rank-major order
    with their optimizer state, and the run ends where the one-process run did."""
    ref_losses, ref_params, ref_run = reference(tmp_path_factory, optimizer)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    shutil.copytree(step_dir(ref_run, RESUME_AT), step_dir(tmp_path / "run", RESUME_AT))
    plan = write_plan(tmp_path / "t2.yaml", {"tensor": 2}, optimizer=optimizer, model=_model())
    _ok(run_worker(plan, tmp_path / "run", STEPS, "--resume", world=2, timeout=600))
    assert_trains_like(tmp_path / "run", ref_losses, ref_params)
