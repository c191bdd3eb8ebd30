"""The attention efficiency surface: calibrate's calls priced back at their measured times, the scalar figure where a
topology has no surface, a local (banded) and a global (causal) layer of one model priced each at its own kind, the
work a banded call executes (every entry of its mask), the estimate and the simulator moving alike when the banded
kind is slower, and a malformed surface refused in one line naming the file and the field."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from rackcast.backend.attention import band_mask
from rackcast.plan import load_plan
from rackcast.presets import load_model
from rackcast.simulator import costs
from rackcast.simulator.activations import window_query_block
from rackcast.simulator.attention_cost import HW, Core, executed_pairs, layer_core, layer_kind
from rackcast.simulator.workload import Workload
from rackcast.topologies import load_topology
from rackcast.topologies.spec import AttentionPoint
from rackcast.validation.calibration import build_topology, header_for, write_topology

from test_calibrate import _fake_measurements

PLAN = Path(__file__).resolve().parent.parent / "examples" / "plans" / "tiny-1proc.yaml"


def _calibrated():
    meas = _fake_measurements()
    return meas, build_topology(meas, load_topology("local-cpu"), "fake")[0]


def _constant_surface(causal: float, banded: float) -> list[AttentionPoint]:
    return [AttentionPoint("causal", r, q, q, d, causal) for r in (4, 64) for q in (64, 1024) for d in (8, 128)] + \
        [AttentionPoint("banded", r, q, w, d, banded) for r in (4, 64) for q in (64, 1024) for w in (16, 64)
         for d in (8, 128)]


def test_the_surface_prices_every_call_calibrate_measured_at_its_measured_time():
    meas, topo = _calibrated()
    for e in meas["compute"]["attention_surface"]:
        core = Core(e["kind"], e["rows"], e["queries"], e["keys"], e["head_dim"])  # ratio 1: executed FLOPs given
        t = costs.attention_time(e["train_flops"], topo, "fp32", core)
        assert float(t) == pytest.approx(e["seconds"], rel=1e-5), e


def test_without_a_surface_every_core_is_priced_at_the_attention_figure_on_the_work_it_executes():
    _, topo = _calibrated()
    bare = topo.with_efficiency(replace(topo.efficiency, attention_surface=[]))
    spec = load_model("tiny-moe")
    peak = costs.compute_peak(bare, "fp32")
    for i in range(spec.layers):
        core = layer_core(spec, i, 2 * spec.seq_len, 1)
        assert float(costs.attention_time(1e9, bare, "fp32", core)) == \
            pytest.approx(1e9 * core.ratio / (peak * bare.efficiency.attention), rel=1e-12)
    assert float(costs.attention_time(1e9, bare, "fp32")) == pytest.approx(1e9 / (peak * bare.efficiency.attention))


def test_a_banded_call_executes_every_entry_of_banded_attentions_mask_and_a_causal_one_the_triangle():
    spec = load_model("tiny-moe")
    local = next(i for i in range(spec.layers) if layer_kind(spec, i) == "banded")
    window, seq = spec.context(local), spec.seq_len
    block = window_query_block(window)
    mask = band_mask(-(-seq // block), block, window, "cpu")
    assert executed_pairs("banded", seq, window) == mask.numel()
    assert executed_pairs("causal", seq, seq) == seq * (seq + 1) / 2
    core = layer_core(spec, local, seq, 1)
    assert core.ratio == pytest.approx(mask.numel() / seq / spec.attention_context(local, HW)) and core.ratio > 1.3
    assert layer_kind(spec, spec.layers - 1) == "causal" and layer_core(spec, spec.layers - 1, seq, 1).ratio == 1.0


def test_the_workload_prices_a_local_and_a_global_layers_core_at_their_own_kinds_efficiency():
    plan = load_plan(str(PLAN))
    spec = plan.model_spec()
    _, topo = _calibrated()
    topo = topo.with_efficiency(replace(topo.efficiency, attention_surface=_constant_surface(0.4, 0.1)))
    layers = Workload(spec, plan, topo).stages[0].chunks[0]
    tokens, peak = plan.tokens_per_microbatch(spec), costs.compute_peak(topo, plan.precision)
    kinds = {layer_kind(spec, w.index) for w in layers}
    assert kinds == {"banded", "causal"}
    for w in layers:
        core = layer_core(spec, w.index, tokens, 1)
        flops = spec.layer_flops_breakdown(w.index, HW)["attn_scores_values"] * tokens
        efficiency = 0.1 if core.kind == "banded" else 0.4
        assert w.core_s == pytest.approx(flops * core.ratio / (peak * efficiency), rel=1e-9)


def _written(tmp_path):
    meas = _fake_measurements()
    topo, notes = build_topology(meas, load_topology("local-cpu"), "fake")
    path = tmp_path / "fake.yaml"
    write_topology(path, topo, header_for(meas, notes, "test"))
    return path


def test_a_calibrated_attention_surface_round_trips_through_its_yaml(tmp_path):
    back = load_topology(str(_written(tmp_path)))
    assert back.efficiency.attention_surface == _calibrated()[1].efficiency.attention_surface
    assert {p.kind for p in back.efficiency.attention_surface} == {"causal", "banded"}


@pytest.mark.parametrize("break_it, field", [
    (lambda s: s.pop(3), "efficiency.attention_surface"),  # no longer a full grid
    (lambda s: s.__setitem__(0, dict(s[1])), "efficiency.attention_surface"),  # a shape twice
    (lambda s: s[2].__setitem__("kind", "sparse"), "efficiency.attention_surface[2].kind"),
    (lambda s: s[1].__setitem__("efficiency", 1.5), "efficiency.attention_surface[1]"),
    (lambda s: s[0].__setitem__("keys", 7), "efficiency.attention_surface[0]"),  # a causal call's keys are its queries
    (lambda s: s[0].pop("rows"), "efficiency.attention_surface[0].rows"),
])
def test_a_malformed_attention_surface_is_refused_in_one_line_naming_the_file_and_field(tmp_path, cli, break_it,
                                                                                          field):
    path = _written(tmp_path)
    data = yaml.safe_load(path.read_text())
    break_it(data["efficiency"]["attention_surface"])
    path.write_text(yaml.safe_dump(data))
    proc = cli("topologies", "show", str(path))
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1
    assert str(path) in proc.stderr and field in proc.stderr, proc.stderr


def test_the_estimate_and_the_simulator_price_a_slower_banded_kind_alike():
    from rackcast.simulator.estimate import estimate
    from rackcast.simulator.step import simulate

    plan = load_plan(str(PLAN))
    _, topo = _calibrated()
    even, slow_band = (topo.with_efficiency(replace(topo.efficiency, attention_surface=_constant_surface(0.4, b)))
                       for b in (0.4, 0.1))
    d_estimate = estimate(plan, topo=slow_band).step_time_s - estimate(plan, topo=even).step_time_s
    d_simulated = float(simulate(plan, topo=slow_band).step_time_s) - float(simulate(plan, topo=even).step_time_s)
    assert d_estimate > 0 and d_estimate == pytest.approx(d_simulated, rel=1e-6)


def test_a_stack_whose_window_kernel_skips_masked_entries_prices_a_local_core_at_its_counted_work():
    spec = load_model("marin-535b-a23b")
    local = next(i for i in range(spec.layers) if layer_kind(spec, i) == "banded")
    core = layer_core(spec, local, spec.seq_len, 1)
    assert core.ratio > 1.0  # window 2048 at sequence 4096: banded blocks hold masked entries
    eager, fused = (load_topology("gb200-nvl72", profile=name) for name in ("eager-pytorch", "megatron-te"))
    assert eager.efficiency.masked_window_work and not fused.efficiency.masked_window_work
    peak = costs.compute_peak(fused, "bf16")
    assert float(costs.attention_time(1e12, fused, "bf16", core)) == \
        pytest.approx(1e12 / (peak * fused.efficiency.attention), rel=1e-12)
    assert float(costs.attention_time(1e12, eager, "bf16", core)) == \
        pytest.approx(1e12 * core.ratio / (peak * eager.efficiency.attention), rel=1e-12)
