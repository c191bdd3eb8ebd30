"""The step simulator's view of the network: a plan's parallel groups as flows on simulator.network.Network.

Two modes, the same answers when the cluster is symmetric (tests/test_step_sim.py checks it):

- reduced (default): the quotient of the cluster by its symmetries. Each pipeline stage is one rank class,
  represented by one GPU (the stage's global rank 0) with its own links: NVLink up/down to its domain's switch,
  PCIe to its NIC, NIC to its rail, the rail's per-GPU share of the spine, the host link. Every other GPU of the
  stage (data-parallel replicas, the other ranks of a tensor / fsdp / expert group) loads its own copy of these
  links in exactly the same way, so one representative flow per collective phase stands for all of them: a ring
  step from the representative to its neighbour in another domain is routed out through its NIC and back in
  through its own NIC (the image of the neighbour's). The graph has a handful of nodes whatever the cluster size,
  so a step on 704 GPUs costs what one replica costs.
- full (`reduce=False`): topologies.graph.build_graph of the whole cluster and every group of every replica run
  with simulator.collectives. Used to check the reduction on small clusters.

Collectives mirror simulator.collectives.collective: rings (hierarchical when a group spans domains with several
ranks in each), nccl-tests sizes and efficiencies. The expert all-to-all is modelled per port in both modes: each
rank's send total leaves on its uplinks (NVLink for peers in its domain, NIC for the others, the spine for peers on
other rails) and its receive total arrives on its downlinks; a direct all-to-all on a crossbar or a rail-optimised
fabric ends when the busiest port drains, and per-pair flows would cost n^2 flows per dispatch. The reduced mode
takes the largest send and receive total of each kind over the group (dropless waits for the most loaded rank).

    net = StepNetwork(env, plan, topo, reduce=True)
    yield from net.ring(stage, "data", "all_reduce", nbytes)       # inside a SimPy process
"""

from __future__ import annotations

import networkx as nx
import numpy as np

from rackcast.plan import Plan
from rackcast.simulator import collectives
from rackcast.simulator.collective_formulas import HIERARCHY, algo_factor, latency_steps
from rackcast.simulator.network import Network
from rackcast.simulator.placement import Group, make_group, place
from rackcast.topologies.spec import Topology

RING_KINDS = ("all_reduce", "reduce_scatter", "all_gather")
A2A_CATEGORIES = ("local", "same_rail", "other_rail")


def axis_groups(plan: Plan, usable: int) -> dict[str, Group]:
    """Every communication axis of a plan as a placement Group (size, stride, span)."""
    pl = place(plan, usable)
    return {"tensor": pl.tensor, "context": pl.context, "fsdp": pl.fsdp, "data": pl.data,
            "pipeline": pl.pipeline, "expert": pl.expert,
            "expert_data": pl.expert_data, "inner": pl.inner,
            "expert_fsdp": pl.expert_fsdp, "expert_replicas": pl.expert_replicas}


class StepNetwork:
    def __init__(self, env, plan: Plan, topo: Topology, reduce: bool = True, track_utilisation: bool = True):
        par = plan.parallel
        self.env = env
        self.topo = topo
        self.reduce = reduce
        self.u = topo.scale_up.usable_gpus
        self.rails = max(topo.scale_out.rails, 1)
        self.stage_ranks = par.stage_ranks
        self.stages = par.pipeline
        self.groups = axis_groups(plan, self.u)
        self.eff = topo.efficiency.collective_efficiency
        self._members: dict[tuple[int, str], list[list[int]]] = {}
        self._plans: dict[tuple, list] = {}
        self._ring_phases: dict[tuple, list] = {}  # ring's phases per (stage, axis, kind, bytes)
        self._eff_cache: dict[tuple, float] = {}
        self._a2a_routes: dict[int, tuple] = {}
        self._a2a_used: dict[tuple, tuple] = {}
        self._p2p: dict[tuple, list] = {}
        graph = self._quotient_graph() if reduce else _full_graph(topo)
        self.graph = graph
        self.net = Network(env, graph, track_utilisation=track_utilisation)

    # ------------------------------------------------------------------------------------------ rank naming
    def domain(self, rank: int) -> int:
        return rank // self.u

    def local(self, rank: int) -> int:
        return rank % self.u

    def rail(self, rank: int) -> int:
        return self.local(rank) % self.rails  # one NIC per route: topologies.graph routes through NIC 0

    def name(self, rank: int) -> str:
        return f"d{self.domain(rank)}/gpu{self.local(rank)}"

    def rep(self, stage: int) -> int:
        return stage * self.stage_ranks

    # ----------------------------------------------------------------------------------- the quotient graph
    def _quotient_graph(self) -> nx.DiGraph:
        topo = self.topo
        su, so, host = topo.scale_up, topo.scale_out, topo.host
        g = nx.DiGraph(name=f"{topo.name} (quotient)")
        on_rail: dict[int, int] = {}

        def link(a, b, cap, lat, kind):
            g.add_edge(a, b, capacity_Bps=cap, latency_s=lat, kind=kind)
            g.add_edge(b, a, capacity_Bps=cap, latency_s=lat, kind=kind)

        for s in range(self.stages):
            r = self.rep(s)
            gpu = f"s{s}/gpu"
            g.add_node(gpu, kind="gpu", domain=self.domain(r))
            link(gpu, f"d{self.domain(r)}/nvswitch", su.bandwidth_Bps, su.latency_s / 2, "nvlink")
            link(gpu, f"s{s}/host", host.link_bandwidth_Bps, host.link_latency_s, "host_link")
            if so.nics_per_gpu > 0:
                link(gpu, f"s{s}/nic", so.nic_bandwidth_Bps, 0.0, "pcie_nic")
                link(f"s{s}/nic", f"rail{self.rail(r)}", so.nic_bandwidth_Bps, so.latency_s / 2, "nic")
                on_rail[self.rail(r)] = on_rail.get(self.rail(r), 0) + 1
        for rail, count in on_rail.items():  # each representative stands for GPUs that own this share of the spine
            link(f"rail{rail}", "spine", count * so.nic_bandwidth_Bps / so.oversubscription, 0.0, "rail_spine")
        return g

    def _node_rank(self, rank: int) -> int:
        """The rank whose links carry `rank`'s traffic: itself, or in the quotient its stage's representative."""
        return self.rep(rank // self.stage_ranks) if self.reduce else rank

    def _gpu(self, rank: int) -> str:
        return self.name(rank) if not self.reduce else f"s{rank // self.stage_ranks}/gpu"

    def _nic(self, rank: int) -> str:
        return f"{self.name(rank)}/nic0" if not self.reduce else f"s{rank // self.stage_ranks}/nic"

    def _switch(self, rank: int) -> str:
        return f"d{self.domain(self._node_rank(rank))}/nvswitch"

    def _rail(self, rank: int) -> str:
        return f"rail{self.rail(self._node_rank(rank))}"

    def _up(self, rank: int, where: str) -> list[tuple[str, str]]:
        """Edges leaving `rank` towards a peer that is local, on the same rail, or on another rail."""
        g = self._gpu(rank)
        if where == "local":
            return [(g, self._switch(rank))]
        nic, rail = self._nic(rank), self._rail(rank)
        return [(g, nic), (nic, rail)] + ([(rail, "spine")] if where == "other_rail" else [])

    def _down(self, rank: int, where: str) -> list[tuple[str, str]]:
        g = self._gpu(rank)
        if where == "local":
            return [(self._switch(rank), g)]
        nic, rail = self._nic(rank), self._rail(rank)
        return ([("spine", rail)] if where == "other_rail" else []) + [(rail, nic), (nic, g)]

    def _where(self, a: int, b: int) -> str:
        if self.domain(a) == self.domain(b):
            return "local"
        return "same_rail" if self.rail(a) == self.rail(b) else "other_rail"

    def path(self, src: int, dst: int) -> list[tuple[str, str]]:
        """Route src -> dst; in the quotient, dst is folded onto its own class's representative."""
        if not self.reduce:
            return collectives_route(self.graph, self.name(src), self.name(dst))
        where = self._where(src, dst)
        return self._up(src, where) + self._down(dst, where)

    # ------------------------------------------------------------------------------------------------ groups
    def members(self, stage: int, axis: str) -> list[list[int]]:
        """Global ranks of every group of `axis` inside pipeline stage `stage` (reduced: the representative's)."""
        key = (stage, axis)
        out = self._members.get(key)
        if out is None:
            grp = self.groups[axis]
            base0 = self.rep(stage)
            bases = [base0] if self.reduce else \
                [base0 + b for b in range(self.stage_ranks) if (b // grp.stride) % grp.size == 0]
            out = self._members[key] = [[b + j * grp.stride for j in range(grp.size)] for b in bases]
        return out

    def group(self, axis: str) -> Group:
        return self.groups[axis]

    # ------------------------------------------------------------------------------------------------- rings
    def ring(self, stage: int, axis: str, kind: str, nbytes: float, tag=None):
        """Run collective `kind` over every `axis` group of `stage` (a generator; returns when all are done)."""
        grp = self.groups[axis]
        if grp.size <= 1 or nbytes <= 0:
            return
        if not self.reduce:
            names = [[self.name(r) for r in m] for m in self.members(stage, axis)]
            procs = [self.env.process(collectives.collective(self.net, kind, n, nbytes, efficiency=self.eff, tag=tag))
                     for n in names]
            yield self.env.all_of(procs)
            return
        key = (stage, axis, kind, nbytes)
        phases = self._ring_phases.get(key)
        if phases is None:  # per phase: the representative's flow, its bytes and efficiency, the tail latency
            phases = self._ring_phases[key] = []
            for phase_kind, (hops, nhops, lat), span, div, factor, tail in self._ring_plan(stage, axis, kind):
                msg = nbytes / div
                phases.append((hops, nhops, lat, factor * msg, self._eff(phase_kind, span, msg), tail))
        for hops, nhops, lat, phase_bytes, eff, tail in phases:
            yield self.net.transfer_many(hops, nhops, phase_bytes, tag=tag, efficiency=eff, lat=lat)
            if tail is not None:
                yield self.env.timeout(tail)

    def _eff(self, kind: str, span: str, nbytes: float) -> float:
        key = (kind, span, nbytes)
        e = self._eff_cache.get(key)
        if e is None:
            e = self._eff_cache[key] = self.eff(kind, span, nbytes)
        return e

    def _ring_plan(self, stage: int, axis: str, kind: str) -> list[tuple]:
        """The representative's phases of one collective, as simulator.collectives.collective runs it: a flat
        ring, or (group spanning domains with equal ranks > 1 in each) local and cross-domain rings.
        Each phase: (kind, links of the representative's ring hop, span, bytes divisor, bytes on the busiest link
        per byte, the latency of the ring's steps after the first: None when there is none)."""
        key = (stage, axis, kind)
        out = self._plans.get(key)
        if out is not None:
            return out
        members = self.members(stage, axis)[0]
        doms: dict[int, list[int]] = {}
        for r in members:
            doms.setdefault(self.domain(r), []).append(r)
        parts = list(doms.values())
        hier = len(parts) > 1 and len({len(p) for p in parts}) == 1 and len(parts[0]) > 1
        phases = [(kind, members, 1)] if not hier else \
            [(k, parts[0], 1) if level == "local" else (k, [p[0] for p in parts], len(parts[0]))
             for k, level in HIERARCHY[kind]]
        out = []
        for k, ring, div in phases:
            n = len(ring)
            span = "scale_up" if len({self.domain(r) for r in ring}) == 1 else "scale_out"
            alpha = max(float(self.net.latency[self.net.links_of(self.path(ring[i], ring[(i + 1) % n]))].sum())
                        for i in range(n))
            hop = self.net.links_of(self.path(ring[0], ring[1 % n]))[None, :]  # one flow: the representative's
            steps = float(latency_steps(k, n))
            tail = (steps - 1) * alpha if steps > 1 and alpha > 0 else None
            out.append((k, (hop, np.array([hop.shape[1]]), self.net.route_latencies(hop)), span, div,
                        float(algo_factor(k, n)), tail))
        self._plans[key] = out
        return out

    def shift(self, stage: int, axis: str, nbytes: float, tag=None):
        """Every member of every `axis` group sends nbytes to the next member (a ring shift, e.g. context-parallel
        key/value exchange)."""
        grp = self.groups[axis]
        if grp.size <= 1 or nbytes <= 0:
            return
        events = []
        for members in self.members(stage, axis):
            n = len(members)
            span = "scale_up" if len({self.domain(r) for r in members}) == 1 else "scale_out"
            eff = self.eff("send_recv", span, nbytes)
            for i in range(1 if self.reduce else n):
                edges = self.path(members[i], members[(i + 1) % n])
                events.append(self.net.transfer(self.net.links_of(edges), nbytes, tag=tag, efficiency=eff))
        yield self.env.all_of(events)

    # ------------------------------------------------------------------------------------------ all-to-all
    def a2a_categories(self, stage: int) -> np.ndarray:
        """(ep, ep) array of category indices (A2A_CATEGORIES) for the pairs of the stage's first expert group."""
        members = self.members(stage, "expert")[0]
        cats = {c: i for i, c in enumerate(A2A_CATEGORIES)}
        return np.array([[cats[self._where(a, b)] for b in members] for a in members], dtype=np.int64)

    def all_to_all(self, stage: int, send: np.ndarray, recv: np.ndarray, message_bytes: float, tag=None):
        """Per-port all-to-all over every expert group of `stage`. send, recv: (ep, 3) bytes per rank and category
        (A2A_CATEGORIES), self excluded; message_bytes: the nccl-tests size that picks the efficiency."""
        yield from self.run_a2a(self.a2a_flows(stage, send, recv, message_bytes), tag)

    def a2a_flows(self, stage: int, send: np.ndarray, recv: np.ndarray, message_bytes: float):
        """The flows `all_to_all` starts (hops, hop counts, bytes, latencies, efficiency, the latency paid after
        them), or None when nothing moves; a step that repeats an exchange (the backward's) keeps them."""
        groups = self.members(stage, "expert")
        if len(groups[0]) <= 1:
            return None
        hops, nhops, tails, span, lat = self._a2a_port_routes(stage)
        eff = self._eff("all_to_all", span, message_bytes)
        if self.reduce:  # six flows at most: plain Python, and the routes of each pattern of used ports kept
            vals = _busiest_port_list(send) + _busiest_port_list(recv)
            used = tuple(v > 0 for v in vals)
            if not any(used):
                return None
            sel = self._a2a_used.get((stage, used))
            if sel is None:
                mask = np.array(used)
                sel = self._a2a_used[stage, used] = (hops[mask], nhops[mask], lat[mask], float(tails[mask].max()))
            return sel[0], sel[1], np.array([v for v, u in zip(vals, used) if u]), sel[2], eff, sel[3]
        nbytes = np.concatenate([send, recv], axis=1).ravel()  # per rank: 3 up, then 3 down categories
        nbytes = np.tile(nbytes, len(groups))
        used = nbytes > 0
        if not used.any():
            return None
        # the halves paid their own latency; a pair's route pays both
        return hops[used], nhops[used], nbytes[used], lat[used], eff, float(tails[used].max())

    def run_a2a(self, flows, tag=None, lead_s: float = 0.0):
        """Run the flows of `a2a_flows` (a generator); lead_s (simulator.ops.Comm.lead_s) is paid with the latency
        after them, in the same timeout (no event of its own)."""
        if flows is None:
            if lead_s > 0:
                yield self.env.timeout(lead_s)
            return
        hops, nhops, nbytes, lat, eff, tail = flows
        yield self.net.transfer_many(hops, nhops, nbytes, tag=tag, efficiency=eff, lat=lat)
        if tail + lead_s > 0:
            yield self.env.timeout(tail + lead_s)

    def _a2a_port_routes(self, stage: int):
        """Per port flow (rank x {up, down} x category): padded link indices, hop counts, and the latency each
        adds after the batch (the down half's, which the up half did not pay)."""
        cached = self._a2a_routes.get(stage)
        if cached is not None:
            return cached
        groups = self.members(stage, "expert")
        routes, tails = [], []
        for members in groups[:1] if self.reduce else groups:
            for r in members[:1] if self.reduce else members:
                for half in (self._up, self._down):
                    for where in A2A_CATEGORIES:
                        if where != "local" and self.topo.scale_out.nics_per_gpu == 0:
                            routes.append(np.zeros(0, dtype=np.int64))
                            tails.append(0.0)
                            continue
                        links = self.net.links_of(half(r, where))
                        routes.append(links)
                        tails.append(float(self.net.latency[links].sum()) if half == self._down else 0.0)
        width = max(len(x) for x in routes)
        hops = np.full((len(routes), width), -1, dtype=np.int64)
        for i, x in enumerate(routes):
            hops[i, : len(x)] = x
        nhops = np.array([len(x) for x in routes], dtype=np.int64)
        span = "scale_up" if len({self.domain(r) for r in groups[0]}) == 1 else "scale_out"
        out = self._a2a_routes[stage] = (hops, nhops, np.array(tails), span, self.net.route_latencies(hops))
        return out

    # ---------------------------------------------------------------------------------- point to point, host
    def p2p(self, src_stage: int, dst_stage: int, nbytes: float, tag=None):
        """Every rank of src_stage sends nbytes to its counterpart in dst_stage (pipeline send/receive)."""
        if nbytes <= 0 or src_stage == dst_stage:
            return
        key = (src_stage, dst_stage, nbytes)
        flows = self._p2p.get(key)
        if flows is None:  # per rank pair: links, hop count, latency, efficiency
            flows = self._p2p[key] = []
            for j in [0] if self.reduce else range(self.stage_ranks):
                a, b = self.rep(src_stage) + j, self.rep(dst_stage) + j
                span = "scale_up" if self.domain(a) == self.domain(b) else "scale_out"
                hop = self.net.links_of(self.path(a, b))[None, :]
                flows.append((hop, np.array([hop.shape[1]]), self.net.route_latencies(hop),
                              self.eff("send_recv", span, nbytes)))
        yield self.env.all_of([self.net.transfer_many(hop, nhop, nbytes, tag=tag, efficiency=eff, lat=lat)
                               for hop, nhop, lat, eff in flows])

    def host(self, stage: int, nbytes: float, to_host: bool, tag=None):
        """Every rank of `stage` copies nbytes to (or from) its host over the host link."""
        if nbytes <= 0:
            return
        eff = self.topo.efficiency.host_link
        offsets = [0] if self.reduce else range(self.stage_ranks)
        events = []
        for j in offsets:
            r = self.rep(stage) + j
            g = self._gpu(r)
            h = f"s{stage}/host" if self.reduce else self.graph.nodes[g]["host"]
            edge = [(g, h)] if to_host else [(h, g)]
            events.append(self.net.transfer(self.net.links_of(edge), nbytes, tag=tag, efficiency=eff))
        yield self.env.all_of(events)

    def link_kind(self, index: int) -> str:
        return self.graph.edges[self.net.links[index]]["kind"]


def _busiest_port_list(b: np.ndarray) -> list[float]:
    """The 3 bytes standing for the group: the largest NVLink total, and the NIC split (same rail, other rail) of
    the rank with the largest NIC total (the first such rank; both NIC categories leave through the same NIC)."""
    rows = b.tolist()
    nic = [row[1] + row[2] for row in rows]
    r = nic.index(max(nic))
    return [max(row[0] for row in rows), rows[r][1], rows[r][2]]


def _full_graph(topo: Topology) -> nx.DiGraph:
    from rackcast.topologies.graph import build_graph

    return build_graph(topo)


def collectives_route(graph, src: str, dst: str):
    from rackcast.topologies.graph import route

    return route(graph, src, dst)
