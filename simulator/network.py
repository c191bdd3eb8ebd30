"""Flow-level network model: the topology graph's directed links as shared resources with max-min fair sharing.

Every directed edge (u, v) of the graph (attributes `capacity_Bps`, per direction, and `latency_s`) is a link. A
transfer is a flow of bytes over a route (a list of directed edges); all active flows get the max-min fair rates of
simulator.fairshare, re-solved whenever a flow starts or finishes (flows started at the same simulated instant are
solved once, together; so are flows finishing together). A flow's bytes occupy its links from its start; it is
delivered the route's summed latency after its last byte has been sent, so a flow alone takes
`latency + bytes / rate`.

The slot bookkeeping around the solve (draining, retiring, gathering, filling) is compiled, in
simulator.flowslots.

`transfer_many` starts a batch of flows (an all-to-all, the n flows of a ring) with vectorised bookkeeping and one
event for the whole batch, which succeeds when its last flow is delivered.

Efficiency (how much of a link a real collective achieves, EfficiencyProfile.collective_efficiency): a transfer with
`efficiency=e` puts `bytes / e` on the wire. Alone it then takes exactly the calibrated time; under contention the
lost fraction still occupies the links (the pessimistic choice: protocol overhead and retransmits load the wire).
A hard per-flow rate cap (`rate_cap_Bps`) is available as well.

Link utilisation is kept as change points (time, link, bytes/s in use) for trace counters.

    import simpy
    from rackcast.simulator.network import Network
    env = simpy.Environment()
    net = Network(env, graph)                      # graph: topologies.graph format (networkx.DiGraph)
    done = net.send("d0/gpu0", "d0/gpu1", 1e9)     # a simpy event
    env.run()

Tests: `.venv/bin/pytest -q tests/test_network.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import simpy

from rackcast.simulator.eventloop import call_later, new_event, trigger_later
from rackcast.simulator.fairshare import maxmin_rates, maxmin_rates_numpy
from rackcast.simulator.flowslots import (C_PEND, C_SIZE, F_CAP, F_OUT, F_OUT_GROUP, F_RATE, F_REM, F_START, F_WIRE,
                                            I_ACTIVE, I_FLOW, I_GROUP, I_NHOPS, I_OUT, I_OUT_GROUP, L_CAP, L_LOAD,
                                            _activate, _apply_rates, _changed, _drain, _gather_active, _start, _step,
                                            allot)

Router = Callable[[object, str, str], Sequence[tuple[str, str]]]


def _per_flow(x) -> bool:
    """Whether x holds one value per flow (else it is one value for all)."""
    return isinstance(x, (list, tuple)) or (isinstance(x, np.ndarray) and x.ndim > 0)


def _length_mismatch(k: int, **per_flow) -> str:
    """The message for per-flow arguments whose length is not the k rows of hops."""
    wrong = ", ".join(f"{name} has {len(v)}" for name, v in per_flow.items()
                      if isinstance(v, np.ndarray) and len(v) != k)
    return f"transfer_many: hops has {k} rows but {wrong}"


# Flows due to finish within this many seconds (absolute plus relative to the clock) of now finish now: float
# rounding of `now + remaining / rate` must not leave a flow with a few bytes for a separate, spurious event.
_TIME_EPS_ABS = 1e-12
_TIME_EPS_REL = 1e-12


def _default_router(graph, src: str, dst: str):
    from rackcast.topologies.graph import route

    return route(graph, src, dst)


class Network:
    """Shared links with max-min fair flow rates inside a SimPy environment.

    router: (graph, src, dst) -> directed edges; default topologies.graph.route.
    solver: "numba" (default) or "numpy" (the reference implementation, slower).
    track_utilisation: keep per-link (time, bytes/s) change points.
    record_flows: keep (tag, start, delivery, wire bytes) per flow in `flow_log`, in start order per finishing instant.
    quantum_s: flows due to finish within this many seconds of the next finish finish with it (their last bytes
        delivered up to quantum_s early), which merges rate solves; 0 (default) is exact.
    """

    def __init__(self, env: simpy.Environment, graph, *, router: Router | None = None, solver: str = "numba",
                 track_utilisation: bool = True, record_flows: bool = False, quantum_s: float = 0.0):
        if quantum_s < 0:
            raise ValueError(f"quantum_s must be >= 0, got {quantum_s}")
        self.quantum_s = float(quantum_s)
        if solver not in ("numba", "numpy"):
            raise ValueError(f"solver must be 'numba' or 'numpy', got {solver!r}")
        self.env = env
        self.graph = graph
        self._router = router or _default_router
        self._solve = maxmin_rates if solver == "numba" else maxmin_rates_numpy
        self.links: list[tuple[str, str]] = list(graph.edges())
        self.link_index = {e: i for i, e in enumerate(self.links)}
        attrs = [graph.edges[e] for e in self.links]
        self.capacity = np.array([a["capacity_Bps"] for a in attrs], dtype=np.float64)
        self.latency = np.array([a.get("latency_s", 0.0) for a in attrs], dtype=np.float64)
        bad = np.flatnonzero(~(self.capacity > 0))
        if bad.size:
            raise ValueError(f"link {self.links[bad[0]]} needs a positive capacity_Bps")
        self._route_cache: dict[tuple[str, str], np.ndarray] = {}
        self._matrix_cache: dict[tuple, tuple] = {}

        # Flows live in slots of these arrays (simulator.flowslots); a slot is reused after its flow finishes.
        # (simulator.flowslots.allot packs them into one float and one int buffer, the compiled kernels' arguments)
        self._views = None
        self._allot(0, 8, 0)
        self._links[L_CAP] = self.capacity
        self._groups: dict[int, tuple] = {}  # gid -> (event, tag) until its last flow is delivered
        self._next_group = 0
        self._last = env.now
        self._kick = False
        self._wake = None  # the pending wake-up (eventloop.call_later's event), None when none is needed
        self._on_wake_callback = self._on_wake  # bound once
        self._compiled = self._solve is maxmin_rates
        self._wake_at = math.inf

        self.track_utilisation = track_utilisation
        self._load = np.zeros(len(self.links))
        self._util_t: list[np.ndarray] = []
        self._util_l: list[np.ndarray] = []
        self._util_v: list[np.ndarray] = []
        self.record_flows = record_flows
        self.flow_log: list[tuple[object, float, float, float]] = []
        self.stats = {"flows": 0, "solves": 0, "max_active": 0}

    # ----------------------------------------------------------------------------------------------- routes
    def route(self, src: str, dst: str) -> np.ndarray:
        """Link indices of the route src -> dst (cached; empty when src == dst)."""
        key = (src, dst)
        r = self._route_cache.get(key)
        if r is None:
            r = self.links_of(self._router(self.graph, src, dst) if src != dst else [])
            self._route_cache[key] = r
        return r

    def links_of(self, edges: Sequence[tuple[str, str]]) -> np.ndarray:
        try:
            return np.array([self.link_index[tuple(e)] for e in edges], dtype=np.int64)
        except KeyError as exc:
            raise ValueError(f"route edge {exc.args[0]} is not a link of the graph") from None

    def route_latency(self, src: str, dst: str) -> float:
        return float(self.latency[self.route(src, dst)].sum())

    def route_matrix(self, srcs: Sequence[str], dsts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Padded link indices (k x hops, -1 padded) and hop counts of the routes srcs[i] -> dsts[i] (cached)."""
        key = (tuple(srcs), tuple(dsts))
        hit = self._matrix_cache.get(key)
        if hit is None:
            routes = [self.route(s, d) for s, d in zip(srcs, dsts)]
            nhops = np.array([len(r) for r in routes], dtype=np.int64)
            hops = np.full((len(routes), max(1, int(nhops.max(initial=0)))), -1, dtype=np.int64)
            for i, r in enumerate(routes):
                hops[i, : len(r)] = r
            hit = (hops, nhops)
            self._matrix_cache[key] = hit
        return hit

    def all_pairs(self, group: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(src index, dst index, padded hops, hop counts) of every ordered pair i != j of group (cached)."""
        key = ("all_pairs", tuple(group))
        hit = self._matrix_cache.get(key)
        if hit is None:
            n = len(group)
            src, dst = np.nonzero(~np.eye(n, dtype=bool))
            hops, nhops = self.route_matrix([group[i] for i in src], [group[j] for j in dst])
            hit = (src, dst, hops, nhops)
            self._matrix_cache[key] = hit
        return hit

    # ------------------------------------------------------------------------------------------- transfers
    def send(self, src: str, dst: str, nbytes: float, *, tag=None, efficiency: float = 1.0,
             rate_cap_Bps: float = math.inf) -> simpy.Event:
        """A point-to-point transfer src -> dst along the router's route; see `transfer`."""
        return self.transfer(self.route(src, dst), nbytes, tag=tag, efficiency=efficiency,
                             rate_cap_Bps=rate_cap_Bps)

    def transfer(self, route, nbytes: float, *, tag=None, efficiency: float = 1.0,
                 rate_cap_Bps: float = math.inf) -> simpy.Event:
        """Start a flow of `nbytes / efficiency` wire bytes over `route` (directed edges, or link indices from
        `route()`); the returned event succeeds (value: tag) when the bytes are delivered."""
        links = route if isinstance(route, np.ndarray) else self.links_of(route)
        return self.transfer_many(links[None, :], np.array([links.size]), nbytes, tag=tag, efficiency=efficiency,
                                  rate_cap_Bps=rate_cap_Bps)

    def route_latencies(self, hops: np.ndarray) -> np.ndarray:
        """Summed link latency of each row of padded link indices (k x h, -1 padded)."""
        return np.where(hops >= 0, self.latency[hops], 0.0).sum(axis=1) if hops.shape[0] else np.zeros(0)

    def transfer_many(self, hops: np.ndarray, nhops: np.ndarray, nbytes, *, tag=None, efficiency: float = 1.0,
                      rate_cap_Bps=math.inf, lat: np.ndarray | None = None) -> simpy.Event:
        """Start k flows at once: hops (k x h link indices, -1 padded, as from `route_matrix`), nhops (k), nbytes
        (scalar or k), rate_cap_Bps (scalar or k). One event (value: tag) succeeds when all k are delivered.
        lat: route_latencies(hops), when the caller keeps it."""
        if not 0.0 < efficiency <= 1.0:
            raise ValueError(f"efficiency must lie in (0, 1], got {efficiency}")
        if type(nbytes) is not float and not (type(nbytes) is np.ndarray and nbytes.ndim == 1):  # one value for
            nbytes = np.asarray(nbytes, dtype=np.float64) if _per_flow(nbytes) else float(nbytes)  # all, or per flow
        if type(rate_cap_Bps) is not float:
            rate_cap_Bps = np.asarray(rate_cap_Bps, dtype=np.float64) if _per_flow(rate_cap_Bps) \
                else float(rate_cap_Bps)
        if type(nhops) is not np.ndarray:  # the step simulator's callers pass int64 arrays already
            nhops = np.asarray(nhops, dtype=np.int64)
        if lat is None:
            lat = self.route_latencies(hops)
        k = hops.shape[0]  # the compiled _start reads every per-flow array at rows 0..k-1 unchecked
        if nhops.shape[0] != k or lat.shape[0] != k or (type(nbytes) is np.ndarray and nbytes.shape[0] != k) or \
                (type(rate_cap_Bps) is np.ndarray and rate_cap_Bps.shape[0] != k):
            raise ValueError(_length_mismatch(k, nhops=nhops, nbytes=nbytes, rate_cap_Bps=rate_cap_Bps, lat=lat))
        now, efficiency = float(self.env._now), float(efficiency)
        gid = self._next_group
        # Flows with nothing to move (or no link to cross) are delivered after their latency alone.
        m, deliver, negative = _start(hops, nhops, nbytes, efficiency, rate_cap_Bps, lat, now, gid, self._fbuf,
                                      self._ibuf)
        if m < 0:  # no room in the slot arrays (checked there, where the counts are): grow them, start again
            self._reserve(hops.shape[0], hops.shape[1], gid)
            m, deliver, negative = _start(hops, nhops, nbytes, efficiency, rate_cap_Bps, lat, now, gid, self._fbuf,
                                          self._ibuf)
        if negative:
            raise ValueError("nbytes must be >= 0")
        done = new_event(self.env)
        if m == 0:
            self._deliver(done, tag, deliver - now)
            return done
        self._next_group += 1
        self._groups[gid] = (done, tag)
        self.stats["flows"] += m
        if not self._kick:
            self._kick = True
            call_later(self.env, 0, self._on_kick)
        return done

    def _reserve(self, k: int, width: int, gid: int) -> None:
        """Room for k more flows of up to `width` hops, and for group `gid` (growing the slot arrays; the slots a
        flow gets do not depend on how much room there is)."""
        slots, groups = self._ii.shape[1], self._grp.shape[1]
        if self._cnt[C_SIZE] + k > slots:
            slots = max(64, int(self._cnt[C_SIZE]) + k, 2 * slots)
        self._allot(slots, max(width, self._hops.shape[1]), groups + max(64, groups) if gid >= groups else groups)

    def _allot(self, slots: int, width: int, groups: int) -> None:
        """The slot arrays (flowslots.allot) for `slots` flows of up to `width` hops and `groups` groups, holding
        the current ones' contents (none at first)."""
        self._fbuf, self._ibuf, self._views = allot(slots, width, len(self.links), groups, self._views)
        self._fl, self._ii, self._hops, self._cnt, self._links, self._grp = self._views[:6]

    def _deliver(self, event: simpy.Event, tag, delay: float) -> None:
        if delay > 0:  # event succeeds with the tag after the delay (as a timeout triggering it would)
            trigger_later(self.env, delay, event, tag)
        else:
            event.succeed(tag)

    # ------------------------------------------------------------------------------------------ event loop
    def _on_kick(self, _event) -> None:
        self._kick = False
        self._update()

    def _on_wake(self, event) -> None:
        if event is self._wake:  # else superseded
            self._wake = None
            self._wake_at = math.inf
            self._update()

    def _update(self) -> None:
        now = self.env._now
        eps = _TIME_EPS_ABS + _TIME_EPS_REL * now + self.quantum_s
        dt = now - self._last
        self._last = now
        track = self.track_utilisation
        if self._compiled:  # drain, retire, activate, gather, solve and apply in one compiled call
            done, groups, n_act, t_min, group, delivery = _step(self._fbuf, self._ibuf, dt, eps, now, track)
            if groups or (done and self.record_flows):
                self._finish(now, done, groups, group, delivery)
            load = self._links[L_LOAD] if track else None
        else:
            load = np.zeros(len(self.links))
            done, groups = _drain(self._fl, self._ii, self._cnt, dt, eps, now, self._grp)
            if done:
                self._finish(now, done, groups, int(self._ii[I_OUT_GROUP, 0]), float(self._fl[F_OUT_GROUP, 0]))
            _activate(self._ii, self._cnt)
            act, indptr, indices, caps = _gather_active(self._ii[I_ACTIVE], self._cnt[C_SIZE], self._ii[I_NHOPS],
                                                        self._hops, self._fl[F_CAP])
            n_act, t_min = act.size, math.inf
            if n_act:
                rates = self._solve(indptr, indices, self.capacity, caps)
                t_min, load = _apply_rates(act, indptr, indices, rates, self._fl[F_REM], self._fl[F_RATE],
                                           len(self.links), self.track_utilisation)
        stats = self.stats
        if n_act > stats["max_active"]:
            stats["max_active"] = n_act
        if track:
            self._record_load(now, load)
        if n_act == 0:
            self._wake = None  # no wake-up is needed any more
            self._wake_at = math.inf
            return
        stats["solves"] += 1
        t_next = now + t_min
        if t_next == self._wake_at:
            return  # the pending wake-up is still the right one
        # SimPy cannot cancel a scheduled event: the superseded wake-up stays queued and is ignored when it fires (it may
        # still advance env.now past the last delivery, so time collectives by their process, not env.now).
        self._wake_at = t_next
        delay = t_next - now
        self._wake = call_later(self.env, delay if delay > 0.0 else 0.0, self._on_wake_callback)

    def _finish(self, now: float, done: int, groups: int, group: int, delivery: float) -> None:
        """Deliver the groups whose last flow finished (`flowslots._drain` retired `done` flows, completing
        `groups` groups, and wrote them to the output buffers; the first of them is `group`, delivered at
        `delivery`)."""
        if self.record_flows:
            slots = self._ii[I_OUT, :done]
            for g, s, d, w in zip(self._ii[I_GROUP, slots].tolist(), self._fl[F_START, slots].tolist(),
                                  self._fl[F_OUT, :done].tolist(), self._fl[F_WIRE, slots].tolist()):
                self.flow_log.append((self._groups[g][1], s, d, w))
        pop, env = self._groups.pop, self.env
        if groups == 1:  # the usual case: one batch ends (scalars, without the lists)
            out_group = ((group, delivery),)
        else:
            out_group = zip(self._ii[I_OUT_GROUP, :groups].tolist(), self._fl[F_OUT_GROUP, :groups].tolist())
        for g, d in out_group:
            event, tag = pop(g)
            if d > now:  # as _deliver
                trigger_later(env, d - now, event, tag)
            else:
                event.succeed(tag)

    # ---------------------------------------------------------------------------------------- observation
    def _record_load(self, now: float, load: np.ndarray) -> None:
        """Keep the links whose bytes/s in use changed (load: bytes/s per link now)."""
        if not self.track_utilisation:
            return
        changed = _changed(load, self._load)
        if changed.size:
            self._util_t.append(np.full(changed.size, now))
            self._util_l.append(changed)
            self._util_v.append(load[changed])
        self._load = load.copy()  # load may be the row the next update overwrites

    def utilisation_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Change points as arrays (times, link indices into `links`, bytes/s in use from that time on)."""
        if not self._util_t:
            return np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0)
        return np.concatenate(self._util_t), np.concatenate(self._util_l), np.concatenate(self._util_v)

    def utilisation(self) -> list[tuple[float, tuple[str, str], float]]:
        """Change points (time, link (u, v), bytes/s in use from that time on), in time order."""
        t, l, v = self.utilisation_arrays()
        return [(float(a), self.links[int(b)], float(c)) for a, b, c in zip(t, l, v)]

    def active_rates(self) -> dict:
        """tag -> current rate (bytes/s) of each active flow (flows started this instant are not solved yet; flows
        sharing a tag report the last one's rate)."""
        act = np.flatnonzero(self._ii[I_ACTIVE, : self._cnt[C_SIZE]])
        act = act[np.argsort(self._ii[I_FLOW, act], kind="stable")]
        return {self._groups[g][1]: float(r) for g, r in zip(self._ii[I_GROUP, act].tolist(),
                                                               self._fl[F_RATE, act].tolist())}

    @property
    def active_flows(self) -> int:
        return int(self._ii[I_ACTIVE, : self._cnt[C_SIZE]].sum()) + int(self._cnt[C_PEND])
