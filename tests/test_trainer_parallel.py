"""Multi-process trainer runs on gloo: every layout trains exactly what one process trains; checkpoints resume.

Each run is the real worker (`backend.train`) on the tiny MoE for a few steps, its ranks forked after one import
(backend.forkrun; torchrun's own start is tested in test_launch and test_trainer_multinode).

    .venv/bin/pytest -q tests/test_trainer_parallel.py        (about 2 minutes on 2 cores)
"""

from __future__ import annotations

import json

import pytest
import torch

from rackcast.backend.checkpoint import MARKER, complete_steps, full_model_state, latest_complete, step_dir
from trainer_helpers import assert_trains_like, losses, reference_run, run_worker, write_plan

pytestmark = pytest.mark.slow

STEPS = 2
LAYOUTS = {
    "dp2": ({"data": 2}, 2),
    "ep2": ({"data": 2, "expert": 2}, 2),
    "pp2": ({"pipeline": 2}, 2),
    "pp2-uneven": ({"pipeline": 2, "stage_layers": [3, 1]}, 2),  # parallel.stage_layers: 3 layers, then 1
    "dp2-zero1": ({"data": 2, "zero": 1}, 2),  # backend.zero: optimizer state sharded over the replicas
    "ep2xdp2-zero1": ({"data": 4, "expert": 2, "zero": 1}, 4),  # dense over 4 replicas, expert slices over 2
    "ep2xdp2": ({"data": 4, "expert": 2}, 4),
}


def _ok(result):
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, the same global batch and micro-batches, two steps."""
    d = tmp_path_factory.mktemp("ref")
    _ok(run_worker(write_plan(d / "ref.yaml", {}), d / "run", STEPS))
    return losses(d / "run"), full_model_state(latest_complete(d / "run"))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_gives_the_losses_and_parameters_of_one_process(name, reference, tmp_path):
    parallel, world = LAYOUTS[name]
    _ok(run_worker(write_plan(tmp_path / f"{name}.yaml", parallel), tmp_path / "run", STEPS, world=world))
    ref_losses, ref_params = reference
    assert losses(tmp_path / "run") == pytest.approx(ref_losses, rel=1e-6)
    params = full_model_state(latest_complete(tmp_path / "run"))
    assert params.keys() == ref_params.keys()
    for key, value in ref_params.items():  # parameters after two updates: the gradients agreed
        torch.testing.assert_close(params[key], value, atol=1e-5, rtol=1e-5, msg=key)


ZERO_BUBBLE_STEPS = 5  # the equivalence tests' length (test_trainer_fsdp's reference run, shared)


def test_zero_bubble_schedule_with_expert_parallelism_trains_what_one_process_trains(tmp_path_factory, tmp_path):
    """ep2xpp2-zb_h1: data 2 x expert 2 x pipeline 2 x virtual 2 under zb_h1 (torch's ScheduleInterleavedZeroBubble,
    weight gradients split from input gradients) with Adam on every group, 5 steps: the expert all-to-all's backward
    runs in the split passes, and the stages' static shapes (backend.pipeline) leave no first-step shape inference
    whose collectives hung."""
    ref = reference_run(tmp_path_factory, "adamw", ZERO_BUBBLE_STEPS)
    plan = write_plan(tmp_path / "ep2xpp2-zb_h1.yaml", {"data": 2, "expert": 2, "pipeline": 2, "virtual": 2},
                      optimizer="adamw", schedule="zb_h1")
    _ok(run_worker(plan, tmp_path / "run", ZERO_BUBBLE_STEPS, world=4, timeout=600))
    assert_trains_like(tmp_path / "run", losses(ref), full_model_state(latest_complete(ref)))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("full")
    _ok(run_worker(write_plan(d / "p.yaml", {}), d / "run", 6, "--checkpoint-every", "2"))
    return losses(d / "run")


def test_stop_and_resume_gives_the_uninterrupted_loss_curve(uninterrupted, tmp_path):
    plan = write_plan(tmp_path / "p.yaml", {})
    stopped = run_worker(plan, tmp_path / "run", 6, "--checkpoint-every", "2", env={"RACKCAST_FAIL": "0:3:step"})
    assert stopped.returncode != 0
    assert latest_complete(tmp_path / "run") == step_dir(tmp_path / "run", 2)
    _ok(run_worker(plan, tmp_path / "run", 6, "--checkpoint-every", "2", "--resume"))
    assert losses(tmp_path / "run") == pytest.approx(uninterrupted, rel=1e-6)


def test_a_rank_killed_while_checkpointing_resumes_from_the_last_complete_checkpoint(uninterrupted, tmp_path):
    plan = write_plan(tmp_path / "ep.yaml", {"data": 2, "expert": 2})
    run = tmp_path / "run"
    # Rank 1 dies right after writing its step-4 shard, before the barrier: step 4 is never marked complete.
    killed = run_worker(plan, run, 6, "--checkpoint-every", "2", world=2, env={"RACKCAST_FAIL": "1:3:checkpoint"})
    assert killed.returncode != 0
    assert [p.name for p in complete_steps(run)] == ["step-00000002"]
    assert not step_dir(run, 4).exists()
    _ok(run_worker(plan, run, 6, "--checkpoint-every", "2", "--resume", world=2))
    assert losses(run) == pytest.approx(uninterrupted, rel=1e-4)
    record = json.loads((run / "record.json").read_text())
    assert record["steps"] == 6 and record["world"] == 2
    # Each rank measured its own peak live tensor bytes (the resumed process profiled its last step); the record
    # keeps the largest.
    per_rank = record["peak_memory_per_rank_bytes"]
    assert len(per_rank) == 2 and all(0 < b < record["peak_rss_bytes"] for b in per_rank)
    assert record["peak_memory_bytes"] == max(per_rank)
    marker = json.loads((step_dir(run, 6) / MARKER).read_text())
    assert marker["world"] == 2 and marker["layout"]["expert"] == 2
    assert sorted(p.name for p in step_dir(run, 6).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not list((run / "checkpoints").glob(".tmp-*"))  # the half-written step-4 save was cleared
