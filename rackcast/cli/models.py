"""`rackcast models list|show`: the model presets and their exact accounting."""

from __future__ import annotations

from rackcast.cli.common import console, human, print_json, table
from rackcast.modelspec import FlopsConvention
from rackcast.presets import list_models, load_model


def register(sub) -> None:
    parser = sub.add_parser("models", help="list model presets or show one's parameter and FLOP accounting")
    msub = parser.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    p_list = msub.add_parser("list", help="list the model presets")
    p_list.add_argument("--json", action="store_true", help="print JSON")
    p_list.set_defaults(func=_list)
    p_show = msub.add_parser("show", help="show a preset's accounting and per-layer table")
    p_show.add_argument("name", help="preset name or path to a model YAML")
    p_show.add_argument("--json", action="store_true", help="print JSON")
    p_show.add_argument(
        "--flops-convention",
        default="default",
        help="MFU convention: attention=full|causal, window=window|sequence, head=in|out (default: full, window, in)",
    )
    p_show.set_defaults(func=_show)


def _list(args) -> int:
    specs = [load_model(name) for name in list_models()]
    if args.json:
        print_json([{"name": s.name, "family": s.family, "params_total": s.params_total,
                     "params_active": s.params_active, "description": s.description} for s in specs])
        return 0
    rows = [[s.name, s.family, human(s.params_total), human(s.params_active), s.description] for s in specs]
    console().print(table("Model presets (params: total, active per token excluding embeddings)",
                          ["name", "family", "total", "active", "description"], rows))
    return 0


def _show(args) -> int:
    spec = load_model(args.name)
    convention = FlopsConvention.parse(args.flops_convention)
    summary = spec.summary(convention)
    if args.json:
        print_json(summary)
        return 0
    out = console()
    out.print(f"[bold]{spec.name}[/bold]  {spec.description}")
    out.print(f"parameters: total {spec.params_total:,}  active per token {spec.params_active:,}  "
              f"embedding+head {spec.params_embedding:,}")
    out.print(f"model FLOPs per token: forward {summary['flops_per_token_fwd']:.4g}, "
              f"train (fwd+bwd) {summary['flops_per_token_train']:.4g}  ({convention.label})")
    rows = [[str(r.index), r.attention, str(r.context), str(r.kv_heads), r.mlp, f"{r.params:,}",
             f"{r.params_active:,}", f"{r.flops_fwd:.4g}"] for r in spec.layer_table(convention)]
    out.print(table("Per layer", ["layer", "attention", "context", "kv heads", "mlp", "params", "active",
                                  "fwd FLOPs/token"], rows))
    return 0
