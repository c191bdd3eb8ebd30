"""The CPU peak-memory measurement (backend.memprof): live tensor bytes plus the profiler's running allocation peak.

    .venv/bin/pytest -q tests/test_memprof.py
"""

from __future__ import annotations

import gc

import torch

from rackcast.backend.memprof import live_bytes, profile_peak, running_peak, storage_bytes

MIB = 1 << 20


def _known_pattern() -> None:
    a = torch.empty(MIB, dtype=torch.uint8)
    b = torch.empty(2 * MIB, dtype=torch.uint8)  # 3 MiB live
    del a  # 2 MiB
    c = torch.empty(4 * MIB, dtype=torch.uint8)  # 6 MiB live: the peak
    del b, c
    d = torch.empty(MIB, dtype=torch.uint8)  # 1 MiB, freed on return
    del d


def test_profile_peak_of_a_known_allocation_pattern():
    _, peak = profile_peak(_known_pattern)
    assert peak.step_bytes == 6 * MIB
    assert peak.events == 8  # four allocations, four frees


def test_tensors_alive_before_profiling_are_the_base_and_views_count_once():
    gc.collect()
    before = live_bytes()
    keep = torch.empty(3 * MIB, dtype=torch.uint8)
    views = [keep[:10], keep.view(torch.int32)]
    assert live_bytes() - before == 3 * MIB
    _, peak = profile_peak(_known_pattern)
    assert peak.base_bytes - before == 3 * MIB
    assert peak.total_bytes == peak.base_bytes + 6 * MIB
    del keep, views


def test_extra_storages_are_added_once_even_when_a_tensor_shares_them():
    t = torch.empty(MIB, dtype=torch.uint8)
    storage = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
    other = (12345, 7)  # a storage only C++ holds (an address no tensor here has)
    assert storage_bytes([t, t[1:]], [storage, other]) == MIB + 7


def test_a_training_step_peaks_at_its_saved_activations_plus_gradients():
    """Linear layers without bias in fp32: forward saves each layer's input; backward adds the weight gradients."""
    torch.manual_seed(0)
    rows, width = 256, 64
    model = torch.nn.Sequential(torch.nn.Linear(width, width, bias=False), torch.nn.Linear(width, width, bias=False))
    x = torch.randn(rows, width)

    def step():
        model(x).sum().backward()

    _, peak = profile_peak(step)
    act = rows * width * 4  # the second layer's input (the first layer's input is x, allocated before)
    grads = 2 * width * width * 4
    assert peak.step_bytes >= act + grads
    assert peak.step_bytes <= 3 * act + grads  # plus the output and one activation gradient in flight


def test_running_peak():
    assert running_peak([]) == 0
    assert running_peak([5, -3, 4, -6]) == 6
    assert running_peak([-5, 2]) == 0


def test_the_speed_probe_leaves_no_live_tensor_for_the_memory_peak_to_count():
    """The trainer takes the speed probe (backend.speed_probe) at every step boundary; its tensors must not add to
    the live tensor bytes the profiled step's peak starts from."""
    from rackcast.backend.speed_probe import SpeedProbe

    probe = SpeedProbe(torch.device("cpu"))
    before = live_bytes()
    assert probe.time() > 0
    assert live_bytes() == before
