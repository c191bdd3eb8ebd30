"""`rackcast plan`: search parallel layouts for a model on a topology against a token budget (and a deadline), print
the ranked table, and write every candidate as Parquet and the winner as a plan file.

    rackcast plan --model marin-535b-a23b --topology gb200-nvl72 --racks 11 --tokens 18e12 --out plan.yaml
"""

from __future__ import annotations

import shlex
import sys
from contextlib import contextmanager

from rackcast.capabilities import EXECUTORS
from rackcast.cli.common import bounded
from rackcast.errors import RackcastError
from rackcast.units import GIB
from rackcast.plan import BatchSpec, Plan, TopologyRef

BATCH_HELP = ("global batch in sequences (default: the model preset's recipe where it has one, e.g. 11,264 x 4,096 "
              "tokens for marin-535b-a23b, else DeepSeek LLM's batch law for the compute budget; planner.batch)")


def add_common(parser) -> None:
    """Arguments shared by `plan` and `size`."""
    parser.add_argument("--topology", required=True, help="topology preset or YAML path (e.g. gb200-nvl72)")
    parser.add_argument("--racks", type=bounded(TopologyRef, "domains", int), default=None, metavar="N",
                        help="domains (racks or nodes) in the job (default: the preset's)")
    parser.add_argument("--tokens", type=bounded(Plan, "tokens"), required=True, metavar="T",
                        help="token budget, e.g. 18e12")
    parser.add_argument("--start", default="", metavar="DATE", help="start date, YYYY-MM-DD")
    parser.add_argument("--deadline", default="", metavar="DATE", help="deadline, YYYY-MM-DD (needs --start)")
    parser.add_argument("--objective", choices=("days", "mfu"), default="days",
                        help="rank by days to the token budget (default) or by MFU")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="processes for the search (default: every core)")


def register(sub) -> None:
    parser = sub.add_parser("plan", help="search parallel layouts; print the ranked table and write the best plan",
                            description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model preset or YAML path (e.g. marin-535b-a23b)")
    add_common(parser)
    parser.add_argument("--top", type=int, default=1, metavar="K",
                        help="simulate at least the best K by estimate (default 1; 0: no simulation); the verified "
                             "ranking goes on until no other candidate can beat the best simulated one within the "
                             "estimate's error band")
    parser.add_argument("--band", type=float, default=None, metavar="F",
                        help="the estimate's error band for the verified ranking, a fraction (default "
                             "planner.verify.ESTIMATE_BAND, 0.03)")
    parser.add_argument("--max-simulate", type=int, default=None, metavar="N",
                        help="simulate at most N candidates (default planner.verify.MAX_SIMULATED, 48)")
    parser.add_argument("--out", default="", metavar="PLAN.yaml", help="write the winner as a plan file")
    parser.add_argument("--parquet", default="", metavar="FILE", help="write every candidate to Parquet")
    parser.add_argument("--explain", action="store_true", help="say why the winner wins and why others lost")
    batch = parser.add_mutually_exclusive_group()
    batch.add_argument("--global-batch", type=bounded(BatchSpec, "global_batch", int), default=0, metavar="N",
                       help=BATCH_HELP)
    batch.add_argument("--global-batch-range", default="", metavar="MIN:MAX",
                       help="try global batches in MIN..MAX (per layout the smallest and largest multiples of "
                            "data x fsdp x micro-batch inside the range)")
    parser.add_argument("--usable-gpus", type=bounded(TopologyRef, "usable_gpus", int), default=None, metavar="N",
                        help="GPUs used per domain (e.g. 64 or 72 on NVL72; default: search both the preset's "
                             "default and the whole domain)")
    parser.add_argument("--memory-per-gpu", type=float, default=0.0, metavar="GIB",
                        help="fit candidates into this many GiB per GPU instead of the whole HBM (headroom for the "
                             "framework, or a stand-in for a smaller part; default: the topology's HBM)")
    parser.add_argument("--max-pipeline", type=int, default=None, metavar="N",
                        help="largest pipeline degree to search (default planner.space.SpaceOptions, 8); 1 keeps "
                             "every layer on every rank")
    parser.add_argument("--max-tensor", type=int, default=None, metavar="N",
                        help="largest tensor-parallel degree to search (default planner.space.SpaceOptions, 8)")
    parser.add_argument("--rows", type=int, default=10, metavar="N", help="rows of the ranked table (default 10)")
    parser.add_argument("--executor", choices=tuple(EXECUTORS), default="trainer",
                        help="layouts to search: those rackcast's trainer runs (default), or any layout the "
                             "simulator prices (tensor, sequence and expert-tensor parallelism, context with fsdp "
                             "or pipeline, ZeRO-2, ...: hardware studies beyond today's trainer; "
                             "rackcast.capabilities.EXECUTORS)")
    parser.add_argument("--measured", default="", metavar="FILE",
                        help="fit the topology's efficiency profile to one measured run (a run folder with "
                             "record.json, or a measurement YAML as `rackcast calibrate --from-measurement` reads) "
                             "and plan with the fitted topology")
    parser.add_argument("--fitted-topology", default="", metavar="PATH",
                        help="where --measured writes the fitted topology (default runs/<topology>-fitted.yaml)")
    parser.set_defaults(func=_run)


def parse_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        low, high = int(lo), int(hi)
    except ValueError:
        raise RackcastError(f"--global-batch-range: {text!r} is not MIN:MAX (two integers)") from None
    if not sep or low <= 0 or high < low:
        raise RackcastError(f"--global-batch-range: {text!r} needs 0 < MIN <= MAX")
    return low, high


def command_line(name: str) -> str:
    return "rackcast " + " ".join(shlex.quote(a) for a in [name, *sys.argv[sys.argv.index(name) + 1:]]) \
        if name in sys.argv else f"rackcast {name}"


def resolve_racks(topology: str, racks: int | None) -> int:
    from rackcast.topologies import load_topology

    return load_topology(topology).domains if racks is None else racks


def fit_measured(args) -> dict:
    """Fit the efficiency factors of --topology to the --measured run (rackcast.validation.fit through
    `rackcast calibrate`'s fit_topology), write the fitted topology, and say what was fitted from what."""
    from pathlib import Path

    from rackcast.cli.calibrate import fit_topology, read_measurements

    source = Path(args.measured)
    if not source.exists():
        raise RackcastError(f"--measured: {args.measured} does not exist")
    ms = read_measurements([str(source)], []) if source.is_dir() else read_measurements([], [str(source)])
    stem = Path(args.topology).stem
    out = Path(args.fitted_topology or f"runs/{stem}-fitted.yaml")
    out.parent.mkdir(parents=True, exist_ok=True)
    res, _ = fit_topology(ms, args.topology, out)
    factors = ", ".join(f"{k} x{v:.3g}" + ("" if res.identified[k] else " (not identified)")
                        for k, v in res.fitted.items())
    runs = "; ".join(f"{m.label}: plan {m.plan.name} on {m.plan.topology.domains} {m.plan.topology.name} "
                     f"domain(s), step {m.step_time_s:.4g} s"
                     + (f", phases {', '.join(k for k, v in m.phases_s.items() if v)}" if any(m.phases_s.values())
                        else ", step time only") for m in ms)
    lines = [f"fitted to {len(ms)} measurement(s) ({runs}): {factors}; step-time error of the measured plan "
             f"{', '.join(f'{100 * e:+.1f}%' for e in res.step_error_before)} before the fit, "
             f"{', '.join(f'{100 * e:+.1f}%' for e in res.step_error_after)} after (validation.fit)",
             f"planned on the fitted topology {out} (--topology {args.topology} with those factors)"]
    return {"topology": str(out), "fitted": res.fitted, "identified": res.identified,
            "measurements": [m.label for m in ms], "step_error_before": res.step_error_before,
            "step_error_after": res.step_error_after, "lines": lines}


@contextmanager
def stage_progress(quiet: bool):
    """A progress(done, total, what) callback drawing a rich progress bar on stderr (None when quiet)."""
    if quiet:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn(), console=Console(stderr=True), transient=True)
    with bar:
        task = bar.add_task("planning", total=None)

        def progress(done: int, total: int, what: str = "") -> None:
            bar.update(task, completed=done, total=total or None, description=what or "planning")

        yield progress


def _run(args) -> int:
    from dataclasses import replace

    from rich.console import Console

    from rackcast.cli.common import print_json
    from rackcast.planner.report import ranked_table, result_json, summary_lines, write_best_plan, write_parquet
    from rackcast.planner.search import Request, search
    from rackcast.planner.space import SpaceOptions

    if args.global_batch < 0:
        raise RackcastError(f"--global-batch must be positive, got {args.global_batch}")
    if args.workers is not None and args.workers < 1:
        raise RackcastError(f"--workers must be >= 1, got {args.workers}")
    for flag, value in (("--max-pipeline", args.max_pipeline), ("--max-tensor", args.max_tensor)):
        if value is not None and value < 1:
            raise RackcastError(f"{flag} must be >= 1, got {value}")
    options = SpaceOptions(global_batch=args.global_batch,
                           batch_range=parse_range(args.global_batch_range) if args.global_batch_range else None)
    if args.usable_gpus is not None:
        options = replace(options, usable=(args.usable_gpus,))
    if args.max_pipeline is not None:
        options = replace(options, max_pipeline=args.max_pipeline)
    if args.max_tensor is not None:
        options = replace(options, max_tensor=args.max_tensor)
    options = replace(options, capabilities=EXECUTORS[args.executor])
    measured = fit_measured(args) if args.measured else None
    if measured is not None:
        args.topology = measured["topology"]
    extra = {k: v for k, v in (("workers", args.workers), ("band", args.band), ("max_simulate", args.max_simulate))
             if v is not None}
    request = Request(model=args.model, topology=args.topology, racks=resolve_racks(args.topology, args.racks),
                      tokens=args.tokens, start=args.start, deadline=args.deadline, objective=args.objective,
                      top=args.top, options=options, command=command_line("plan"), forecast_rows=args.rows,
                      memory_per_gpu=args.memory_per_gpu * GIB, **extra)
    with stage_progress(quiet=args.json) as progress:
        result = search(request, progress=progress)
    plan = write_best_plan(result, args.out, request.command) if args.out else None
    rows = write_parquet(result, args.parquet) if args.parquet else 0
    if args.json:
        data = result_json(result, args.rows)
        if measured is not None:
            data["measured"] = {k: v for k, v in measured.items() if k != "lines"}
        if args.explain:
            from rackcast.planner.explain import explain_lines

            data["explain"] = explain_lines(result)
        data["wrote"] = {"plan": args.out or None, "parquet": args.parquet or None, "parquet_rows": rows}
        print_json(data)
        return 0
    out = Console(width=max(160, Console().width), highlight=False)
    out.print(ranked_table(result, args.rows))
    for line in (measured or {}).get("lines", []) + summary_lines(result, args.rows):
        out.print(line, markup=False)
    if args.explain:
        from rackcast.planner.explain import explain_lines

        for line in explain_lines(result):
            out.print(line, markup=False)
    if plan is not None:
        out.print(f"wrote {args.out} ({plan.name}: {result.winner.layout.label})", markup=False)
    if args.parquet:
        out.print(f"wrote {args.parquet} ({rows} candidates)", markup=False)
    return 0
