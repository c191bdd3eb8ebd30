"""`rackcast plan`: search parallel layouts for a model on a topology against a token budget (and a deadline), print
the ranked table, and write every candidate as Parquet and the winner as a plan file.

    rackcast plan --model marin-535b-a23b --topology gb200-nvl72 --racks 11 --tokens 18e12 --out plan.yaml
"""

from __future__ import annotations

import shlex
import sys

from rackcast.errors import RackcastError

BATCH_HELP = ("global batch in sequences (default: the Marin rule, 65,536 tokens per GPU of the preset's default "
              "GPUs per domain: 11,264 x 4,096 tokens for marin-535b-a23b on 11 racks of 64; the same batch is "
              "used for 64- and 72-GPU layouts)")


def add_common(parser) -> None:
    """Arguments shared by `plan` and `size`."""
    parser.add_argument("--topology", required=True, help="topology preset or YAML path (e.g. gb200-nvl72)")
    parser.add_argument("--racks", type=int, default=None, metavar="N",
                        help="domains (racks or nodes) in the job (default: the preset's)")
    parser.add_argument("--tokens", type=float, required=True, metavar="T", help="token budget, e.g. 18e12")
    parser.add_argument("--start", default="", metavar="DATE", help="start date, YYYY-MM-DD")
    parser.add_argument("--deadline", default="", metavar="DATE", help="deadline, YYYY-MM-DD (needs --start)")
    parser.add_argument("--objective", choices=("days", "mfu"), default="days",
                        help="rank by days to the token budget (default) or by MFU")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--workers", type=int, default=2, metavar="N", help="processes for the search (default 2)")


def register(sub) -> None:
    parser = sub.add_parser("plan", help="search parallel layouts; print the ranked table and write the best plan",
                            description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model preset or YAML path (e.g. marin-535b-a23b)")
    add_common(parser)
    parser.add_argument("--top", type=int, default=5, metavar="K",
                        help="simulate the best K in the discrete-event simulator and re-rank them (default 5)")
    parser.add_argument("--out", default="", metavar="PLAN.yaml", help="write the winner as a plan file")
    parser.add_argument("--parquet", default="", metavar="FILE", help="write every candidate to Parquet")
    parser.add_argument("--explain", action="store_true", help="say why the winner wins and why others lost")
    batch = parser.add_mutually_exclusive_group()
    batch.add_argument("--global-batch", type=int, default=0, metavar="N", help=BATCH_HELP)
    batch.add_argument("--global-batch-range", default="", metavar="MIN:MAX",
                       help="try global batches in MIN..MAX (per layout the smallest and largest multiples of "
                            "data x fsdp x micro-batch inside the range)")
    parser.add_argument("--usable-gpus", type=int, default=None, metavar="N",
                        help="GPUs used per domain (e.g. 64 or 72 on NVL72; default: search both the preset's "
                             "default and the whole domain)")
    parser.add_argument("--rows", type=int, default=10, metavar="N", help="rows of the ranked table (default 10)")
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


def _run(args) -> int:
    from dataclasses import replace

    from rich.console import Console

    from rackcast.cli.common import print_json
    from rackcast.planner.report import ranked_table, result_json, summary_lines, write_best_plan, write_parquet
    from rackcast.planner.search import Request, search
    from rackcast.planner.space import SpaceOptions

    if args.global_batch < 0:
        raise RackcastError(f"--global-batch must be positive, got {args.global_batch}")
    if args.workers < 1:
        raise RackcastError(f"--workers must be >= 1, got {args.workers}")
    options = SpaceOptions(global_batch=args.global_batch,
                           batch_range=parse_range(args.global_batch_range) if args.global_batch_range else None)
    if args.usable_gpus is not None:
        options = replace(options, usable=(args.usable_gpus,))
    request = Request(model=args.model, topology=args.topology, racks=resolve_racks(args.topology, args.racks),
                      tokens=args.tokens, start=args.start, deadline=args.deadline, objective=args.objective,
                      top=args.top, options=options, workers=args.workers, command=command_line("plan"),
                      forecast_rows=args.rows)
    result = search(request)
    plan = write_best_plan(result, args.out, request.command) if args.out else None
    rows = write_parquet(result, args.parquet) if args.parquet else 0
    if args.json:
        data = result_json(result, args.rows)
        if args.explain:
            from rackcast.planner.explain import explain_lines

            data["explain"] = explain_lines(result)
        data["wrote"] = {"plan": args.out or None, "parquet": args.parquet or None, "parquet_rows": rows}
        print_json(data)
        return 0
    out = Console(width=max(160, Console().width), highlight=False)
    out.print(ranked_table(result, args.rows))
    for line in summary_lines(result):
        out.print(line)
    if args.explain:
        from rackcast.planner.explain import explain_lines

        for line in explain_lines(result):
            out.print(line, markup=False)
    if plan is not None:
        out.print(f"wrote {args.out} ({plan.name}: {result.winner.layout.label})", markup=False)
    if args.parquet:
        out.print(f"wrote {args.parquet} ({rows} candidates)", markup=False)
    return 0
