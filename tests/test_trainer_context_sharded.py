"""Context parallelism with sharded data parallelism and with pipelines trains what one process trains (5 steps;
losses to 1e-5 relative, parameters to 1e-5 absolute), with MuonH and with Adam: C2 x F2 (FSDP2 shards the dense
weights over the fsdp ranks and replicates them over the context ranks, backend.parallel.dense_fsdp_mesh: the
gradients are averaged over data x fsdp x context; with EP2 the expert stacks are sharded over fsdp x context /
expert and divided by the token ranks too), D2 x C2 under ZeRO-1 (optimizer state sharded over the four
token ranks, the replicas data x context) and under ZeRO-2 (each gradient reduced to its owner among them and
divided by their number; ZeRO needs data > 1, so no C2-only ZeRO run), and C2 x PP2 (each stage on the sequence
chunks, the last stage's loss scaled by the chunk's share of each micro-batch's counted targets). The C2 x F2 run
is also stopped after its third step and resumed from its own checkpoint to the uninterrupted run's losses.

    .venv/bin/pytest -q tests/test_trainer_context_sharded.py        (about five minutes on 2 shared cores)
"""

from __future__ import annotations

import pytest

from rackcast.backend.checkpoint import latest_complete
from trainer_helpers import assert_trains_like, losses, optimizer_cases, run_worker, write_plan
from test_trainer_context import _ok, reference

pytestmark = pytest.mark.slow

STEPS = 5
LAYOUTS = {
    # C2 x F2 alone runs in test_context_with_fsdp_resumes_its_own_checkpoint; the suite's time goes to C2 x F2 x EP2
    "d2c2z1": ({"data": 2, "context": 2, "zero": 1}, 4),
    "d2c2z2": ({"data": 2, "context": 2, "zero": 2}, 4),
    "c2p2": ({"context": 2, "pipeline": 2}, 4),
    "c2f2e2": ({"context": 2, "fsdp": 2, "expert": 2}, 4),  # expert stacks FSDP-sharded over fsdp x context / expert
}


# Adam too where the state is sharded (ZeRO over data x context, FSDP over fsdp x context); c2p2 shards nothing
@pytest.mark.parametrize("optimizer,name", optimizer_cases(LAYOUTS, adamw_too={"d2c2z1", "d2c2z2", "c2f2e2"}))
def test_context_with_sharding_trains_what_one_process_trains(optimizer, name, tmp_path_factory, tmp_path):
    ref_losses, ref_params = reference(tmp_path_factory, optimizer)
    parallel, world = LAYOUTS[name]
    plan = write_plan(tmp_path / f"{name}.yaml", parallel, optimizer=optimizer)
    _ok(run_worker(plan, tmp_path / "run", STEPS, world=world, timeout=600))
    assert_trains_like(tmp_path / "run", ref_losses, ref_params)


def test_context_with_fsdp_resumes_its_own_checkpoint(tmp_path):
    """C2 x F2 trains 3 steps and stops; C2 x F2 resumes from its sharded checkpoint (weights and Adam moments as
    DTensors on the (data x context, fsdp) mesh) and its steps 4-5 are one uninterrupted process's, with Adam (a
    wrongly placed moment would show)."""
    whole = write_plan(tmp_path / "whole.yaml", {}, optimizer="adamw")
    _ok(run_worker(whole, tmp_path / "uninterrupted", STEPS))
    sharded = write_plan(tmp_path / "c2f2.yaml", {"context": 2, "fsdp": 2}, optimizer="adamw")
    stopped = run_worker(sharded, tmp_path / "run", STEPS, "--checkpoint-every", "3", world=4, timeout=600,
                         env={"RACKCAST_FAIL": "0:4:step"})
    assert stopped.returncode != 0 and latest_complete(tmp_path / "run").name == "step-00000003"
    _ok(run_worker(sharded, tmp_path / "run", STEPS, "--resume", world=4, timeout=600))
    assert losses(tmp_path / "run") == pytest.approx(losses(tmp_path / "uninterrupted"), rel=1e-5)
