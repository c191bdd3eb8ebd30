"""`rackcast topologies list|show`: the hardware presets, their figures and the graph built from them.

    rackcast topologies list [--json]
    rackcast topologies show gb200-nvl72 --racks 11 [--usable-gpus 72] [--json]

Units: FLOP/s for peaks (dense), bytes/s per GPU per direction for links, seconds for latencies.
"""

from __future__ import annotations

from typing import Any

from rackcast.cli.common import bounded, console, gib, human, print_json, table
from rackcast.plan import TopologyRef
from rackcast.strict import to_data
from rackcast.topologies import list_topologies, load_topology
from rackcast.topologies.spec import Topology


def register(sub) -> None:
    parser = sub.add_parser("topologies", help="list hardware presets or show one's figures and graph")
    tsub = parser.add_subparsers(dest="topologies_command", metavar="ACTION", required=True)
    p_list = tsub.add_parser("list", help="list the topology presets")
    p_list.add_argument("--json", action="store_true", help="print JSON")
    p_list.set_defaults(func=_list)
    p_show = tsub.add_parser("show", help="show a preset's figures, derived bandwidths and graph size")
    p_show.add_argument("name", help="preset name or path to a topology YAML")
    p_show.add_argument("--racks", type=bounded(TopologyRef, "domains", int), default=None, metavar="N",
                        help="number of domains (racks or nodes); default: the preset's")
    p_show.add_argument("--usable-gpus", type=bounded(TopologyRef, "usable_gpus", int), default=None, metavar="N",
                        help="GPUs used per domain (e.g. 64 or 72 on NVL72); default: the preset's")
    p_show.add_argument("--json", action="store_true", help="print JSON")
    p_show.set_defaults(func=_show)


def _peak_bf16(topo: Topology) -> float | None:
    return topo.accelerator.peak_flops.get("bf16")


def _summary(topo: Topology) -> dict[str, Any]:
    peak = _peak_bf16(topo)
    return {
        "name": topo.name,
        "domain_label": topo.domain_label,
        "domains": topo.domains,
        "gpus_per_domain": topo.scale_up.usable_gpus,
        "domain_size": topo.scale_up.domain_size,
        "gpus": topo.gpus,
        "accelerator": topo.accelerator.name,
        "peak_bf16_flops_per_gpu": peak,
        "scale_up_bandwidth_Bps": topo.link_bandwidth_Bps("scale_up"),
        "scale_out_bandwidth_Bps": topo.link_bandwidth_Bps("scale_out"),
        "description": topo.description,
    }


def _list(args) -> int:
    topos = [load_topology(name) for name in list_topologies()]
    if args.json:
        print_json([_summary(t) for t in topos])
        return 0
    rows = []
    for t in topos:
        s = _summary(t)
        rows.append([t.name, f"{s['gpus_per_domain']}/{s['domain_size']} per {t.domain_label}", t.accelerator.name,
                     human(s["peak_bf16_flops_per_gpu"] or 0, "FLOP/s"), human(s["scale_up_bandwidth_Bps"], "B/s"),
                     human(s["scale_out_bandwidth_Bps"], "B/s")])
    console().print(table("Topology presets (bf16 dense peak per GPU; link bandwidth per GPU per direction)",
                          ["name", "GPUs used", "accelerator", "bf16 peak", "scale-up", "scale-out"], rows))
    return 0


def show_data(topo: Topology) -> dict[str, Any]:
    """Every typed field (strict.to_data) plus derived figures and the graph's size."""
    from rackcast.topologies.graph import build_graph  # networkx: only when a graph is asked for

    graph = build_graph(topo)
    peak = _peak_bf16(topo)
    data = to_data(topo)
    data.update({
        "gpus": topo.gpus,
        "peak_bf16_flops_per_gpu": peak,
        "peak_bf16_flops_total": None if peak is None else peak * topo.gpus,
        "link_bandwidth_Bps": {span: topo.link_bandwidth_Bps(span) for span in ("scale_up", "scale_out")},
        "link_latency_s": {span: topo.link_latency_s(span) for span in ("scale_up", "scale_out")},
        "graph": {"nodes": graph.number_of_nodes(), "edges": graph.number_of_edges()},
    })
    return data


def _show(args) -> int:
    topo = load_topology(args.name, domains=args.racks, usable_gpus=args.usable_gpus)
    data = show_data(topo)
    if args.json:
        print_json(data)
        return 0
    su, so, acc, host = topo.scale_up, topo.scale_out, topo.accelerator, topo.host
    out = console()
    out.print(f"[bold]{topo.name}[/bold]  {topo.description}")
    out.print(f"{topo.domains} {topo.domain_label}(s) x {su.usable_gpus} of {su.domain_size} GPUs = "
              f"{topo.gpus} GPUs; graph: {data['graph']['nodes']} nodes, {data['graph']['edges']} directed edges")
    peaks = ", ".join(f"{k} {human(v, 'FLOP/s')}" for k, v in acc.peak_flops.items())
    out.print(f"accelerator: {acc.name}; dense peak per GPU: {peaks}")
    if data["peak_bf16_flops_total"] is not None:
        out.print(f"cluster bf16 dense peak: {data['peak_bf16_flops_total'] / 1e15:,.4g} PFLOP/s")
    out.print(f"device memory: {gib(acc.hbm_bytes)} at {human(acc.hbm_bandwidth_Bps, 'B/s')} per GPU; host: "
              f"{gib(host.memory_bytes)} at {human(host.memory_bandwidth_Bps, 'B/s')} per {host.gpus_per_host} GPUs")
    rows = [
        ["scale-up (in domain)", human(su.bandwidth_Bps, "B/s"), f"{su.latency_s * 1e6:.3g} us",
         f"{su.switches} switch chips"],
        ["scale-out (NICs)", human(so.bandwidth_per_gpu_Bps, "B/s"), f"{so.latency_s * 1e6:.3g} us",
         f"{so.nics_per_gpu} NIC/GPU x {human(so.nic_bandwidth_Bps, 'B/s')}, {so.rails} rails, "
         f"oversubscription {so.oversubscription:g}"] if so.nics_per_gpu else
        ["scale-out (NICs)", "none", "", f"no fabric: one {topo.domain_label} only"],
        ["host link", human(host.link_bandwidth_Bps, "B/s"), f"{host.link_latency_s * 1e6:.3g} us", ""],
    ]
    out.print(table("Links (bandwidth per GPU per direction; peak, before the efficiency profile)",
                    ["link", "bandwidth", "latency", "notes"], rows))
    eff, a = topo.efficiency, topo.accelerator
    out.print(f"efficiency profile: {eff.source}")
    out.print(f"  attention {eff.attention:.2f} of peak, memory-bound {eff.memory_bound:.2f} of memory bandwidth, "
              f"host link {eff.host_link:.2f}; " + (f"largest measured GEMM point {eff.gemm[-1].value:.2f} of peak"
                                                    if eff.gemm else
                                                    f"GEMM shape model: ceilings {eff.gemm_ceiling:.3f} dense, "
                                                    f"{eff.grouped_gemm_ceiling:.3f} grouped, {a.sms} SMs, "
                                                    f"{a.tile_m} x {a.tile_n} tiles"))
    out.print(f"  stack profile {eff.stack or '-'} (topologies/profiles): launch floor {eff.launch_s * 1e6:.3g} us, "
              f"error band +-{100 * eff.error_band:.0f}%")
    return 0
