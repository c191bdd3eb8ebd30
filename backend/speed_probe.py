"""The machine-speed probe: a small fixed reference kernel timed inside every training run, at each step boundary.

Why: on a shared virtual machine the speed of a core moves with the host's placement of the vCPUs (two vCPUs
sharing a physical core's SMT siblings, or a neighbour's load), which the guest cannot see: the process is never
descheduled (core_share 1.00) and /proc/stat steal stays ~0, yet the same one-process plan measured 274 ms a step
at one time and 306-408 ms at others. A probe taken between runs does not see it (the machine's speed changed
within runs); this one is taken by every rank between the steps of the run, so a run's figure can be set beside the
speed of the machine it ran on, and against the same probe taken by `rackcast calibrate`.

The kernel: one fp32 GEMM (PROBE_GEMM_SIZE square: compute-bound, as the trainer's matmuls) and one elementwise
multiply-add over PROBE_STREAM_ELEMENTS fp32 values (memory-bound, three streams larger than a core's L2), together a
few ms on one core of this machine, run outside the 50-400 ms steps the validation suite times (it adds wall time
between them, not to them). It runs in the process's torch thread setting (backend.cpu_runtime), PROBE_REPEATS times
back to back; the probe's figure is the fastest pass (rackcast.spread.undisturbed: a preemption inside one pass is
not machine speed). After it, `align` (the trainer passes a barrier when it has several ranks) lets every rank start
the step together, so the ranks' different probe times do not become waiting inside the next step's timing.

CPU only: on CUDA `time` returns NaN and calibration takes no probe (so validate does not check), because a GPU is
not shared with a neighbour the way a vCPU is, the kernel would take about 10 us there (timing the launch and the
synchronisation, not the device), and its 25 MiB would count in the run's max_memory_allocated peak.

    from rackcast.backend.speed_probe import SpeedProbe
    probe = SpeedProbe(torch.device("cpu"))
    seconds = probe.time()
Calibration (backend.calibrate) takes CALIBRATION_PROBES probes on every rank at once, as the trainer's ranks take
theirs, each the mean over ranks as in the trainer's metrics (`calibration_probe`).
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from rackcast.spread import undisturbed

# 384^3 multiply-adds (113 MFLOP): about 1 ms on one core here, as large as the suite's larger matmuls (tiny-moe's
# expert GEMMs at micro-batch 8), so it runs at the core's matmul speed rather than its dispatch overhead.
PROBE_GEMM_SIZE = 384
# 2^21 fp32 values (8 MiB a stream, 24 MiB over x, y and the output): beyond a core's L2, so it measures the memory
# path a neighbour on the host shares.
PROBE_STREAM_ELEMENTS = 1 << 21
# Passes per probe, the fastest kept: three passes at ~2 ms each, 6-7 ms of untimed wall time per step boundary.
PROBE_REPEATS = 3
# Probes `rackcast calibrate` takes (its figure is their median): one per step boundary of a validation run of the
# suite's default 20 steps.
CALIBRATION_PROBES = 20


class SpeedProbe:
    """The reference kernel timed on `device`. Its tensors live only while it runs (about 25 MiB): kept between
    probes, they would count in the trainer's measured peak of live tensors (backend.memprof), which the memory
    model is compared with. Their values are constants: a dense fp32 GEMM and an add take the same time whatever
    finite values they hold, and filling them is not timed."""

    def __init__(self, device: torch.device, align=None):
        self.device = device
        self.align = align  # called after each probe (a barrier across ranks), or None

    @staticmethod
    def _pass(a, b, x, y, out) -> float:
        t0 = time.perf_counter()
        torch.mm(a, b)
        torch.add(x, y, alpha=2.0, out=out)
        return time.perf_counter() - t0

    def time(self) -> float:
        """Seconds for one pass of the kernel: the fastest of PROBE_REPEATS passes; NaN off the CPU (module
        docstring)."""
        if self.device.type != "cpu":
            return math.nan
        square, f32 = (PROBE_GEMM_SIZE, PROBE_GEMM_SIZE), torch.float32
        with torch.no_grad():
            a, b = torch.full(square, 0.5, dtype=f32), torch.full(square, 0.25, dtype=f32)
            x, y, out = (torch.full((PROBE_STREAM_ELEMENTS,), v, dtype=f32) for v in (1.0, 2.0, 0.0))
            seconds = undisturbed(self._pass(a, b, x, y, out) for _ in range(PROBE_REPEATS))
        if self.align is not None:
            self.align()
        return seconds


def calibration_probe(device: torch.device, barrier, mean_over_ranks) -> dict:
    """CALIBRATION_PROBES probes, every rank at once (barrier() before each), each the mean over ranks
    (mean_over_ranks(list of seconds) -> list); their median is the calibrated machine's probe. Empty off the CPU
    (module docstring): the calibration then holds no probe."""
    if device.type != "cpu":
        return {}
    probe = SpeedProbe(device)
    samples = []
    for _ in range(CALIBRATION_PROBES):
        barrier()
        samples.append(probe.time())
    samples = mean_over_ranks(samples)
    return {"samples_s": samples, "median_s": statistics.median(samples)}
