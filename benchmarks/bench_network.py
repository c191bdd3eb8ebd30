"""Benchmark of the flow-level network model: an EP64 all-to-all (64 x 63 flows) on GB200 NVL72, inside one rack
and across two racks (32 GPUs in each), uniform and with uneven (all-to-allv) counts, plus the bare rate solve.

    .venv/bin/python benchmarks/bench_network.py

Prints the time to build the 11-rack (704-GPU) graph, then flows/s (flows simulated per wall-clock second, start to delivery; "cold" includes computing the routes in a
fresh Network, "warm" is the median of later repeats), rate solves/s inside the simulation, and the numba kernel
alone on the full 4032-flow instance (solves/s) against the numpy reference.
"""

from __future__ import annotations

import time

import numpy as np
import simpy

from rackcast.simulator import collectives as coll
from rackcast.simulator.fairshare import maxmin_rates, maxmin_rates_numpy
from rackcast.simulator.network import Network
from rackcast.topologies import load_topology
from rackcast.topologies.graph import build_graph, gpu_name

NBYTES = 256e6  # per-rank send buffer of the all-to-all
REPEATS = 5


def _group(domains: int, per_domain: int) -> list[str]:
    return [gpu_name(d, g) for d in range(domains) for g in range(per_domain)]


def _bench(label: str, graph, group, matrix, quantum_s: float = 0.0) -> None:
    """The first all-to-all in a fresh Network (cold: routes computed) then REPEATS more (warm), one after the
    other in the same simulation; wall time of each."""
    env = simpy.Environment()
    net = Network(env, graph, quantum_s=quantum_s)
    walls, sims, solves = [], [], []

    def proc():
        for _ in range(REPEATS + 1):
            t0, s0, n0 = time.perf_counter(), env.now, net.stats["solves"]
            yield from coll.all_to_allv(net, group, matrix)
            walls.append(time.perf_counter() - t0)
            sims.append(env.now - s0)
            solves.append(net.stats["solves"] - n0)

    env.process(proc())
    env.run()
    flows = int(np.count_nonzero(matrix) - np.count_nonzero(np.diag(matrix)))
    wall = float(np.median(walls[1:]))
    print(f"{label:<40} flows {flows:5d}  solves {solves[-1]:5d}  simulated {sims[-1] * 1e3:7.3f} ms  "
          f"wall cold {walls[0] * 1e3:7.2f} ms  warm {wall * 1e3:7.2f} ms  {flows / wall:9.0f} flows/s  "
          f"{solves[-1] / wall:7.0f} solves/s")


def _kernel(graph, group) -> None:
    env = simpy.Environment()
    net = Network(env, graph)
    routes = [net.route(a, b) for a in group for b in group if a != b]
    indptr = np.concatenate([[0], np.cumsum([len(r) for r in routes])]).astype(np.int64)
    indices = np.concatenate(routes).astype(np.int64)
    caps = np.full(len(routes), np.inf)
    for name, fn, reps in (("numba", maxmin_rates, 200), ("numpy", maxmin_rates_numpy, 5)):
        fn(indptr, indices, net.capacity, caps)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(indptr, indices, net.capacity, caps)
        dt = (time.perf_counter() - t0) / reps
        print(f"  rate solve alone ({name}, {len(routes)} flows, {len(net.links)} links): "
              f"{dt * 1e6:9.1f} us  = {1 / dt:9.0f} solves/s")


def main() -> None:
    rng = np.random.default_rng(0)
    maxmin_rates(np.zeros(1, np.int64), np.zeros(0, np.int64), np.ones(1), np.ones(0))  # load the compiled kernel
    start = time.perf_counter()
    big = build_graph(load_topology("gb200-nvl72", domains=11))
    print(f"build_graph, 11 x GB200 NVL72 ({big.number_of_nodes()} nodes, {big.number_of_edges()} links): "
          f"{(time.perf_counter() - start) * 1e3:.0f} ms")
    for domains in (1, 2):
        topo = load_topology("gb200-nvl72", domains=domains)
        graph = build_graph(topo)
        group = _group(domains, 64 // domains)
        n = len(group)
        print(f"EP64 on {domains} x GB200 NVL72 ({n // domains} GPUs per rack), {NBYTES / 1e6:.0f} MB per rank:")
        uniform = np.full((n, n), NBYTES / n)
        _bench("  all_to_all uniform", graph, group, uniform)
        skew = rng.zipf(1.5, size=(n, n)).astype(np.float64).clip(max=50)  # uneven counts: one solve per finish
        skew *= uniform.sum() / skew.sum()
        _bench("  all_to_allv Zipf-skewed counts", graph, group, skew)
        _bench("  all_to_allv Zipf-skewed, quantum 1 us", graph, group, skew, quantum_s=1e-6)
        _kernel(graph, group)


if __name__ == "__main__":
    main()
