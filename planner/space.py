"""The layout search space: which parallel layouts and knobs the planner enumerates, and how one becomes a Plan.

Axes: data (with its ZeRO stage 0-2, parallel.zero), fsdp, tensor, pipeline (+ virtual chunks; where the layers do
not divide the chunks, the uneven splits rackcast.layout.uneven_split builds: the remainder on the first, middle or
last chunks), expert, expert_tensor and context degrees; micro-batch; global batch (fixed or a range); pipeline
schedule; recomputation; optimizer state in HBM or host memory; dropless or capacity expert transport; the GPUs used
per domain (64 or 72 on an NVL72 rack).

Only layouts whose degrees multiply to the GPU count are generated. Placement rule: tensor x context groups are the
innermost ranks and must divide the GPUs used per domain, so tensor- and context-parallel traffic never crosses the
NICs; expert, fsdp, data and pipeline groups may cross domains, and the estimate charges the scale-out link for it.
Everything else about divisibility (heads, KV heads, layers, experts, expert width, sequence, batch, schedule) is
decided by rackcast.plan.validate, the single authority: a layout it refuses is kept as a rejected row with the
RackcastError text. Only layouts the executor can run are offered (SpaceOptions.capabilities, by default
rackcast.capabilities.TRAINER): its refusals reject the rest with the reason, and the search tries only the
recomputation modes and optimizer-state locations it implements.

"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Iterator

from rackcast.capabilities import TRAINER, Capabilities, refusals
from rackcast.errors import RackcastError
from rackcast.modelspec import FlopsConvention, ModelSpec, Recipe
from rackcast.simulator.schedule_formulas import peak_in_flight
from rackcast.plan import (BatchSpec, ExpertTransport, OptimizerSpec, ParallelSpec, Plan, TopologyRef,
                           validate)
from rackcast.layout import SPLIT_RULES, uneven_split
from rackcast.vocab import PLAN_SCHEDULES, SINGLE_CHUNK_SCHEDULES, V_SHAPED_SCHEDULES

# Marin's fixed-capacity transport ran at capacity factor 1.15 (https://github.com/marin-community/marin/issues/8435).
CAPACITY_FACTOR = 1.15

RECOMPUTE = ("none", "selective", "full")
OPT_LOCATIONS = ("hbm", "host")
TRANSPORTS = ("dropless", "capacity")
ZERO_STAGES = (0, 1, 2)


DEGREES = ("data", "fsdp", "tensor", "pipeline", "virtual", "expert", "expert_tensor", "context", "zero")
LAYOUT_COLUMNS = ("usable", *DEGREES, "stage_layers", "global_batch", "micro_batch", "schedule", "recompute",
                  "opt_location", "transport")  # Layout.as_row's keys (stage_layers: "15,16,15,15", or "" if even)


@dataclass(frozen=True)
class Layout:
    """One point of the search space (everything a Plan needs besides the model and the hardware): the parallel
    layout (rackcast.layout.ParallelSpec, the plan's `parallel:` block) and the search knobs around it."""

    usable: int  # GPUs used per domain
    parallel: ParallelSpec
    global_batch: int
    micro_batch: int
    schedule: str
    recompute: str
    opt_location: str
    transport: str

    def as_row(self) -> dict:
        """Flat columns (usable, the degrees, then the knobs) for tables, JSON and Parquet."""
        row = {k: getattr(self.parallel, k) if k in DEGREES else getattr(self, k, None) for k in LAYOUT_COLUMNS}
        row["stage_layers"] = ",".join(map(str, self.parallel.stage_layers))
        return row

    @cached_property
    def parallel_label(self) -> str:
        par = self.parallel
        parts = [f"d{par.data}", f"f{par.fsdp}"]
        for name, short in (("tensor", "t"), ("context", "c"), ("expert", "e"), ("expert_tensor", "et")):
            if getattr(par, name) > 1:
                parts.append(f"{short}{getattr(par, name)}")
        if par.pipeline > 1:
            parts.append(f"p{par.pipeline}" + (f"v{par.virtual}" if par.virtual > 1 else ""))
        if par.stage_layers:
            parts.append("L" + ",".join(map(str, par.stage_layers)))
        if par.zero:
            parts.append(f"z{par.zero}")
        return " ".join(parts)

    @cached_property
    def knobs_label(self) -> str:
        sched = self.schedule if self.parallel.pipeline > 1 else "-"
        return (f"gb{self.global_batch} mb{self.micro_batch} {sched} rc={self.recompute} opt={self.opt_location} "
                f"{self.transport} {self.usable}/dom")

    @cached_property
    def label(self) -> str:
        return f"{self.parallel_label} | {self.knobs_label}"

    @property
    def layout_class(self) -> str:
        """The axes in use (degree > 1), e.g. 'data+fsdp+expert': the class explain groups rejections by."""
        axes = [n for n in ("data", "fsdp", "tensor", "context", "pipeline", "expert", "expert_tensor")
                if getattr(self.parallel, n) > 1]
        return "+".join(axes) or "single-gpu"

    def replica_gpus(self) -> int:
        """GPUs holding one full copy of the model: per pipeline stage, the larger of the dense shard group
        (tensor x context x fsdp) and the expert group (expert x expert_tensor), both innermost ranks."""
        par = self.parallel
        return max(par.stage_ranks // par.data, par.expert_group) * par.pipeline


@dataclass(frozen=True)
class SpaceOptions:
    """Which values each axis may take. Degrees not listed are generated from the GPU count's divisors."""

    usable: tuple[int, ...] = ()  # empty: the preset's default and the full domain (64 and 72 on NVL72)
    global_batch: int = 0  # fixed global batch (sequences); 0: see batch_range, else the default rule
    batch_range: tuple[int, int] | None = None
    max_tensor: int = 8
    contexts: tuple[int, ...] = (1, 2)
    max_pipeline: int = 8
    virtuals: tuple[int, ...] = (2,)
    expert_tensors: tuple[int, ...] = (1, 2)
    max_micro_batch: int = 16
    micro_batches: tuple[int, ...] = ()  # empty: every power of two up to max_micro_batch
    schedules: tuple[str, ...] = PLAN_SCHEDULES
    recompute: tuple[str, ...] = RECOMPUTE
    opt_locations: tuple[str, ...] = OPT_LOCATIONS
    transports: tuple[str, ...] = TRANSPORTS
    zero_stages: tuple[int, ...] = ZERO_STAGES  # ZeRO stages of the data replicas (parallel.zero), where data > 1
    # Only layouts this executor can run are offered (rackcast.capabilities); EVERYTHING plans beyond the trainer.
    capabilities: Capabilities = TRAINER

    @classmethod
    def coarse(cls, **overrides) -> "SpaceOptions":
        """A smaller space for model-size search, which runs one layout search per shape: no context or expert-tensor
    parallelism, micro-batches 1, 4 and 16, 1F1B or interleaved pipelines, dropless transport."""
        base = dict(contexts=(1,), virtuals=(2,), expert_tensors=(1,), micro_batches=(1, 4, 16),
                    schedules=("1f1b", "interleaved_1f1b"), transports=("dropless",))
        base.update(overrides)
        return cls(**base)


@lru_cache(maxsize=None)
def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def default_global_batch(spec: ModelSpec, default_usable: int, domains: int, tokens: float = 0.0) -> int:
    """The default global batch (planner.batch.default_batch: the preset's recipe, else DeepSeek LLM's batch law for
    the token budget), counted on the preset's default GPUs per domain, so 64- and 72-GPU layouts train on the same
    batch."""
    from rackcast.planner.batch import default_batch

    if not (spec.recipe and spec.recipe.global_batch) and tokens <= 0:
        raise ValueError(f"{spec.name} has no recipe batch; the batch law needs the token budget")
    return default_batch(spec, default_usable * domains, tokens).global_batch


def global_batches(options: SpaceOptions, replicas: int, micro: int, fallback: int) -> list[int]:
    """Global batches to try for data x fsdp = `replicas`: the fixed one, or in range mode the smallest and the
    largest multiples of replicas x micro-batch inside the range."""
    if options.batch_range is None:
        return [options.global_batch or fallback]
    lo, hi = options.batch_range
    unit = replicas * micro
    first, last = -(-lo // unit) * unit, hi // unit * unit
    return sorted({b for b in (first, last) if lo <= b <= hi and b > 0})


def usable_options(options: SpaceOptions, default_usable: int, domain_size: int) -> tuple[int, ...]:
    return options.usable or tuple(sorted({default_usable, domain_size}))


def _schedules(options: SpaceOptions, pipeline: int, layers: int) -> list[tuple[str, int]]:
    if pipeline == 1:
        return [("1f1b", 1)]
    out = []
    for name in options.schedules:
        if name in SINGLE_CHUNK_SCHEDULES:
            out.append((name, 1))
        elif name == "zb_h1":
            out.append((name, 1))
        elif name == "interleaved_1f1b":
            out += [(name, v) for v in options.virtuals]
        elif name in V_SHAPED_SCHEDULES:
            out.append((name, 2))
    return out


def structures(spec: ModelSpec, domains: int, usable: int, options: SpaceOptions) -> Iterator[tuple[int, ...]]:
    """(data, fsdp, tensor, context, pipeline, expert, expert_tensor) whose product matches the GPUs and whose
    tensor x context groups divide the GPUs of one domain (the placement rule)."""
    gpus = usable * domains
    experts = spec.moe.experts if spec.moe else 1
    for t in divisors(gpus):
        if t > options.max_tensor or usable % t:
            continue
        for c in options.contexts:
            if usable % (t * c):
                continue
            rest = gpus // (t * c)
            for p in divisors(rest):
                if p > options.max_pipeline:
                    continue
                for f in divisors(rest // p):
                    d = rest // p // f
                    fold = d * f * c * t
                    for e in divisors(fold) if spec.moe else (1,):
                        if e > experts:
                            continue
                        for et in options.expert_tensors if spec.moe else (1,):
                            if fold % (e * et) == 0:
                                yield d, f, t, c, p, e, et


def knob_variants(spec: ModelSpec, options: SpaceOptions, data: int, fsdp: int, pipeline: int,
                  fallback_batch: int) -> Iterator[tuple]:
    """(global_batch, micro_batch, schedule, virtual, transport) for one structure. Recomputation and optimizer
    location are chosen per layout by the search (planner.search), not enumerated blindly. GPipe is offered only
    where 1F1B cannot run (fewer micro-batches than stages): otherwise it has the same bubble and holds more
    activations, so 1F1B dominates it."""
    transports = enumerated_transports(spec, options)
    replicas = data * fsdp
    micro = options.micro_batches or tuple(2 ** i for i in range(options.max_micro_batch.bit_length()))
    for mb in micro:
        for gb in global_batches(options, replicas, mb, fallback_batch):
            if gb % (replicas * mb):
                continue  # validate would refuse it too; skip the whole knob product at once
            for sched, v in _schedules(options, pipeline, spec.layers):
                if sched == "gpipe" and gb // (replicas * mb) >= pipeline:
                    continue
                for tr in transports:
                    yield gb, mb, sched, v, tr


def enumerated_transports(spec: ModelSpec, options: SpaceOptions) -> tuple[str, ...]:
    """Dense models have no expert transport; MoE layouts are enumerated dropless (when asked for) and the search
    refines its best ones with capacity transport, which changes only the all-to-all, not memory or validity."""
    if spec.moe is None:
        return ("dropless",)
    return ("dropless",) if "dropless" in options.transports else options.transports


def optimizer_for(spec: ModelSpec) -> str:
    """For a preset without a recipe: MuonH for MoE models (the Marin recipe), AdamW for dense ones."""
    return "muonh" if spec.moe is not None else "adamw"


@lru_cache(maxsize=None)
def expert_transport(mode: str) -> ExpertTransport:
    """The plan's expert_transport block for a transport mode: capacity runs at CAPACITY_FACTOR."""
    return ExpertTransport(mode=mode, capacity_factor=CAPACITY_FACTOR if mode == "capacity" else 1.0)


@lru_cache(maxsize=None)
def _optimizer(recipe: Recipe, state_location: str) -> OptimizerSpec:
    """The plan's optimizer block (frozen, so one per recipe and location serves every layout)."""
    return OptimizerSpec.from_recipe(recipe, state_location=state_location)


def make_plan(layout: Layout, model: str | ModelSpec, topology: str, domains: int, spec: ModelSpec, *,
              tokens: float = 0.0, start: str = "", deadline: str = "", name: str = "") -> Plan:
    recipe = spec.recipe or Recipe(optimizer=optimizer_for(spec))
    transport = expert_transport(layout.transport)
    return Plan(
        name=name or f"{spec.name}-{topology}-{domains}",
        model=model,
        topology=TopologyRef(name=topology, domains=domains, usable_gpus=layout.usable),
        parallel=layout.parallel,
        batch=BatchSpec(global_batch=layout.global_batch, micro_batch=layout.micro_batch),
        schedule=layout.schedule,
        recompute=layout.recompute,
        optimizer=_optimizer(recipe, layout.opt_location),
        expert_transport=transport,
        z_loss_weight=recipe.z_loss_weight, combine_sum=recipe.combine_sum,
        tokens=tokens, start=start, deadline=deadline,
    )


def check(layout: Layout, spec: ModelSpec, domains: int, capabilities: Capabilities = TRAINER) -> str:
    """'' when rackcast.plan.validate accepts the layout and the executor can run it (rackcast.capabilities), else
    the first reason it cannot."""
    plan = make_plan(layout, spec.name, "", domains, spec)
    try:
        validate(plan, spec, layout.usable * domains)
    except RackcastError as exc:
        return str(exc)
    unrunnable = refusals(plan, spec, capabilities)
    if unrunnable:
        return unrunnable[0]
    par = layout.parallel
    if par.pipeline > 1:
        try:  # the schedule formulas' own coverage rules (e.g. dualpipev needs 2 x stages micro-batches)
            peak_in_flight(layout.schedule, par.pipeline, plan.microbatches, par.chunks_per_rank)
        except ValueError as exc:
            return f"schedule: {exc}"
    return ""


@dataclass
class Enumeration:
    layouts: list[Layout] = field(default_factory=list)  # valid: validate accepted them
    rejected: list[tuple[Layout, str]] = field(default_factory=list)  # with the RackcastError text


def enumerate_space(spec: ModelSpec, domains: int, default_usable: int, domain_size: int,
                    options: SpaceOptions, tokens: float = 0.0) -> Enumeration:
    """Every layout of the space, split into those validate accepts and those it refuses. A structure refused for
    a reason no knob can change (heads, layers, experts, expert width, sequence) is one rejected row, not one row per
    knob combination."""
    out = Enumeration()
    fallback = options.global_batch or default_global_batch(spec, default_usable, domains, tokens)
    for u in usable_options(options, default_usable, domain_size):
        for d, f, t, c, p, e, et in structures(spec, domains, u, options):
            pars = {}  # per virtual stage count, built when a knob variant first needs it

            def parallels(v: int) -> list[ParallelSpec]:
                if v not in pars:
                    pars[v] = [ParallelSpec(data=d, fsdp=f, tensor=t, pipeline=p, virtual=v, expert=e,
                                            expert_tensor=et, context=c, sequence_parallel=t > 1, stage_layers=split,
                                            zero=z)
                               for split in layer_splits(spec.layers, p * v, options.capabilities)
                               for z in zero_stages(options, d, f)]
                return pars[v]
            base = Layout(u, parallels(1)[0], options.global_batch or fallback, 1, "1f1b", "none", "hbm", "dropless")
            reason = check(base, spec, domains, options.capabilities)
            if reason and not _knob_dependent(reason):
                out.rejected.append((base, reason))
                continue
            any_knobs = False
            for gb, mb, sched, v, tr in knob_variants(spec, options, d, f, p, fallback):
                any_knobs = True
                for par in parallels(v):
                    layout = Layout(u, par, gb, mb, sched, "none", "hbm", tr)
                    reason = check(layout, spec, domains, options.capabilities)
                    if reason:
                        out.rejected.append((layout, reason))
                    else:
                        out.layouts.append(layout)
            if not any_knobs:
                out.rejected.append((base, check(base, spec, domains, options.capabilities) or
                                     f"batch.global_batch: {base.global_batch} sequences are not divisible by "
                                     f"data x fsdp = {d * f}"))
    return out


def layer_splits(layers: int, chunks: int, capabilities: Capabilities = TRAINER) -> list[tuple[int, ...]]:
    """The layer splits offered for `chunks` model chunks: the even one (stage_layers empty) where the layers divide
    them, else each distinct uneven split (rackcast.layout.uneven_split) when the executor runs uneven splits; none
    left means the even split, which validate then refuses with the reason."""
    if layers % chunks == 0 or layers < chunks or not capabilities.uneven_pipeline:
        return [()]
    return list(dict.fromkeys(uneven_split(layers, chunks, rule) for rule in SPLIT_RULES))


def zero_stages(options: SpaceOptions, data: int, fsdp: int) -> tuple[int, ...]:
    """The ZeRO stages offered for `data` replicas (parallel.zero): those asked for and the executor runs
    (rackcast.capabilities: its `zero` stages, and whether it shards over replicas that fsdp shards already);
    only 0 for one replica."""
    caps = options.capabilities
    if data == 1:
        return (0,)
    return tuple(z for z in options.zero_stages if z in caps.zero and (z == 0 or fsdp == 1 or caps.zero_with_fsdp)) \
        or (0,)


def _knob_dependent(reason: str) -> bool:
    """Whether a micro-batch, schedule or virtual-stage choice could lift this refusal."""
    return "batch" in reason  # the base has mb=1 and one chunk per rank: only the batch rules depend on knobs


class FastSpec(ModelSpec):
    """A ModelSpec that memoises its per-layer accounting (the spec is frozen, so the answers never change).
    The closed-form stage asks the same per-layer questions for every candidate; this makes it ~5x faster."""

    def _memo(self, key, compute):
        cache = self.__dict__.setdefault("_planner_memo", {})
        if key not in cache:
            cache[key] = compute()
        return cache[key]

    def layer_param_breakdown(self, layer: int) -> dict[str, int]:
        return self._memo(("params", layer), lambda: ModelSpec.layer_param_breakdown(self, layer))

    def layer_params(self, layer: int) -> int:
        return self._memo(("layer_params", layer), lambda: ModelSpec.layer_params(self, layer))

    def layer_flops_breakdown(self, layer: int, convention: FlopsConvention = FlopsConvention()):
        return self._memo(("flops", layer, convention),
                          lambda: ModelSpec.layer_flops_breakdown(self, layer, convention))

    def top_param_breakdown(self) -> dict[str, int]:
        return self._memo(("top",), lambda: ModelSpec.top_param_breakdown(self))

    def head_flops_fwd(self, convention: FlopsConvention = FlopsConvention()) -> float:
        return self._memo(("head", convention), lambda: ModelSpec.head_flops_fwd(self, convention))


def fast_spec(spec: ModelSpec) -> FastSpec:
    return FastSpec(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(ModelSpec)})
