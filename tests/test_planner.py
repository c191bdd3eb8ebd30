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

    from rackcast.capabilities import EVERYTHING

    # Everything the estimate prices (not only what the trainer runs): these tests check the estimate and memory.
    return search(Request(model="marin-535b-a23b", topology="gb200-nvl72", racks=2, tokens=1e12, top=0,
                          simulate=False, options=SpaceOptions.coarse(capabilities=EVERYTHING)))


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


def test_refused_rows_built_on_demand_hold_their_own_layouts_memory_and_match_the_counts(small_result):
    """The refused layouts become Rows only when result.rows is read (planner.rows): every over-memory row must
    carry the memory simulator.memory gives its own layout (with the recompute and optimizer location it lists),
    must not fit, and the counts must be those of the rows."""
    from collections import Counter

    from rackcast.simulator import metrics
    from rackcast.simulator.memory import memory_breakdown
    from rackcast.topologies import load_topology

    rows = small_result.rows
    statuses = Counter(row.status for row in rows)
    counts = small_result.counts
    assert counts["enumerated"] == len(rows)
    assert {k: counts[k] for k in ("invalid", "no_fit", "ranked")} == dict(statuses)
    over = [row for row in rows if row.status == "no_fit"]
    assert over
    for row in over[:: max(1, len(over) // 12)]:
        plan = small_result.plan_for(row)
        mem = memory_breakdown(small_result.spec, plan)
        topo = load_topology(plan.topology.name, plan.topology.domains, plan.topology.usable_gpus)
        assert row.memory["total"] == pytest.approx(mem.total, rel=1e-12)
        assert row.memory["host"] == pytest.approx(mem.host, rel=1e-12)
        assert row.host_per_host == pytest.approx(metrics.host_bytes_per_host(mem.host, topo), rel=1e-12)
        assert not metrics.fits_memory(mem.total, mem.host, topo)


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
               "--start", "2026-09-01", "--deadline", "2026-11-20", "--top", "2", "--max-simulate", "2",
               "--out", str(out),
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
    proc = cli("plan", "--model", "gpt-145b", "--topology", "a100-dgx", "--racks", "1", "--tokens", "1e12")
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
    ["--tokens", "1e12", "--memory-per-gpu", "nan"],
    ["--tokens", "1e12", "--memory-per-gpu", "-1"],
    ["--tokens", "1e12", "--max-pipeline", "0"],
    ["--tokens", "1e12", "--max-tensor", "-2"],
], ids=["tokens", "range", "deadline-without-start", "objective", "usable", "memory-nan", "memory-negative",
        "max-pipeline", "max-tensor"])
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


def test_verify_rule_simulates_in_estimate_order_until_none_can_beat_the_best():
    from rackcast.planner.verify import verify

    estimates = [10.0, 10.2, 10.4, 11.0, 12.0, 20.0]  # days, best first
    truth = {0: 11.5, 1: 10.9, 2: 10.6, 3: 11.2, 4: 12.1, 5: 20.0}  # what the simulator says
    v = verify(estimates, lambda i: {"days": truth[i]}, lambda sim: sim["days"], objective="days", band=0.05,
               cap=10, minimum=1)
    # 0: 11.5; 1 (10.2 x 0.95 < 11.5) -> 10.9; 2 (9.88 < 10.9) -> 10.6; 3 (10.45 < 10.6) -> 11.2;
    # 4: 12.0 x 0.95 = 11.4 >= 10.6: stop.
    assert v.simulated == [0, 1, 2, 3] and v.stop_index == 4 and v.reason == "verified"
    capped = verify(estimates, lambda i: {"days": truth[i]}, lambda sim: sim["days"], objective="days", band=0.05,
                    cap=2, minimum=1)
    assert capped.simulated == [0, 1] and capped.reason == "cap"
    mfu = verify([0.5, 0.49, 0.40], lambda i: {"mfu": [0.45, 0.47, 0.5][i]}, lambda sim: sim["mfu"],
                 objective="mfu", band=0.05, cap=10, minimum=1)
    assert mfu.simulated == [0, 1]  # 0.40 x 1.05 = 0.42 cannot beat 0.47


def test_verified_ranking_simulates_a_candidate_whose_estimate_beats_the_best_simulated(monkeypatch):
    from rackcast.planner import search as S
    from rackcast.planner import verify as verify_module
    from rackcast.simulator.estimate import estimate

    request = S.Request(model="tiny-moe", topology="local-cpu", racks=1, tokens=1e9, top=0, simulate=False,
                        workers=1, band=0.05)
    by_estimate = S.search(request)
    favourite, runner_up = (by_estimate.plan_for(row) for row in by_estimate.ranked[:2])

    def simulator(plan):  # the simulator finds the estimate's favourite 30% slower than estimated
        est = estimate(plan)
        slow = 1.3 if plan == favourite else 1.0
        return {"step_time_s": est.step_time_s * slow, "tokens_per_s": est.tokens_per_s / slow, "mfu": est.mfu / slow,
                "peak_memory_bytes": est.memory.total, "phases_s": est.phases_s}

    monkeypatch.setattr(verify_module, "_simulate_one", simulator)
    res = S.search(replace(request, top=1, simulate=True))
    simulated = [row for row in res.ranked if row.sim]
    assert any(res.plan_for(row) == runner_up for row in simulated)  # its estimate beat the favourite's simulation
    assert res.plan_for(res.winner) != favourite and res.winner.sim
    best = min(row.sim["days"] for row in simulated)
    assert all(row.days * (1 - 0.05) >= best for row in res.ranked if not row.sim)
    assert res.ranked[:len(simulated)] == simulated  # simulated rows first, ranked by their simulated figures


def test_candidates_too_large_to_simulate_keep_their_estimate_and_the_plan_still_finishes(monkeypatch):
    from rackcast.planner import search as S
    from rackcast.simulator import step

    monkeypatch.setattr(step, "MAX_LAYER_PASSES", 1)  # every candidate is past simulate's work bound
    request = S.Request(model="tiny-moe", topology="local-cpu", racks=1, tokens=1e9, top=2, simulate=True,
                        workers=1, band=0.05)
    res = S.search(request)
    assert res.ranked and not any(row.sim for row in res.ranked)  # closed-form figures everywhere
    assert "too large to simulate keep their estimate" in res.sim_note
    assert S.predicted_for(res, res.winner).source == "estimate"


def test_default_batch_follows_the_recipe_else_the_batch_law():
    from rackcast.planner.batch import default_batch, law_batch_tokens

    gpt = default_batch(load_model("gpt-145b"), gpus=192 * 8, tokens=300e9)
    assert gpt.global_batch == 2304 and "Narayanan" in gpt.rule  # the Megatron table's recipe, not ~100 M tokens
    ladder = load_model("marin-ladder-d768")  # no recipe: the law for its compute budget
    assert not ladder.recipe.global_batch  # its recipe publishes the optimizer, not a batch
    choice = default_batch(ladder, gpus=64, tokens=1e11)
    law = law_batch_tokens(ladder.flops_per_token_train() * 1e11)
    assert choice.global_batch % 64 == 0 and 0.7 < choice.global_batch * ladder.seq_len / law < 1.42
    assert "DeepSeek LLM" in choice.rule
    bigger = default_batch(ladder, gpus=64, tokens=1e13)
    assert bigger.global_batch > choice.global_batch  # more compute, larger batch


def test_plan_from_a_measurement_fits_then_plans_in_one_command(tmp_path, cli):
    import yaml

    from conftest import PLANS
    from rackcast.topologies import load_topology
    from rackcast.validation.fit import synthetic

    measured_plan = PLANS / "tiny-2proc-ep.yaml"  # one measured run on a part of the machine
    m = synthetic([load_plan(str(measured_plan))], load_topology("local-cpu"), {"gemm": 0.5, "all_to_all": 0.5})[0]
    mfile = tmp_path / "measured.yaml"
    mfile.write_text(yaml.safe_dump({"plan": str(measured_plan), "step_time_s": m.step_time_s,
                                     "phases_s": {k: v for k, v in m.phases_s.items() if v}}))
    fitted_path = tmp_path / "fitted.yaml"
    args = ["plan", "--model", "tiny-moe", "--topology", "local-cpu", "--tokens", "1e9", "--top", "0", "--json"]
    plain = json.loads(cli(*args).stdout)
    proc = cli(*args, "--measured", str(mfile), "--fitted-topology", str(fitted_path))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["measured"]["topology"] == str(fitted_path) and fitted_path.exists()
    assert data["measured"]["fitted"] and data["measured"]["measurements"] == [f"{mfile}[0]"]
    assert abs(data["measured"]["step_error_after"][0]) < 0.01 < abs(data["measured"]["step_error_before"][0])
    assert data["topology"] == "fitted"
    # half the GEMM efficiency: the same search is slower on the fitted profile
    assert data["ranked"][0]["tokens_per_s"] < 0.9 * plain["ranked"][0]["tokens_per_s"]
    text = cli(*args[:-1], "--measured", str(mfile), "--fitted-topology", str(fitted_path)).stdout
    assert "fitted to 1 measurement(s)" in text and "gemm x" in text


def test_executor_any_searches_layouts_beyond_the_trainer_and_trainer_does_not(cli):
    # The trainer runs no ZeRO together with fsdp (rackcast.capabilities.TRAINER zero_with_fsdp), so the default
    # search never offers it; --executor any searches every layout the simulator prices, those included. Tensor
    # parallelism with fsdp or ZeRO the trainer now runs (backend.fsdp, backend.zero), so both searches offer it.
    import json

    args = ("plan", "--model", "gpt-1.7b", "--topology", "h100-hgx", "--racks", "1", "--tokens", "1e9", "--top", "0",
            "--rows", "200", "--json")
    rows = {name: json.loads(cli(*args, *extra).stdout)["ranked"] for name, extra in
            (("trainer", ()), ("any", ("--executor", "any")))}
    beyond = {name: [r for r in got if r["zero"] > 0 and r["fsdp"] > 1] for name, got in rows.items()}
    sharded_tp = {name: [r for r in got if r["tensor"] > 1 and (r["fsdp"] > 1 or r["zero"] > 0)]
                  for name, got in rows.items()}
    assert rows["trainer"] and not beyond["trainer"] and sharded_tp["trainer"]
    assert beyond["any"] and sharded_tp["any"]


def test_memory_per_gpu_fits_every_candidate_into_the_cap_and_says_so(cli):
    import json

    args = ("plan", "--model", "marin-cpu-d512", "--topology", "local-cpu", "--usable-gpus", "4", "--tokens", "1e7",
            "--global-batch", "8", "--top", "0", "--rows", "50")
    whole = json.loads(cli(*args, "--json").stdout)["ranked"]
    cap_gib = 0.15
    capped = json.loads(cli(*args, "--json", "--memory-per-gpu", str(cap_gib)).stdout)["ranked"]
    assert max(r["memory_per_gpu_bytes"] for r in whole) > cap_gib * 2**30  # the cap bites
    assert capped and all(r["memory_per_gpu_bytes"] <= cap_gib * 2**30 for r in capped)
    assert all(r["hbm_bytes"] == cap_gib * 2**30 for r in capped)
    assert capped[0]["layout"] != whole[0]["layout"]
    text = cli(*args, "--memory-per-gpu", str(cap_gib)).stdout
    assert "memory per GPU held to 0.15 GiB (memory_per_gpu)" in text


def test_max_pipeline_and_max_tensor_bound_every_ranked_layout(cli):
    args = ("plan", "--model", "marin-cpu-d512", "--topology", "local-cpu", "--usable-gpus", "4", "--tokens", "1e7",
            "--global-batch", "8", "--top", "0", "--rows", "200", "--json")
    whole = json.loads(cli(*args).stdout)["ranked"]
    assert max(r["pipeline"] for r in whole) > 1  # the bound bites
    bounded = json.loads(cli(*args, "--max-pipeline", "1", "--max-tensor", "1").stdout)["ranked"]
    assert bounded and all(r["pipeline"] == 1 and r["tensor"] == 1 for r in bounded)
