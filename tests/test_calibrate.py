"""calibrate: topology from microbenchmark figures, factor fitting (recovers known factors), the CLI paths."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import yaml

from rackcast.validation.calibration import build_topology, header_for, write_topology
from rackcast.validation.fit import NOISE, apply_factors, fit, synthetic
from rackcast.plan import load_plan
from rackcast.topologies import load_topology
from rackcast.topologies.profiles import apply_profile, load_profile
from rackcast.vocab import DEFAULT_STACK_PROFILE
from rackcast.topologies.spec import HostOpTimes

from conftest import PLANS, ROOT

RUN = ROOT / "tests" / "data" / "run-tiny-dp2-ep2"



def _plans():
    base = [load_plan(str(PLANS / f"{n}.yaml")) for n in ("tiny-1proc", "tiny-2proc-ep", "tiny-2proc-pp")]
    p0 = base[0]
    return base + [replace(p0, name="adamw", optimizer=replace(p0.optimizer, name="adamw")),
                   replace(p0, name="dense", model="tiny-dense"),
                   replace(base[1], name="mb4", batch=replace(base[1].batch, micro_batch=4)),
                   replace(base[1], name="mb1", batch=replace(base[1].batch, micro_batch=1))]


def test_fit_recovers_known_factors():
    plans = _plans()
    topo = load_topology("local-cpu")
    truth = {"gemm": 0.5, "attention": 0.6, "memory_bound": 0.7, "all_to_all": 0.6, "send_recv": 0.8,
             "comm_compute_slowdown": 0.1}
    res = fit(synthetic(plans, topo, truth), topo)
    assert res.identified["gemm"] and res.identified["all_to_all"]
    # Exact data: the prior barely moves what the measurements pin; the rest (these seven plans leave memory_bound,
    # send_recv, attention and the slowdown with posterior standard errors of 0.2 to 1) it holds towards their
    # microbenchmark values, so there the truth lies within one posterior standard error.
    for name, value in truth.items():
        if res.identified[name]:
            assert res.factors[name] == pytest.approx(value, rel=0.02), name
        elif name == "comm_compute_slowdown":
            assert abs(res.factors[name] - value) < res.std_error[name], name
        else:
            assert abs(math.log(res.factors[name] / value)) < res.std_error[name], name
    assert res.rms_after < NOISE / 10 and res.rms_after < res.rms_before / 10


def test_fit_without_the_prior_recovers_every_known_factor_from_exact_data():
    # the same design with the prior made negligible (a log-factor's prior sigma of 1000): exact data pin every
    # factor, the weakly informed ones too, as they did before the prior existed
    plans = _plans()
    topo = load_topology("local-cpu")
    truth = {"gemm": 0.5, "attention": 0.6, "memory_bound": 0.7, "all_to_all": 0.6, "send_recv": 0.8,
             "comm_compute_slowdown": 0.1}
    res = fit(synthetic(plans, topo, truth), topo, prior_sigma=1e3)
    for name, value in truth.items():
        assert res.factors[name] == pytest.approx(value, rel=0.02, abs=0.005), name
    assert res.rms_after < 1e-4 < res.rms_before


def test_step_time_alone_fits_one_overall_factor():
    plan = load_plan(str(PLANS / "tiny-1proc.yaml"))
    topo = load_topology("local-cpu")
    m = synthetic([plan], topo, {"gemm": 0.5, "attention": 0.5, "memory_bound": 0.5})[0]
    m.phases_s = {}
    res = fit([m], topo)
    assert set(res.std_error) == {"overall"}
    # the prior pulls the fitted factor towards 1 by w / (1 + w) of its log, w = (NOISE / PRIOR_SIGMA)^2: far inside
    # the noise
    assert abs(res.step_error_after[0]) < NOISE / 10 < abs(res.step_error_before[0])


def test_apply_factors_clamps_to_valid_profile():
    topo = apply_factors(load_topology("local-cpu"), {"gemm": 10.0, "all_reduce": 0.5, "comm_compute_slowdown": 2})
    assert max(p.value for p in topo.efficiency.gemm) == 1.0
    assert topo.efficiency.comm_compute_slowdown == 0.95
    base = load_topology("local-cpu").efficiency.collectives["all_reduce"].scale_up[0].value
    assert topo.efficiency.collectives["all_reduce"].scale_up[0].value == pytest.approx(base * 0.5)


def _fake_measurements() -> dict:
    # a skinny output (small n) runs slower per FLOP than a square one, as measured on CPUs
    gemm = [{"m": m, "k": k, "n": n, "flops": 2.0 * m * n * k,
             "seconds": 2.0 * m * n * k / (50e9 * (k / 1024) ** .2 * (n / 1024) ** .3)}
            for m in (128, 2048) for n in (8, 64, 1024) for k in (64, 1024)]
    coll = [{"kind": kind, "group": 2, "bytes": b, "seconds": 1e-4 + b / 2e9}
            for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_uneven", "send_recv")
            for b in (1 << 14, 1 << 20, 1 << 23)]
    return {"compute": {"dtype": "float32", "gemm": gemm,
                        "peak": [{"dtype": dt, "n": 512, "flops": 2.0 * 512 ** 3, "seconds": 2.0 * 512 ** 3 / rate}
                                 for dt, rate in (("bfloat16", 100e9), ("float32", 50e9))],
                        "grouped_gemm": [{"experts": 8, "rows": r, "n": n, "k": k, "flops_per_group": 2.0 * r * n * k,
                                          "seconds": 1e-5 + 2.0 * r * n * k / 40e9}
                                         for r in (16, 256) for n in (8, 64) for k in (8, 64)],
                        "attention": [{"batch": 1, "heads": 4, "seq": 128, "head_dim": 16, "train_flops": 1e7,
                                       "seconds": 1e-3}],
                        "attention_surface": _fake_attention_surface(),
                        "memory": [{"elements": 1 << 18, "bytes": 1 << 20, "copy_Bps": 20e9, "add_Bps": 20e9,
                                    "mix_Bps": 5e9}],
                        "memory_stream": {"elements": 1 << 24, "bytes": 1 << 26, "copy_Bps": 10e9, "add_Bps": 12e9},
                        "host_link_Bps": 8e9,
                        "speed_probe": {"samples_s": [2.5e-3, 2.4e-3, 2.7e-3], "median_s": 2.5e-3}},
            "collectives": coll, "world": 2, "quick": True, "device": "cpu", "started_utc": "2026-11-29T00:00:00+00:00",
            "wall_s": 1.0, "machine": {"torch": "x", "python": "3", "platform": "p", "cpu_count": 2,
                                       "device_name": "CPU process", "host_memory_bytes": 8 << 30}}


def _fake_attention_surface() -> list[dict]:
    """Calls on a full grid of each kind, banded ones slower per executed FLOP than causal ones (as measured here)."""
    from rackcast.simulator.attention_cost import executed_flops

    shapes = [("causal", r, q, q, d) for r in (8, 32) for q in (128, 512) for d in (16, 64)] + \
        [("banded", r, q, w, d) for r in (8, 32) for q in (128, 512) for w in (32, 64) for d in (16, 64)]
    return [{"kind": kind, "rows": r, "queries": q, "keys": w, "head_dim": d,
             "train_flops": 3 * executed_flops(kind, r, q, w, d),
             "seconds": 3 * executed_flops(kind, r, q, w, d) / ((8e9 if kind == "banded" else 20e9) * (q / 128) ** .3)}
            for kind, r, q, w, d in shapes]


def test_topology_from_measurements_round_trips(tmp_path):
    meas = _fake_measurements()
    topo, notes = build_topology(meas, load_topology("local-cpu"), "fake")
    path = tmp_path / "fake.yaml"
    write_topology(path, topo, header_for(meas, notes, "test"))
    text = path.read_text()
    assert text.startswith("# test: this machine")
    back = load_topology(str(path))
    assert back == apply_profile(topo, load_profile(DEFAULT_STACK_PROFILE))  # the loader applies the default stack
    assert back.peak_flops("bf16") == pytest.approx(100e9)
    assert back.accelerator.hbm_bandwidth_Bps == pytest.approx(12e9)
    assert back.efficiency.memory_bound == pytest.approx(5 / 12, abs=1e-3)
    assert back.scale_up.bandwidth_Bps == pytest.approx((1 << 23) / ((1e-4 + (1 << 23) / 2e9) / 2), rel=1e-3)
    assert all(0 < p.value <= 1 for p in back.efficiency.gemm)
    assert back.efficiency.speed_probe_s == 2.5e-3  # the machine-speed probe validate checks runs against
    assert len(back.efficiency.attention_surface) == len(meas["compute"]["attention_surface"])


def test_measurements_from_before_the_speed_probe_give_a_topology_without_one():
    meas = _fake_measurements()
    del meas["compute"]["speed_probe"]
    topo, notes = build_topology(meas, load_topology("local-cpu"), "fake")
    assert topo.efficiency.speed_probe_s == 0.0 and not any("speed probe" in n for n in notes)


def test_cli_from_measurement_writes_fitted_topology(tmp_path, cli):
    plan = load_plan(str(PLANS / "tiny-2proc-ep.yaml"))
    topo = load_topology("local-cpu")
    m = synthetic([plan], topo, {"gemm": 0.5, "all_to_all": 0.5})[0]
    mfile = tmp_path / "m.yaml"
    mfile.write_text(yaml.safe_dump({"plan": str(PLANS / "tiny-2proc-ep.yaml"), "step_time_s": m.step_time_s,
                                     "phases_s": {k: v for k, v in m.phases_s.items() if v}}))
    dest = tmp_path / "fitted.yaml"
    # One measurement has five quantities (step and four phases), so it pins at most that many factors: the
    # optimizer phase mixes GEMM (Newton-Schulz), memory-bound traffic and balancing's all-reduces.
    proc = cli("calibrate", "--from-measurement", str(mfile), "--out", str(dest), "--json",
               "--factors", "gemm,all_to_all,all_reduce,memory_bound")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["factors"]["gemm"] == pytest.approx(0.5, rel=0.03)
    assert res["factors"]["all_to_all"] == pytest.approx(0.5, rel=0.03)
    assert load_topology(str(dest)).efficiency.attention > 0


def test_cli_from_run_and_bad_input(tmp_path, cli):
    dest = tmp_path / "fitted.yaml"
    proc = cli("calibrate", "--from-run", str(RUN), "--out", str(dest))
    assert proc.returncode == 0, proc.stderr
    assert "Fitted efficiency factors" in proc.stdout and dest.exists()
    proc = cli("calibrate", "--from-run", str(tmp_path / "missing"))
    assert proc.returncode == 2 and "record.json" in proc.stderr


def test_calibrated_cpu_curves_price_an_fp32_gemm_at_its_measured_rate():
    # CPU calibration measures fp32 (the trainer's dtype) and stores each rate over the fp32 peak, which an fp32 plan
    # is priced against (costs.compute_peak): at a measured shape the price is the measured time.
    from rackcast.simulator import costs

    meas = _fake_measurements()
    topo, _ = build_topology(meas, load_topology("local-cpu"), "fake")
    assert topo.accelerator.peak_flops["fp32"] == pytest.approx(50e9)
    for e in meas["compute"]["gemm"]:
        shape = costs.GemmShape(e["m"], e["n"], e["k"])
        assert float(costs.gemm_time(e["flops"], shape, topo, "fp32")) == pytest.approx(e["seconds"], rel=1e-3)


@pytest.mark.slow
def test_calibrate_quick_on_this_machine(tmp_path, cli):
    dest = tmp_path / "here.yaml"
    proc = cli("calibrate", "--quick", "--out", str(dest))
    assert proc.returncode == 0, proc.stderr
    topo = load_topology(str(dest))
    assert topo.peak_flops("bf16") > 0 and topo.scale_up.bandwidth_Bps > 0 and topo.efficiency.speed_probe_s > 0
    assert dest.read_text().startswith("# rackcast calibrate --quick")
    assert load_plan(str(PLANS / "tiny-2proc-ep.yaml")).topology.name == "local-cpu"
    from rackcast.simulator.estimate import estimate

    assert estimate(load_plan(str(PLANS / "tiny-2proc-ep.yaml")), topo=topo).step_time_s > 0


def test_fit_recovers_op_overhead_with_gemm(tiny_counts):
    # The estimate includes the host per-op overhead (op counts of tiny-moe, counted once per session), so the
    # op_overhead factor scales the topology's host_op_s (all three) like any other efficiency.
    base = load_topology("local-cpu")
    topo = base.with_efficiency(replace(base.efficiency, host_op_s=HostOpTimes(5e-6, 3e-6, 2.5e-6)))
    plans = _plans()[:3] + [_plans()[5]]
    truth = {"gemm": 0.7, "op_overhead": 1.6, "all_to_all": 0.5}
    ms = synthetic(plans, topo, truth)
    res = fit(ms, topo, ["gemm", "op_overhead", "all_to_all", "memory_bound"])
    for name, value in truth.items():
        assert res.factors[name] == pytest.approx(value, rel=0.02), name
    assert res.topology.efficiency.host_op_s.forward == pytest.approx(8e-6, rel=0.02)
    assert res.topology.efficiency.host_op_s.optimizer == pytest.approx(4e-6, rel=0.02)


@pytest.mark.slow
def test_opcount_counts_the_backend_model():
    from rackcast.backend.opcount import count_ops

    c = count_ops("tiny-moe")
    spec = load_model_spec("tiny-moe")
    assert len(c["fwd_layers"]) == spec.layers and all(e > 0 for e in c["fwd_experts"])
    assert c["fwd_total"] == c["fwd_embed"] + sum(c["fwd_layers"]) + c["fwd_head"]
    assert 1.0 < c["bwd_over_fwd"] < 4.0 and c["optimizer_ops"] > 0


def load_model_spec(name):
    from rackcast.presets import load_model

    return load_model(name)


def test_the_cpu_attention_surface_grid_brackets_every_tiny_presets_attention_core():
    import torch

    from rackcast.backend.calibrate_compute import attention_surface_shapes
    from rackcast.presets import load_model
    from rackcast.simulator.attention_cost import layer_core
    from rackcast.simulator.op_counts import TABLE_MODELS

    grid = attention_surface_shapes(torch.device("cpu"), quick=False)
    for name in TABLE_MODELS:
        spec = load_model(name)
        for micro_batch in (2, 8):  # the validation plans' micro-batches, one process
            for i in range(spec.layers):
                core = layer_core(spec, i, micro_batch * spec.seq_len, 1)
                mine = [g for g in grid if g[0] == core.kind]
                for axis, value in zip(range(1, 5), (core.rows, core.queries, core.keys, core.head_dim)):
                    assert min(g[axis] for g in mine) <= value <= max(g[axis] for g in mine), (name, i, axis)


def test_the_cpu_gemm_grids_span_the_tiny_presets_widths_and_the_grouped_grid_runs_tiny_moes_experts():
    import torch

    from rackcast.backend.calibrate_compute import _shapes, surface_experts
    from rackcast.presets import load_model
    from rackcast.simulator.op_counts import TABLE_MODELS

    assert surface_experts() == load_model("tiny-moe").moe.experts
    for quick in (True, False):
        widths = _shapes(torch.device("cpu"), quick)["gemm_nk"]
        for spec in map(load_model, TABLE_MODELS):
            used = [spec.d_model, spec.vocab] + [w for w in (spec.gated_norm_rank, spec.moe and spec.moe.experts) if w]
            assert min(widths) <= min(used) and max(used) <= max(widths), (spec.name, quick)


def test_fit_weighs_a_measurement_by_its_scatter():
    # two runs of plans a gemm factor of 0.5 explains, one measured 30% slow: as precise as the other it pulls the
    # fit half-way; flagged with a scatter of 0.3 (ten times NOISE, a hundredth of the weight) it barely moves it
    plans = _plans()[:2]
    topo = load_topology("local-cpu")
    exact, slow = synthetic(plans, topo, {"gemm": 0.5})
    for m in (exact, slow):
        m.phases_s = {}
    slow.step_time_s *= 1.3

    def fitted(scatter: float) -> float:
        return fit([exact, replace(slow, scatter=scatter)], topo, ["gemm"]).factors["gemm"]

    equal, weighted = fitted(0.0), fitted(0.3)
    assert abs(math.log(weighted / 0.5)) < abs(math.log(equal / 0.5)) / 10
    assert fitted(NOISE / 2) == pytest.approx(equal)  # below NOISE a scatter counts as NOISE
