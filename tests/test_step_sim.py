"""Checks of the step simulator (simulator/step.py, workload.py, stepnet.py, trace.py, results.py) and
`rackcast simulate`. Run: .venv/bin/pytest -q tests/test_step_sim.py"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from functools import lru_cache

import pyarrow.parquet as pq
import pytest

from conftest import PLANS
from rackcast.plan import BatchSpec, ExpertTransport, ParallelSpec, TopologyRef, load_plan, validate
from rackcast.simulator.estimate import estimate
from rackcast.vocab import PHASES
from rackcast.simulator.memory import memory_breakdown
from rackcast.simulator.results import result_json, write_parquet
from rackcast.simulator.step import simulate
from rackcast.simulator.trace import trace_json

EXAMPLES = sorted(p.name for p in PLANS.glob("*.yaml"))


@lru_cache(maxsize=None)
def _sim(name: str):
    """Each example plan simulated once per test session (gpt-145b-megatron: 96 micro-batches, a few seconds)."""
    plan = load_plan(str(PLANS / name))
    return plan, simulate(plan, seed=0, record=name == "marin-535b-hero.yaml")


def _small_cluster(topology: TopologyRef, parallel: ParallelSpec, batch: BatchSpec, schedule: str = "1f1b"):
    plan = replace(load_plan(str(PLANS / "tiny-4proc.yaml")), topology=topology, parallel=parallel, batch=batch,
                   schedule=schedule)
    validate(plan, plan.model_spec(), plan.topology_spec().gpus)
    return plan


def test_same_plan_and_seed_give_byte_identical_json():
    for name in ("tiny-4proc.yaml", "marin-535b-hero.yaml"):
        plan = load_plan(str(PLANS / name))
        first = result_json(simulate(plan, seed=7, record=False))
        second = result_json(simulate(plan, seed=7, record=True))
        assert first == second


@pytest.mark.parametrize("topology, parallel, batch, schedule", [
    # data replicas across 3 racks, fsdp and experts inside each
    (TopologyRef("gb200-nvl72", 3, 4), ParallelSpec(data=3, fsdp=4, expert=4), BatchSpec(24, 2), "1f1b"),
    # experts spanning two racks (NIC and spine traffic), two pipeline stages in different racks
    (TopologyRef("gb200-nvl72", 4, 2), ParallelSpec(data=2, fsdp=2, expert=4, pipeline=2), BatchSpec(16, 2), "1f1b"),
    # tensor parallelism inside a rack, experts over 4 racks
    (TopologyRef("gb200-nvl72", 4, 2), ParallelSpec(data=4, tensor=2, expert=8), BatchSpec(16, 2), "1f1b"),
    # HGX nodes: tensor, fsdp, pipeline and data parallelism together
    (TopologyRef("h100-hgx", 2, 8), ParallelSpec(data=2, tensor=2, fsdp=2, pipeline=2, expert=2), BatchSpec(16, 2),
     "gpipe"),
])
def test_symmetry_reduction_gives_the_same_step_time_as_the_full_cluster(topology, parallel, batch, schedule):
    plan = _small_cluster(topology, parallel, batch, schedule)
    reduced = simulate(plan, record=False)
    full = simulate(plan, reduce=False, record=False)
    assert reduced.step_time_s == pytest.approx(full.step_time_s, rel=1e-9)
    assert reduced.phases_s == pytest.approx(full.phases_s, rel=1e-9, abs=1e-15)
    assert reduced.peak_memory_bytes == full.peak_memory_bytes
    assert full.events > reduced.events  # the full cluster really simulated more flows


def test_reduced_simulation_cost_does_not_grow_with_data_parallel_replicas():
    hero = load_plan(str(PLANS / "marin-535b-hero.yaml"))
    counts = []
    for racks in (2, 11, 44):  # (one rack would have no cross-rack reduction at all)
        plan = replace(hero, topology=replace(hero.topology, domains=racks),
                       parallel=replace(hero.parallel, data=racks), batch=BatchSpec(racks * 1024, 16))
        counts.append(simulate(plan, record=False).events)
    # 22x the replicas, the same events but for a few flow-rate changes where the shorter 2-rack reduction ends
    # inside a compute op rather than after it (4,750 against 4,761 events)
    assert max(counts) <= 1.01 * min(counts)


@pytest.mark.parametrize("name", EXAMPLES)
def test_memory_timeline_peak_is_within_2_percent_of_the_memory_model(name):
    plan, result = _sim(name)
    model = memory_breakdown(plan.model_spec(), plan).total
    assert abs(result.peak_memory_bytes - model) <= 0.02 * model


@pytest.mark.parametrize("name", EXAMPLES)
def test_phases_sum_to_the_step_time(name):
    _, result = _sim(name)
    assert set(result.phases_s) == set(PHASES)
    assert sum(result.phases_s.values()) == pytest.approx(result.step_time_s, rel=1e-9)
    assert all(v >= -1e-12 for v in result.phases_s.values())


def test_a_single_process_plan_matches_the_closed_form_exactly():
    # No communication, no pipeline: both add the same per-layer roofline times.
    plan, result = _sim("tiny-1proc.yaml")
    assert result.step_time_s == pytest.approx(estimate(plan).step_time_s, rel=1e-9)


# The simulator differs from the closed form by design: it redoes tensor-parallel all-reduces and expert
# all-to-alls during full recomputation (the estimate counts them once), exposes the gradient reduction of the
# first layers (issued last in backward), slows only compute that overlaps a running collective, draws the
# actual most-loaded expert rank per layer instead of an expected factor, and puts the head on the last stage.
TOLERANCE = 0.25


@pytest.mark.parametrize("name", EXAMPLES)
def test_step_time_is_within_tolerance_of_the_closed_form_estimate(name):
    plan, result = _sim(name)
    est = estimate(plan)
    assert abs(result.step_time_s / est.step_time_s - 1.0) <= TOLERANCE
    assert result.mfu == pytest.approx(est.mfu * est.step_time_s / result.step_time_s, rel=1e-9)


def test_hero_trace_is_a_chrome_trace_with_processes_threads_slices_and_counters():
    _, result = _sim("marin-535b-hero.yaml")
    doc = json.loads(trace_json(result))
    events = doc["traceEvents"]
    assert isinstance(events, list) and events
    meta = [e for e in events if e["ph"] == "M"]
    assert any(e["name"] == "process_name" for e in meta)
    threads = {e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert "compute" in threads and any(t.startswith("nvlink") for t in threads) and "host link" in threads
    slices = [e for e in events if e["ph"] == "X"]
    for e in slices:
        assert {"ph", "ts", "dur", "pid", "tid", "name"} <= set(e)
        assert e["dur"] >= 0
    names = {e["name"] for e in slices}
    assert {"dispatch", "combine", "shared experts", "experts", "optimizer step"} <= names
    counters = [e for e in events if e["ph"] == "C"]
    assert any(e["name"] == "memory (GiB)" for e in counters)
    assert any("->" in e["name"] and 0.0 <= e["args"]["utilisation"] <= 1.0 + 1e-9 for e in counters)
    # No two slices of one thread overlap (Perfetto requires proper nesting).
    by_thread: dict = {}
    for e in slices:
        by_thread.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_thread.values():
        spans.sort()
        assert all(b[0] >= round(a[1], 3) for a, b in zip(spans, spans[1:]))


def test_capacity_mode_with_zipf_routing_drops_tokens_and_dropless_does_not():
    plan = load_plan(str(PLANS / "tiny-2proc-ep.yaml"))
    skew = dict(routing="zipf", zipf_s=1.2)
    capped = simulate(replace(plan, expert_transport=ExpertTransport(mode="capacity", capacity_factor=1.0, **skew)),
                      seed=3, record=False)
    dropless = simulate(replace(plan, expert_transport=ExpertTransport(mode="dropless", **skew)), seed=3,
                        record=False)
    assert capped.drop_fraction > 0.05
    assert dropless.drop_fraction == 0.0
    assert dropless.step_time_s > capped.step_time_s  # dropless waits for the hot experts' rank


def test_skewed_routing_slows_a_dropless_step():
    plan = load_plan(str(PLANS / "tiny-2proc-ep.yaml"))
    uniform = simulate(plan, record=False)
    skewed = simulate(replace(plan, expert_transport=ExpertTransport(routing="zipf", zipf_s=1.5)), record=False)
    assert skewed.step_time_s > uniform.step_time_s


def test_host_offloaded_optimizer_moves_state_over_the_host_link():
    plan, result = _sim("marin-535b-hero.yaml")
    assert result.phases_s["host_transfer"] > 0
    on_hbm = simulate(replace(plan, optimizer=replace(plan.optimizer, state_location="hbm")), record=False)
    assert on_hbm.phases_s["host_transfer"] == 0.0


def test_parquet_row_holds_the_metrics(tmp_path):
    _, result = _sim("tiny-4proc.yaml")
    path = tmp_path / "sim.parquet"
    write_parquet(result, str(path))
    row = pq.read_table(path).to_pylist()[0]
    assert row["step_time_s"] == pytest.approx(result.step_time_s)
    assert row["phase_compute_s"] == pytest.approx(result.phases_s["compute"])
    assert math.isclose(row["peak_memory_bytes"], result.peak_memory_bytes)


def test_cli_simulate_writes_json_trace_and_parquet(tmp_path, cli):
    plan = str(PLANS / "tiny-4proc.yaml")
    trace, parquet = tmp_path / "t.json", tmp_path / "m.parquet"
    proc = cli("simulate", plan, "--seed", "1", "--json", "--trace", str(trace), "--parquet", str(parquet))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["plan"] == "tiny-4proc" and data["seed"] == 1 and data["step_time_s"] > 0
    assert json.loads(trace.read_text())["traceEvents"]
    assert pq.read_table(parquet).num_rows == 1
