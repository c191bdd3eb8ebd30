"""validation.fit's memory_bound factor where eager bytes are counted (efficiency.eager_bandwidth: YAML round trip,
refusals), and its log-normal prior: factors the measurements barely inform stay near their microbenchmark values
while identified ones reach the truth."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml

from rackcast.errors import RackcastError
from rackcast.plan import load_plan
from rackcast.simulator import costs
from rackcast.simulator import op_bytes as ob
from rackcast.simulator.estimate import estimate
from rackcast.simulator.host_overhead import counted_bytes, eager_bytes, host_bytes
from rackcast.simulator.step import simulate
from rackcast.topologies import load_topology
from rackcast.topologies.spec import HostOpTimes
from rackcast.validation.calibration import write_topology
from rackcast.validation.fit import apply_factors, fit, synthetic

from conftest import PLANS, ROOT

MEASURED_HOST_OPS = HostOpTimes(1e-5, 6e-6, 4e-6)  # any measured figures: they switch on counted eager bytes


def _counted_plan_and_topology():
    plan = load_plan(str(PLANS / "tiny-1proc.yaml"))  # tiny-moe, fp32, flash: run as the bytes were counted
    topo = plan.topology_spec()
    return plan, topo.with_efficiency(replace(topo.efficiency, host_op_s=MEASURED_HOST_OPS))


def test_the_memory_bound_factor_slows_the_counted_eager_bytes_in_estimate_and_simulator_alike():
    plan, topo = _counted_plan_and_topology()
    spec = plan.model_spec()
    assert counted_bytes(spec, plan, topo) is not None
    e = host_bytes(eager_bytes(ob.lookup(spec, "muonh"), spec, plan), spec, plan)
    counted_s = costs.eager_bytes_time(e.forward + e.backward + e.optimizer, topo)
    halved = apply_factors(topo, {"memory_bound": 0.5})
    base = [estimate(plan, topo=topo).step_time_s, simulate(plan, topo=topo, record=False).step_time_s]
    slow = [estimate(plan, topo=halved).step_time_s, simulate(plan, topo=halved, record=False).step_time_s]
    # half the bandwidth: the counted bytes take twice as long, so the step grows by their time once more
    assert counted_s > 0.0
    assert slow[0] - base[0] == pytest.approx(counted_s, rel=1e-6)
    assert slow[1] - base[1] == pytest.approx(counted_s, rel=1e-6)


def test_a_memory_bound_factor_above_1_lifts_eager_bandwidth_past_1_but_caps_memory_bound_at_1():
    _, topo = _counted_plan_and_topology()
    faster = apply_factors(topo, {"memory_bound": 3.0}).efficiency
    assert faster.eager_bandwidth == pytest.approx(3.0 * topo.efficiency.eager_bandwidth)
    assert faster.memory_bound == 1.0


def _topology_file(tmp_path, eager_bandwidth) -> str:
    data = yaml.safe_load((ROOT / "topologies" / "presets" / "local-cpu.yaml").read_text())
    data["efficiency"]["eager_bandwidth"] = eager_bandwidth
    path = tmp_path / "topo.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_eager_bandwidth_round_trips_through_yaml_and_defaults_to_the_measured_figure(tmp_path):
    assert load_topology("local-cpu").efficiency.eager_bandwidth == 1.0
    assert load_topology(_topology_file(tmp_path, 1.7)).efficiency.eager_bandwidth == 1.7
    topo = load_topology("local-cpu")
    out = tmp_path / "written.yaml"
    write_topology(out, topo.with_efficiency(replace(topo.efficiency, eager_bandwidth=2.5)), ["test"])
    assert load_topology(str(out)).efficiency.eager_bandwidth == 2.5


@pytest.mark.parametrize("value", [0, 0.0, -1.0])
def test_a_zero_or_negative_eager_bandwidth_is_refused_in_one_line_naming_the_field(tmp_path, value):
    with pytest.raises(RackcastError) as err:
        load_topology(_topology_file(tmp_path, value))
    line = str(err.value)
    assert "efficiency.eager_bandwidth" in line and "topo.yaml" in line and "\n" not in line


def test_a_factor_the_measurements_barely_inform_stays_near_1_while_identified_ones_reach_the_truth():
    # Seven plans, one pipelined: its p2p is a sliver of its step, so the data pin send_recv to a log standard error
    # of about 2.9 only (without the prior); the posterior's is about the prior's, and the prior holds it at 1.
    base = [load_plan(str(PLANS / f"{n}.yaml")) for n in ("tiny-1proc", "tiny-2proc-ep", "tiny-2proc-pp")]
    plans = base + [replace(base[0], name="dense", model="tiny-dense"),
                    replace(base[1], name="mb4", batch=replace(base[1].batch, micro_batch=4)),
                    replace(base[1], name="mb1", batch=replace(base[1].batch, micro_batch=1)),
                    replace(base[0], name="adamw", optimizer=replace(base[0].optimizer, name="adamw"))]
    topo = load_topology("local-cpu")
    truth = {"gemm": 0.5, "all_to_all": 0.6, "send_recv": 0.4}
    res = fit(synthetic(plans, topo, truth), topo, ["gemm", "all_to_all", "send_recv", "memory_bound"])
    assert res.identified["gemm"] and res.identified["all_to_all"]
    assert res.factors["gemm"] == pytest.approx(0.5, rel=0.01)
    assert res.factors["all_to_all"] == pytest.approx(0.6, rel=0.01)
    assert not res.identified["send_recv"] and res.std_error["send_recv"] > 0.5
    assert res.factors["send_recv"] == pytest.approx(1.0, abs=0.1)  # held at its microbenchmark value, not 0.4
    assert res.factors["memory_bound"] == pytest.approx(1.0, abs=0.1)
