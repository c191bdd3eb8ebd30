"""How many torch threads a CPU process of the trainer (and of the calibration, so both measure alike) runs.

One thread per process when the processes fill the cores (more would oversubscribe them: on a busy 2-core machine
two threads per process made one-process steps 4-14x slower than one), else the cores shared out evenly.

    from rackcast.backend.threads import set_cpu_threads
    set_cpu_threads(processes=2)            # or requested=N to force N
"""

from __future__ import annotations

import os

import torch


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_threads(processes: int) -> int:
    """Torch threads per process for `processes` processes on this machine."""
    cores = usable_cores()
    return 1 if processes >= cores else cores // processes


def set_cpu_threads(processes: int, requested: int = 0) -> int:
    """Set torch's intra-op threads (requested, or default_threads(processes)); returns the number set."""
    threads = requested or default_threads(processes)
    torch.set_num_threads(threads)
    return threads
