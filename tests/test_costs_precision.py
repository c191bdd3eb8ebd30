"""Compute priced at the precision a plan runs in (simulator.costs.compute_peak): an fp32 plan's GEMMs, grouped GEMMs
and attention cores at the topology's fp32 peak, bf16 at bf16, fp8 at fp8 where the topology lists it (else bf16);
the estimate and the simulator both follow it; a topology without the peak a plan needs is refused in one line;
MFU stays against the dense bf16 peak whatever the precision."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from conftest import PLANS
from rackcast.errors import RackcastError
from rackcast.plan import load_plan
from rackcast.simulator import costs
from rackcast.simulator.estimate import estimate, plan_features, step_time
from rackcast.topologies import load_topology
from rackcast.vocab import PRECISIONS

CPU = load_topology("local-cpu")
H100 = load_topology("h100-hgx")
A100 = load_topology("a100-dgx")


def test_an_fp32_gemm_takes_flops_over_the_fp32_peak_times_its_efficiency():
    shape = costs.GemmShape(512.0, 64.0, 64.0)
    flops = 2.0 * 512 * 64 * 64 * 10
    eff = float(costs.efficiency(CPU.efficiency.gemm, 2.0 * 512 * 64 * 64))
    assert float(costs.gemm_time(flops, shape, CPU, "fp32")) == pytest.approx(
        flops / (CPU.accelerator.peak_flops["fp32"] * eff), rel=1e-12)
    assert float(costs.gemm_time(flops, shape, CPU, "bf16")) == pytest.approx(
        flops / (CPU.accelerator.peak_flops["bf16"] * eff), rel=1e-12)


def test_fp32_grouped_gemm_and_attention_use_the_fp32_peak():
    shape = costs.GemmShape(128.0, 64.0, 32.0, 8.0)
    eff = float(costs.efficiency(CPU.efficiency.grouped_gemm, 2.0 * 128 * 64 * 32))
    fp32 = CPU.accelerator.peak_flops["fp32"]
    assert float(costs.grouped_gemm_time(1e9, shape, CPU, "fp32")) == pytest.approx(1e9 / (fp32 * eff), rel=1e-12)
    assert float(costs.attention_time(1e9, CPU, "fp32")) == pytest.approx(
        1e9 / (fp32 * CPU.efficiency.attention), rel=1e-12)


def test_fp8_uses_the_fp8_peak_where_listed_else_bf16():
    assert costs.compute_peak(H100, "fp8") == H100.accelerator.peak_flops["fp8"]
    assert "fp8" not in A100.accelerator.peak_flops  # A100 has no fp8 tensor cores
    assert costs.compute_peak(A100, "fp8") == A100.accelerator.peak_flops["bf16"]
    # the shape model on a GPU: an fp8 GEMM that fills whole waves runs at the ceiling of the fp8 peak
    a, ceil = H100.accelerator, H100.efficiency.gemm_ceiling
    shape = costs.GemmShape(a.tile_m * a.sms, a.tile_n * 32, 8192.0)  # 32 full waves: compute binds, not bytes
    assert float(costs.gemm_seconds(shape, H100, ceil, "fp8")) == pytest.approx(
        float(costs.gemm_seconds(shape, H100, ceil, "bf16")) / 2, rel=1e-12)


def test_fp8_keeps_attention_head_and_optimizer_products_at_bf16():
    """An fp8 recipe quantises the linear layers only (costs.unquantised): attention cores and the optimizer's
    Newton-Schulz products run at the bf16 peak, in the scalar and the estimate's array form."""
    bf16 = H100.accelerator.peak_flops["bf16"]
    assert float(costs.attention_time(1e12, H100, "fp8")) == pytest.approx(
        1e12 / (bf16 * H100.efficiency.attention), rel=1e-12)
    ns = costs.GemmShape(4096.0, 4096.0, 4096.0)
    assert float(costs.optimizer_time(0.0, 1e12, ns, H100, "fp8")) == pytest.approx(
        float(costs.optimizer_time(0.0, 1e12, ns, H100, "bf16")), rel=1e-12)
    codes = np.array([PRECISIONS.index(p) for p in ("fp8", "fp32", "bf16")])
    assert [PRECISIONS[c] for c in costs.unquantised(codes)] == ["bf16", "fp32", "bf16"]
    assert costs.unquantised("fp32") == "fp32"


def test_a_memory_bound_gemm_moves_its_operands_in_the_plans_precision():
    """The shape model's roofline: a thin GEMM (k = 16) is bound by its bytes, operands in the plan's precision and
    the output in bf16 under fp8 (costs.element_bytes, unquantised): fp32 moves twice bf16's bytes."""
    shape = costs.GemmShape(8192.0, 8192.0, 16.0)
    m, n, k = 8192.0, 8192.0, 16.0
    times = {p: float(costs.gemm_seconds(shape, H100, 1.0, p)) for p in ("fp32", "bf16", "fp8")}
    for p, (operand, out) in {"fp32": (4, 4), "bf16": (2, 2), "fp8": (1, 2)}.items():
        assert times[p] == pytest.approx(float(costs.memory_bound_time(operand * (m * k + k * n) + out * m * n, H100)),
                                         rel=1e-12)
    codes = np.array([PRECISIONS.index(p) for p in ("fp32", "bf16", "fp8")])
    assert costs.element_bytes(codes).tolist() == [4.0, 2.0, 1.0]


def test_the_estimates_precision_feature_indexes_the_peaks_elementwise():
    codes = np.array([PRECISIONS.index(p) for p in ("bf16", "fp32", "bf16")], dtype=float)
    assert costs.compute_peak(CPU, codes).tolist() == [225e9, 103e9, 225e9]


def _without_fp32(topo):
    peaks = {k: v for k, v in topo.accelerator.peak_flops.items() if k != "fp32"}
    return replace(topo, accelerator=replace(topo.accelerator, peak_flops=peaks))


def test_every_preset_lists_the_peaks_every_precision_needs():
    from rackcast.topologies import list_topologies

    for name in list_topologies():
        topo = load_topology(name)
        for precision in PRECISIONS:
            assert costs.compute_peak(topo, precision) > 0, (name, precision)


def test_a_topology_without_the_plans_peak_is_refused_in_one_line_naming_the_field():
    with pytest.raises(RackcastError) as err:
        costs.compute_peak(_without_fp32(H100), "fp32")
    text = str(err.value)
    assert "accelerator.peak_flops.fp32" in text and "h100-hgx.yaml" in text and "\n" not in text


def test_cli_refuses_an_fp32_plan_whose_topology_file_has_no_fp32_peak(tmp_path, cli):
    import yaml

    from rackcast.plan import plan_to_yaml
    from rackcast.topologies import PRESET_DIR

    data = yaml.safe_load((PRESET_DIR / "h100-hgx.yaml").read_text())
    del data["accelerator"]["peak_flops"]["fp32"]
    topo_file = tmp_path / "no-fp32.yaml"
    topo_file.write_text(yaml.safe_dump(data))
    plan = load_plan(str(PLANS / "gpt-145b-megatron.yaml"))
    bad = tmp_path / "fp32.yaml"
    bad.write_text(plan_to_yaml(replace(plan, precision="fp32", topology=replace(plan.topology, name=str(topo_file)))))
    proc = cli("estimate", str(bad))
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert err.count("\n") == 0 and "precision" in err and "accelerator.peak_flops.fp32" in err
    assert str(topo_file) in err and str(bad) in err


def test_fp32_plan_estimate_and_simulation_are_slower_than_bf16_by_the_peak_ratio_at_most():
    from rackcast.simulator.step import simulate

    fp32 = load_plan(str(PLANS / "tiny-1proc.yaml"))
    assert fp32.precision == "fp32"
    bf16 = replace(fp32, precision="bf16")
    e32, e16 = estimate(fp32), estimate(bf16)
    ratio = CPU.accelerator.peak_flops["bf16"] / CPU.accelerator.peak_flops["fp32"]
    assert e32.phases_s["compute"] > e16.phases_s["compute"]
    # compute holds GEMMs (scaled by the peak ratio) and memory-bound work (unchanged)
    assert e32.phases_s["compute"] < ratio * e16.phases_s["compute"]
    s32, s16 = simulate(fp32, record=False), simulate(bf16, record=False)
    assert s32.step_time_s > s16.step_time_s
    # MFU keeps the dense bf16 peak as denominator: the same model FLOPs in a longer step
    assert e32.mfu == pytest.approx(e16.mfu * e16.step_time_s / e32.step_time_s, rel=1e-9)


def test_step_time_reads_the_precision_from_the_features():
    plan = load_plan(str(PLANS / "tiny-1proc.yaml"))
    spec = plan.model_spec()
    f = plan_features(spec, plan, CPU)
    assert f["precision"] == PRECISIONS.index("fp32")
    as_bf16 = step_time(dict(f, precision=float(PRECISIONS.index("bf16"))), CPU)
    assert float(step_time(f, CPU)["compute"]) > float(as_bf16["compute"])
