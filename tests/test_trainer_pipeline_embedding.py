"""Pipelines whose last stage reads the token embedding train what one process trains (5 steps; losses to 1e-5
relative, parameters to 1e-5 absolute): a tied output head and multi-token prediction (backend.pipeline: the last
stage's own copy of the embedding, its gradient summed with the first stage's over the embedding group; the MTP
modules on the last chunk, reading the micro-batch's tokens, their loss term scaled as the main loss).

    .venv/bin/pytest -q tests/test_trainer_pipeline_embedding.py        (about two minutes on 2 cores)
"""

from __future__ import annotations

import pytest

from rackcast.backend.checkpoint import full_model_state, latest_complete
from trainer_helpers import assert_trains_like, inline_preset, losses, reference_run, run_worker, write_plan

pytestmark = pytest.mark.slow

STEPS = 5
# Adam's eps 1e-6: tiny-dense's key bias has a zero gradient in exact arithmetic (softmax ignores a shift shared by
# all keys), so at 1e-8 Adam turns its rounding noise into steps of up to 8e-5 that differ from one process's
TIED = (inline_preset("tiny-dense", "tiny-dense-tied"), {"eps": 1e-6})  # tied embeddings, learned positions
MTP = (inline_preset("tiny-deepseek-v3", "tiny-deepseek-v3-mtp"), {})  # one MTP module, aux-loss-free balancing
CASES = {  # name: (model and optimizer fields, optimizer, parallel, processes, schedule)
    "tied-p2": (TIED, "muonh", {"pipeline": 2}, 2, "1f1b"),
    # the data-parallel average of both copies, then their sum (Adam on every group: a misscaled sum shows)
    "tied-d2p2": (TIED, "adamw", {"data": 2, "pipeline": 2}, 4, "1f1b"),
    "mtp-p2": (MTP, "muonh", {"pipeline": 2}, 2, "1f1b"),
    # split backward, and a rank holding a middle chunk besides the last (the tokens reach both stages)
    "mtp-p2v2-zb": (MTP, "muonh", {"pipeline": 2, "virtual": 2}, 2, "zb_h1"),
}


def _ok(result):
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_whose_last_stage_reads_the_embedding_trains_what_one_process_trains(name, tmp_path_factory,
                                                                                       tmp_path):
    (model, optimizer_extra), optimizer, parallel, world, schedule = CASES[name]
    fields = {"model": model, "optimizer_extra": optimizer_extra}
    ref = reference_run(tmp_path_factory, optimizer, STEPS, **fields)
    plan = write_plan(tmp_path / f"{name}.yaml", parallel, optimizer=optimizer, schedule=schedule, **fields)
    _ok(run_worker(plan, tmp_path / "run", STEPS, world=world, timeout=600))
    assert_trains_like(tmp_path / "run", losses(ref), full_model_state(latest_complete(ref)))
