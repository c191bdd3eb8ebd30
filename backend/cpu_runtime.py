"""CPU process settings the trainer runs with, and the calibration too, so that both measure alike: torch threads
and the allocator's treatment of large freed blocks.

- Threads: one per process, however many cores are free (`--threads N` asks for more). local-cpu prices one
  process as one core, measured on one thread, and intra-op threads oversubscribe a machine that other work shares:
  every op's OpenMP barrier then waits for a descheduled thread, and the waiting threads spin. On this 2-core
  machine, shared by other runs (load 7-12), tiny-1proc took 2.5-5.9 s a step (median) on two threads against
  0.45-0.67 s on one, and 1.6-2.4 s of CPU time against 0.15 s; `aten::_grouped_mm` took 1.3-31 ms a call in its
  training step on two threads, 0.4-0.7 ms on one (README, "Why the CPU step is slower than predicted").
- Pinning: each process is pinned to its own `threads` cores (local rank r takes cores r x threads onwards, modulo
  the usable cores), so the scheduler does not migrate a measured process between cores mid-step and two processes
  never share a core while another sits idle; the trainer and the calibration pin alike.
- Large blocks: glibc malloc serves blocks above its mmap threshold (at most 32 MiB by default) with fresh mmaps, so
  every large gradient a backward allocates (an [E, d, w] expert stack's is 113 MiB at marin-ladder-d768's shape)
  page-faults in anew each step, which costs as much as the matmuls; raising the mmap and trim thresholds
  (mallopt(3): M_MMAP_THRESHOLD, M_TRIM_THRESHOLD) makes freed blocks reusable, as jemalloc or tcmalloc would.

    from rackcast.backend.cpu_runtime import configure_cpu_process
    configure_cpu_process(local_rank=0)   # or requested_threads=N to force N
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import torch

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
HEAP_BLOCK_LIMIT = 1 << 30  # blocks up to 1 GiB come from the reusable heap, not fresh mmaps
HEAP_KEEP = 1 << 31  # free heap kept before trimming back to the OS


DEFAULT_THREADS = 1  # torch threads per process, whatever the count of processes and of usable cores (see above)


def keep_freed_memory() -> bool:
    """Make glibc keep large freed blocks for reuse (see the module docstring); False where libc is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, HEAP_BLOCK_LIMIT)) and bool(mallopt(M_TRIM_THRESHOLD, HEAP_KEEP))


def pin_cores(local_rank: int, threads: int) -> list[int]:
    """Pin this process to `threads` of the usable cores, local rank r taking cores r x threads onwards (wrapping);
    returns the cores, or [] where affinity cannot be set (not Linux)."""
    try:
        usable = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return []
    cores = [usable[(local_rank * threads + i) % len(usable)] for i in range(min(threads, len(usable)))]
    os.sched_setaffinity(0, cores)
    return cores


def configure_cpu_process(requested_threads: int = 0, local_rank: int = 0) -> int:
    """Set torch's intra-op threads (requested_threads, or DEFAULT_THREADS), pin the process to that many cores
    (pin_cores) and keep freed memory; returns the threads set."""
    threads = requested_threads or DEFAULT_THREADS
    pin_cores(local_rank, threads)
    torch.set_num_threads(threads)
    keep_freed_memory()
    return threads
