"""The array path of the closed form (simulator.plan_arrays: many layouts at once) against the single-plan one: the
features, the step time, the memory of every sampled layout agree to float rounding, for dense and MoE models on
GPU and CPU topologies, with every recompute level, optimizer location, transport and pipeline schedule mixed in one
batch, so the two paths cannot drift."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from rackcast.planner.space import SpaceOptions, enumerate_space, fast_spec, make_plan
from rackcast.presets import load_model
from rackcast.simulator.estimate import estimate, plan_features, step_time
from rackcast.simulator.memory import memory_breakdown
from rackcast.simulator.plan_arrays import PARALLEL_FIELDS, PlanArrays
from rackcast.topologies import load_topology

RTOL = 1e-12
CASES = [  # model, topology, domains, global batch, sample size
    ("marin-535b-a23b", "gb200-nvl72", 11, 11264, 60),
    ("deepseek-v3-class", "h100-hgx", 64, 2048, 60),
    ("llama-3.1-405b", "h100-hgx", 64, 1024, 40),
    ("tiny-moe", "local-cpu", 1, 16, 30),
]


def _sample(model: str, topology: str, domains: int, global_batch: int, k: int):
    spec = fast_spec(load_model(model))
    base = load_topology(topology, domains)
    su = base.scale_up
    layouts = enumerate_space(spec, domains, su.usable_gpus, su.domain_size,
                              SpaceOptions(global_batch=global_batch), 1e12).layouts
    rng = random.Random(0)
    picked = rng.sample(layouts, min(k, len(layouts)))
    transports = ("dropless", "capacity") if spec.moe else ("dropless",)
    picked = [replace(lay, recompute=rng.choice(("none", "selective", "full")),
                      opt_location=rng.choice(("hbm", "host")), transport=rng.choice(transports)) for lay in picked]
    plans = [make_plan(lay, spec.name, topology, domains, spec) for lay in picked]
    return spec, base, picked, plans


def _arrays(plans) -> PlanArrays:
    pars = [p.parallel for p in plans]
    columns = {k: [getattr(par, k) for par in pars] for k in PARALLEL_FIELDS}
    columns.update(usable=[p.topology.usable_gpus for p in plans], global_batch=[p.batch.global_batch for p in plans],
                   micro_batch=[p.batch.micro_batch for p in plans], schedule=[p.schedule for p in plans],
                   recompute=[p.recompute for p in plans],
                   state_location=[p.optimizer.state_location for p in plans],
                   transport=[p.expert_transport for p in plans])
    return PlanArrays(plans[0], columns)


@pytest.mark.parametrize("model,topology,domains,global_batch,k", CASES)
def test_array_features_and_step_time_equal_the_single_plan_estimate(model, topology, domains, global_batch, k):
    spec, _, layouts, plans = _sample(model, topology, domains, global_batch, k)
    assert len({(p.schedule, p.recompute, p.optimizer.state_location) for p in plans}) > 3  # a mixed batch
    # One array pass per count of GPUs used per domain, on that count's topology, as the planner prices them
    # (planner.search._closed_form_by_usable): per-GPU figures depend on it where processes time-share CPU cores.
    for usable in sorted({lay.usable for lay in layouts}):
        topo = load_topology(topology, domains, usable)
        group = [i for i, lay in enumerate(layouts) if lay.usable == usable]
        feats = plan_features(spec, _arrays([plans[i] for i in group]), topo)
        times = step_time(feats, topo)
        for j, i in enumerate(group):
            lay, plan = layouts[i], plans[i]
            one = plan_features(spec, plan, topo)
            for key, value in one.items():
                np.testing.assert_allclose(feats[key][j], value, rtol=RTOL, err_msg=f"{key} of {lay.label}")
            est = estimate(plan, spec=spec, topo=topo)
            np.testing.assert_allclose(times["step_time_s"][j], est.step_time_s, rtol=RTOL, err_msg=lay.label)
            for phase, secs in est.phases_s.items():
                np.testing.assert_allclose(times[phase][j], secs, rtol=RTOL, atol=1e-300,
                                           err_msg=f"{phase} {lay.label}")


@pytest.mark.parametrize("model,topology,domains,global_batch,k", CASES)
@pytest.mark.parametrize("activations,dtype", [("fused", None), ("eager", "fp32")])
def test_array_memory_equals_the_single_plan_breakdown(model, topology, domains, global_batch, k, activations,
                                                        dtype):
    spec, _, layouts, plans = _sample(model, topology, domains, global_batch, k)
    mem = memory_breakdown(spec, _arrays(plans), dtype, activations=activations).as_dict()
    for i, (lay, plan) in enumerate(zip(layouts, plans)):
        one = memory_breakdown(spec, plan, dtype, activations=activations).as_dict()
        for part, value in one.items():
            np.testing.assert_allclose(mem[part][i], value, rtol=RTOL, err_msg=f"{part} of {lay.label}")


def test_plan_arrays_rebuild_each_plan():
    _, _, _, plans = _sample("marin-535b-a23b", "gb200-nvl72", 11, 11264, 20)
    arrays = _arrays(plans)
    assert [arrays.plan(i) for i in range(len(plans))] == plans
    swapped = arrays.replace(recompute=["full"] * len(plans))
    assert [swapped.plan(i) for i in range(len(plans))] == [replace(p, recompute="full") for p in plans]


def test_per_key_table_of_some_rows_is_those_rows_of_the_whole_table_and_asks_only_their_keys():
    _, _, _, plans = _sample("marin-535b-a23b", "gb200-nvl72", 11, 11264, 20)
    arrays = _arrays(plans)
    fields = ("pipeline", "virtual", "schedule")
    whole = arrays.per_key_table(fields, lambda p: (p.parallel.pipeline, p.parallel.virtual, len(p.schedule)))
    rows = np.array([7, 2, 2, 11, 0])
    asked = []
    some = arrays.per_key_table(fields, lambda p: asked.append(p) or (p.parallel.pipeline, p.parallel.virtual,
                                                                      len(p.schedule)), rows)
    np.testing.assert_array_equal(some, whole[rows])
    assert len(asked) == len(set(arrays.key_index(fields)[1][rows].tolist()))  # once per key those rows have
