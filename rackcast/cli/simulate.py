"""`rackcast simulate PLAN`: a discrete-event simulation of one training step of a plan (simulator.step) — step
time, tokens/s, MFU, exposed-time breakdown, drop fraction, peak memory per GPU; optionally a Chrome/Perfetto trace
and a Parquet row."""

from __future__ import annotations

import math

from rackcast.cli.common import bounded, console, gib, human, refuse_unless_fits, table
from rackcast.cli.estimate import add_convention_argument
from rackcast.modelspec import FlopsConvention
from rackcast.plan import Plan, load_plan
from rackcast.simulator import metrics


def register(sub) -> None:
    parser = sub.add_parser("simulate", help="discrete-event simulation of one training step of a plan file")
    parser.add_argument("plan", help="plan YAML file")
    parser.add_argument("--seed", type=bounded(Plan, "seed", int), default=None,
                        help="routing seed, 0..2^32-1 (default: the plan's seed)")
    parser.add_argument("--json", action="store_true", help="print the metrics as JSON (deterministic)")
    parser.add_argument("--trace", metavar="OUT.json", help="write a Chrome/Perfetto trace")
    parser.add_argument("--parquet", metavar="OUT.parquet", help="write the metrics as a one-row Parquet file")
    add_convention_argument(parser)
    parser.set_defaults(func=_run)


def _run(args) -> int:
    import sys

    from rackcast.simulator.results import result_json, write_parquet
    from rackcast.simulator.step import simulate
    from rackcast.simulator.trace import write_trace

    plan = load_plan(args.plan)
    seed = plan.seed if args.seed is None else args.seed
    result = simulate(plan, seed=seed, convention=FlopsConvention.parse(args.flops_convention),
                      record=bool(args.trace))
    if args.trace:
        write_trace(result, args.trace)
    if args.parquet:
        write_parquet(result, args.parquet)
    hbm = plan.topology_spec().accelerator.hbm_bytes
    if args.json:
        sys.stdout.write(result_json(result))
        refuse_unless_fits(args.plan, result.fits, result.peak_memory_bytes, hbm)
        return 0
    out = console()
    verdict = "[green]fits[/green]" if result.fits else "[red]does not fit[/red]"
    out.print(f"[bold]{plan.name}[/bold]: simulated step on {result.gpus} GPUs ({plan.topology.domains} x "
              f"{plan.topology.name}), {result.simulated_ranks} simulated rank class(es), seed {seed}  {verdict}")
    step = result.step_time_s
    rows = [[k, f"{v:.4f}", f"{100 * v / step:.1f}%"] for k, v in result.phases_s.items()]
    rows.append(["step", f"{step:.4f}", "100%"])
    out.print(table("Step time breakdown (seconds; rank 0's timeline, exposed parts only)", ["phase", "s", "share"],
                    rows))
    days = "no token budget in the plan" if math.isnan(result.days_to_budget) else \
        f"{result.days_to_budget:.1f} days to {human(plan.tokens)} tokens (steady state, no failures)"
    out.print(f"tokens/s {human(result.tokens_per_s)}   MFU {100 * result.mfu:.1f}% of bf16 peak "
              f"({result.flops_convention})   {days}")
    if result.band:
        out.print(metrics.band_text(result.band))
    out.print(f"peak memory per GPU {gib(result.peak_memory_bytes)} (memory timeline)   "
              f"drop fraction {100 * result.drop_fraction:.2f}%   {result.events} events")
    for label, path in (("trace", args.trace), ("parquet", args.parquet)):
        if path:
            out.print(f"wrote {label} {path}")
    refuse_unless_fits(args.plan, result.fits, result.peak_memory_bytes, hbm)
    return 0
