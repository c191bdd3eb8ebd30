"""Context-parallel layouts train what one process trains (5 steps; losses to 1e-5 relative, parameters to 1e-5
absolute), with MuonH and with Adam on every group: CP2 (each rank holds half of every sequence: K/V all-gather on
the global layer, the previous rank's window on the local ones, the short convolutions' halo, RoPE at the chunk's
offset, the loss scaled by the chunk's share of the targets) and EP2 x CP2 (the expert groups fold over the
data x context token ranks; the quantile balancer's histogram pools all of them).

    .venv/bin/pytest -q tests/test_trainer_context.py        (about three minutes on 2 cores)
"""

from __future__ import annotations

import pytest

from rackcast.backend.checkpoint import full_model_state, latest_complete
from trainer_helpers import (assert_trains_like, inline_preset, losses, optimizer_cases, reference_run, run_worker,
                             write_plan)

pytestmark = pytest.mark.slow

STEPS = 5
LAYOUTS = {
    "c2": ({"context": 2}, 2),
    "e2c2": ({"data": 2, "context": 2, "expert": 2}, 4),  # token ranks u = dp_rank x 2 + cp_rank; ep = u % 2
}


def _ok(result):
    assert result.returncode == 0, result.stderr[-3000:]


def reference(tmp_path_factory, optimizer: str):
    run = reference_run(tmp_path_factory, optimizer, STEPS)
    return losses(run), full_model_state(latest_complete(run))


# Adam too on the layout that reduces gradients over context and expert ranks together
@pytest.mark.parametrize("optimizer,name", optimizer_cases(LAYOUTS, adamw_too={"e2c2"}))
def test_context_layout_trains_what_one_process_trains(optimizer, name, tmp_path_factory, tmp_path):
    ref_losses, ref_params = reference(tmp_path_factory, optimizer)
    parallel, world = LAYOUTS[name]
    plan = write_plan(tmp_path / f"{name}.yaml", parallel, optimizer=optimizer)
    _ok(run_worker(plan, tmp_path / "run", STEPS, world=world, timeout=600))
    assert_trains_like(tmp_path / "run", ref_losses, ref_params)


def _variant(preset: str, name: str, drop: tuple = (), **moe) -> dict:
    """A preset as a plan's inline model, renamed, less the `drop` fields, with `moe` fields changed."""
    spec = inline_preset(preset, name, drop)
    spec["moe"].update(moe)
    return spec


# Adam's eps is 1e-6: at 1e-8 tiny-deepseek-v3's untied embedding rows of rare tokens (gradients near zero, summed in
# another order) moved by up to 2.8e-5 from one process's; at 1e-6 by 1.2e-6
LATENT = _variant("tiny-deepseek-v3", "tiny-deepseek-v3-no-mtp", drop=("mtp",))
# the auxiliary balancing loss's weight raised so that a loss over one part of the sequence would move the router by
# more than the tolerance
AUX = _variant("tiny-mixtral", "tiny-mixtral-aux", aux_loss_weight=0.1)
D2C2E2 = ({"data": 2, "context": 2, "expert": 2}, 4)
FEATURES = {  # name: (model, (parallel, processes))
    # latent attention: keys and values expanded per head, gathered along the sequence; RoPE on the last dims at
    # the chunk's offset (MTP left out: test_mtp_on_split_sequences_trains_what_one_process_trains runs it)
    "latent": (LATENT, D2C2E2),
    # the aux loss from the whole micro-batch's f and P: sums over the context ranks (gradients summed back)...
    "aux-loss": (AUX, D2C2E2),
    # ... or over the sequence-parallel tp ranks (gradients passed through)
    "aux-loss-t2sp": (AUX, ({"tensor": 2, "sequence_parallel": True}, 2)),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_model_feature_on_split_sequences_trains_what_one_process_trains(feature, tmp_path_factory, tmp_path):
    """Each rank holding a part of every sequence, with Adam on every group, against one process (each data rank's
    micro-batches are one process's, backend.data.TokenData.batch, so the auxiliary loss's per-micro-batch
    statistics agree too)."""
    model, (parallel, world) = FEATURES[feature]
    fields = {"model": model, "optimizer_extra": {"eps": 1e-6}}
    ref = reference_run(tmp_path_factory, "adamw", STEPS, **fields)
    plan = write_plan(tmp_path / f"{feature}.yaml", parallel, optimizer="adamw", **fields)
    _ok(run_worker(plan, tmp_path / "run", STEPS, world=world, timeout=600))
    assert_trains_like(tmp_path / "run", losses(ref), full_model_state(latest_complete(ref)))


@pytest.mark.parametrize("optimizer", ["muonh", "adamw"])
def test_mtp_on_split_sequences_trains_what_one_process_trains(optimizer, tmp_path_factory, tmp_path):
    """tiny-deepseek-v3's MTP module at D2 x C2 x EP2: each rank's lookahead takes the next context rank's first
    tokens, the last rank pads its chunk past the sequence's end (padding neither routed nor counted by the module's
    MoE layer and its aux-free bias), and each rank's MTP loss is its share of the whole sequences' targets; with
    MuonH and with Adam on every group (Adam's eps 1e-6, as for the latent run above)."""
    fields = {"model": "tiny-deepseek-v3", "optimizer_extra": {"eps": 1e-6}}
    ref = reference_run(tmp_path_factory, optimizer, STEPS, **fields)
    parallel, world = D2C2E2
    plan = write_plan(tmp_path / "mtp.yaml", parallel, optimizer=optimizer, **fields)
    _ok(run_worker(plan, tmp_path / "run", STEPS, world=world, timeout=600))
    assert_trains_like(tmp_path / "run", losses(ref), full_model_state(latest_complete(ref)))
