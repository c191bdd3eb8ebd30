"""`rackcast estimate PLAN`: the closed-form prediction of a plan — fits or not, memory per GPU, step time,
tokens/s, MFU, phase breakdown and days to the plan's token budget."""

from __future__ import annotations

import math

from rackcast.cli.common import console, gib, human, print_json, refuse_unless_fits, table
from rackcast.modelspec import FlopsConvention
from rackcast.plan import load_plan
from rackcast.simulator import metrics


def add_convention_argument(parser) -> None:
    parser.add_argument(
        "--flops-convention", default="default",
        help="MFU numerator: attention=full|causal, window=window|sequence, head=in|out "
             "(default attention=full,window=window,head=in)")


def register(sub) -> None:
    parser = sub.add_parser("estimate", help="closed-form step time, memory and MFU of a plan file")
    parser.add_argument("plan", help="plan YAML file")
    parser.add_argument("--json", action="store_true", help="print JSON")
    add_convention_argument(parser)
    parser.set_defaults(func=_run)


def _run(args) -> int:
    from rackcast.simulator.estimate import estimate

    plan = load_plan(args.plan)
    result = estimate(plan, FlopsConvention.parse(args.flops_convention))
    if args.json:
        print_json({"plan": plan.name, **result.as_dict()})
        refuse_unless_fits(args.plan, result.fits, result.memory.total, result.hbm_bytes)
        return 0
    out = console()
    verdict = "[green]fits[/green]" if result.fits else "[red]does not fit[/red]"
    out.print(f"[bold]{plan.name}[/bold]: {plan.model_spec().name} on {result.gpus} GPUs "
              f"({plan.topology.domains} x {plan.topology.name})  {verdict}")
    mem = result.memory.as_dict()
    rows = [[k, gib(v)] for k, v in mem.items() if k not in ("total", "host")]
    rows.append(["total", f"{gib(mem['total'])} of {gib(result.hbm_bytes)} HBM"])
    if mem["host"]:
        rows.append(["host (offloaded)", f"{gib(mem['host'])} per GPU; {gib(result.host_bytes_per_host)} of "
                                         f"{gib(result.host_capacity_bytes)} per host"])
    out.print(table("Memory per GPU (heaviest pipeline rank)", ["part", "bytes"], rows))
    step = result.step_time_s
    rows = [[k, f"{v:.4f}", f"{100 * v / step:.1f}%"] for k, v in result.phases_s.items()]
    rows.append(["step", f"{step:.4f}", "100%"])
    out.print(table("Step time breakdown (seconds; exposed parts only)", ["phase", "s", "share"], rows))
    days = "no token budget in the plan" if math.isnan(result.days_to_budget) else \
        f"{result.days_to_budget:.1f} days to {human(plan.tokens)} tokens (steady state, no failures)"
    out.print(f"tokens/s {human(result.tokens_per_s)}   MFU {100 * result.mfu:.1f}% of bf16 peak "
              f"({result.flops_convention})   {days}")
    if result.band:
        out.print(metrics.band_text(result.band))
    if result.drop_fraction:
        out.print(f"expected drop fraction (capacity transport): {100 * result.drop_fraction:.2f}%")
    spec, topo = plan.model_spec(), plan.topology_spec()
    if topo.efficiency.host_op_s.measured:
        from rackcast.simulator.estimate import eager_bytes_counted
        from rackcast.simulator.host_overhead import COUNTED_AS, runs_as_counted
        from rackcast.simulator.op_bytes import MAX_PARAMS

        out.print("eager memory traffic: " + ("counted bytes per framework op (simulator/op_bytes)"
                  if eager_bytes_counted(spec, plan, topo) else
                  "the plan does not run as the bytes are counted (" +
                  ", ".join(f"{k} {v}" for k, v in COUNTED_AS.items()) + "); the fused elementwise term stands"
                  if not runs_as_counted(plan) else
                  f"not counted for this model (rackcast calibrate --op-counts MODEL counts models up to "
                  f"{MAX_PARAMS:.3g} parameters); the fused elementwise term stands"))
    refuse_unless_fits(args.plan, result.fits, result.memory.total, result.hbm_bytes)
    return 0
