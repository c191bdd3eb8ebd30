"""Closed-form alpha-beta times of collectives, vectorised with numpy (the planner ranks thousands of layouts).

    time = steps x alpha + factor x nbytes / (efficiency x bandwidth)

with the nccl-tests bus-bandwidth factors (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
all_reduce 2(n-1)/n, all_gather / reduce_scatter / all_to_all (n-1)/n, send_recv 1; and the latency steps of the
algorithms simulator.collectives runs: ring all_reduce 2(n-1), ring all_gather / reduce_scatter n-1, direct
all_to_all 1 (all pairs at once), send_recv 1. Sizes follow nccl-tests (see simulator.collectives).
`bandwidth_Bps` is the per-GPU, per-direction bandwidth of the slowest hop, `latency_s` one hop's route latency
(alpha). Every argument may be an array; they broadcast.

    from rackcast.simulator.collective_formulas import collective_time
    t = collective_time("all_reduce", nbytes=np.logspace(6, 10, 5), n=64, bandwidth_Bps=bw, latency_s=alpha)

Tests: `.venv/bin/pytest -q tests/test_network.py`.
"""

from __future__ import annotations

import numpy as np

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


# A ring collective over a group spanning domains with the same number (> 1) of ranks in each runs in phases, ring by
# ring: inside each domain over the scale-up links, and across domains among the ranks of the same local index on
# 1 / (ranks per domain) of the bytes, so every rank's NIC carries its share (hierarchical all-reduce: Jia et al.
# 2018, "Highly Scalable Deep Learning Training System with Mixed-Precision", arXiv 1807.11205, section 3.3;
# Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE). kind -> phases (kind, level), as simulator.collectives runs them.
HIERARCHY = {
    "all_reduce": (("reduce_scatter", "local"), ("all_reduce", "cross"), ("all_gather", "local")),
    "reduce_scatter": (("reduce_scatter", "local"), ("reduce_scatter", "cross")),
    "all_gather": (("all_gather", "cross"), ("all_gather", "local")),
}


def algo_factor(kind: str, n):
    """Bytes on the busiest link per byte of the nccl-tests size (the busbw / algbw ratio)."""
    n = np.asarray(n, dtype=np.float64)
    if kind == "all_reduce":
        return 2.0 * (n - 1.0) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1.0) / n
    if kind == "send_recv":
        return np.where(n > 1, 1.0, 0.0)
    raise ValueError(f"unknown collective {kind!r} (known: {', '.join(KINDS)})")


def latency_steps(kind: str, n):
    n = np.asarray(n, dtype=np.float64)
    if kind == "all_reduce":
        return 2.0 * (n - 1.0)
    if kind in ("all_gather", "reduce_scatter"):
        return n - 1.0
    if kind in ("all_to_all", "send_recv"):
        return np.where(n > 1, 1.0, 0.0)
    raise ValueError(f"unknown collective {kind!r} (known: {', '.join(KINDS)})")


def collective_time(kind: str, nbytes, n, bandwidth_Bps, latency_s, efficiency=1.0):
    """Alpha-beta time of one flat collective over n ranks."""
    nbytes = np.asarray(nbytes, dtype=np.float64)
    bw = np.asarray(bandwidth_Bps, dtype=np.float64) * np.asarray(efficiency, dtype=np.float64)
    return latency_steps(kind, n) * np.asarray(latency_s, dtype=np.float64) + algo_factor(kind, n) * nbytes / bw


def efficiency_at(curve_sizes, curve_values, message_bytes):
    """Vectorised EfficiencyProfile curve lookup: piecewise-linear in log(size), clamped at both ends (the same
    rule as topologies.spec.interpolate)."""
    sizes = np.log(np.asarray(curve_sizes, dtype=np.float64))
    return np.interp(np.log(np.asarray(message_bytes, dtype=np.float64)), sizes,
                     np.asarray(curve_values, dtype=np.float64))
