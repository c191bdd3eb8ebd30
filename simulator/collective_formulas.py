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


def all_reduce_time(nbytes, n, bandwidth_Bps, latency_s, efficiency=1.0):
    return collective_time("all_reduce", nbytes, n, bandwidth_Bps, latency_s, efficiency)


def all_gather_time(nbytes, n, bandwidth_Bps, latency_s, efficiency=1.0):
    return collective_time("all_gather", nbytes, n, bandwidth_Bps, latency_s, efficiency)


def reduce_scatter_time(nbytes, n, bandwidth_Bps, latency_s, efficiency=1.0):
    return collective_time("reduce_scatter", nbytes, n, bandwidth_Bps, latency_s, efficiency)


def all_to_all_time(nbytes, n, bandwidth_Bps, latency_s, efficiency=1.0):
    return collective_time("all_to_all", nbytes, n, bandwidth_Bps, latency_s, efficiency)


def send_recv_time(nbytes, bandwidth_Bps, latency_s, efficiency=1.0):
    return collective_time("send_recv", nbytes, 2, bandwidth_Bps, latency_s, efficiency)


def hierarchical_time(kind: str, nbytes, n_local, n_domains, bw_up, lat_up, bw_out, lat_out,
                      eff_up=1.0, eff_out=1.0):
    """Hierarchical all_reduce (RS inside, AR across on nbytes / n_local, AG inside), reduce_scatter (RS inside,
    RS across) or all_gather (AG across, AG inside), as simulator.collectives runs them."""
    nbytes = np.asarray(nbytes, dtype=np.float64)
    shard = nbytes / np.asarray(n_local, dtype=np.float64)
    rs_in = reduce_scatter_time(nbytes, n_local, bw_up, lat_up, eff_up)
    ag_in = all_gather_time(nbytes, n_local, bw_up, lat_up, eff_up)
    if kind == "all_reduce":
        return rs_in + all_reduce_time(shard, n_domains, bw_out, lat_out, eff_out) + ag_in
    if kind == "reduce_scatter":
        return rs_in + reduce_scatter_time(shard, n_domains, bw_out, lat_out, eff_out)
    if kind == "all_gather":
        return all_gather_time(shard, n_domains, bw_out, lat_out, eff_out) + ag_in
    raise ValueError(f"no hierarchical form for {kind!r}")


def all_to_all_two_tier_time(nbytes, n_local, n_domains, bw_up, lat_up, bw_out, lat_out, eff_up=1.0, eff_out=1.0):
    """Direct all-to-all over n_domains x n_local ranks where in-domain pairs use the scale-up links and the others
    the NIC (one per GPU): the slower of (n_local-1)/n x nbytes over scale-up and (n-n_local)/n x nbytes over the
    NIC, each after its own latency. With n_domains = 1 it is all_to_all_time."""
    nbytes = np.asarray(nbytes, dtype=np.float64)
    n_local = np.asarray(n_local, dtype=np.float64)
    n = n_local * np.asarray(n_domains, dtype=np.float64)
    local = np.where(n_local > 1, lat_up + (n_local - 1.0) / n * nbytes / (np.asarray(bw_up) * eff_up), 0.0)
    remote = np.where(n > n_local, lat_out + (n - n_local) / n * nbytes / (np.asarray(bw_out) * eff_out), 0.0)
    return np.maximum(local, remote)


def efficiency_at(curve_sizes, curve_values, message_bytes):
    """Vectorised EfficiencyProfile curve lookup: piecewise-linear in log(size), clamped at both ends (the same
    rule as topologies.spec.interpolate)."""
    sizes = np.log(np.asarray(curve_sizes, dtype=np.float64))
    return np.interp(np.log(np.asarray(message_bytes, dtype=np.float64)), sizes,
                     np.asarray(curve_values, dtype=np.float64))


def topology_collective_time(topology, kind: str, nbytes, n, span: str, with_efficiency: bool = True):
    """Flat collective time on a Topology: slowest-hop bandwidth and latency of `span`, calibrated efficiency."""
    eff = 1.0
    if with_efficiency:
        curves = topology.efficiency.collectives[kind]
        curve = curves.scale_up if span == "scale_up" else curves.scale_out
        eff = efficiency_at([p.size for p in curve], [p.value for p in curve], nbytes)
    return collective_time(kind, nbytes, n, topology.link_bandwidth_Bps(span), topology.link_latency_s(span), eff)
