"""The topology as a networkx graph: GPUs, switches, NICs, rails, spine and hosts, with per-direction link capacities.

    from rackcast.topologies import load_topology
    from rackcast.topologies.graph import build_graph, route, max_flow_Bps, gpu_name
    g = build_graph(load_topology("gb200-nvl72", domains=11))        # 704 GPUs
    edges = route(g, gpu_name(0, 0), gpu_name(3, 5))                  # [(u, v), ...] directed edges
    max_flow_Bps(g, gpu_name(0, 0), gpu_name(0, 1))                   # 900e9 inside one NVL72 rack

Nodes (attribute `kind`):
  d{D}/gpu{G}        "gpu"       only the usable GPUs of each domain (G in 0..usable_gpus-1)
  d{D}/nvswitch      "nvswitch"  one non-blocking crossbar per domain
  d{D}/gpu{G}/nic{K} "nic"       K in 0..nics_per_gpu-1
  rail{R}            "rail"      NIC K of GPU G sits on rail (G * nics_per_gpu + K) % rails
  spine              "spine"     joins the rails
  d{D}/host{H}       "host"      GPU G belongs to host G // gpus_per_host
Scale-out nodes (NICs, rails, spine) are built whenever nics_per_gpu > 0, even for one domain.

Every link is two directed edges, each with `capacity_Bps` (that direction), `latency_s` and `kind`:
  nvlink     GPU <-> nvswitch   scale_up.bandwidth_Bps, scale_up.latency_s / 2 per edge
  pcie_nic   GPU <-> NIC        nic_bandwidth_Bps, latency 0
  nic        NIC <-> rail       nic_bandwidth_Bps, scale_out.latency_s / 2 per edge
  rail_spine rail <-> spine     (sum of NIC bandwidth on the rail) / oversubscription, latency 0
  host_link  GPU <-> host       host.link_bandwidth_Bps, host.link_latency_s
So a GPU-switch-GPU route takes scale_up.latency_s and a GPU-NIC-rail-(spine-rail)-NIC-GPU route scale_out.latency_s.

Run the checks with `.venv/bin/pytest -q tests/test_topologies.py`.
"""

from __future__ import annotations

import networkx as nx

from rackcast.errors import RackcastError
from rackcast.topologies.spec import Topology

SPINE = "spine"


def gpu_name(domain: int, gpu: int) -> str:
    return f"d{domain}/gpu{gpu}"


def switch_name(domain: int) -> str:
    return f"d{domain}/nvswitch"


def nic_name(domain: int, gpu: int, nic: int) -> str:
    return f"d{domain}/gpu{gpu}/nic{nic}"


def rail_name(rail: int) -> str:
    return f"rail{rail}"


def host_name(domain: int, host: int) -> str:
    return f"d{domain}/host{host}"


def rail_of(topo: Topology, gpu: int, nic: int) -> int:
    so = topo.scale_out
    return (gpu * so.nics_per_gpu + nic) % so.rails


def build_graph(topo: Topology) -> nx.DiGraph:
    """The directed graph of `topo` (see the module docstring for names, attributes and capacities)."""
    su, so, host = topo.scale_up, topo.scale_out, topo.host
    has_fabric = so.nics_per_gpu > 0
    if has_fabric and so.rails <= 0:
        raise RackcastError(f"{topo.name}: scale_out.rails must be positive when scale_out.nics_per_gpu > 0")
    if has_fabric and so.nic_bandwidth_Bps <= 0:
        raise RackcastError(f"{topo.name}: scale_out.nic_bandwidth_Bps must be positive when it has NICs")
    if topo.domains > 1 and not has_fabric:
        raise RackcastError(
            f"{topo.name}: scale_out.nics_per_gpu is 0, so it cannot span {topo.domains} {topo.domain_label}s"
        )

    g = nx.DiGraph(name=topo.name, domains=topo.domains, usable_gpus=su.usable_gpus, nics_per_gpu=so.nics_per_gpu)
    nodes: list[tuple[str, dict]] = []
    edges: list[tuple[str, str, dict]] = []

    def link(a: str, b: str, capacity_Bps: float, latency_ab_s: float, latency_ba_s: float, kind: str) -> None:
        edges.append((a, b, {"capacity_Bps": capacity_Bps, "latency_s": latency_ab_s, "kind": kind}))
        edges.append((b, a, {"capacity_Bps": capacity_Bps, "latency_s": latency_ba_s, "kind": kind}))

    nvlink_latency_s = su.latency_s / 2
    nic_latency_s = so.latency_s / 2
    rail_load_Bps = [0.0] * so.rails if has_fabric else []
    for d in range(topo.domains):
        switch = switch_name(d)
        nodes.append((switch, {"kind": "nvswitch", "domain": d}))
        for h in range(-(-su.usable_gpus // host.gpus_per_host)):
            nodes.append((host_name(d, h), {"kind": "host", "domain": d, "index": h}))
        for gi in range(su.usable_gpus):
            gpu = gpu_name(d, gi)
            h = host_name(d, gi // host.gpus_per_host)
            nodes.append((gpu, {"kind": "gpu", "domain": d, "index": gi, "host": h}))
            link(gpu, switch, su.bandwidth_Bps, nvlink_latency_s, nvlink_latency_s, "nvlink")
            link(gpu, h, host.link_bandwidth_Bps, host.link_latency_s, host.link_latency_s, "host_link")
            for k in range(so.nics_per_gpu):
                nic = nic_name(d, gi, k)
                r = rail_of(topo, gi, k)
                nodes.append((nic, {"kind": "nic", "domain": d, "gpu": gpu, "rail": rail_name(r)}))
                link(gpu, nic, so.nic_bandwidth_Bps, 0.0, 0.0, "pcie_nic")
                link(nic, rail_name(r), so.nic_bandwidth_Bps, nic_latency_s, nic_latency_s, "nic")
                rail_load_Bps[r] += so.nic_bandwidth_Bps
    if has_fabric:
        nodes.append((SPINE, {"kind": "spine"}))
        for r in range(so.rails):
            nodes.append((rail_name(r), {"kind": "rail", "index": r}))
            if rail_load_Bps[r] > 0:
                link(rail_name(r), SPINE, rail_load_Bps[r] / so.oversubscription, 0.0, 0.0, "rail_spine")
    g.add_nodes_from(nodes)
    g.add_edges_from(edges)
    return g


def _gpu(graph: nx.DiGraph, name: str) -> dict:
    attrs = graph.nodes.get(name)
    if attrs is None or attrs.get("kind") != "gpu":
        raise RackcastError(f"{graph.graph.get('name', 'topology')}: no GPU named {name!r} in the graph")
    return attrs


def route(graph: nx.DiGraph, src_gpu: str, dst_gpu: str) -> list[tuple[str, str]]:
    """The directed edges one flow from `src_gpu` to `dst_gpu` takes (empty when they are the same GPU).

    Same domain: through the domain's nvswitch. Different domains: src GPU -> its NIC 0 -> its rail -> (spine ->
    the destination's rail, when the rails differ) -> destination NIC 0 -> destination GPU.
    """
    src, dst = _gpu(graph, src_gpu), _gpu(graph, dst_gpu)
    if src_gpu == dst_gpu:
        return []
    if src["domain"] == dst["domain"]:
        switch = switch_name(src["domain"])
        return [(src_gpu, switch), (switch, dst_gpu)]
    if graph.graph.get("nics_per_gpu", 0) <= 0:
        raise RackcastError(f"{graph.graph.get('name', 'topology')}: no scale-out fabric between domains")
    src_nic, dst_nic = f"{src_gpu}/nic0", f"{dst_gpu}/nic0"
    src_rail, dst_rail = graph.nodes[src_nic]["rail"], graph.nodes[dst_nic]["rail"]
    path = [(src_gpu, src_nic), (src_nic, src_rail)]
    if src_rail != dst_rail:
        path += [(src_rail, SPINE), (SPINE, dst_rail)]
    path += [(dst_rail, dst_nic), (dst_nic, dst_gpu)]
    return path


def route_latency_s(graph: nx.DiGraph, edges: list[tuple[str, str]]) -> float:
    return sum(graph.edges[e]["latency_s"] for e in edges)


def route_capacity_Bps(graph: nx.DiGraph, edges: list[tuple[str, str]]) -> float:
    """The narrowest edge of a route (infinite for an empty route)."""
    return min((graph.edges[e]["capacity_Bps"] for e in edges), default=float("inf"))


def max_flow_Bps(graph: nx.DiGraph, src: str, dst: str) -> float:
    """Maximum flow from `src` to `dst` on capacity_Bps, with GPUs and hosts as endpoints only.

    Other GPUs and hosts do not relay traffic (no PXN-style forwarding through a peer GPU, no staging through host
    memory), and two GPUs of one domain talk over the scale-up fabric only, as NCCL does when NVLink is present.
    So this is the bandwidth the fabric offers the pair, not what an adversarial relay scheme could squeeze out.
    """
    for name in (src, dst):
        if name not in graph:
            raise RackcastError(f"{graph.graph.get('name', 'topology')}: no node named {name!r} in the graph")
    if src == dst:
        return float("inf")
    src_domain, dst_domain = graph.nodes[src].get("domain"), graph.nodes[dst].get("domain")
    same_domain = src_domain is not None and src_domain == dst_domain
    scale_out = {"nic", "rail", "spine"}

    def keep(node: str) -> bool:
        if node == src or node == dst:
            return True
        kind = graph.nodes[node]["kind"]
        if kind in ("gpu", "host"):
            return False
        return not (same_domain and kind in scale_out)

    sub = graph.subgraph([n for n in graph if keep(n)])
    return float(nx.maximum_flow_value(sub, src, dst, capacity="capacity_Bps"))
