"""The per-expert token-count all-to-all that blocks before every forward expert dispatch (backend.expert_parallel
sends one int64 count per expert and expert-tensor rank): its bytes (simulator.costs.count_exchange_bytes); that the
estimate and the simulator both add its closed-form time (costs.count_exchange_time) once per MoE layer per
micro-batch forward (twice under full recomputation, never without expert parallelism) as a latency of the forward
dispatch, not as a collective of its own (the simulated step runs no extra exchange); and that the trainer times it
into the exposed_expert_a2a phase.
Run: .venv/bin/pytest -q tests/test_count_exchange.py"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from conftest import PLANS
from rackcast.backend import expert_parallel
from rackcast.backend.moe import MoE, balanced_assignment
from rackcast.backend.parallel import PhaseTimer
from rackcast.plan import load_plan
from rackcast.simulator import costs
from rackcast.simulator.estimate import estimate
from rackcast.simulator.step import simulate

EP_PLAN = PLANS / "tiny-2proc-ep.yaml"  # data 2 x expert 2, 4 MoE layers, 2 micro-batches per rank


def _moe_layers(plan) -> int:
    spec = plan.model_spec()
    return sum(spec.is_moe(i) for i in range(spec.layers))


def _exchanges(plan) -> Counter:
    """Rank 0's all-to-all slices in the simulated step, by name."""
    return Counter(name for _, kind, name, *_ in simulate(plan).timeline.slices if name in ("dispatch", "combine",
                                                                                             "token counts"))


@pytest.mark.parametrize("expert_tensor", [1, 2])
def test_the_count_exchange_sends_one_int64_per_expert_and_expert_tensor_rank(expert_tensor):
    spec = load_plan(str(EP_PLAN)).model_spec()
    int64 = torch.empty(0, dtype=torch.int64).element_size()
    assert costs.count_exchange_bytes(spec, expert_tensor) == spec.moe.experts * expert_tensor * int64 == \
        8 * expert_tensor * 8  # tiny-moe: 8 experts


@pytest.mark.parametrize("recompute, forwards", [("none", 1), ("full", 2)])
def test_estimate_and_simulator_add_the_closed_form_count_exchange_once_per_layer_and_forward(monkeypatch, recompute,
                                                                                              forwards):
    plan = replace(load_plan(str(EP_PLAN)), recompute=recompute)
    par = plan.parallel
    one = float(costs.count_exchange_time(plan.topology_spec(), plan.model_spec(), par, False))
    expected = forwards * _moe_layers(plan) * plan.microbatches * one
    with_counts = estimate(plan), simulate(plan, record=False)
    monkeypatch.setattr(costs, "count_exchange_bytes", lambda spec, expert_tensor: 0.0)
    without = estimate(plan), simulate(plan, record=False)
    assert one > 0
    for a, b in zip(with_counts, without):
        assert a.step_time_s - b.step_time_s == pytest.approx(expected, rel=1e-6)


def test_the_count_exchange_adds_no_exchange_of_its_own_to_the_simulated_step(monkeypatch):
    plan = load_plan(str(EP_PLAN))
    with_counts = _exchanges(plan)
    monkeypatch.setattr(costs, "count_exchange_bytes", lambda spec, expert_tensor: 0.0)
    assert with_counts == _exchanges(plan) and with_counts["dispatch"] > 0 and with_counts["token counts"] == 0


def test_without_expert_parallelism_the_count_exchange_costs_nothing():
    base = load_plan(str(EP_PLAN))
    plan = replace(base, parallel=replace(base.parallel, expert=1))
    par = plan.parallel
    assert _moe_layers(plan) > 0
    assert costs.count_exchange_time(plan.topology_spec(), plan.model_spec(), par, False) == 0.0


class _ClockTimer(PhaseTimer):
    """A PhaseTimer whose clock advances one second per reading: each timed span is one second."""

    def __init__(self):
        super().__init__()
        self.clock = 0.0

    def now(self) -> float:
        self.clock += 1.0
        return self.clock


def test_the_trainer_times_the_count_exchange_as_expert_all_to_all(monkeypatch):
    """Run one ep=2 MoE forward in one process, each all_to_all_single standing in for a symmetric peer (it receives
    what it sends): three exchanges, the counts' and the rows' dispatch and combine, each one timed span."""
    calls = []

    def loopback(out, x, output_split_sizes=None, input_split_sizes=None, group=None):
        calls.append(x.dtype)
        out.copy_(x)

    monkeypatch.setattr(expert_parallel.dist, "all_to_all_single", loopback)
    torch.manual_seed(0)
    spec = load_plan(str(EP_PLAN)).model_spec()
    tokens, experts, top_k = 16, spec.moe.experts, spec.moe.top_k
    moe = MoE(spec)
    timer = _ClockTimer()
    [sharded] = expert_parallel.shard_experts(moe, ep_group=None, ep_rank=0, ep=2, capacity_factor=None, timer=timer)
    ids = balanced_assignment(tokens, top_k, experts)
    sharded.dispatch_compute_combine(torch.randn(tokens, spec.expert_input_dim), ids, torch.rand(tokens, top_k))
    assert calls == [torch.int64, torch.float32, torch.float32]
    assert timer.pop() == {"exposed_expert_a2a": 3.0}
