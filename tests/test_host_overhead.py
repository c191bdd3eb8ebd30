"""Host per-op overhead (efficiency.host_op_s) in the closed-form estimate and the discrete-event simulator
(simulator.host_overhead), and reading op counts as data (simulator.op_counts). The real counts of tiny-moe come
from the session fixture `tiny_counts` (the table packaged with the simulator; the session's RACKCAST_CACHE is a
temporary folder).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from rackcast.errors import RackcastError
from rackcast.plan import load_plan
from rackcast.presets import load_model
from rackcast.simulator import op_counts as oc
from rackcast.simulator.estimate import estimate
from rackcast.simulator.host_overhead import (host_overhead, ops_per_microbatch, per_step_ops, recompute_share,
                                             step_end_ops)
from rackcast.simulator.step import simulate
from rackcast.topologies.spec import HostOpTimes

from conftest import PLANS

# Host seconds per forward, backward and optimizer op for these tests (distinct, so a term priced at the wrong one
# fails): the overhead is then most of a tiny plan's step.
T = HostOpTimes(forward=1e-5, backward=6e-6, optimizer=4e-6)
COUNTS = {"fwd_embed": 20, "fwd_layers": [300, 300, 300, 280], "fwd_experts": [80, 80, 80, 80], "fwd_head": 40,
          "bwd_over_fwd": 2.0, "optimizer_ops": 4000, "ep_fwd": 30, "ep_bwd": 10,
          "capacity_fwd": 7, "capacity_bwd": 3, "step_ops": 50, "ddp_ops": 170, "expert_reduce_ops": 36,
          "dense_reduce_ops": 310}


def _t_op(topo, t: HostOpTimes):
    return topo.with_efficiency(replace(topo.efficiency, host_op_s=t))


@pytest.fixture(autouse=True)
def _ops_alone(monkeypatch):
    """These tests price the op counts alone: the counted eager bytes (tests/test_op_bytes.py) left out."""
    from rackcast.simulator import op_bytes

    monkeypatch.setattr(op_bytes, "lookup", lambda spec, optimizer: None)


def test_host_overhead_follows_the_layout():
    one = load_plan(str(PLANS / "tiny-1proc.yaml"))
    ep = load_plan(str(PLANS / "tiny-2proc-ep.yaml"))
    pp = load_plan(str(PLANS / "tiny-2proc-pp.yaml"))
    spec = one.model_spec()
    full = (20 + 1180 + 40) * 3
    assert ops_per_microbatch(COUNTS, spec, one, 0) == full
    # grouped GEMMs: the same layer ops for half the experts, plus the dispatch path's own in each MoE layer
    assert ops_per_microbatch(COUNTS, spec, ep, 0) == full + sum(map(spec.is_moe, range(spec.layers))) * (30 + 10)
    assert ops_per_microbatch(COUNTS, spec, pp, 0) == (20 + 600) * 3
    assert ops_per_microbatch(COUNTS, spec, pp, 1) == (580 + 40) * 3
    o = host_overhead(COUNTS, spec, pp, T)
    m = pp.microbatches
    per_mb = 620 * (T.forward + 2 * T.backward)
    assert o.compute_s == pytest.approx(m * per_mb)
    assert o.bubble_s == pytest.approx((m + 1) * per_mb - o.compute_s)
    assert o.optimizer_s == pytest.approx((2000 + 25) * T.optimizer)  # half the layers: of the step's end too


@pytest.mark.parametrize("run", [estimate, simulate], ids=["estimate", "simulate"])
def test_one_process_adds_microbatches_times_ops(run, tiny_counts):
    plan = load_plan(str(PLANS / "tiny-1proc.yaml"))
    c, topo, m = tiny_counts, plan.topology_spec(), plan.microbatches
    fwd_mb = c["fwd_embed"] + sum(c["fwd_layers"]) + c["fwd_head"]  # ep = 1: all of the experts' loop
    host_mb = fwd_mb * (T.forward + c["bwd_over_fwd"] * T.backward)
    base, over = run(plan, topo=topo), run(plan, topo=_t_op(topo, T))
    assert over.phases_s["compute"] - base.phases_s["compute"] == pytest.approx(m * host_mb, rel=1e-9)
    once = (c["optimizer_ops"] + c["step_ops"]) * T.optimizer  # one process: no gradient reduction
    assert over.phases_s["optimizer"] - base.phases_s["optimizer"] == pytest.approx(once, rel=1e-9)
    assert over.phases_s["pipeline_bubble"] == pytest.approx(base.phases_s["pipeline_bubble"], abs=1e-12)
    assert over.step_time_s - base.step_time_s == pytest.approx(m * host_mb + once, rel=1e-9)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_overhead_grows_the_bubble_through_the_schedule(schedule, tiny_counts):
    plan = replace(load_plan(str(PLANS / "tiny-2proc-pp.yaml")), schedule=schedule)
    spec, topo = plan.model_spec(), plan.topology_spec()
    m, p = plan.microbatches, plan.parallel.pipeline
    worst = max(ops_per_microbatch(tiny_counts, spec, plan, s) for s in range(p)) / (1 + tiny_counts["bwd_over_fwd"])
    per_mb = worst * (T.forward + tiny_counts["bwd_over_fwd"] * T.backward)
    expected = (m + p - 1) * per_mb + per_step_ops(tiny_counts, spec, plan, 0) * T.optimizer
    est = estimate(plan, topo=_t_op(topo, T)).step_time_s - estimate(plan, topo=topo).step_time_s
    assert est == pytest.approx(expected, rel=1e-9)  # the closed form is this formula
    base = simulate(plan, topo=topo, record=False)
    over = simulate(plan, topo=_t_op(topo, T), record=False)
    # The simulator runs the schedule: the formula charges every stage the heaviest stage's ops (stage 1 holds
    # about 6% fewer than stage 0 here) and ignores how the overhead overlaps the plan's own bubble, so the
    # simulated growth lies between the formula at the lightest stage's ops and at the heaviest's (a missing term,
    # one micro-batch's ops, is 1 / (m + p - 1) = 20% of it).
    lightest = min(ops_per_microbatch(tiny_counts, spec, plan, s) for s in range(p)) / (1 + tiny_counts["bwd_over_fwd"])
    low = (m + p - 1) * lightest * (T.forward + tiny_counts["bwd_over_fwd"] * T.backward) + \
        min(per_step_ops(tiny_counts, spec, plan, s) for s in range(p)) * T.optimizer
    assert low <= over.step_time_s - base.step_time_s <= expected * (1 + 1e-9)
    assert over.phases_s["pipeline_bubble"] > base.phases_s["pipeline_bubble"]


@pytest.mark.parametrize("recompute", ["full", "selective"])
@pytest.mark.parametrize("run", [estimate, simulate], ids=["estimate", "simulate"])
def test_recomputation_reruns_its_share_of_each_layers_forward_host_ops(run, recompute, tiny_counts):
    plan = replace(load_plan(str(PLANS / "tiny-1proc.yaml")), recompute=recompute)
    spec, topo, m = plan.model_spec(), plan.topology_spec(), plan.microbatches
    share = [recompute_share(spec, plan, i) for i in range(spec.layers)]
    assert all(0.0 < s <= 1.0 for s in share) and (max(share) < 1.0) == (recompute == "selective")

    def overhead(p):
        return run(p, topo=_t_op(topo, T)).step_time_s - run(p, topo=topo).step_time_s

    rerun = m * sum(ops * s for ops, s in zip(tiny_counts["fwd_layers"], share)) * T.forward
    assert overhead(plan) - overhead(replace(plan, recompute="none")) == pytest.approx(rerun, rel=1e-9)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("run", [estimate, simulate], ids=["estimate", "simulate"])
def test_expert_parallel_adds_its_dispatch_ops_per_moe_layer_and_microbatch(run, recompute, tiny_counts,
                                                                            monkeypatch):
    """The dispatch path's counted ops (ep_fwd, ep_bwd) x host_op_s x MoE layers x micro-batches on a DP2 x EP2 plan
    (the forward's again under full recomputation, which reruns the block), capacity mode's (capacity_fwd,
    capacity_bwd) on top at any ep; nothing on dropless plans without an expert group."""
    def step(plan, counts):
        monkeypatch.setattr(oc, "op_counts", lambda spec, optimizer: {**counts, "model": spec.name})
        return run(plan, topo=_t_op(plan.topology_spec(), T)).step_time_s

    c = {**tiny_counts, "capacity_bwd": 3}  # tiny-moe's capacity cut has no backward op of its own: priced anyway
    unpriced = {**c, "ep_fwd": 0, "ep_bwd": 0, "capacity_fwd": 0, "capacity_bwd": 0}
    reruns = 2 if recompute == "full" else 1

    def added(plan, keys):
        spec = plan.model_spec()
        return plan.microbatches * sum(map(spec.is_moe, range(spec.layers))) * sum(
            reruns * c[f"{k}_fwd"] * T.forward + c[f"{k}_bwd"] * T.backward for k in keys)

    ep = replace(load_plan(str(PLANS / "tiny-2proc-ep.yaml")), recompute=recompute)
    assert ep.parallel.expert == 2 and c["ep_fwd"] > 0 and c["ep_bwd"] > 0 and c["capacity_fwd"] > 0
    assert step(ep, c) - step(ep, unpriced) == pytest.approx(added(ep, ["ep"]), rel=1e-9)
    capacity = replace(ep.expert_transport, mode="capacity")
    for plan, keys in ((replace(ep, expert_transport=capacity), ["ep", "capacity"]),
                       (replace(load_plan(str(PLANS / "tiny-1proc.yaml")), recompute=recompute,
                                expert_transport=capacity), ["capacity"])):
        assert step(plan, c) - step(plan, unpriced) == pytest.approx(added(plan, keys), rel=1e-9)
    for name in ("tiny-1proc.yaml", "tiny-2proc-pp.yaml"):
        plan = replace(load_plan(str(PLANS / name)), recompute=recompute)
        assert step(plan, c) == step(plan, unpriced)


@pytest.mark.parametrize("run", [estimate, simulate], ids=["estimate", "simulate"])
def test_the_step_end_and_the_gradient_reduction_are_priced_by_layout(run, tiny_counts, monkeypatch):
    """step_end_ops x host_op_s.optimizer: one process runs the step's end alone (balancer, zero_grad); DP2 x EP2
    adds DDP's ops and the expert gradients' flat reduction; a pipeline over data-parallel ranks (not DDP-wrapped)
    the flat dense reduction instead of DDP's, each stage its share of the layers."""
    def step(plan, counts):
        monkeypatch.setattr(oc, "op_counts", lambda spec, optimizer: {**counts, "model": spec.name})
        return run(plan, topo=_t_op(plan.topology_spec(), T)).step_time_s

    c = {**tiny_counts, **{k: COUNTS[k] for k in oc.STEP_KEYS}}
    none = {**c, **dict.fromkeys(oc.STEP_KEYS, 0)}
    one, ep, pp_dp = (load_plan(str(PLANS / name)) for name in ("tiny-1proc.yaml", "tiny-2proc-ep.yaml",
                                                                  "tiny-4proc.yaml"))
    assert step(one, c) - step(one, none) == pytest.approx(c["step_ops"] * T.optimizer, rel=1e-9)
    ddp = c["step_ops"] + c["ddp_ops"] + c["expert_reduce_ops"]
    assert step(ep, c) - step(ep, none) == pytest.approx(ddp * T.optimizer, rel=1e-9)
    assert pp_dp.parallel.pipeline == 2 and pp_dp.parallel.data == 2
    spec = pp_dp.model_spec()
    flat = [(c["step_ops"] + c["dense_reduce_ops"] + c["expert_reduce_ops"]) * len(pp_dp.rank_layers(spec, s)) /
            spec.layers for s in range(2)]
    assert [step_end_ops(c, spec, pp_dp, s) for s in range(2)] == pytest.approx(flat, rel=1e-12)
    assert step(pp_dp, c) > step(pp_dp, none)


def test_zero_overhead_changes_nothing_and_counts_nothing(monkeypatch):
    def no_count(*a, **k):
        raise AssertionError("op counts asked for without measured host_op_s")

    monkeypatch.setattr(oc, "op_counts", no_count)
    plan = load_plan(str(PLANS / "marin-535b-hero.yaml"))
    topo = plan.topology_spec()
    assert not topo.efficiency.host_op_s.measured
    est = estimate(plan, topo=_t_op(topo, HostOpTimes()))
    assert est.as_dict() == estimate(plan).as_dict()
    assert round(est.step_time_s, 3) == 9.750  # 9.7498 s since the count exchange is priced (costs.count_exchange_time)
    assert round(simulate(plan, topo=_t_op(topo, HostOpTimes()), record=False).step_time_s, 3) == 9.723


def test_counts_are_read_as_data_without_torch_or_the_backend():
    code = ("import sys; from rackcast.presets import load_model; from rackcast.simulator.op_counts import op_counts; "
            "c = op_counts(load_model('tiny-moe'), 'muonh'); "
            "assert c['optimizer_ops'] > 0 and c['model'] == 'tiny-moe'; "
            "assert 'torch' not in sys.modules and not any(m.startswith('rackcast.backend') for m in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_counts_come_from_the_packaged_table(tiny_counts, monkeypatch):
    spec = load_model("tiny-moe")
    assert len(tiny_counts["fwd_layers"]) == spec.layers and tiny_counts["optimizer_ops"] > 0
    assert oc.cache_key(spec, "muonh") in oc._table()
    assert not (oc.cache_dir() / f"{oc.cache_key(spec, 'muonh')}.json").exists()
    assert oc.cache_key(spec, "adamw") != oc.cache_key(spec, "muonh")
    assert oc.cache_key(replace(spec, layers=spec.layers - 1), "muonh") != oc.cache_key(spec, "muonh")
    monkeypatch.setattr(oc, "_MEMORY", {})
    assert oc.op_counts(spec, "muonh") == tiny_counts


def test_a_miss_is_one_line_and_stored_counts_are_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv(oc.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(oc, "_MEMORY", {})
    spec = replace(load_model("tiny-moe"), name="three", layers=3)  # a structure no preset has
    with pytest.raises(oc.OpCountsMissing) as exc:
        oc.op_counts(spec, "muonh")
    assert isinstance(exc.value, RackcastError) and "\n" not in str(exc.value) and "'three'" in str(exc.value)
    assert "--" not in str(exc.value)  # library errors name no CLI flag; the front end adds the hint
    counts = {**COUNTS, "fwd_layers": COUNTS["fwd_layers"][:3], "fwd_experts": COUNTS["fwd_experts"][:3]}
    path = oc.store(spec, "muonh", counts)  # what backend.opcount.count_into_cache writes
    assert path.parent == tmp_path / oc.CACHE_SUBDIR
    monkeypatch.setattr(oc, "_MEMORY", {})
    assert oc.op_counts(spec, "muonh") == {**counts, "model": "three"}  # from disk
    wide = replace(spec, name="wide", d_model=2 * spec.d_model,
                   attention=replace(spec.attention, head_dim=2 * spec.attention.head_dim))
    assert oc.op_counts(wide, "muonh") == {**counts, "model": "wide"}  # widths of the same structure: same counts
    with pytest.raises(RackcastError):
        oc.store(spec, "adamw", {"fwd_embed": 1})
    assert sorted(p.name for p in (tmp_path / oc.CACHE_SUBDIR).iterdir()) == [path.name]  # no temporary left


def test_the_cli_counts_a_missing_model_once_and_then_estimates(tmp_path, cli):
    """A model of one's own on a topology with measured host_op_s: the estimate names the flag that counts it (one
    line, exit 2); `rackcast calibrate --op-counts` counts its ops and eager bytes into the caches; then the estimate
    runs."""
    root = PLANS.parent.parent
    topo = tmp_path / "measured.yaml"
    topo.write_text((root / "topologies" / "presets" / "local-cpu.yaml").read_text().replace(
        "efficiency:\n", "efficiency:\n  host_op_s: {forward: 1.0e-5, backward: 6.0e-6, optimizer: 4.0e-6}\n", 1))
    model = tmp_path / "three.yaml"
    model.write_text((root / "rackcast" / "model_presets" / "tiny-moe.yaml").read_text()
                     .replace("name: tiny-moe", "name: three").replace("layers: 4", "layers: 3"))
    plan = tmp_path / "plan.yaml"
    plan.write_text((PLANS / "tiny-1proc.yaml").read_text().replace("model: tiny-moe", f"model: {model}")
                    .replace("name: local-cpu", f"name: {topo}"))
    proc = cli("estimate", str(plan), "--json")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "no op counts for model 'three'" in proc.stderr and "rackcast calibrate --op-counts" in proc.stderr
    proc = cli("calibrate", "--op-counts", str(model), "--json", timeout=1500)  # torch import + 2 counts
    assert proc.returncode == 0, proc.stderr
    written = json.loads(proc.stdout)["written"]  # both optimizers, op counts and (a small model) eager bytes
    assert sorted(w.split("/")[-2] for w in written) == ["op-bytes", "op-bytes", "op-counts", "op-counts"]
    proc = cli("estimate", str(plan), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["step_time_s"] > 0
