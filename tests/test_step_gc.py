"""Garbage collection only at step boundaries (backend.step_gc): no automatic collection inside a step, a reference
cycle made in a step freed before the next one, the collector restored after the loop (also on an error), frozen
tensors still counted by backend.memprof, and the trainer's loop running under the policy (a cycle made in one step
freed before the next, the collector off inside each step and restored after training), with the speed probe
(backend.speed_probe) recorded for every step.

    .venv/bin/pytest -q tests/test_step_gc.py        (about 15 s on 2 cores)
"""

from __future__ import annotations

import gc
import json
import statistics
import subprocess
import sys
import weakref

import pytest
import torch

from rackcast.backend import memprof
from rackcast.backend.step_gc import StepBoundaryGC
from rackcast.backend.tiny_runs import ROOT, write_plan


class Cycle:
    def __init__(self):
        self.me = self


def _restored():
    """The collector's state as a test found it: enabled, nothing frozen."""
    gc.enable()
    gc.unfreeze()


def test_cycle_made_in_a_step_survives_allocations_in_it_and_is_freed_before_the_next():
    alive_at_step_end, alive_at_next_start, enabled_in_step = [], [], []
    ref = None
    try:
        with StepBoundaryGC() as boundary:
            for step in boundary.steps(range(4)):
                if ref is not None:
                    alive_at_next_start.append(ref() is not None)
                enabled_in_step.append(gc.isenabled())
                cycle = Cycle()
                ref = weakref.ref(cycle)
                del cycle
                junk = [[i] for i in range(10 * gc.get_threshold()[0])]  # would start automatic collections
                del junk
                alive_at_step_end.append(ref() is not None)
    finally:
        _restored()
    assert enabled_in_step == [False] * 4
    assert alive_at_step_end == [True] * 4  # no collection inside the step
    assert alive_at_next_start == [False] * 3  # the boundary collection freed it


def test_collector_is_restored_after_the_loop_and_after_an_error():
    try:
        with StepBoundaryGC() as boundary:
            for _ in boundary.steps(range(2)):
                assert gc.get_freeze_count() > 0 and not gc.isenabled()
        assert gc.isenabled() and gc.get_freeze_count() == 0
        with pytest.raises(RuntimeError), StepBoundaryGC() as boundary:
            for _ in boundary.steps(range(2)):
                raise RuntimeError("a failed step")
        assert gc.isenabled() and gc.get_freeze_count() == 0
        gc.disable()
        with StepBoundaryGC():
            pass
        assert not gc.isenabled()  # left as the caller had it
    finally:
        _restored()


def test_a_callers_own_freeze_is_kept_through_the_loop():
    try:
        gc.collect()
        gc.freeze()  # the caller's (e.g. before forking workers)
        frozen = gc.get_freeze_count()
        with StepBoundaryGC() as boundary:
            for _ in boundary.steps(range(2)):
                assert gc.get_freeze_count() == frozen and not gc.isenabled()
        assert gc.get_freeze_count() == frozen and gc.isenabled()
    finally:
        _restored()


def test_memprof_counts_the_storages_of_frozen_tensors():
    weights = torch.zeros(1 << 16)
    try:
        with StepBoundaryGC():
            assert any(t is weights for t in memprof.live_cpu_tensors())
            assert gc.get_freeze_count() > 0  # frozen again after listing
    finally:
        _restored()


SPY = """
import gc, json, sys, weakref
from rackcast.backend import train
seen, cycles = [], []
original = train.Trainer.train_step
class Cycle:
    def __init__(self):
        self.me = self
def spied(self, step):
    seen.append({"enabled": gc.isenabled(), "frozen": gc.get_freeze_count() > 0,
                 "last_step_cycle_freed": not cycles or cycles[-1]() is None})
    cycles.append(weakref.ref(Cycle()))
    return original(self, step)
train.Trainer.train_step = spied
code = train.main(sys.argv[1:])
print(json.dumps({"code": code, "steps": seen, "enabled_after": gc.isenabled(), "frozen_after": gc.get_freeze_count()}))
"""


def test_trainer_steps_run_with_automatic_collection_off_collect_between_restore_it_after_and_record_the_probe(
        tmp_path):
    plan = write_plan(tmp_path / "tiny.yaml", {})
    args = ["--plan", str(plan), "--steps", "3", "--out", str(tmp_path / "run"), "--quiet", "--threads", "1",
            "--data-dir", str(ROOT / "runs" / ".data")]
    done = subprocess.run([sys.executable, "-c", SPY, *args], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["code"] == 0
    assert seen["steps"] == [{"enabled": False, "frozen": True, "last_step_cycle_freed": True}] * 3
    assert seen["enabled_after"] and seen["frozen_after"] == 0
    record = json.loads((tmp_path / "run" / "record.json").read_text())
    assert record["peak_memory_bytes"] > 0
    import pyarrow.parquet as pq  # the speed probe, taken at every step boundary beside the collection

    rows = pq.read_table(tmp_path / "run" / "metrics.parquet").to_pylist()
    assert len(rows) == 3 and all(r["probe_s"] > 0 for r in rows)
    steady = [r["probe_s"] for r in rows[1:] if not r["memory_profiled"]]  # as record.steady_rows
    assert record["probe_s"] == statistics.median(steady) and record["fastest"]["probe_s"] in steady
