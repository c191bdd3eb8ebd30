"""Python's cyclic garbage collector in the training loop: it runs only at step boundaries, outside the timed step.

Left automatic, the collector starts whenever allocations outnumber deallocations by a threshold, and an autograd
step allocates many container objects, so generation 0-2 collections fall at arbitrary points inside a step; with
ranks synchronising several times a step, one rank's pause stalls them all. torchtitan's GarbageCollection
(https://github.com/pytorch/torchtitan/blob/main/torchtitan/tools/utils.py) disables automatic collection during
training and collects explicitly between steps. Here:

- on entry: one full collection, then gc.freeze(), so the long-lived objects built during setup (modules,
  parameters, optimizer, process groups) move to the permanent generation and no later collection rescans them;
  then gc.disable();
- before each step (`steps`): gc.collect(YOUNG_GENERATION), which frees the reference cycles the previous step and
  its bookkeeping left, and every FULL_COLLECT_EVERY steps a full collection;
- on exit, however the loop ends: gc.unfreeze() and automatic collection as it was before entry, so teardown and
  later code see the collector as usual.
Objects in a reference cycle made during a step now live until the next boundary instead of until an automatic
collection: the CPU peak-memory step (backend.memprof) collects before it measures, as it did before.
Frozen objects are invisible to gc.get_objects(); backend.memprof.live_cpu_tensors unfreezes to see them.

    from rackcast.backend.step_gc import StepBoundaryGC
    with StepBoundaryGC() as boundary:
        for step in boundary.steps(range(start, end)):
            ...  # one timed step, no automatic collection inside it
"""

from __future__ import annotations

import gc
from typing import Iterable, Iterator

YOUNG_GENERATION = 1  # generations 0 and 1: the objects made since the last boundary, not the frozen setup
OLDEST_GENERATION = 2  # a full collection (frozen objects still excluded)
FULL_COLLECT_EVERY = 1  # steps between full collections (see docs/architecture.md, "Garbage collection")


class StepBoundaryGC:
    """Automatic garbage collection off inside a `with` block, explicit collections before each step (see above)."""

    def __init__(self, full_every: int = FULL_COLLECT_EVERY):
        if full_every < 1:
            raise ValueError(f"full_every must be at least 1, not {full_every}")
        self.full_every = full_every
        self.was_enabled = True

    def __enter__(self) -> "StepBoundaryGC":
        self.was_enabled = gc.isenabled()
        gc.collect()
        gc.freeze()
        gc.disable()
        return self

    def __exit__(self, *exc) -> None:
        gc.unfreeze()
        if self.was_enabled:
            gc.enable()

    def steps(self, steps: Iterable[int]) -> Iterator[int]:
        """Each of `steps`, after the collection that precedes it (the first step's is the one on entry)."""
        for i, step in enumerate(steps):
            if i:
                gc.collect(OLDEST_GENERATION if i % self.full_every == 0 else YOUNG_GENERATION)
            yield step
