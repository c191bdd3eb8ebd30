"""Peak bytes of live tensors during one call, on the CPU, with torch's profiler (what backend.train records on CPU).

On CUDA torch.cuda.max_memory_allocated answers this; the CPU allocator keeps no such statistic, and the process's
peak resident set (ru_maxrss) is dominated by the torch libraries and allocator slack. So:

    peak = bytes live when profiling starts + the running maximum of the bytes allocated (net of frees) since then

- The second term comes from the profiler's memory events (`profile_memory=True`): every c10 CPU allocation and
  free made while profiling is on is one "[memory]" event whose nbytes is signed (+ allocation, - free). Their
  running sum is the chrome trace's "Total Allocated" less its value at the start; summing the events ourselves
  rather than reading "Total Allocated" keeps the figure right when an earlier profiling session left blocks in the
  allocator's size table (their later frees lower the total, as they should). Frees of blocks allocated before any
  profiling are not reported by torch (it does not know their size), so the running sum can only over-count after
  such a free; measure a step in which the long-lived tensors stay alive (see backend.train).
- The first term is the bytes of the unique storages of every CPU tensor Python can reach (`gc.get_objects()`:
  parameters, gradients, optimizer state, module buffers, caches such as RoPE tables and attention masks, pipeline
  receive buffers), plus storages held only by C++ objects that the caller names (`extra`, as (address, bytes):
  DDP's gradient buckets, see backend.parallel).
The profiler used is torch.autograd.profiler.profile(use_kineto=True), the object torch.profiler.profile wraps for
CPU activity; calling it directly avoids torch.profiler's import of torch._inductor (about a second, once).

    from rackcast.backend.memprof import profile_peak
    result, peak = profile_peak(fn, *args)       # peak.total_bytes, peak.base_bytes, peak.step_bytes
    .venv/bin/pytest -q tests/test_memprof.py
"""

from __future__ import annotations

import gc
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import Tensor

MEMORY_EVENT = "[memory]"  # the profiler's name for allocation and free events


@dataclass(frozen=True)
class PeakMeasurement:
    base_bytes: int  # live tensor storages when profiling started
    step_bytes: int  # the running maximum of net allocations while profiling
    events: int  # memory events seen

    @property
    def total_bytes(self) -> int:
        return self.base_bytes + self.step_bytes


def _storage(t: Tensor) -> tuple[int, int] | None:
    """(data pointer, bytes) of t's storage, or None for tensors without one on the CPU (meta, sparse, ...)."""
    try:
        if t.device.type != "cpu" or t.layout != torch.strided:
            return None
        s = t.untyped_storage()
        return (s.data_ptr(), s.nbytes()) if s.data_ptr() else None
    except (RuntimeError, NotImplementedError):  # storage-less tensor types
        return None


def storage_bytes(tensors: Iterable[Tensor], extra: Iterable[tuple[int, int]] = ()) -> int:
    """Bytes of the unique storages behind `tensors` and the (address, bytes) storages in `extra` (views and shared
    storages counted once)."""
    seen: dict[int, int] = {}
    for st in [_storage(t) for t in tensors] + list(extra):
        if st is not None:
            seen[st[0]] = max(seen.get(st[0], 0), st[1])
    return sum(seen.values())


def live_cpu_tensors() -> list[Tensor]:
    """Every CPU tensor object the garbage collector tracks (tensors are GC-tracked Python objects), frozen ones too:
    gc.get_objects() leaves out gc.freeze()'s permanent generation (backend.step_gc freezes the trainer's setup), so
    they are unfrozen to be listed and frozen again after, with whatever else is alive then."""
    frozen = gc.get_freeze_count() > 0
    if frozen:
        gc.unfreeze()
    try:
        with warnings.catch_warnings():  # isinstance() on some lazily deprecated torch attributes warns
            warnings.simplefilter("ignore")
            return [o for o in gc.get_objects() if isinstance(o, Tensor)]
    finally:
        if frozen:
            gc.freeze()


def live_bytes(extra: Iterable[tuple[int, int]] = ()) -> int:
    """Bytes of the unique storages of all live CPU tensors, plus `extra`: (address, bytes) of storages that only
    C++ code holds."""
    return storage_bytes(live_cpu_tensors(), extra)


def running_peak(nbytes: Iterable[int]) -> int:
    """Largest running sum of signed allocation sizes (0 when nothing was allocated)."""
    total = peak = 0
    for n in nbytes:
        total += n
        peak = max(peak, total)
    return peak


def memory_events(prof) -> list[tuple[int, int]]:
    """(start time ns, signed bytes) of the CPU memory events of a finished autograd profiler, in time order."""
    out = [(e.start_ns(), e.nbytes()) for e in prof.kineto_results.events()
           if e.name() == MEMORY_EVENT and e.device_type() == torch.autograd.DeviceType.CPU]
    out.sort(key=lambda x: x[0])
    return out


def profile_peak(fn: Callable, *args, extra: Iterable[tuple[int, int]] = (),
                 **kwargs) -> tuple[object, PeakMeasurement]:
    """Call fn(*args, **kwargs) under the CPU memory profiler; returns its result and the peak live tensor bytes."""
    from torch.autograd.profiler import profile

    gc.collect()  # drop unreachable tensors first, so the base counts only what is really alive
    base = live_bytes(extra)
    prof = profile(use_kineto=True, use_cpu=True, profile_memory=True)
    with prof:
        result = fn(*args, **kwargs)
    events = memory_events(prof)
    return result, PeakMeasurement(base_bytes=base, step_bytes=running_peak(n for _, n in events),
                                   events=len(events))


def chrome_trace(path: Path, cuda: bool, wait: int, active: int):
    """A started torch.profiler that skips `wait` steps, records the next `active` (CPU, and CUDA where `cuda`) and
    writes them as a Chrome trace to `path`; the caller calls its step() after each step and stop() at the end."""
    from torch.profiler import ProfilerActivity, profile, schedule

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    profiler = profile(activities=acts, schedule=schedule(wait=wait, warmup=0, active=active, repeat=1),
                       on_trace_ready=lambda p: p.export_chrome_trace(str(path)))
    profiler.start()
    return profiler
