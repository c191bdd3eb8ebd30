"""Tensor parallelism combined with sharding or host-resident optimizer state trains what one process trains (5 steps;
losses to 1e-5 relative, parameters to 1e-5 absolute), with MuonH and with Adam on every group:
- TP2 x FSDP2 (4 processes): backend.fsdp shards the tensor-parallel DTensors again over the fsdp ranks of one tp
  rank (torchtitan's order: TP first, then fully_shard on a mesh sharing the tp mesh's root); MuonH gathers each 2-D
  (fsdp x tp) update whole before Newton-Schulz; the routed experts, replicated over the tp ranks, are sharded over
  fsdp x tp and their reduce-scatter divided by dp x tp;
- the same with sequence parallelism: the norms' and router's reduce-scattered gradients are then summed over "tp"
  (found again by name after FSDP2 swapped the parameters), the experts' not (their reduce-scatter already sums tp);
- TP2 x ZeRO-1 and ZeRO-2 (data 2): backend.zero owns whole DTensor parameters, the same ones on both tp ranks,
  and reduces / broadcasts each rank's own part;
- TP2 x FSDP2 with the optimizer state in host memory (backend.offload steps host copies of the DTensors);
- TP2 x FSDP2 resuming the one-process run's checkpoint.

The model is tests/test_trainer_tensor.py's (tiny-moe, two stored KV heads on every layer, the short convolution
after K only; routed experts replicated over the tensor ranks, FSDP-sharded over fsdp x tp).

    .venv/bin/pytest -q tests/test_trainer_tensor_sharding.py -m slow     (12 tests: about 5 min on 2 shared cores)
"""

from __future__ import annotations

import shutil

import pytest

from rackcast.backend.checkpoint import step_dir
from test_trainer_tensor import _model, _ok, reference
from trainer_helpers import assert_trains_like, optimizer_cases, run_worker, write_plan

pytestmark = pytest.mark.slow

STEPS = 5
RESUME_AT = 3
LAYOUTS = {  # name: (parallel, processes, other plan fields)
    "t2f2": ({"tensor": 2, "fsdp": 2}, 4),  # ranks 2f + t: the fsdp group of tp rank t is {t, t + 2}
    # sequence parallelism: norms, router and routed experts see half the sequence on each tp rank; the norms' and
    # router's FSDP-reduced shards are then summed over "tp", the experts' reduce-scatter over fsdp x tp sums them
    "t2f2sp": ({"tensor": 2, "fsdp": 2, "sequence_parallel": True}, 4),
    "t2d2z1": ({"tensor": 2, "data": 2, "zero": 1}, 4),
    "t2d2z2": ({"tensor": 2, "data": 2, "zero": 2}, 4),
    # TP2 with host state alone is left to TP2 x FSDP2 with host state below (the same DTensor host copies)
    "t2f2-host": ({"tensor": 2, "fsdp": 2}, 4, {"optimizer_extra": {"state_location": "host"}}),
}


# Adam too where the state is sharded other than as t2f2, which runs with Adam in the resume test below
@pytest.mark.parametrize("optimizer,name", optimizer_cases(LAYOUTS, adamw_too={"t2f2sp", "t2d2z1", "t2d2z2",
                                                                              "t2f2-host"}))
def test_tensor_with_sharding_trains_what_one_process_trains(optimizer, name, tmp_path_factory, tmp_path):
    ref_losses, ref_params, _ = reference(tmp_path_factory, optimizer)
    parallel, world, *extra = LAYOUTS[name]
    plan = write_plan(tmp_path / f"{name}.yaml", parallel, optimizer=optimizer, model=_model(),
                      **(extra[0] if extra else {}))
    _ok(run_worker(plan, tmp_path / "run", STEPS, world=world, timeout=600))
    assert_trains_like(tmp_path / "run", ref_losses, ref_params)


@pytest.mark.parametrize("optimizer", ["muonh", "adamw"])
def test_tensor_with_fsdp_resumes_a_one_process_checkpoint(optimizer, tmp_path_factory, tmp_path):
    """The one-process checkpoint of step 3 continued under TP2 x FSDP2: DCP reshards the parameters and their
    optimizer state onto the 2-D placements (fused rows back in the rank-major order), and the run ends where the
    one-process run did."""
    ref_losses, ref_params, ref_run = reference(tmp_path_factory, optimizer)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    shutil.copytree(step_dir(ref_run, RESUME_AT), step_dir(tmp_path / "run", RESUME_AT))
    plan = write_plan(tmp_path / "t2f2.yaml", {"tensor": 2, "fsdp": 2}, optimizer=optimizer, model=_model())
    _ok(run_worker(plan, tmp_path / "run", STEPS, "--resume", world=4, timeout=600))
    assert_trains_like(tmp_path / "run", ref_losses, ref_params)
