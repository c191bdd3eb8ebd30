"""backend.speed_probe: the probe aligns the ranks after timing (so their probe times do not leak into the step's
timing) and is CPU only (NaN, and no calibration probe, on another device)."""

from __future__ import annotations

import math

import torch

from rackcast.backend.speed_probe import SpeedProbe, calibration_probe


def test_probe_times_on_cpu_then_calls_align_once():
    calls = []
    seconds = SpeedProbe(torch.device("cpu"), align=lambda: calls.append(1)).time()
    assert 0 < seconds < 1 and calls == [1]


def test_probe_is_cpu_only_nan_and_no_calibration_elsewhere():
    calls = []
    cuda = torch.device("cuda")  # the object only: nothing runs on it
    assert math.isnan(SpeedProbe(cuda, align=lambda: calls.append(1)).time()) and calls == []
    assert calibration_probe(cuda, barrier=lambda: calls.append(1), mean_over_ranks=lambda s: s) == {}
    assert calls == []
