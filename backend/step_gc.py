"""Python's cyclic garbage collector in the training loop: it runs only at step boundaries, outside the timed step.

Left automatic, the collector starts whenever allocations outnumber deallocations by a threshold, so its
collections fall at arbitrary points inside a step; with ranks synchronising several times a step, one rank's pause
stalls them all. torchtitan's GarbageCollection
(https://github.com/pytorch/torchtitan/blob/main/torchtitan/tools/utils.py) disables automatic collection during
training and collects explicitly between steps. Here:

- on entry: one full collection, then gc.freeze(), so the long-lived objects built during setup (modules,
  parameters, optimizer, process groups) move to the permanent generation and no later collection rescans them;
  then gc.disable();
- before each step after the first (`steps`): a full collection, which frees the reference cycles the previous step
  and its bookkeeping left. Full, every step, because the frozen setup leaves it little to scan (tiny-moe: 0.07-0.09
  ms median, 0.3 ms at most, against 0.12-0.2 s steps; README, "Garbage collection between steps"). torchtitan
  collects generation 1 every gc_freq steps instead: it freezes nothing, so a full collection rescans every module;
- on exit, however the loop ends: gc.unfreeze() (unless the caller had frozen objects before entry: then its
  freeze stands and none is added) and automatic collection as it was before entry, so teardown and later code see
  the collector as usual.
Objects in a reference cycle made during a step now live until the next boundary instead of until an automatic
collection: the CPU peak-memory step (backend.memprof) collects before it measures, as it did before.
Frozen objects are invisible to gc.get_objects(); backend.memprof.live_cpu_tensors unfreezes to see them and
freezes again what is alive then (right after its own full collection), so the profiled step's survivors stay
frozen, and uncollected if they later become cyclic garbage, until the loop ends: once a run, a bounded leak.

    from rackcast.backend.step_gc import StepBoundaryGC
    with StepBoundaryGC() as boundary:
        for step in boundary.steps(range(start, end)):
            ...  # one timed step, no automatic collection inside it
"""

from __future__ import annotations

import gc
from typing import Iterable, Iterator


class StepBoundaryGC:
    """Automatic garbage collection off inside a `with` block, a full collection before each step (see above)."""

    def __init__(self):
        self.was_enabled = True
        self.froze = False

    def __enter__(self) -> "StepBoundaryGC":
        self.was_enabled = gc.isenabled()
        gc.collect()
        # A caller that froze objects itself (the freeze-before-fork pattern) keeps its freeze: it is not undone on
        # exit, and nothing is frozen on top of it.
        self.froze = gc.get_freeze_count() == 0
        if self.froze:
            gc.freeze()
        gc.disable()
        return self

    def __exit__(self, *exc) -> None:
        if self.froze:
            gc.unfreeze()
        if self.was_enabled:
            gc.enable()

    def steps(self, steps: Iterable[int]) -> Iterator[int]:
        """Each of `steps`, after the collection that precedes it (the first step's is the one on entry)."""
        for i, step in enumerate(steps):
            if i:
                gc.collect()
            yield step
