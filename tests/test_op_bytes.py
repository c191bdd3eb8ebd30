"""Eager memory traffic (backend.opcount.count_bytes, simulator.op_bytes, simulator.host_overhead): the bytes an op
reads and writes, their exact split into fixed + per-sequence parts, the packaged table against a fresh count, and
the estimate and the simulator adding the same term in place of the fused elementwise traffic."""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from rackcast.backend.opcount import _Counter, bytes_at, count_bytes  # noqa: E402
from rackcast.plan import load_plan  # noqa: E402
from rackcast.presets import load_model  # noqa: E402
from rackcast.simulator import costs  # noqa: E402
from rackcast.simulator import op_bytes as ob  # noqa: E402
from rackcast.simulator import op_counts as oc  # noqa: E402
from rackcast.simulator.estimate import estimate, plan_features  # noqa: E402
from rackcast.layout import ParallelSpec  # noqa: E402
from rackcast.simulator.host_overhead import counted_bytes, eager_bytes, host_bytes, optimizer_bytes  # noqa: E402
from rackcast.simulator.memory import rank_params  # noqa: E402
from rackcast.simulator.optimizer_cost import optimizer_traffic_bytes  # noqa: E402
from rackcast.simulator.step import simulate  # noqa: E402
from rackcast.topologies.spec import HostOpTimes  # noqa: E402

from conftest import PLANS  # noqa: E402

FP32 = 4


def _moved(fn) -> int:
    counter = _Counter(with_bytes=True)
    with counter:
        fn()
    return sum(counter.moved.values())


def test_a_mul_moves_its_two_inputs_and_its_output_a_broadcast_operand_once_views_and_matmuls_nothing():
    a, b, w = torch.randn(8, 128, 64), torch.randn(8, 128, 64), torch.randn(64)
    full = 8 * 128 * 64 * FP32
    assert _moved(lambda: a * b) == 3 * full
    assert _moved(lambda: a * w) == 2 * full + 64 * FP32  # the kernel broadcasts w: read once
    assert _moved(lambda: a * w.expand_as(a)) == 2 * full + 64 * FP32  # expanded: stride 0 over the rows, read once
    assert _moved(lambda: a.view(8 * 128, 64).transpose(0, 1)) == 0
    assert _moved(lambda: a.reshape(-1, 64) @ torch.ones(64, 32)) == 64 * 32 * FP32  # the ones' fill, not the mm


def test_an_rmsnorm_moves_what_its_eager_ops_read_and_write():
    x, weight = torch.randn(8, 128, 64), torch.ones(64)
    full, rows = 8 * 128 * 64 * FP32, 8 * 128 * FP32
    # pow (x in, x^2 out), mean (x^2 in, rows out), add eps (rows, rows), rsqrt (rows, rows), mul (x, rows -> x),
    # mul by the weight (x, weight -> x)
    expected = 2 * full + (full + rows) + 2 * rows + 2 * rows + (2 * full + rows) + (2 * full + 64 * FP32)
    assert _moved(lambda: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight) == expected


def test_bytes_at_four_sequences_are_fixed_plus_four_per_sequence():
    spec = load_model("tiny-moe")
    parts, four = count_bytes(spec, "adamw"), bytes_at(spec, "adamw", 4)
    at = lambda pair: pair[0] + 4 * pair[1]  # noqa: E731
    assert four["fwd_layers"] == [at(p) for p in parts["fwd_layers"]]
    assert (four["fwd_embed"], four["fwd_head"], four["bwd"]) == \
        (at(parts["fwd_embed"]), at(parts["fwd_head"]), at(parts["bwd"]))
    assert four["optimizer"] == parts["opt_step"] > 0


@pytest.mark.parametrize("name", oc.TABLE_MODELS)
def test_the_packaged_byte_table_matches_a_fresh_count(name):
    spec = load_model(name)
    packed = ob._table()[ob.cache_key(spec, "muonh")]
    drop = ("model", "torch")
    fresh = count_bytes(spec, "muonh")
    assert {k: v for k, v in packed.items() if k not in drop} == {k: v for k, v in fresh.items() if k not in drop}


def test_the_byte_key_includes_widths_and_seq_len():
    spec = load_model("tiny-moe")
    assert ob.cache_key(replace(spec, name="x", description=""), "muonh") == ob.cache_key(spec, "muonh")
    for other in (replace(spec, d_model=96), replace(spec, seq_len=64)):
        assert ob.cache_key(other, "muonh") != ob.cache_key(spec, "muonh")
    assert not ob.countable(load_model("marin-535b-a23b"))


@pytest.mark.parametrize("plan_file", ["tiny-1proc.yaml", "tiny-2proc-ep.yaml"])
def test_estimate_and_simulator_add_the_same_eager_bytes_in_place_of_the_fused_elementwise_term(monkeypatch,
                                                                                                plan_file):
    plan = load_plan(str(PLANS / plan_file))
    spec = plan.model_spec()
    topo = plan.topology_spec()
    topo = topo.with_efficiency(replace(topo.efficiency, host_op_s=HostOpTimes(1e-5, 6e-6, 4e-6)))
    e = host_bytes(eager_bytes(ob.lookup(spec, "muonh"), spec, plan), spec, plan)
    counted_s = costs.eager_bytes_time(e.forward + e.backward + e.optimizer, topo)
    with_bytes = [estimate(plan, topo=topo).step_time_s, simulate(plan, topo=topo, record=False).step_time_s]
    monkeypatch.setattr(ob, "lookup", lambda s, o: None)
    without = [estimate(plan, topo=topo).step_time_s, simulate(plan, topo=topo, record=False).step_time_s]
    est_delta, sim_delta = with_bytes[0] - without[0], with_bytes[1] - without[1]
    assert counted_s > 0.0 and est_delta == pytest.approx(sim_delta, rel=1e-6)
    assert est_delta < counted_s  # the fused elementwise and optimizer-update traffic went out


def test_without_measured_host_times_no_bytes_are_looked_up_and_the_fused_term_stands(monkeypatch):

    def no_lookup(*a, **k):
        raise AssertionError("eager bytes asked for without measured host_op_s")

    monkeypatch.setattr(ob, "lookup", no_lookup)
    plan = load_plan(str(PLANS / "tiny-1proc.yaml"))  # local-cpu: host_op_s not measured
    f = plan_features(plan.model_spec(), plan, plan.topology_spec())
    assert f["eager_bytes_counted"] == 0.0 and f["elementwise_bytes"] > 0.0 and f["opt_bytes"] > 0.0
    assert simulate(plan, record=False).step_time_s > 0.0


def test_expert_parallel_2_halves_the_expert_part_of_the_optimizer_bytes():
    plan = load_plan(str(PLANS / "tiny-2proc-ep.yaml"))  # data 2, expert 2, no ZeRO: dense updated on every rank
    spec = plan.model_spec()
    e = eager_bytes(ob.lookup(spec, "muonh"), spec, plan)
    one = replace(plan, parallel=ParallelSpec())
    whole = rank_params(spec, one)
    update = lambda rp: optimizer_traffic_bytes(rp, one)[0]  # noqa: E731
    expert_part = 1.0 - update(replace(whole, expert=0.0, expert_adam=0.0)) / update(whole)
    assert 0.0 < expert_part < 1.0
    replicas = replace(plan, parallel=replace(plan.parallel, expert=1))
    assert optimizer_bytes(e, spec, replicas, 0) == pytest.approx(e.opt_step, rel=1e-12)
    assert optimizer_bytes(e, spec, plan, 0) == pytest.approx(e.opt_step * (1.0 - expert_part / 2), rel=1e-12)


def test_tensor_parallel_2_halves_each_layers_eager_bytes_not_the_ends():
    plan = load_plan(str(PLANS / "tiny-1proc.yaml"))
    spec = plan.model_spec()
    tp2 = replace(plan, parallel=replace(plan.parallel, tensor=2))
    one, two = (eager_bytes(ob.lookup(spec, "muonh"), spec, p) for p in (plan, tp2))
    assert two.layers == pytest.approx([x / 2 for x in one.layers], rel=1e-12)
    assert (two.embed, two.head, two.bwd_over_fwd) == (one.embed, one.head, one.bwd_over_fwd)


def test_a_plan_not_run_as_the_bytes_were_counted_keeps_the_fused_term():
    plan = load_plan(str(PLANS / "tiny-1proc.yaml"))
    spec, topo = plan.model_spec(), plan.topology_spec()
    topo = topo.with_efficiency(replace(topo.efficiency, host_op_s=HostOpTimes(1e-5, 6e-6, 4e-6)))
    assert counted_bytes(spec, plan, topo) is not None
    for other in (replace(plan, precision="bf16"), replace(plan, attention_kernel="materialized")):
        assert counted_bytes(spec, other, topo) is None
        f = plan_features(spec, other, topo)
        assert f["eager_bytes_counted"] == 0.0 and f["eager_forward"] == 0.0 and f["elementwise_bytes"] > 0.0
