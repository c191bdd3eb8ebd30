"""`rackcast size`: vary the model shape along a family and report, per shape, the best layout, tokens/s, days to
the token budget, whether it meets the deadline, and the Pareto front of size against days.

    rackcast size --family marin-moe --topology gb200-nvl72 --racks 11 --tokens 18e12
"""

from __future__ import annotations

from rackcast.cli.plan import add_common, resolve_racks
from rackcast.errors import RackcastError


def register(sub) -> None:
    parser = sub.add_parser("size", help="search model sizes along a family: best layout, days, Pareto front",
                            description=__doc__.splitlines()[0])
    parser.add_argument("--family", required=True, choices=("marin-moe", "dense-gpt"),
                        help="shape family: marin-moe (Marin ladder rules) or dense-gpt (Megatron shapes)")
    add_common(parser)
    parser.add_argument("--top", type=int, default=10, metavar="K",
                        help="simulate the best layouts of the K fastest shapes (default 10)")
    parser.set_defaults(func=_run)


def _run(args) -> int:
    from rackcast.cli.common import print_json
    from rackcast.planner.report import size_json, size_table
    from rackcast.planner.search import available_days
    from rackcast.planner.size import size_search
    from rich.console import Console

    if args.workers is None:
        from rackcast.planner.verify import default_workers

        args.workers = default_workers()
    if args.workers < 1:
        raise RackcastError(f"--workers must be >= 1, got {args.workers}")
    if args.top < 0:
        raise RackcastError(f"--top must be >= 0, got {args.top}")
    if args.tokens <= 0:
        raise RackcastError(f"--tokens must be positive, got {args.tokens:g}")
    available_days(args.start, args.deadline)  # bad dates fail before the search
    res = size_search(args.family, args.topology, resolve_racks(args.topology, args.racks), args.tokens,
                      start=args.start, deadline=args.deadline, objective=args.objective, top=args.top,
                      workers=args.workers)
    if args.json:
        print_json(size_json(res))
        return 0
    out = Console(width=max(200, Console().width), highlight=False)
    out.print(size_table(res))
    out.print(f"candidates: {res.enumerated} layouts enumerated, {res.candidates} ranked by the closed-form "
              f"estimate across {len(res.shapes)} shapes; {res.simulated} simulated", markup=False)
    for note in res.notes:
        out.print(note, markup=False)
    out.print("per replica: the domains one model copy of the best layout spans; min: the fewest any fitting layout "
              "needs; 1-domain EP+FSDP mem: memory per GPU with experts and state sharded over one domain, data "
              "parallel across domains, the per-GPU batch as one micro-batch, full recomputation, optimizer state "
              "in HBM (the check behind Marin's one-rack / two-rack sizing)", markup=False)
    front = [sh.spec.name for sh in res.shapes if sh.pareto]
    out.print(f"Pareto front (size against days): {', '.join(front) or 'none'}", markup=False)
    return 0
