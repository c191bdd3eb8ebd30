"""What the TUI screens ask of the planner and simulator, without any textual code: read the form into a
planner.search.Request (one inline message per bad field), build the detail of a candidate (memory, phases,
pipeline schedule, simulated streams, days against the deadline) and the plan file the CLI would write.

Every figure comes from the same functions the CLI calls (planner.search, simulator.estimate, simulator.step,
simulator.pipeline_exec, rackcast.plan); this module only gathers them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from rackcast.errors import RackcastError

FIELDS = ("model", "topology", "racks", "tokens", "start", "deadline", "width", "depth", "experts", "top_k")
SHAPE_FIELDS = {"width": "d_model", "depth": "layers", "experts": "experts", "top_k": "top_k"}


class InputErrors(RackcastError):
    """Bad form input: field name -> one-line message."""

    def __init__(self, errors: dict[str, str]) -> None:
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))
        self.errors = errors


def _positive_int(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected a whole number, got {text!r}") from None
    if not value.is_integer() or value <= 0:
        raise ValueError(f"expected a positive whole number, got {text!r}")
    return int(value)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected a number such as 18e12, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"expected a positive number, got {text!r}")
    return value


def _parse_budget(v: dict, errors: dict) -> dict:
    """Racks and tokens from the form's text; a bad field's message goes to errors."""
    parsed = {}
    for name, parse in (("racks", _positive_int), ("tokens", _positive_float)):
        try:
            parsed[name] = parse(v[name])
        except ValueError as exc:
            errors[name] = str(exc)
    return parsed


def _check_dates(v: dict, errors: dict) -> None:
    """Start and deadline must be ISO dates (the loaders' rule, rackcast.bounds.parse_date), the deadline after the
    start."""
    from rackcast.bounds import parse_date
    from rackcast.planner.search import available_days

    for name in ("start", "deadline"):
        if v[name]:
            try:
                parse_date(v[name], name)
            except RackcastError as exc:
                errors[name] = str(exc).removeprefix(f"{name}: ")
    if v["deadline"] and "deadline" not in errors and "start" not in errors:
        try:
            available_days(v["start"], v["deadline"])
        except RackcastError as exc:
            errors["deadline"] = str(exc).replace("--", "")


def preset_shape(model: str) -> dict[str, str]:
    """The shape fields of a preset, as the form shows them."""
    from rackcast.presets import load_model

    spec = load_model(model)
    return {"width": str(spec.d_model), "depth": str(spec.layers),
            "experts": str(spec.moe.experts) if spec.moe else "", "top_k": str(spec.moe.top_k) if spec.moe else ""}


def shaped_model(model: str, shape: dict[str, int]):
    """The preset name when the shape is the preset's, else an inline ModelSpec with the edited shape."""
    from rackcast.presets import load_model

    spec = load_model(model)
    now = {"d_model": spec.d_model, "layers": spec.layers,
           "experts": spec.moe.experts if spec.moe else None, "top_k": spec.moe.top_k if spec.moe else None}
    wanted = {k: v for k, v in shape.items() if v is not None}
    if all(now.get(k) == v for k, v in wanted.items()):
        return model
    moe = spec.moe
    if moe is not None and ("experts" in wanted or "top_k" in wanted):
        moe = dataclasses.replace(moe, experts=wanted.get("experts", moe.experts), top_k=wanted.get("top_k", moe.top_k))
    elif moe is None and ("experts" in wanted or "top_k" in wanted):
        raise ValueError(f"{model} is a dense model: experts and top-k do not apply")
    return dataclasses.replace(spec, name=f"{spec.name}-custom", d_model=wanted.get("d_model", spec.d_model),
                               layers=wanted.get("layers", spec.layers), moe=moe)


def build_request(values: dict[str, str], **request_options):
    """Form values (strings) -> planner.search.Request; raises InputErrors naming every bad field."""
    from rackcast.planner.search import Request
    from rackcast.presets import list_models
    from rackcast.topologies import list_topologies

    errors: dict[str, str] = {}
    v = {k: (values.get(k) or "").strip() for k in FIELDS}
    if v["model"] not in list_models():
        errors["model"] = f"unknown model preset {v['model']!r}"
    if v["topology"] not in list_topologies():
        errors["topology"] = f"unknown topology {v['topology']!r}"
    parsed = _parse_budget(v, errors)
    shape = {}
    for name, key in SHAPE_FIELDS.items():
        if v[name]:
            try:
                shape[key] = _positive_int(v[name])
            except ValueError as exc:
                errors[name] = str(exc)
    _check_dates(v, errors)
    model = v["model"]
    if "model" not in errors and shape:
        try:
            model = shaped_model(v["model"], shape)
        except (ValueError, TypeError, RackcastError) as exc:
            errors["width"] = str(exc)
    if errors:
        raise InputErrors(errors)
    request = Request(model=model, topology=v["topology"], racks=parsed["racks"], tokens=parsed["tokens"],
                      start=v["start"], deadline=v["deadline"], **request_options)
    return dataclasses.replace(request, command=cli_command(request, v["tokens"]))


# ---------------------------------------------------------------- a candidate's detail
@dataclass
class Detail:
    title: str
    label: str
    plan: object  # rackcast.plan.Plan, with the prediction the CLI would write
    memory: dict
    hbm_bytes: float
    phases: dict
    step_s: float
    tokens_per_s: float
    mfu: float
    days: float
    steady_days: float
    available_days: float
    meets: bool | None
    deadline_prob: float
    source: str  # simulate | estimate
    pipeline: object = None  # simulator.pipeline_exec.PipelineResult (pipeline > 1)
    sim: object = None  # simulator.step.SimResult with its timeline
    sim_note: str = ""  # why there is no simulated step (past simulate's work bound), else ""
    band: dict = field(default_factory=dict)  # simulator.metrics.error_band of the figures above ({}: none)


def cli_command(request, tokens_text: str = "") -> str:
    """The `rackcast plan` command line for the same inputs (recorded in the plan's provenance, as the CLI does)."""
    import shlex

    model = request.model if isinstance(request.model, str) else f"<inline {request.model.name}>"
    args = ["--model", model, "--topology", request.topology, "--racks", str(request.racks),
            "--tokens", tokens_text or f"{request.tokens:g}"]
    args += ["--start", request.start] if request.start else []
    args += ["--deadline", request.deadline] if request.deadline else []
    return "rackcast plan " + " ".join(shlex.quote(a) for a in args)


def plan_with_prediction(result, row):
    """The plan `rackcast plan --out` writes for this candidate (planner.report.best_plan does this for the
    winner): the search's plan with its predicted block and provenance."""
    from rackcast.planner.search import predicted_for
    from rackcast.plan import with_prediction

    return with_prediction(result.plan_for(row), predicted_for(result, row), command=result.request.command)


def detail(result, row) -> Detail:
    """Everything the detail screen shows for one ranked candidate."""
    plan = plan_with_prediction(result, row)
    pipeline = None
    p = plan.parallel
    if p.pipeline > 1:
        from rackcast.simulator.pipeline_exec import ChunkDurations, run_pipeline

        # Schedule units, as simulator.pipeline_exec draws them: forward of one model = 1.
        pipeline = run_pipeline(plan.schedule, p.pipeline, plan.microbatches, p.virtual,
                                ChunkDurations.uniform(1.0 / (p.pipeline * p.virtual)))
    from rackcast.errors import RackcastError
    from rackcast.simulator.step import simulate

    sim, sim_note = None, ""
    try:
        sim = simulate(plan, seed=plan.seed)
    except RackcastError as exc:  # past simulate's work bound (simulator.step.check_work): the estimate stands
        sim_note = f"not simulated: {exc}"
    days = result.days_for(row)
    return Detail(
        title=f"#{row.rank} {row.layout.parallel_label}", label=row.layout.label, plan=plan, memory=row.memory,
        hbm_bytes=result.hbm_bytes, phases=row.sim.get("phases_s", row.phases),
        step_s=row.sim.get("step_time_s", row.step_time_s), tokens_per_s=row.best_tokens_per_s, mfu=row.best_mfu,
        days=days, steady_days=row.best_days, available_days=result.available_days,
        meets=result.meets_deadline(row), deadline_prob=result.deadline_prob.get(id(row), math.nan),
        source="simulate" if row.sim else "estimate", pipeline=pipeline, sim=sim, sim_note=sim_note,
        band=result.band_for(row))


# ---------------------------------------------------------------- size search
def build_size_request(values: dict[str, str], **options) -> dict:
    """Form values -> keyword arguments of planner.size.size_search; raises InputErrors naming every bad field."""
    from rackcast.planner.size import FAMILIES
    from rackcast.topologies import list_topologies

    v = {k: (values.get(k) or "").strip() for k in ("family", "topology", "racks", "tokens", "start", "deadline")}
    errors: dict[str, str] = {}
    if v["family"] not in FAMILIES:
        errors["family"] = f"one of {', '.join(FAMILIES)}"
    if v["topology"] not in list_topologies():
        errors["topology"] = f"unknown topology {v['topology']!r}"
    out = {"family": v["family"], "topology": v["topology"], "start": v["start"], "deadline": v["deadline"]}
    out.update(_parse_budget(v, errors))
    _check_dates(v, errors)
    if errors:
        raise InputErrors(errors)
    return {**out, **options}
