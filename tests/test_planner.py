"""The planner: layout search end to end through the CLI (Marin's problem, an infeasible request, bad arguments),
the vectorised ranking against the scalar estimate, memory shortcuts against simulator.memory, the model-size
families against their presets, and determinism."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pyarrow.parquet as pq
import pytest

from rackcast.layout import ParallelSpec
from rackcast.plan import load_plan
from rackcast.presets import load_model


@pytest.fixture(scope="module")
def small_result():
    from rackcast.planner.search import Request, search
    from rackcast.planner.space import SpaceOptions

    return search(Request(model="marin-535b-a23b", topology="gb200-nvl72", racks=2, tokens=1e12, top=0,
                          simulate=False, options=SpaceOptions.coarse()))


def test_vectorised_ranking_equals_scalar_estimate(small_result):
    from rackcast.simulator.estimate import estimate

    ranked = small_result.ranked
    assert {row.layout.usable for row in ranked} == {64, 72}  # both GPU counts per rack are in the sample
    sample = ranked[:: max(1, len(ranked) // 12)] + [next(r for r in ranked if r.layout.usable == 72)]
    for row in sample:
        est = estimate(small_result.plan_for(row))
        assert est.fits
        assert row.step_time_s == pytest.approx(est.step_time_s, rel=1e-12)
        assert row.tokens_per_s == pytest.approx(est.tokens_per_s, rel=1e-12)
        assert row.mfu == pytest.approx(est.mfu, rel=1e-12)
        assert row.memory["total"] == pytest.approx(est.memory.total, rel=1e-12)
        for phase, secs in est.phases_s.items():
            assert row.phases[phase] == pytest.approx(secs, rel=1e-9, abs=1e-12)


def test_ranking_is_sorted_and_rows_cover_every_status(small_result):
    days = [row.days for row in small_result.ranked]
    assert days == sorted(days)
    statuses = {row.status for row in small_result.rows}
    assert statuses == {"ranked", "invalid", "no_fit"}
    assert all(row.reason for row in small_result.rows if row.status != "ranked")


def test_host_offload_shortcut_matches_memory_breakdown():
    from rackcast.planner.search import offloaded
    from rackcast.planner.space import Layout, make_plan
    from rackcast.simulator.memory import memory_breakdown

    spec = load_model("marin-535b-a23b")
    lay = Layout(64, ParallelSpec(data=11, fsdp=64, expert=64), 11264, 4, "1f1b", "full", "hbm", "dropless")
    hbm = memory_breakdown(spec, make_plan(lay, spec.name, "gb200-nvl72", 11, spec))
    host = memory_breakdown(spec, make_plan(replace(lay, opt_location="host"), spec.name, "gb200-nvl72", 11, spec))
    assert offloaded(hbm) == host


def test_fast_spec_answers_like_the_spec():
    from rackcast.planner.space import fast_spec

    spec = load_model("marin-535b-a23b")
    fast = fast_spec(spec)
    assert fast.params_total == spec.params_total and fast.params_active == spec.params_active
    for layer in (0, 3, 47):
        assert fast.layer_param_breakdown(layer) == spec.layer_param_breakdown(layer)
        assert fast.layer_flops_breakdown(layer) == spec.layer_flops_breakdown(layer)


def test_default_global_batch_is_marins():
    from rackcast.planner.space import default_global_batch

    assert default_global_batch(load_model("marin-535b-a23b"), 64, 11) == 11264


@pytest.mark.slow
def test_plan_marin_end_to_end(tmp_path, cli):
    out, parquet = tmp_path / "plan.yaml", tmp_path / "all.parquet"
    proc = cli("plan", "--model", "marin-535b-a23b", "--topology", "gb200-nvl72", "--racks", "11", "--tokens", "18e12",
               "--start", "2026-09-01", "--deadline", "2026-11-20", "--top", "2", "--out", str(out),
               "--parquet", str(parquet), "--json", "--explain", timeout=170)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    win = data["ranked"][0]
    assert win["memory_per_gpu_bytes"] <= win["hbm_bytes"]
    plan = load_plan(str(out))  # validates against the model and topology
    assert plan.predicted is not None and plan.provenance is not None and plan.predicted.fits
    assert plan.parallel.gpus == 11 * plan.topology.usable_gpus
    assert plan.batch.global_batch == 11264 and plan.optimizer.name == "muonh"
    table = pq.read_table(parquet)
    counts = data["counts"]
    assert table.num_rows == counts["enumerated"] >= counts["ranked"] >= 1000
    status = table.column("status").to_pylist()
    assert status.count("ranked") == counts["ranked"] and status.count("no_fit") == counts["no_fit"]
    assert any(line.startswith("Rejected by memory") for line in data["explain"])
    assert any("deadline" in line for line in data["explain"])


def test_infeasible_request_exits_2_with_the_tightest_constraint(cli):
    proc = cli("plan", "--model", "gpt-1t", "--topology", "a100-dgx", "--racks", "1", "--tokens", "1e12")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and proc.stdout == ""
    assert "nothing fits" in lines[0] and "GiB HBM" in lines[0] and "nodes" in lines[0]


@pytest.mark.parametrize("args", [
    ["--tokens", "lots"],
    ["--tokens", "1e12", "--global-batch-range", "9:3"],
    ["--tokens", "1e12", "--deadline", "2026-11-20"],
    ["--tokens", "1e12", "--objective", "speed"],
    ["--tokens", "1e12", "--usable-gpus", "80"],
], ids=["tokens", "range", "deadline-without-start", "objective", "usable"])
def test_bad_argument_exits_2_with_one_line(args, cli):
    proc = cli("plan", "--model", "marin-535b-a23b", "--topology", "gb200-nvl72", "--racks", "11", *args)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "error" in proc.stderr


def test_plan_output_is_deterministic(tmp_path, cli):
    args = ["plan", "--model", "tiny-moe", "--topology", "local-cpu", "--tokens", "1e9", "--top", "0", "--json"]
    first, second = cli(*args), cli(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout


def test_marin_family_reproduces_the_presets_and_the_reference_sizing():
    from rackcast.planner.size import marin_shapes, one_domain_replica
    from rackcast.planner.space import SpaceOptions
    from rackcast.topologies import load_topology

    shapes = {s.name: s for s in marin_shapes()}
    hbm = load_topology("gb200-nvl72").accelerator.hbm_bytes
    opts = SpaceOptions.coarse(usable=(64,))
    for preset in ("marin-535b-a23b", "marin-d6144-e128k4", "marin-d6144-e256k4"):
        ref = load_model(preset)
        shape = shapes[f"marin-moe-d6144-e{ref.moe.experts}k{ref.moe.top_k}"]
        assert shape.params_total == ref.params_total and shape.params_active == ref.params_active
    assert shapes["marin-moe-d5120-e128k4"].params_total == load_model("marin-d5120-e128k4").params_total
    mem = {name: one_domain_replica(shapes[name], "gb200-nvl72", 11, opts)[0]
           for name in ("marin-moe-d6144-e128k4", "marin-moe-d6144-e384k8", "marin-moe-d6144-e256k4")}
    assert mem["marin-moe-d6144-e128k4"] < mem["marin-moe-d6144-e384k8"] < hbm < mem["marin-moe-d6144-e256k4"]


def test_size_dense_gpt_through_the_cli(cli):
    proc = cli("size", "--family", "dense-gpt", "--topology", "a100-dgx", "--racks", "8", "--tokens", "300e9",
               "--top", "1", "--json", timeout=170)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    shapes = {s["shape"]: s for s in data["shapes"]}
    assert not shapes["dense-gpt-d25600-l128"]["fits"] and "nothing fits" in shapes["dense-gpt-d25600-l128"]["reason"]
    fitting = [s for s in data["shapes"] if s["fits"]]
    assert fitting and all(s["days"] > 0 and not math.isnan(s["days"]) for s in fitting)
    assert data["pareto_front"] and all(shapes[n]["pareto"] for n in data["pareto_front"])
    assert sum(s["simulated"] for s in fitting) <= 1


def test_global_batch_range_tries_several_batches(cli):
    proc = cli("plan", "--model", "tiny-moe", "--topology", "local-cpu", "--tokens", "1e9", "--top", "0",
               "--global-batch-range", "8:64", "--json", "--rows", "400")
    assert proc.returncode == 0, proc.stderr
    batches = {row["global_batch"] for row in json.loads(proc.stdout)["ranked"]}
    assert len(batches) > 1 and all(8 <= b <= 64 for b in batches)
