"""The memory the estimate reports and the planner's fit check use is the heaviest pipeline rank's, not rank 0's:
an uneven split (parallel.stage_layers) that loads the last stage reports the last rank, in closed form, for one Plan
and for PlanArrays alike; the planner refuses a layout whose rank 0 fits but whose last rank does not; and the
simulator's memory timeline (every rank) peaks where the estimate says."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from test_memory import GPT, gpt_plan
from rackcast.layout import ParallelSpec
from rackcast.simulator.memory import memory_breakdown, rank_params
from rackcast.simulator.plan_arrays import PlanArrays

SPLIT = [4, 4, 4, 12]  # 24 layers; the last stage holds half of them and the head (GPT ties it to the embedding)


def uneven_plan():
    return gpt_plan(parallel={"data": 2, "pipeline": 4, "stage_layers": SPLIT}, schedule="1f1b")


def test_an_uneven_split_reports_its_heaviest_rank_the_last_not_rank_0():
    plan = uneven_plan()
    ranks = [memory_breakdown(GPT, plan, rank=r) for r in range(4)]
    mem = memory_breakdown(GPT, plan)
    assert ranks[3].total > ranks[0].total  # rank 0 has 4 micro-batches in flight, but a third of rank 3's layers
    assert mem == ranks[3] == max(ranks, key=lambda m: m.total)  # the whole breakdown is rank 3's
    # Closed form of its weights: bf16 (2 bytes) x (its 12 layers + its own copy of the tied embedding + final norm).
    top = GPT.top_param_breakdown()
    held = sum(GPT.layer_params(i) for i in range(12, 24)) + top["embedding"] + top["final_norm"]
    assert mem.weights == 2 * held
    assert mem.inflight_microbatches == 1  # the last 1F1B stage runs each micro-batch's backward right away
    assert rank_params(GPT, plan, 3).layers == 12


def test_plan_arrays_pick_each_plans_heaviest_rank():
    plan = uneven_plan()
    splits = [tuple(SPLIT), (12, 4, 4, 4), ()]  # heaviest: the last rank, rank 0, rank 0 (even split)
    arrays = PlanArrays(plan, {"stage_layers": splits})
    got = memory_breakdown(GPT, arrays)
    for i, split in enumerate(splits):
        one = replace(plan, parallel=replace(plan.parallel, stage_layers=split))
        want = max((memory_breakdown(GPT, one, rank=r) for r in range(4)), key=lambda m: m.total)
        assert got.total[i] == pytest.approx(want.total, rel=1e-12)
        assert got.weights[i] == pytest.approx(want.weights, rel=1e-12)


def test_the_planner_refuses_a_layout_whose_rank_0_fits_but_whose_heaviest_rank_does_not():
    from rackcast.planner import search as S
    from rackcast.planner.space import Layout, SpaceOptions, make_plan
    from rackcast.simulator import metrics
    from rackcast.topologies import load_topology

    lay = Layout(8, ParallelSpec(data=2, pipeline=4, stage_layers=tuple(SPLIT)), 8, 1, "1f1b", "none", "hbm",
                 "dropless")
    request = S.Request(model="gpt-1.7b", topology="a100-dgx", racks=1, tokens=1e9, top=0, simulate=False,
                        workers=1, options=SpaceOptions(recompute=("none",), opt_locations=("hbm",)))
    plan = make_plan(lay, GPT.name, "a100-dgx", 1, GPT)
    rank0, heaviest = memory_breakdown(GPT, plan, rank=0).total, memory_breakdown(GPT, plan, rank=3).total
    assert rank0 < heaviest
    base = load_topology("a100-dgx", 1, 8)
    tight = replace(base, accelerator=replace(base.accelerator, hbm_bytes=(rank0 + heaviest) / 2))
    assert metrics.fits_memory(rank0, 0.0, tight)  # the old rank-0 check would have called it fitting
    fitting, over = S._memory_choices([lay], GPT, {8: tight}, request)
    assert fitting == [] and over.index.tolist() == [0]
    assert over.memory["total"][0] == pytest.approx(heaviest, rel=1e-12)
    roomy = replace(base, accelerator=replace(base.accelerator, hbm_bytes=heaviest * 1.01))
    fitting, over = S._memory_choices([lay], GPT, {8: roomy}, request)
    assert len(fitting) == 1 and len(over) == 0


def test_the_simulated_peak_over_every_rank_agrees_with_the_heaviest_rank_estimate():
    from rackcast.simulator.step import simulate

    plan = uneven_plan()
    peak = simulate(plan, seed=0, record=False).peak_memory_bytes
    heaviest, rank0 = memory_breakdown(GPT, plan).total, memory_breakdown(GPT, plan, rank=0).total
    assert abs(peak - heaviest) <= 0.02 * heaviest
    assert peak > 1.1 * rank0  # the figure it agrees with is not rank 0's
    assert np.isfinite(peak)
