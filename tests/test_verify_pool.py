"""The verified ranking's speed-ups leave its results unchanged: a pool of workers that takes the next candidate as
soon as one is free keeps and applies the same candidates, in estimate order, as one process; and the simulations
it runs without a timeline (record=False) give the same figures, bit for bit, as with one."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from rackcast.plan import load_plan
from rackcast.planner.verify import verify
from rackcast.simulator.step import simulate

from conftest import PLANS

# Simulated days per candidate (estimate order) and how long each simulation takes: the slow early ones make a
# two-worker pool finish candidates out of estimate order.
ESTIMATES = [10.0, 10.1, 10.2, 10.3, 10.4, 10.5, 10.6, 11.5, 12.0, 13.0]
TRUTH = [11.0, 10.9, 10.8, 12.0, 10.7, 11.5, 10.65, 11.0, 13.0, 14.0]
DELAY_S = [0.3, 0.0, 0.2, 0.0, 0.25, 0.0, 0.0, 0.0, 0.3, 0.0]


def _simulate(i: int) -> dict:
    time.sleep(DELAY_S[i])
    return {"days": TRUTH[i], "index": i}


def _run(workers: int):
    applied = []
    v = verify(ESTIMATES, _simulate, lambda sim: sim["days"], objective="days", band=0.05, cap=9, minimum=1,
               workers=workers, on_result=lambda i, sim: applied.append((i, sim["index"], sim["days"])))
    return v, applied


def test_a_pool_that_takes_candidates_as_workers_free_keeps_and_applies_what_one_process_does():
    one, applied_one = _run(1)
    # 0..6 are simulated (the best falls to 10.65); 7: 11.5 x 0.95 = 10.925 cannot beat it.
    assert one.simulated == [0, 1, 2, 3, 4, 5, 6] and one.reason == "verified" and one.stop_index == 7
    for workers in (2, 3):
        pooled, applied = _run(workers)
        assert (pooled.simulated, pooled.stop_index, pooled.reason) == (one.simulated, one.stop_index, one.reason)
        assert applied == applied_one  # each candidate's own figures, applied in estimate order


@pytest.mark.parametrize("name,stages", [("tiny-2proc-ep.yaml", None), ("marin-535b-hero.yaml", 16)])
def test_a_step_simulated_without_its_timeline_has_the_same_figures_bit_for_bit(name, stages):
    plan = load_plan(str(PLANS / name))
    if stages:  # the hero cluster with a 16-stage pipeline: expert all-to-alls, pipeline sends, shared links
        plan = replace(plan, parallel=replace(plan.parallel, fsdp=64 // stages, expert=64 // stages, pipeline=stages))
    full, figures_only = simulate(plan, seed=0), simulate(plan, seed=0, record=False)
    assert full.timeline.slices and not figures_only.timeline.slices  # record=False did skip the timeline
    for field in ("step_time_s", "tokens_per_s", "mfu", "phases_s", "peak_memory_bytes",
                  "peak_memory_per_stage_bytes", "drop_fraction", "events", "fits"):
        assert getattr(full, field) == getattr(figures_only, field), field
