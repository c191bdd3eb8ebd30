"""Collectives decomposed into flows on a simulator.network.Network, as SimPy process generators.

Each function is a generator: `yield from ring_all_reduce(net, group, nbytes)` inside a process, or
`env.process(ring_all_reduce(net, group, nbytes))`; it returns when the collective is done. `group` is a list of GPU
node names (`d{D}/gpu{G}`); its order is the ring order.

Sizes follow nccl-tests: `nbytes` is the all-reduce buffer, the full (gathered) buffer of an all-gather or
reduce-scatter, and the per-rank send buffer of an all-to-all (nbytes / n to each rank, itself included).

Rings. The default (`stepwise=False`) models a ring as n concurrent flows, rank i -> rank i+1, each carrying the
per-neighbour total (all_reduce 2(n-1)/n x nbytes, reduce_scatter / all_gather (n-1)/n x nbytes), followed by
(steps - 1) x alpha, alpha being the slowest ring hop's route latency (the flows themselves paid one). Alone, that is
exactly the alpha-beta time steps x alpha + factor x nbytes / bandwidth of simulator.collective_formulas; under
contention it costs one rate solve per ring instead of one per step. `stepwise=True` runs the 2(n-1) (or n-1)
synchronised steps of nbytes / n each (same time alone; finer interplay with other traffic).

Hierarchical versions (groups spanning several scale-up domains, the same number of ranks in each): reduce-scatter
inside each domain, all-reduce (or reduce-scatter / all-gather) across domains between the ranks of equal local rank
on nbytes / n_local, then all-gather inside each domain; domains run each phase concurrently.

All-to-all is direct: all n(n-1) pairs at once. `all_to_allv` takes a per-(src, dst) byte matrix.

Efficiency: `efficiency` is a float in (0, 1] or a callable (kind, span, message_bytes) -> float such as
`topology.efficiency.collective_efficiency`; a collective's flows put bytes / efficiency on the wire (see
simulator.network). span is "scale_up" when the group (or phase) lies in one domain, else "scale_out".

Tests: `.venv/bin/pytest -q tests/test_network.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from rackcast.simulator.network import Network

Efficiency = float | Callable[[str, str, float], float]


def domain_of(graph, node: str) -> str:
    """The scale-up domain of a GPU node: its `domain` attribute if the graph has one, else the `d{D}` prefix."""
    dom = graph.nodes[node].get("domain") if node in graph else None
    return str(dom) if dom is not None else node.split("/", 1)[0]


def span_of(graph, group: Sequence[str]) -> str:
    return "scale_up" if len({domain_of(graph, g) for g in group}) <= 1 else "scale_out"


def _efficiency(efficiency: Efficiency, kind: str, span: str, message_bytes: float) -> float:
    return float(efficiency(kind, span, message_bytes)) if callable(efficiency) else float(efficiency)


def _tag(tag, kind):
    return kind if tag is None else tag


# -------------------------------------------------------------------------------------------------- point to point
def send(net: Network, src: str, dst: str, nbytes: float, *, efficiency: Efficiency = 1.0, tag=None):
    """Point-to-point transfer src -> dst."""
    span = span_of(net.graph, [src, dst])
    yield net.send(src, dst, nbytes, tag=_tag(tag, "send_recv"),
                   efficiency=_efficiency(efficiency, "send_recv", span, nbytes))


# ------------------------------------------------------------------------------------------------------------ rings
_RING = {  # kind -> (steps, per-neighbour bytes factor), as functions of n
    "all_reduce": (lambda n: 2 * (n - 1), lambda n: 2.0 * (n - 1) / n),
    "reduce_scatter": (lambda n: n - 1, lambda n: (n - 1) / n),
    "all_gather": (lambda n: n - 1, lambda n: (n - 1) / n),
}


def _ring(net: Network, kind: str, group: Sequence[str], nbytes: float, efficiency: Efficiency, tag,
          stepwise: bool):
    n = len(group)
    if n <= 1 or nbytes <= 0:
        return
    steps, factor = _RING[kind][0](n), _RING[kind][1](n)
    eff = _efficiency(efficiency, kind, span_of(net.graph, group), nbytes)
    hops, nhops = net.route_matrix(group, list(group[1:]) + [group[0]])
    tag = _tag(tag, kind)
    env = net.env
    if stepwise:
        for _ in range(steps):
            yield net.transfer_many(hops, nhops, nbytes / n, tag=tag, efficiency=eff)
        return
    yield net.transfer_many(hops, nhops, factor * nbytes, tag=tag, efficiency=eff)
    alpha = float(np.where(hops >= 0, net.latency[hops], 0.0).sum(axis=1).max())
    if steps > 1 and alpha > 0:
        yield env.timeout((steps - 1) * alpha)


def ring_all_reduce(net: Network, group: Sequence[str], nbytes: float, *, efficiency: Efficiency = 1.0,
                    tag=None, stepwise: bool = False):
    """Ring all-reduce of an nbytes buffer: 2(n-1) steps of nbytes / n to the ring neighbour."""
    yield from _ring(net, "all_reduce", group, nbytes, efficiency, tag, stepwise)


def ring_reduce_scatter(net: Network, group: Sequence[str], nbytes: float, *, efficiency: Efficiency = 1.0,
                        tag=None, stepwise: bool = False):
    """Ring reduce-scatter of an nbytes input buffer (each rank keeps nbytes / n): n-1 steps of nbytes / n."""
    yield from _ring(net, "reduce_scatter", group, nbytes, efficiency, tag, stepwise)


def ring_all_gather(net: Network, group: Sequence[str], nbytes: float, *, efficiency: Efficiency = 1.0,
                    tag=None, stepwise: bool = False):
    """Ring all-gather into an nbytes output buffer (each rank contributes nbytes / n): n-1 steps of nbytes / n."""
    yield from _ring(net, "all_gather", group, nbytes, efficiency, tag, stepwise)


# ---------------------------------------------------------------------------------------------------- hierarchical
def split_by_domain(graph, group: Sequence[str]) -> list[list[str]]:
    """The group's ranks per domain (domains in order of first appearance, ranks in group order); equal sizes."""
    doms: dict[str, list[str]] = {}
    for g in group:
        doms.setdefault(domain_of(graph, g), []).append(g)
    parts = list(doms.values())
    if len({len(p) for p in parts}) > 1:
        raise ValueError(f"hierarchical collective needs the same number of ranks per domain, got "
                         f"{[len(p) for p in parts]}")
    return parts


def _concurrently(net: Network, gens):
    procs = [net.env.process(g) for g in gens]
    if procs:
        yield net.env.all_of(procs)


def _hierarchical(net: Network, phases: Sequence[tuple[str, str]], group, nbytes, efficiency, tag, stepwise):
    parts = split_by_domain(net.graph, group)
    n_local = len(parts[0])
    columns = [[p[r] for p in parts] for r in range(n_local)]
    for kind, level in phases:
        if level == "local":
            gens = [_ring(net, kind, p, nbytes, efficiency, tag, stepwise) for p in parts]
        else:
            gens = [_ring(net, kind, c, nbytes / n_local, efficiency, tag, stepwise) for c in columns]
        yield from _concurrently(net, gens)


def hierarchical_all_reduce(net: Network, group: Sequence[str], nbytes: float, *,
                            efficiency: Efficiency = 1.0, tag=None, stepwise: bool = False):
    """Reduce-scatter inside each domain, all-reduce of nbytes / n_local across domains, all-gather inside."""
    yield from _hierarchical(net, [("reduce_scatter", "local"), ("all_reduce", "cross"), ("all_gather", "local")],
                             group, nbytes, efficiency, _tag(tag, "all_reduce"), stepwise)


def hierarchical_reduce_scatter(net: Network, group: Sequence[str], nbytes: float, *,
                                efficiency: Efficiency = 1.0, tag=None, stepwise: bool = False):
    """Reduce-scatter inside each domain, then of the nbytes / n_local shard across domains."""
    yield from _hierarchical(net, [("reduce_scatter", "local"), ("reduce_scatter", "cross")],
                             group, nbytes, efficiency, _tag(tag, "reduce_scatter"), stepwise)


def hierarchical_all_gather(net: Network, group: Sequence[str], nbytes: float, *,
                            efficiency: Efficiency = 1.0, tag=None, stepwise: bool = False):
    """All-gather of the nbytes / n_local shard across domains, then inside each domain."""
    yield from _hierarchical(net, [("all_gather", "cross"), ("all_gather", "local")],
                             group, nbytes, efficiency, _tag(tag, "all_gather"), stepwise)


# ------------------------------------------------------------------------------------------------------ all-to-all
def all_to_allv(net: Network, group: Sequence[str], matrix, *, efficiency: Efficiency = 1.0, tag=None):
    """Direct all-to-all with uneven counts: matrix[i][j] bytes from group[i] to group[j], all pairs concurrently
    (the diagonal stays local). The efficiency's message size is the mean per-rank send total."""
    m = np.asarray(matrix, dtype=np.float64)
    n = len(group)
    if m.shape != (n, n):
        raise ValueError(f"all_to_allv matrix must be {n}x{n}, got {m.shape}")
    if n <= 1:
        return
    eff = _efficiency(efficiency, "all_to_all", span_of(net.graph, group), float(m.sum()) / n)
    src, dst, hops, nhops = net.all_pairs(group)
    yield net.transfer_many(hops, nhops, m[src, dst], tag=_tag(tag, "all_to_all"), efficiency=eff)


def all_to_all(net: Network, group: Sequence[str], nbytes: float, *, efficiency: Efficiency = 1.0, tag=None):
    """Direct all-to-all of an nbytes per-rank send buffer: nbytes / n from every rank to every other."""
    n = len(group)
    yield from all_to_allv(net, group, np.full((n, n), nbytes / max(n, 1)), efficiency=efficiency, tag=tag)


# ---------------------------------------------------------------------------------------------------- dispatching
COLLECTIVES = {
    "all_reduce": ring_all_reduce,
    "reduce_scatter": ring_reduce_scatter,
    "all_gather": ring_all_gather,
    "all_to_all": all_to_all,
    "hierarchical_all_reduce": hierarchical_all_reduce,
    "hierarchical_reduce_scatter": hierarchical_reduce_scatter,
    "hierarchical_all_gather": hierarchical_all_gather,
}


def collective(net: Network, kind: str, group: Sequence[str], nbytes: float, *, hierarchical: bool | None = None,
               **kw):
    """Run collective `kind` (all_reduce, reduce_scatter, all_gather, all_to_all, or a hierarchical_ one).
    hierarchical=None picks the hierarchical ring for a group spanning several domains with the same number (> 1)
    of ranks in each; True forces it, False keeps the flat ring."""
    if kind in _RING:
        if hierarchical is None:
            sizes = {}
            for g in group:
                d = domain_of(net.graph, g)
                sizes[d] = sizes.get(d, 0) + 1
            hierarchical = len(sizes) > 1 and len(set(sizes.values())) == 1 and next(iter(sizes.values())) > 1
        if hierarchical:
            kind = "hierarchical_" + kind
    try:
        fn = COLLECTIVES[kind]
    except KeyError:
        raise ValueError(f"unknown collective {kind!r} (known: {', '.join(COLLECTIVES)})") from None
    yield from fn(net, group, nbytes, **kw)
