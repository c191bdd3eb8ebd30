"""Tensor parallelism together with expert parallelism trains what one process trains (5 steps; losses to 1e-5
relative, parameters to 1e-5 absolute), with MuonH and with Adam on every group. The expert groups fold over the tp
ranks (rackcast.layout.ParallelSpec.expert_coordinates, Megatron-Core's MoE parallel folding; the trainer's
backend.parallel.Groups.expert_mesh), each tp rank dispatching the tokens it holds through backend.expert_parallel:
- TP2 x EP2 x data 2 (4 processes): the expert group is the two tp ranks of one token rank, which route the same
  tokens without sequence parallelism, so each expert receives every token twice and its gradient, summed over the
  two expert-data replicas (the data ranks), is divided by data x tp (Layout.expert_divide);
- TP2 x EP4 x data 2 with sequence parallelism (4 processes): one expert group spans tp x data, each rank routing
  its half of the sequence; the routed experts' gradients are then no tp partial sums (backend.tensor_parallel
  leaves them out) and are divided by the token ranks only;
- TP2 x EP2 x FSDP2 (4 processes): FSDP2 shards each expert slice over the fsdp ranks holding it (the expert FSDP
  mesh's ep dim is the tp pair) and divides its reduce-scatter by fsdp x tp;
- TP2 x EP2 x data 2 under ZeRO-2 (4 processes): backend.zero reduces each expert slice's gradient to its owner
  among the expert-data replicas and divides it by Layout.expert_divide (data x tp), the dense ones by the token
  ranks;
- TP2 x EP2 x PP2 with sequence parallelism (4 processes): each stage's expert group is its tp pair, and the stages
  pass the rank's part of the sequence with static shapes (backend.pipeline.Pipeline._static_shapes; torch's
  first-step shape inference hung here, the two tp ranks' backwards entering the tp all-gather and the expert
  all-to-all in different orders).

The model is tests/test_trainer_tensor.py's (tiny-moe, eight experts, two stored KV heads on every layer, the short
convolution after K only).

    .venv/bin/pytest -q tests/test_trainer_tensor_experts.py     (10 tests: about 7 min on 2 shared cores)
"""

from __future__ import annotations

import pytest

from test_trainer_tensor import _model, _ok, reference
from trainer_helpers import assert_trains_like, optimizer_cases, run_worker, write_plan

pytestmark = pytest.mark.slow

STEPS = 5
LAYOUTS = {  # name: (parallel, processes)
    "t2e2d2": ({"tensor": 2, "expert": 2, "data": 2}, 4),  # expert groups {0, 1}, {2, 3}: the tp pairs
    "t2e4d2sp": ({"tensor": 2, "expert": 4, "data": 2, "sequence_parallel": True}, 4),  # one group: all four
    "t2e2f2": ({"tensor": 2, "expert": 2, "fsdp": 2}, 4),
    "t2e2d2z2": ({"tensor": 2, "expert": 2, "data": 2, "zero": 2}, 4),
    "t2e2p2sp": ({"tensor": 2, "expert": 2, "pipeline": 2, "sequence_parallel": True}, 4),  # tp innermost per stage
}


# Adam on every group too: each layout reduces the expert gradients a new way, and a wrong divisor scales a whole
# expert matrix's gradient, which MuonH's orthogonalised update hides
@pytest.mark.parametrize("optimizer,name", optimizer_cases(LAYOUTS, adamw_too=set(LAYOUTS)))
def test_tensor_with_experts_trains_what_one_process_trains(optimizer, name, tmp_path_factory, tmp_path):
    ref_losses, ref_params, _ = reference(tmp_path_factory, optimizer)
    parallel, world = LAYOUTS[name]
    plan = write_plan(tmp_path / f"{name}.yaml", parallel, optimizer=optimizer, model=_model())
    _ok(run_worker(plan, tmp_path / "run", STEPS, world=world, timeout=600))
    assert_trains_like(tmp_path / "run", ref_losses, ref_params)
