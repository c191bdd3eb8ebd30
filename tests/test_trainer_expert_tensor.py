"""Expert tensor parallelism (backend.expert_tensor) trains what one process trains: EP2 x ETP2 on four gloo
processes (two blocks of experts, each expert's width split over the two ranks of its block), and ETP2 on two with
the optimizer state in host memory, for 5 steps, losses to 1e-5 relative and parameters to 1e-5 absolute, with
MuonH (Newton-Schulz on the whole gate, up and down matrices, gathered over the ETP ranks) and with Adam on every
group, also with FSDP2 sharding the width slices again (FSDP4 x ETP2: each slice over two fsdp ranks); and
checkpoints cross layouts both ways: ETP2 over data 4 (two expert-data replicas of each width slice) resumes the
one-process step-3 checkpoint, and one process resumes that run's step-4 checkpoint, each ending where one process
ends.

The model is tiny-moe with biases in the MLPs, so the width-split biases (gate/up or up, stored like the weights)
and the down bias every ETP rank holds whole (its gradient summed over the ETP ranks) are covered: SwiGLU (fused
gate/up columns stored rank-major) under MuonH, GELU under Adam. The Adam runs use eps 1e-6: with the default 1e-8,
one element of 8192 of layers.2.attn.qkv, whose gradient cancels to nearly zero, ends 1.3e-5 off one process's after
5 steps, because Adam's g / (|g| + eps) turns the last-bit rounding of the split down-projection sum (two partial
sums of half the width instead of one) into a visible step there; every other parameter is within 1e-6, and with
eps 1e-6 all are.

    .venv/bin/pytest -q tests/test_trainer_expert_tensor.py -m slow     (6 tests, about 3 minutes on 2 cores)
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


def _model(**fields) -> dict:
    return {**inline_preset("tiny-moe", "tiny-moe-etp"), "mlp_bias": True, **fields}


CASES = {  # optimizer: other plan fields
    "muonh": {"model": _model()},
    "adamw": {"model": _model(activation="gelu"), "optimizer_extra": {"eps": 1e-6}},
}


def _ok(result):
    assert result.returncode == 0, result.stderr[-3000:]


def _fields(optimizer, state_location="hbm") -> dict:
    fields = {k: (dict(v) if isinstance(v, dict) else v) for k, v in CASES[optimizer].items()}
    fields["optimizer_extra"] = dict(fields.get("optimizer_extra", {}), state_location=state_location)
    return fields


def _plan(path, parallel, optimizer, state_location="hbm"):
    return write_plan(path, parallel, optimizer=optimizer, **_fields(optimizer, state_location))


def reference(tmp_path_factory, optimizer: str):
    """The one-process run (checkpointed at RESUME_AT for the resume test): losses, whole parameters, folder."""
    run = reference_run(tmp_path_factory, optimizer, STEPS, "--checkpoint-every", str(RESUME_AT), **_fields(optimizer))
    return losses(run), full_model_state(latest_complete(run)), run


LAYOUTS = {  # name: (parallel, processes, optimizer state location)
    "e2et2": ({"data": 4, "expert": 2, "expert_tensor": 2}, 4, "hbm"),
    # the optimizer steps host copies of the DTensor width slices (backend.offload)
    "et2-host": ({"data": 2, "expert_tensor": 2}, 2, "host"),
    "c2et2": ({"context": 2, "expert_tensor": 2}, 2, "hbm"),  # the slices' gradients averaged over context ranks
    "d2et2p2": ({"data": 2, "expert_tensor": 2, "pipeline": 2}, 4, "hbm"),  # each stage's stacks sliced
    # ZeRO-2 reduces gradients itself: the down-projection bias's partials are summed over the ETP ranks first, once
    # for a slice it alone holds (they accumulate over the micro-batches); without that it ended 1.2e-3 off
    "d2et2z2": ({"data": 2, "expert_tensor": 2, "zero": 2}, 2, "hbm"),
    # FSDP2 shards each width slice again over the two fsdp ranks holding it (2-D placements on one root mesh with
    # "etp", backend.parallel.Groups); the down bias's shards are summed over the ETP ranks after its reduce-scatter
    "f4et2": ({"fsdp": 4, "expert_tensor": 2}, 4, "hbm"),
}


# Adam on the layouts that place the expert state in a new way (width slices; their host copies; ZeRO owners; FSDP
# shards of the slices) or
# reduce the slices' gradients over new ranks (context); a pipeline stage slices its stacks as e2et2 does
@pytest.mark.parametrize("optimizer,name", optimizer_cases(LAYOUTS, adamw_too={"e2et2", "et2-host", "c2et2",
                                                                              "d2et2z2", "f4et2"}))
def test_expert_tensor_layout_trains_what_one_process_trains(optimizer, name, tmp_path_factory, tmp_path):
    ref_losses, ref_params, _ = reference(tmp_path_factory, optimizer)
    parallel, world, location = LAYOUTS[name]
    plan = _plan(tmp_path / f"{name}.yaml", parallel, optimizer, location)
    _ok(run_worker(plan, tmp_path / "run", STEPS, world=world, timeout=600))
    assert_trains_like(tmp_path / "run", ref_losses, ref_params)


@pytest.mark.parametrize("optimizer", list(CASES))
def test_expert_tensor_checkpoints_resume_across_layouts(optimizer, tmp_path_factory, tmp_path):
    """One process's step-3 checkpoint continued under ETP2 x data 4 (the width slices and their optimizer state
    cut out of the whole tensors, gate/up columns into the rank-major order), saved at step 4 (put back whole), and
    that continued by one process to step 5: both end where the uninterrupted one-process run ends."""
    ref_losses, ref_params, ref_run = reference(tmp_path_factory, optimizer)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(step_dir(ref_run, RESUME_AT), step_dir(run, RESUME_AT))
    plan = _plan(tmp_path / "et2.yaml", {"data": 4, "expert_tensor": 2}, optimizer)
    _ok(run_worker(plan, run, STEPS, "--resume", "--checkpoint-every", "1", world=4, timeout=600))
    assert_trains_like(run, ref_losses, ref_params)
    shutil.rmtree(step_dir(run, STEPS))  # one process continues the ETP run's step-4 checkpoint
    _ok(run_worker(_plan(tmp_path / "one.yaml", {}, optimizer), run, STEPS, "--resume"))
    assert_trains_like(run, ref_losses, ref_params)
