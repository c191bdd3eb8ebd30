"""Topology presets load strictly and round-trip; the graph has the right capacities, routes and max-flows; the CLI.

    .venv/bin/pytest -q tests/test_topologies.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rackcast.errors import RackcastError
from rackcast.strict import from_data, load_yaml, to_data
from rackcast.topologies import PRESET_DIR, list_topologies, load_topology
from rackcast.topologies.graph import build_graph, gpu_name, max_flow_Bps, route, route_latency_s
from rackcast.topologies.spec import Topology

REPO = Path(__file__).resolve().parent.parent
EXPECTED_PRESETS = {"gb200-nvl72", "gb300-nvl72", "h100-hgx", "h200-hgx", "b200-hgx", "a100-dgx", "local-cpu"}


def _preset_data(name: str) -> dict:
    return load_yaml(PRESET_DIR / f"{name}.yaml")


def test_all_expected_presets_exist():
    assert EXPECTED_PRESETS <= set(list_topologies())


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS))
def test_preset_loads_strictly_and_round_trips(name):
    topo = load_topology(name)
    assert topo.name == name
    assert from_data(Topology, to_data(topo)) == topo


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS))
def test_every_preset_figure_line_carries_a_comment(name):
    # Every numeric hardware figure names its source in a YAML comment on its line (curve points may share the
    # comment of their list's header line).
    text = (PRESET_DIR / f"{name}.yaml").read_text().splitlines()
    for line in text:
        stripped = line.strip()
        if stripped.startswith(("#", "- {", "domains:")):
            continue
        key, _, value = stripped.partition(":")
        value = value.split("#")[0].strip()
        try:
            float(value)
        except ValueError:
            continue
        assert "#" in line, f"{name}: {key} has no source comment"


def test_unknown_key_in_preset_names_the_field():
    data = _preset_data("h100-hgx")
    data["scale_up"]["bandwith_Bps"] = 1.0
    with pytest.raises(RackcastError, match=r"h100-hgx\.yaml: scale_up\.bandwith_Bps: unknown key"):
        from_data(Topology, data, where="h100-hgx.yaml")


def test_wrong_type_in_preset_names_the_field():
    data = _preset_data("a100-dgx")
    data["scale_out"]["rails"] = "eight"
    with pytest.raises(RackcastError, match=r"a100-dgx\.yaml: scale_out\.rails: expected int"):
        from_data(Topology, data, where="a100-dgx.yaml")


def test_nvl72_rack_max_flow_between_two_gpus_is_nvlink_rate():
    graph = build_graph(load_topology("gb200-nvl72", domains=2))
    assert max_flow_Bps(graph, gpu_name(0, 0), gpu_name(0, 37)) == pytest.approx(900e9)


def test_max_flow_between_racks_is_bound_by_the_nic_rate():
    graph = build_graph(load_topology("gb200-nvl72", domains=2))
    assert max_flow_Bps(graph, gpu_name(0, 0), gpu_name(1, 5)) == pytest.approx(48.5e9)
    assert max_flow_Bps(graph, gpu_name(0, 3), gpu_name(1, 3)) == pytest.approx(48.5e9)


def test_graph_node_counts_and_usable_gpus_only():
    topo = load_topology("gb200-nvl72", domains=11)
    graph = build_graph(topo)
    kinds: dict[str, int] = {}
    for _, attrs in graph.nodes(data=True):
        kinds[attrs["kind"]] = kinds.get(attrs["kind"], 0) + 1
    assert kinds == {"gpu": 704, "nvswitch": 11, "nic": 704, "rail": 8, "spine": 1, "host": 352}
    assert gpu_name(0, 63) in graph and gpu_name(0, 64) not in graph
    for u, v, attrs in graph.edges(data=True):
        assert graph.has_edge(v, u), f"{u}->{v} has no reverse edge"
        assert set(attrs) == {"capacity_Bps", "latency_s", "kind"}


def test_rail_spine_capacity_is_rail_nic_sum_over_oversubscription():
    topo = load_topology("h100-hgx", domains=4)
    graph = build_graph(topo)
    # 4 nodes x 8 GPUs, one NIC each, 8 rails: 4 NICs per rail.
    assert graph.edges["rail0", "spine"]["capacity_Bps"] == pytest.approx(4 * 48.5e9)
    assert graph.edges["d2/gpu5/nic0", "rail5"]["latency_s"] == pytest.approx(2.5e-6)


def test_same_domain_route_goes_through_the_switch_and_sums_scale_up_latency():
    topo = load_topology("gb200-nvl72", domains=2)
    graph = build_graph(topo)
    edges = route(graph, gpu_name(1, 2), gpu_name(1, 60))
    assert edges == [("d1/gpu2", "d1/nvswitch"), ("d1/nvswitch", "d1/gpu60")]
    assert route_latency_s(graph, edges) == pytest.approx(topo.scale_up.latency_s)


def test_cross_domain_routes_exist_and_sum_scale_out_latency():
    topo = load_topology("gb200-nvl72", domains=3)
    graph = build_graph(topo)
    same_rail = route(graph, gpu_name(0, 1), gpu_name(2, 9))  # rails 1 and 9 % 8 = 1
    other_rail = route(graph, gpu_name(0, 1), gpu_name(2, 2))
    assert [v for _, v in same_rail] == ["d0/gpu1/nic0", "rail1", "d2/gpu9/nic0", "d2/gpu9"]
    assert ("rail1", "spine") in other_rail and ("spine", "rail2") in other_rail
    for edges in (same_rail, other_rail):
        assert all(graph.has_edge(u, v) for u, v in edges)
        assert all(b[0] == a[1] for a, b in zip(edges, edges[1:]))
        assert route_latency_s(graph, edges) == pytest.approx(topo.scale_out.latency_s)


def test_route_refuses_an_unknown_gpu():
    graph = build_graph(load_topology("h100-hgx"))
    with pytest.raises(RackcastError, match="d0/gpu8"):
        route(graph, gpu_name(0, 0), gpu_name(0, 8))


def test_single_machine_preset_refuses_several_domains_at_load():
    with pytest.raises(RackcastError, match="domains: local-cpu has no scale-out fabric"):
        load_topology("local-cpu", domains=2)


@pytest.mark.parametrize("name, domains, gpus, nic_Bps, hbm_bytes", [
    ("h100-hgx", 2048, 16384, 48.5e9, 80.0e9),     # a 16,384-GPU H100 cluster over 400G NDR InfiniBand
    ("b200-hgx", 32, 256, 48.5e9, 180.0e9),
    ("gb300-nvl72", 4, 256, 97.0e9, 279.0e9),     # 4 racks x 64 GPUs, 800G ConnectX-8 per GPU
])
def test_frontier_cluster_preset_loads_and_builds_its_graph(name, domains, gpus, nic_Bps, hbm_bytes):
    topo = load_topology(name, domains=domains)
    assert topo.gpus == gpus
    assert topo.accelerator.hbm_bytes == hbm_bytes
    graph = build_graph(topo)
    assert sum(1 for _, kind in graph.nodes(data="kind") if kind == "gpu") == gpus
    two = build_graph(load_topology(name, domains=2))
    assert max_flow_Bps(two, gpu_name(0, 0), gpu_name(1, 3)) == pytest.approx(nic_Bps)
    assert max_flow_Bps(two, gpu_name(0, 0), gpu_name(0, 3)) == pytest.approx(topo.scale_up.bandwidth_Bps)


def test_gb300_keeps_gb200_fabric_and_differs_in_memory_fp4_and_nic():
    gb200, gb300 = load_topology("gb200-nvl72"), load_topology("gb300-nvl72")
    assert gb300.scale_up == gb200.scale_up
    assert gb300.peak_flops("bf16") == gb200.peak_flops("bf16")
    assert gb300.peak_flops("fp4") == 1.5 * gb200.peak_flops("fp4")
    assert gb300.accelerator.hbm_bytes > gb200.accelerator.hbm_bytes
    assert gb300.scale_out.nic_bandwidth_Bps == 2 * gb200.scale_out.nic_bandwidth_Bps


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rackcast.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


def test_cli_show_eleven_racks_reports_704_gpus():
    result = _cli("topologies", "show", "gb200-nvl72", "--racks", "11", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["gpus"] == 704
    assert data["domains"] == 11
    assert data["link_bandwidth_Bps"] == {"scale_up": 900e9, "scale_out": 48.5e9}
    assert data["graph"]["nodes"] == 1780
    assert from_data(Topology, {k: v for k, v in data.items() if k in Topology.__dataclass_fields__}) \
        == load_topology("gb200-nvl72", domains=11)


def test_cli_list_json_names_every_preset():
    result = _cli("topologies", "list", "--json")
    assert result.returncode == 0, result.stderr
    assert EXPECTED_PRESETS <= {row["name"] for row in json.loads(result.stdout)}


def test_cli_unknown_preset_exits_2_with_one_line():
    result = _cli("topologies", "show", "no-such-rack")
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
    assert "no-such-rack" in result.stderr


def test_processes_beyond_the_hosts_cores_time_share_them_and_gpus_do_not():
    from dataclasses import replace

    from rackcast.topologies import load_topology

    two, four = load_topology("local-cpu", 1, 2), load_topology("local-cpu", 1, 4)
    assert two.host.cores == 2 and two.time_share() == 1.0 and four.time_share() == 0.5
    assert four.peak_flops("fp32") == two.peak_flops("fp32") / 2
    assert four.accelerator.hbm_bandwidth_Bps == two.accelerator.hbm_bandwidth_Bps / 2
    ops = replace(two.efficiency.host_op_s, forward=1e-5, backward=2e-5, optimizer=3e-6)
    shared = replace(two.with_efficiency(replace(two.efficiency, host_op_s=ops)), scale_up=four.scale_up).time_shared()
    assert (shared.efficiency.host_op_s.forward, shared.efficiency.host_op_s.backward,
            shared.efficiency.host_op_s.optimizer) == pytest.approx((2e-5, 4e-5, 6e-6))
    assert four.scale_up.bandwidth_Bps == two.scale_up.bandwidth_Bps  # links stay as measured
    gpus = load_topology("gb200-nvl72", 1, 72)
    assert gpus.host.cores == 0 and gpus.time_share() == 1.0 and gpus == gpus.time_shared()
