"""Flow-level network model (simulator.network, simulator.fairshare) and collectives (simulator.collectives)
against closed forms (simulator.collective_formulas) and textbook max-min fair answers.

    .venv/bin/pytest -q tests/test_network.py

Graphs are built by hand here with round numbers (NVLink 900 GB/s, NIC 50 GB/s) in the topologies.graph format.
"""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
import simpy

from rackcast.simulator import collective_formulas as cf
from rackcast.simulator import collectives as coll
from rackcast.simulator.costs import collective_time as topology_collective_time
from rackcast.simulator.fairshare import maxmin_rates, maxmin_rates_into, maxmin_rates_numpy, maxmin_workspace
from rackcast.simulator.network import Network

NVLINK = 900e9
NIC = 50e9
LAT_NV = 2e-6  # route latency gpu -> nvswitch -> gpu
LAT_NIC = 6e-6  # route latency gpu -> nic -> rail -> (spine -> rail) -> nic -> gpu


def hierarchical_time(kind: str, nbytes, n_local, n_domains, bw_up, lat_up, bw_out, lat_out):
    """Hierarchical all_reduce (RS inside, AR across on nbytes / n_local, AG inside), as simulator.collectives runs
    it, from the flat closed forms."""
    shard = nbytes / n_local
    assert kind == "all_reduce"
    return (cf.collective_time("reduce_scatter", nbytes, n_local, bw_up, lat_up) +
            cf.collective_time("all_reduce", shard, n_domains, bw_out, lat_out) +
            cf.collective_time("all_gather", nbytes, n_local, bw_up, lat_up))


def all_to_all_two_tier_time(nbytes, n_local, n_domains, bw_up, lat_up, bw_out, lat_out):
    """Direct all-to-all over n_domains x n_local ranks: the slower of the in-domain part over scale-up
    ((n_local-1)/n x nbytes) and the rest over the one NIC per GPU ((n-n_local)/n x nbytes), each after its own
    latency."""
    n = n_local * n_domains
    local = lat_up + (n_local - 1) / n * nbytes / bw_up if n_local > 1 else 0.0
    remote = lat_out + (n - n_local) / n * nbytes / bw_out if n > n_local else 0.0
    return max(local, remote)


def _link(g, u, v, cap, lat, kind):
    g.add_edge(u, v, capacity_Bps=cap, latency_s=lat, kind=kind)
    g.add_edge(v, u, capacity_Bps=cap, latency_s=lat, kind=kind)


def cluster(domains: int, gpus: int) -> nx.DiGraph:
    """domains x gpus GPUs, one NVSwitch per domain, one NIC per GPU on rail (gpu index), a non-blocking spine;
    the topologies.graph format and latency split, by hand with round numbers."""
    g = nx.DiGraph(name="test", domains=domains, usable_gpus=gpus, nics_per_gpu=1)
    for d in range(domains):
        g.add_node(f"d{d}/nvswitch", kind="nvswitch", domain=d)
        for i in range(gpus):
            gpu, nic = f"d{d}/gpu{i}", f"d{d}/gpu{i}/nic0"
            g.add_node(gpu, kind="gpu", domain=d, index=i)
            g.add_node(nic, kind="nic", domain=d, gpu=gpu, rail=f"rail{i}")
            _link(g, gpu, f"d{d}/nvswitch", NVLINK, LAT_NV / 2, "nvlink")
            _link(g, gpu, nic, NIC, 0.0, "pcie_nic")
            _link(g, nic, f"rail{i}", NIC, LAT_NIC / 2, "nic")
    g.add_node("spine", kind="spine")
    for r in range(gpus):
        g.add_node(f"rail{r}", kind="rail", index=r)
        _link(g, f"rail{r}", "spine", NIC * domains, 0.0, "rail_spine")
    return g


def gpus(domains, n):
    return [f"d{d}/gpu{i}" for d in range(domains) for i in range(n)]


def run(graph, make, **net_kw):
    """Run the process `make(net)` alone; return (elapsed simulated time, network)."""
    env = simpy.Environment()
    net = Network(env, graph, **net_kw)
    out = {}

    def proc():
        yield from make(net)
        out["t"] = env.now

    env.process(proc())
    env.run()
    return out["t"], net


def _line(caps: dict[tuple[str, str], float]) -> nx.DiGraph:
    g = nx.DiGraph()
    for (u, v), c in caps.items():
        g.add_edge(u, v, capacity_Bps=c, latency_s=0.0)
    return g


# ---------------------------------------------------------------------------------------------- closed forms
@pytest.mark.parametrize("stepwise", [False, True])
def test_ring_all_reduce_alone_matches_alpha_beta_closed_form(stepwise):
    g = cluster(1, 8)
    group = gpus(1, 8)
    nbytes = 256e6
    t, _ = run(g, lambda net: coll.ring_all_reduce(net, group, nbytes, stepwise=stepwise))
    expect = cf.collective_time("all_reduce", nbytes, 8, NVLINK, LAT_NV)
    assert t == pytest.approx(float(expect), rel=0.01)


@pytest.mark.parametrize("fn,kind", [(coll.ring_reduce_scatter, "reduce_scatter"),
                                     (coll.ring_all_gather, "all_gather"), (coll.all_to_all, "all_to_all")])
def test_other_collectives_alone_match_closed_form(fn, kind):
    group = gpus(1, 8)
    t, _ = run(cluster(1, 8), lambda net: fn(net, group, 64e6))
    assert t == pytest.approx(float(cf.collective_time(kind, 64e6, 8, NVLINK, LAT_NV)), rel=0.01)


def test_efficiency_scales_the_collective_time():
    group = gpus(1, 8)
    t1, _ = run(cluster(1, 8), lambda net: coll.ring_all_gather(net, group, 64e6))
    t2, _ = run(cluster(1, 8), lambda net: coll.ring_all_gather(net, group, 64e6, efficiency=lambda k, s, b: 0.5))
    lat = 7 * LAT_NV
    assert (t2 - lat) == pytest.approx(2 * (t1 - lat), rel=1e-9)


def test_hierarchical_all_reduce_matches_its_closed_form():
    group = gpus(2, 4)
    nbytes = 128e6
    t, _ = run(cluster(2, 4), lambda net: coll.hierarchical_all_reduce(net, group, nbytes))
    cross_lat = LAT_NIC
    expect = hierarchical_time("all_reduce", nbytes, 4, 2, NVLINK, LAT_NV, NIC, cross_lat)
    assert t == pytest.approx(float(expect), rel=0.01)
    t_auto, _ = run(cluster(2, 4), lambda net: coll.collective(net, "all_reduce", group, nbytes))
    assert t_auto == t
    t_flat, _ = run(cluster(2, 4), lambda net: coll.collective(net, "all_reduce", group, nbytes, hierarchical=False))
    assert t_flat == pytest.approx(float(cf.collective_time("all_reduce", nbytes, 8, NIC, LAT_NIC)), rel=0.01)
    assert t_flat > t


def test_send_alone_takes_latency_plus_bytes_over_bandwidth():
    t, _ = run(cluster(2, 2), lambda net: coll.send(net, "d0/gpu0", "d1/gpu1", 1e9))
    assert t == pytest.approx(LAT_NIC + 1e9 / NIC, rel=1e-9)  # different rails: through the spine
    assert run(cluster(2, 2), lambda net: coll.send(net, "d0/gpu1", "d0/gpu1", 1e9))[0] == 0.0


# -------------------------------------------------------------------------------------------------- sharing
def test_two_equal_flows_on_one_link_each_take_twice_as_long():
    g = _line({("a", "b"): 100.0})

    def flows(k):
        def make(net):
            yield net.env.all_of([net.transfer([("a", "b")], 1000.0, tag=i) for i in range(k)])
        return make

    t1, _ = run(g, flows(1))
    t2, net = run(g, flows(2), record_flows=True)
    assert t1 == pytest.approx(10.0)
    assert t2 == pytest.approx(2 * t1, rel=1e-12)
    assert [end for _, _, end, _ in net.flow_log] == pytest.approx([20.0, 20.0])


def test_three_flows_get_textbook_max_min_fair_rates():
    # Bertsekas & Gallager: f0 crosses L1 (10) and L2 (4), f1 only L1, f2 only L2 -> f0 = f2 = 2, f1 = 8.
    g = _line({("a", "b"): 10.0, ("b", "c"): 4.0})
    routes = [[("a", "b"), ("b", "c")], [("a", "b")], [("b", "c")]]
    sizes = [20.0, 100.0, 20.0]
    seen = {}

    def make(net):
        evs = [net.transfer(r, s, tag=i) for i, (r, s) in enumerate(zip(routes, sizes))]
        yield net.env.timeout(1.0)
        seen.update(net.active_rates())
        yield net.env.all_of(evs)

    t, net = run(g, make, record_flows=True)
    assert seen == pytest.approx({0: 2.0, 1: 8.0, 2: 2.0})
    ends = {tag: end for tag, _, end, _ in net.flow_log}
    # f0, f2 end at 20/2 = 10; f1 has 100 - 80 = 20 left, alone on L1 at 10 -> ends at 12.
    assert ends == pytest.approx({0: 10.0, 1: 12.0, 2: 10.0})
    caps = np.array([10.0, 4.0])
    indptr, indices = np.array([0, 2, 3, 4]), np.array([0, 1, 0, 1])
    assert maxmin_rates(indptr, indices, caps, np.full(3, np.inf)) == pytest.approx([2, 8, 2])


def test_rate_cap_limits_a_flow_and_frees_capacity_for_others():
    g = _line({("a", "b"): 10.0})
    seen = {}

    def make(net):
        evs = [net.transfer([("a", "b")], 100.0, tag=0, rate_cap_Bps=3.0), net.transfer([("a", "b")], 100.0, tag=1)]
        yield net.env.timeout(1.0)
        seen.update(net.active_rates())
        yield net.env.all_of(evs)

    run(g, make)
    assert seen == pytest.approx({0: 3.0, 1: 7.0})


@pytest.mark.parametrize("argument", ["nhops", "nbytes", "rate_cap_Bps", "lat"])
def test_transfer_many_rejects_a_per_flow_array_whose_length_is_not_the_number_of_routes(argument):
    net = Network(simpy.Environment(), _line({("a", "b"): 10.0, ("b", "c"): 4.0}))
    hops = np.array([[net.link_index["a", "b"], -1], [net.link_index["b", "c"], -1]])
    given = {"nhops": np.array([1, 1]), "nbytes": np.array([5.0, 5.0]), "rate_cap_Bps": np.array([3.0, 3.0]),
             "lat": np.zeros(2)}
    given[argument] = given[argument][:1]  # one value short: the compiled kernel would read past its end
    nhops = given.pop("nhops")
    with pytest.raises(ValueError, match=f"hops has 2 rows but {argument} has 1"):
        net.transfer_many(hops, nhops, given.pop("nbytes"), **given)
    assert net.stats["flows"] == 0  # nothing started


def test_all_to_all_across_two_domains_is_bound_by_the_nics_not_nvlink():
    group = gpus(2, 4)
    nbytes = 400e6  # per rank; 4 of its 8 chunks leave the domain through its one NIC
    t, _ = run(cluster(2, 4), lambda net: coll.all_to_all(net, group, nbytes))
    nic_bound = LAT_NIC + (4 / 8) * nbytes / NIC
    nvlink_bound = LAT_NV + (7 / 8) * nbytes / NVLINK
    assert t == pytest.approx(nic_bound, rel=0.01)
    assert t > 10 * nvlink_bound
    two_tier = all_to_all_two_tier_time(nbytes, 4, 2, NVLINK, LAT_NV, NIC, LAT_NIC)
    assert t == pytest.approx(float(two_tier), rel=0.01)


def test_all_to_allv_with_a_hot_destination_is_slower_than_uniform_with_the_same_bytes():
    n = 8
    group = gpus(1, n)
    uniform = np.full((n, n), 8e6)
    np.fill_diagonal(uniform, 0.0)
    hot = np.full((n, n), 4e6)
    hot[:, 0] = 0.0
    np.fill_diagonal(hot, 0.0)
    hot[1:, 0] = (uniform.sum() - hot.sum()) / (n - 1)  # rank 0 receives 36 MB from each, the others 4 MB
    assert hot.sum() == pytest.approx(uniform.sum())
    t_uni, _ = run(cluster(1, n), lambda net: coll.all_to_allv(net, group, uniform))
    t_hot, _ = run(cluster(1, n), lambda net: coll.all_to_allv(net, group, hot))
    assert t_hot > 1.5 * t_uni
    # The hot destination's ingress link carries its column: that is the bound.
    assert t_hot == pytest.approx(LAT_NV + hot[:, 0].sum() / NVLINK, rel=0.01)


def test_quantum_merges_finishes_and_stays_within_the_quantum():
    rng = np.random.default_rng(3)
    group = gpus(1, 8)
    m = rng.uniform(1e6, 10e6, size=(8, 8))
    t_exact, n_exact = run(cluster(1, 8), lambda net: coll.all_to_allv(net, group, m))
    t_q, n_q = run(cluster(1, 8), lambda net: coll.all_to_allv(net, group, m), quantum_s=1e-6)
    assert n_q.stats["solves"] < n_exact.stats["solves"]
    assert abs(t_q - t_exact) <= 1e-6 * n_exact.stats["solves"]
    assert t_q == pytest.approx(t_exact, rel=0.02)


def test_closed_forms_vectorise_and_match_the_topology_efficiency_curves():
    from rackcast.topologies import load_topology

    topo = load_topology("gb200-nvl72")
    sizes = np.logspace(5, 10, 11)
    n = np.array([[8], [64]])
    t = topology_collective_time(topo, "all_reduce", n, sizes, span_out=False)
    assert t.shape == (2, 11)
    for j, size in enumerate(sizes):
        eff = topo.efficiency.collective_efficiency("all_reduce", "scale_up", size)
        expect = 2 * 63 * topo.link_latency_s("scale_up") + 2 * 63 / 64 * size / (eff * topo.scale_up.bandwidth_Bps)
        assert t[1, j] == pytest.approx(expect, rel=1e-12)
    assert cf.collective_time("all_reduce", 1e9, 1, 1e9, 1e-6) == 0.0
    assert cf.collective_time("send_recv", 1e9, 2, 1e9, 1e-6) == pytest.approx(1.0 + 1e-6)


def test_utilisation_change_points_integrate_to_the_bytes_moved():
    group = gpus(1, 4)
    t, net = run(cluster(1, 4), lambda net: coll.all_to_all(net, group, 40e6))
    times, links, values = net.utilisation_arrays()
    moved = 0.0
    for l in np.unique(links):
        ts, vs = times[links == l], values[links == l]
        moved += float(np.sum(vs[:-1] * np.diff(ts)))
        assert vs[-1] == 0.0
    # every off-diagonal chunk crosses two links (gpu -> nvswitch -> gpu)
    assert moved == pytest.approx(2 * 12 * 10e6, rel=1e-9)
    assert max(values) <= NVLINK * (1 + 1e-12)


# -------------------------------------------------------------------------------------------- solver, determinism
def _random_instance(rng):
    nf, nl = int(rng.integers(1, 60)), int(rng.integers(1, 25))
    lens = rng.integers(1, min(nl, 6) + 1, size=nf)
    indices = np.concatenate([rng.choice(nl, size=k, replace=False) for k in lens]).astype(np.int64)
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    capacity = rng.choice([1.0, 2.0, 5.0, 10.0], size=nl) * rng.uniform(0.5, 2.0, size=nl)
    caps = np.where(rng.random(nf) < 0.3, rng.uniform(0.05, 3.0, size=nf), np.inf)
    return indptr, indices, capacity, caps


def test_numba_and_numpy_rate_solvers_agree_on_random_instances():
    rng = np.random.default_rng(1234)
    for _ in range(300):
        inst = _random_instance(rng)
        a, b = maxmin_rates(*inst), maxmin_rates_numpy(*inst)
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=0)
        indptr, indices, capacity, caps = inst
        load = np.bincount(indices, weights=np.repeat(a, np.diff(indptr)), minlength=len(capacity))
        assert np.all(load <= capacity * (1 + 1e-9))
        assert np.all(a <= caps * (1 + 1e-12))
        # max-min: every flow is at its cap or crosses a saturated link where it has the largest rate
        for f in range(len(a)):
            ls = indices[indptr[f]:indptr[f + 1]]
            if a[f] >= caps[f] * (1 - 1e-9):
                continue
            ok = False
            for l in ls:
                on_l = np.repeat(np.arange(len(a)), np.diff(indptr))[indices == l]
                if load[l] >= capacity[l] * (1 - 1e-9) and a[f] >= a[on_l].max() * (1 - 1e-9):
                    ok = True
            assert ok


def _mixed_scenario(solver):
    rng = np.random.default_rng(7)
    group = gpus(2, 4)
    m = rng.uniform(1e6, 20e6, size=(8, 8))

    def make(net):
        env = net.env
        a = env.process(coll.all_to_allv(net, group, m))
        b = env.process(coll.hierarchical_all_reduce(net, group, 50e6, stepwise=True))
        c = env.process(coll.send(net, "d0/gpu1", "d1/gpu2", 30e6))
        yield env.all_of([a, b, c])

    return run(cluster(2, 4), make, solver=solver, record_flows=True)


def test_rate_solver_reusing_one_dirty_workspace_gives_the_rates_of_a_fresh_solve():
    rng = np.random.default_rng(99)
    ints, floats = np.empty(0, np.int64), np.empty(0)
    for _ in range(200):
        indptr, indices, capacity, caps = _random_instance(rng)
        need_ints, need_floats = maxmin_workspace(len(caps), len(capacity), len(indices))
        if len(ints) < need_ints or len(floats) < need_floats:  # kept across instances, as simulator.network does
            ints, floats = np.empty(2 * need_ints, np.int64), np.empty(2 * need_floats)
        ints[:] = rng.integers(-5, 50, size=len(ints))  # whatever the last solve or anything else left there
        floats[:] = rng.uniform(-1.0, 1.0, size=len(floats))
        rates = np.full(len(caps), np.nan)
        maxmin_rates_into(indptr, indices, capacity, caps, rates, ints, floats)
        assert rates.tobytes() == maxmin_rates(indptr, indices, capacity, caps).tobytes()


def test_many_flows_finishing_together_are_delivered_in_start_order_at_their_latency():
    # 40 flows (more than flowslots sorts by insertion) of equal bytes share one link and finish at one instant.
    # Earlier flows freed their slots last-first, so these take the slots in reverse of their start order; started
    # in two batches, with route latencies falling in start order. Each batch's event fires at its last delivery.
    g = nx.DiGraph()
    g.add_edge("a", "hub", capacity_Bps=NIC, latency_s=0.0)
    for i in range(40):
        g.add_edge("hub", f"b{i}", capacity_Bps=1e15, latency_s=(40 - i) * 1e-6)
    env = simpy.Environment()
    net = Network(env, g, record_flows=True)
    route = [np.array([net.link_index["a", "hub"], net.link_index["hub", f"b{i}"]]) for i in range(40)]
    for i in range(40):  # the 40 slots, freed one at a time, the last started first
        net.transfer(route[i], (40 - i) * 1e5, tag="earlier")
    env.run()
    t0, fired = env.now, {}
    for batch, flows in (("first", range(0, 25)), ("second", range(25, 40))):
        ev = net.transfer_many(np.stack([route[i] for i in flows]), np.full(len(flows), 2), 1e6, tag=batch)
        ev.callbacks.append(lambda e, b=batch: fired.setdefault(b, env.now))
    env.run()
    drained = t0 + 40 * 1e6 / NIC
    log = net.flow_log[40:]
    assert [tag for tag, *_ in log] == ["first"] * 25 + ["second"] * 15
    assert [deliver for _, _, deliver, _ in log] == pytest.approx([drained + (40 - i) * 1e-6 for i in range(40)],
                                                                  rel=1e-12)
    assert fired == pytest.approx({"first": drained + 40e-6, "second": drained + 15e-6}, rel=1e-12)


def test_results_are_deterministic():
    t1, n1 = _mixed_scenario("numba")
    t2, n2 = _mixed_scenario("numba")
    assert t1 == t2
    assert n1.flow_log == n2.flow_log
    for x, y in zip(n1.utilisation_arrays(), n2.utilisation_arrays()):
        assert np.array_equal(x, y)
    t3, _ = _mixed_scenario("numpy")
    assert t3 == pytest.approx(t1, rel=1e-9)


def test_contention_between_collectives_slows_both():
    group = gpus(1, 8)
    t_a2a, _ = run(cluster(1, 8), lambda net: coll.all_to_all(net, group, 100e6))

    def both(net):
        a = net.env.process(coll.all_to_all(net, group, 100e6))
        b = net.env.process(coll.ring_all_reduce(net, group, 100e6))
        yield a
        out["a2a"] = net.env.now
        yield b

    out = {}
    run(cluster(1, 8), both)
    # Each GPU's egress carries 7 all-to-all chunks of 12.5 MB and its ring flow (far larger): max-min gives each
    # of the 8 flows 900/8 GB/s, so the all-to-all slows by 8/7.
    assert t_a2a == pytest.approx(LAT_NV + 87.5e6 / NVLINK, rel=1e-9)
    assert out["a2a"] == pytest.approx(LAT_NV + 12.5e6 / (NVLINK / 8), rel=1e-9)


def test_all_to_all_on_the_preset_graph_is_bound_by_the_preset_nic():
    from rackcast.topologies import load_topology
    from rackcast.topologies.graph import build_graph

    topo = load_topology("gb200-nvl72", domains=2, usable_gpus=4)
    group = gpus(2, 4)
    t, net = run(build_graph(topo), lambda net: coll.all_to_all(net, group, 100e6))
    nic_bound = net.route_latency("d0/gpu0", "d1/gpu1") + (4 / 8) * 100e6 / topo.scale_out.nic_bandwidth_Bps
    assert t == pytest.approx(nic_bound, rel=0.01)
