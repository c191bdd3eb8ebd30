"""FSDP2 layouts train what one process trains (5 steps; losses to 1e-5 relative, parameters to 1e-5 absolute), with
MuonH and with Adam on every group: sharded experts whose reduce-scatter divides by dp (not by the expert-data
group), FSDP with expert parallelism (its checkpoint holds both splits of the expert stacks), and FSDP across pipeline
stages, also under the split-backward schedules zb_h1 and dualpipev; and FSDP2 with the optimizer state in host
memory (the step on host copies of the DTensor shards).

    .venv/bin/pytest -q tests/test_trainer_fsdp.py        (several minutes on 2 cores)
"""

from __future__ import annotations

import pytest

from rackcast.backend.checkpoint import latest_complete, full_model_state
from trainer_helpers import assert_trains_like, losses, optimizer_cases, reference_run, run_worker, write_plan

pytestmark = pytest.mark.slow

STEPS = 5
LAYOUTS = {
    "f2": ({"fsdp": 2}, 2),  # experts sharded over the 2 expert-data ranks; MuonH gathers each 2-D matrix
    # optimizer state in host memory: the step runs on host copies of the FSDP2 DTensor shards (backend.offload)
    "f2-host": ({"fsdp": 2}, 2, {"optimizer_extra": {"state_location": "host"}}),
    "f4e2": ({"fsdp": 4, "expert": 2}, 4),  # EP2 inside FSDP4: expert stacks sharded over edp=2, divided by dp=4
    "f2p2": ({"fsdp": 2, "pipeline": 2}, 4),  # FSDP2 inside each pipeline stage (1f1b)
    # split-backward schedules: weight gradients after later micro-batches' forwards (backend.fsdp keeps the units
    # gathered; resharded after each forward, 2-7e-2 of the parameters went missing)
    "f2p2-zb_h1": ({"fsdp": 2, "pipeline": 2, "virtual": 2}, 4, {"schedule": "zb_h1"}),
    "f2p2-dualpipev": ({"fsdp": 2, "pipeline": 2, "virtual": 2}, 4, {"schedule": "dualpipev", "micro_batch": 1}),
}


def _ok(result):
    assert result.returncode == 0, result.stderr[-3000:]


def reference(tmp_path_factory, optimizer: str):
    run = reference_run(tmp_path_factory, optimizer, STEPS)
    return losses(run), full_model_state(latest_complete(run))


# Adam too where the state is sharded (f2, f4e2's expert stacks) or on the host; the pipeline cases shard each stage
# as f2 does
@pytest.mark.parametrize("optimizer,name", optimizer_cases(LAYOUTS, adamw_too={"f2", "f2-host", "f4e2"}))
def test_fsdp_layout_trains_what_one_process_trains(optimizer, name, tmp_path_factory, tmp_path):
    ref_losses, ref_params = reference(tmp_path_factory, optimizer)
    parallel, world, *extra = LAYOUTS[name]
    plan = write_plan(tmp_path / f"{name}.yaml", parallel, optimizer=optimizer, **(extra[0] if extra else {}))
    _ok(run_worker(plan, tmp_path / "run", STEPS, world=world, timeout=600))
    assert_trains_like(tmp_path / "run", ref_losses, ref_params)


def test_fsdp_sharded_experts_under_expert_parallelism_resume_a_one_process_checkpoint(tmp_path):
    """One process trains 3 steps and stops; FSDP4 x EP2 resumes from its checkpoint (experts split twice on load)
    and its steps 4-6 are the uninterrupted run's, with Adam (a wrongly placed moment would show)."""
    whole = write_plan(tmp_path / "whole.yaml", {}, optimizer="adamw")
    _ok(run_worker(whole, tmp_path / "uninterrupted", 6))
    stopped = run_worker(whole, tmp_path / "run", 6, "--checkpoint-every", "3", env={"RACKCAST_FAIL": "0:4:step"})
    assert stopped.returncode != 0 and latest_complete(tmp_path / "run").name == "step-00000003"
    sharded = write_plan(tmp_path / "f4e2.yaml", {"fsdp": 4, "expert": 2}, optimizer="adamw")
    _ok(run_worker(sharded, tmp_path / "run", 6, "--resume", world=4, timeout=600))
    assert losses(tmp_path / "run") == pytest.approx(losses(tmp_path / "uninterrupted"), rel=1e-5)
