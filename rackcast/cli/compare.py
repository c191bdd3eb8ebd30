"""`rackcast compare PLAN RUN_DIR`: predicted (simulator, else estimate) against measured (the run's record.json) for
every metric, with the error; --trace writes the simulated and measured timelines into one Chrome trace.

    rackcast compare examples/plans/tiny-2proc-ep.yaml runs/tiny-2proc-ep --topology runs/calibrated.yaml
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from rackcast.cli.common import console, print_json, table
from rackcast.errors import RackcastError
from rackcast.plan import load_plan
from rackcast.units import MIB


def register(sub) -> None:
    p = sub.add_parser("compare", help="predicted vs measured metrics of a plan and its run folder")
    p.add_argument("plan", help="plan YAML file")
    p.add_argument("run_dir", help="run folder written by `rackcast train` (record.json)")
    p.add_argument("--topology", help="topology preset or YAML to predict with (default: the plan's), e.g. the "
                                      "output of `rackcast calibrate`")
    p.add_argument("--estimate", action="store_true", help="predict with the closed-form estimate, not the simulator")
    p.add_argument("--no-overhead", action="store_true", help="predict with the topology's host_op_s set to 0 "
                                                               "(the host per-op overhead is otherwise included when "
                                                               "the topology has a measured one)")
    p.add_argument("--force", action="store_true", help="compare even when the run trained another plan (its "
                                                         "record's plan_hash differs from this plan's)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--trace", metavar="OUT.json", help="write simulated and measured timelines as one Chrome trace")
    p.set_defaults(func=_run)


def _fmt(v, unit: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if unit == "bytes":
        return f"{v / MIB:.1f} MiB"
    if unit == "tokens/s":
        return f"{v:,.0f}"
    if unit.startswith("fraction"):
        return f"{100 * v:.2f}%"
    return f"{v:.4f}"


def _run(args) -> int:
    from rackcast.validation.compare import (calibration_note, check_same_plan, combined_trace, compare_rows,
                                             core_wait_note, load_record, predict)
    from rackcast.atomic import write_text_atomic
    from rackcast.topologies import load_topology

    plan = load_plan(args.plan)
    rec = load_record(args.run_dir)
    if not args.force:
        try:
            check_same_plan(plan, rec, args.run_dir)
        except RackcastError as exc:
            raise RackcastError(f"{exc}; --force compares anyway") from None
    if args.topology:
        t = plan.topology
        topo = load_topology(args.topology, t.domains, t.usable_gpus or None)
    else:
        topo = plan.topology_spec()
    note = calibration_note(topo)
    if args.no_overhead:
        topo = topo.with_efficiency(topo.efficiency.without_host_ops())
    source, result = predict(plan, topo=topo, record=bool(args.trace),
                             prefer="estimate" if args.estimate else "simulate")
    rows = compare_rows(result, rec, plan)
    if args.trace:
        write_text_atomic(args.trace, json.dumps(combined_trace(result, source, Path(args.run_dir), rec)) + "\n")
    topo_name = args.topology or plan.topology.name
    if args.json:
        print_json({"plan": plan.name, "run": str(args.run_dir), "prediction": source, "topology": topo_name,
                    "calibrated": not note, "core_share": rec.get("core_share"), "step_cpu_s": rec.get("step_cpu_s"),
                    "metrics": [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
                                for r in rows]})
        return 0
    out = console()
    cells = [[r["metric"], _fmt(r["predicted"], r["unit"]), _fmt(r["measured"], r["unit"]),
              "-" if math.isnan(r["error"]) else f"{100 * r['error']:+.1f}%"] for r in rows]
    out.print(table(f"{plan.name}: predicted ({source}, topology {topo_name}) vs measured ({args.run_dir}); "
                    "error = (predicted - measured) / measured", ["metric", "predicted", "measured", "error"], cells))
    if rec.get("memory_measure"):
        out.print(f"peak memory: measured as {rec['memory_measure']}, largest rank; predicted for "
                  f"{rec.get('param_dtype', 'bf16')} weights and eager activations (validation.compare)")
    elif rec.get("device", "cpu") == "cpu":
        out.print("peak memory: this (older) run reports the process's peak resident set, runtime included")
    if args.trace:
        out.print(f"wrote {args.trace} (open in https://ui.perfetto.dev)")
    waited = core_wait_note(rec)
    if waited:
        out.print(f"[yellow]note:[/yellow] {waited}")
    if note:
        out.print(f"[yellow]note:[/yellow] {note}")
    return 0
