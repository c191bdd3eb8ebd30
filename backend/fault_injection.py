"""Failure injection for the trainer's failure tests: RACKCAST_FAIL="RANK:STEP:WHERE" makes that rank exit
abruptly at the start of step STEP (0-based; WHERE: step) or right after writing its checkpoint shard (WHERE:
checkpoint), or hang there until killed (WHERE: stall). backend.train calls the hook at those points.

    from rackcast.backend.fault_injection import fail_hook
    fail = fail_hook(rank); fail("step", step); ...; fail("checkpoint")
"""

from __future__ import annotations

import os
import sys
import time

STALL_POLL_S = 1.0  # RACKCAST_FAIL=...:stall sleeps in steps this long until killed


def fail_hook(rank: int):
    """The hook for this rank: a no-op unless RACKCAST_FAIL names it."""
    spec = os.environ.get("RACKCAST_FAIL", "")
    if not spec:
        return lambda where, step=None: None
    f_rank, f_step, f_where = spec.split(":")
    state = {"step": -1}

    def hook(where: str, step: int | None = None):
        if step is not None:
            state["step"] = step
        if rank != int(f_rank) or state["step"] != int(f_step):
            return
        if f_where == "stall" and where == "step":
            print(f"rank {rank}: stalling on purpose at step {state['step']}", file=sys.stderr, flush=True)
            while True:
                time.sleep(STALL_POLL_S)
        if where == f_where:
            print(f"rank {rank}: failing on purpose at step {state['step']} ({where})", file=sys.stderr, flush=True)
            os._exit(17)

    return hook
