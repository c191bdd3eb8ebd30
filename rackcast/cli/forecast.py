"""`rackcast forecast PLAN --tokens T --start DATE`: when the run will be done, with failures, restarts,
checkpoints and spares — a Monte Carlo of the whole run (planner.forecast) on the plan's steady-state speed.

Prints expected days, P10/P50/P90 finish dates, the probability of finishing before the deadline, goodput, the
time lost per cause and the checkpoint interval that minimises expected days; --json prints the same as JSON and
--output writes it to a file (atomically, at the end: Ctrl-C leaves no partial file).

    rackcast forecast examples/plans/marin-535b-hero.yaml --tokens 18e12 --start 2026-09-01 --deadline 2026-11-20
"""

from __future__ import annotations

import math
import sys

from rackcast.cli.common import console, human, json_text, print_json, table
from rackcast.errors import RackcastError
from rackcast.plan import Plan, load_plan
from rackcast.strict import check_value
from rackcast.units import GIB, SECONDS_PER_HOUR


def register(sub) -> None:
    parser = sub.add_parser("forecast", help="Monte Carlo forecast of a whole run: failures, restarts, "
                                             "checkpoints, finish dates")
    parser.add_argument("plan", help="plan YAML file")
    parser.add_argument("--tokens", help="token budget (e.g. 18e12; default: the plan's tokens)")
    parser.add_argument("--start", help="start date, YYYY-MM-DD (default: the plan's start)")
    parser.add_argument("--deadline", help="deadline, YYYY-MM-DD: the run must finish before this date begins "
                                           "(default: the plan's deadline, if any)")
    parser.add_argument("--runs", default="10000", help="Monte Carlo runs (default 10000)")
    parser.add_argument("--seed", default="0", help="random seed (default 0)")
    parser.add_argument("--checkpoint-interval", metavar="HOURS",
                        help="compute hours between checkpoints (default: the reliability file's; 0: none)")
    parser.add_argument("--spares-policy", help="when a domain has no spares left: shrink (run on with fewer "
                                                "data-parallel replicas) or wait (for its repair)")
    parser.add_argument("--reliability", default="default",
                        help="failure rates and costs: a name in topologies/reliability/ or a YAML path")
    parser.add_argument("--no-interval-search", action="store_true",
                        help="skip the search for the checkpoint interval that minimises expected days")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--output", metavar="FILE", help="also write the JSON to FILE")
    parser.set_defaults(func=_run)


def _number(text: str, what: str, kind=float):
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise RackcastError(f"--{what}: expected a number, got {text!r}") from None
    if kind is int:
        if not value.is_integer():
            raise RackcastError(f"--{what}: expected a whole number, got {text!r}")
        return int(value)
    if not math.isfinite(value):
        raise RackcastError(f"--{what}: expected a finite number, got {text!r}")
    return value


def _progress():
    """A rich progress bar on stderr (only on a terminal) and the two callbacks that drive it."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(stderr=True), transient=True, disable=not sys.stderr.isatty())
    tasks = {}

    def callback(name: str):
        def update(done: int, total: int):
            if name not in tasks:
                tasks[name] = bar.add_task(name, total=total)
            bar.update(tasks[name], completed=done)
        return update

    return bar, callback("Monte Carlo runs"), callback("checkpoint intervals")


def _run(args) -> int:
    from rackcast.planner.forecast import forecast
    from rackcast.atomic import write_text_atomic
    from rackcast.topologies.reliability import load_reliability

    runs = _number(args.runs, "runs", int)
    seed = check_value(Plan, "seed", _number(args.seed, "seed", int), "--seed")
    tokens = check_value(Plan, "tokens", _number(args.tokens, "tokens"), "--tokens") if args.tokens is not None \
        else None
    interval_s = None
    if args.checkpoint_interval is not None:
        hours = _number(args.checkpoint_interval, "checkpoint-interval")
        if hours < 0:
            raise RackcastError(f"--checkpoint-interval: hours must be >= 0 (0: no checkpoints), got {hours}")
        interval_s = hours * SECONDS_PER_HOUR
    plan = load_plan(args.plan)
    start = args.start or plan.start
    if not start:
        raise RackcastError("a start date is needed (--start YYYY-MM-DD, or start: in the plan)")
    deadline = args.deadline or plan.deadline or None
    reliability = load_reliability(args.reliability)
    bar, runs_cb, search_cb = _progress()
    with bar:
        result = forecast(plan, tokens, start, deadline, runs=runs, seed=seed, reliability=reliability,
                          interval_s=interval_s, policy=args.spares_policy, search=not args.no_interval_search,
                          progress=runs_cb, search_progress=search_cb)
    data = {"plan": plan.name, "reliability": reliability.name, **result.as_dict()}
    if args.output:
        write_text_atomic(args.output, json_text(data))
    if args.json:
        print_json(data)
        return 0
    _print(plan, reliability, result)
    return 0


def _print(plan, reliability, r) -> None:
    out = console()
    s = r.setup
    out.print(f"[bold]{plan.name}[/bold]: {human(s.tokens)} tokens on {s.gpus} GPUs ({s.domains} domains), "
              f"{human(s.tokens_per_s)} tokens/s steady state = {s.steady_days:.2f} days without failures")
    fails = ", ".join(f"{k} {v:.3f}" for k, v in s.job_failures_per_day.items())
    rows = [
        ["failures per day (whole job)", f"{sum(s.job_failures_per_day.values()):.3f} ({fails})"],
        ["job MTBF", f"{s.mtbf_s / SECONDS_PER_HOUR:.1f} h"],
        ["checkpoint", f"{s.checkpoint_bytes / GIB:,.0f} GiB, written in {s.checkpoint_write_s:.1f} s, "
                       f"every {s.interval_s / SECONDS_PER_HOUR:.2f} h of compute" if s.interval_s else "disabled"],
        ["restart cost", f"{s.restart_s / 60:.1f} min (detection + rescheduling + {s.reload_s:.1f} s reload)"],
        ["spares", f"{s.spares_per_domain} GPUs per domain; policy {s.policy}"],
        ["reliability figures", reliability.name],
    ]
    out.print(table("Inputs", ["item", "value"], rows))

    def when(days: float) -> str:
        return f"{days:.2f} days" + (f"  ({r.date_after(days)})" if r.start else "")

    rows = [["expected", f"{r.expected_days:.2f} days"], ["P10", when(r.p10_days)], ["P50", when(r.p50_days)],
            ["P90", when(r.p90_days)]]
    if r.deadline:
        rows.append([f"P(done before {r.deadline})", f"{100 * r.probability_by_deadline:.1f}%"])
    rows.append(["goodput", f"{100 * r.goodput:.1f}% (steady-state time / wall time)"])
    if r.unfinished_runs:
        rows.append(["unfinished runs", str(r.unfinished_runs)])
    out.print(table(f"Finish (from {r.start}; {r.runs} runs, seed {r.seed})" if r.start else "Finish",
                    ["statistic", "value"], rows))
    rows = [[cause.replace("_", " "), f"{days:.3f}", f"{24 * days:.1f}"] for cause, days in r.lost_days.items()]
    rows.append(["total", f"{sum(r.lost_days.values()):.3f}", f"{24 * sum(r.lost_days.values()):.1f}"])
    out.print(table("Time lost per run (mean)", ["cause", "days", "hours"], rows))
    if r.interval:
        iv = r.interval
        out.print(f"best checkpoint interval {iv.best_s / 60:.1f} min of compute (expected "
                  f"{iv.best_expected_days:.2f} days over {iv.runs} runs; Young {iv.young_s / 60:.1f} min, "
                  f"Daly {iv.daly_s / 60:.1f} min)")
