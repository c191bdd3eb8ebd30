"""Plan: what to run — model, hardware, parallel layout, batch, schedule, optimizer — plus what was predicted.

A plan file is YAML, loaded strictly (unknown keys, wrong types and layouts that do not divide the hardware or the
model are refused with one line naming the file and field) and written back byte-identically (round-trip).

The `parallel:` block is a rackcast.layout.ParallelSpec: the grid's degrees (gpus = data x fsdp x context x tensor x
pipeline, experts re-folded over expert x expert_tensor ranks of a stage) and every size derived from them.

    python -m rackcast.plan examples/plans/marin-535b-hero.yaml    # validate a plan file (exit 2 on a refusal)
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass, field, replace
from typing import Annotated, Literal

from rackcast import __version__
from rackcast.bounds import IsoDate, Range, Text, parse_date
from rackcast.errors import RackcastError
from rackcast.layout import ParallelSpec
from rackcast.modelspec import ModelSpec, Recipe
from rackcast.presets import load_model
from rackcast.atomic import write_text_atomic
from rackcast.strict import dump_yaml, from_data, load_yaml, to_data
from rackcast.vocab import DEFAULT_STACK_PROFILE, STAGE_BOUND_SCHEDULES, PlanSchedule, Precision, Routing



@dataclass(frozen=True)
class TopologyRef:
    name: str  # preset name or YAML path (strict.is_file_reference)
    domains: Annotated[int, Range(1, 65536)] = 1  # racks or nodes
    # GPUs used per domain; 0 keeps the preset's default (64 of 72 on NVL72)
    usable_gpus: Annotated[int, Range(0, 4096)] = 0
    # the software stack's kernel figures (topologies/profiles/*.yaml: eager-pytorch, megatron-te) or a YAML path
    profile: Annotated[str, Text()] = DEFAULT_STACK_PROFILE


@dataclass(frozen=True)
class BatchSpec:
    global_batch: Annotated[int, Range(1, 2**24)]  # sequences per optimizer step
    micro_batch: Annotated[int, Range(1, 2**20)] = 1  # sequences per micro-batch on one data-parallel rank


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer and its recipe (rackcast.modelspec.Recipe documents the fields; `rackcast plan` copies the
    model preset's recipe here)."""

    name: Literal["adamw", "muonh"] = "adamw"
    state_location: Literal["hbm", "host"] = "hbm"  # optimizer state and fp32 master weights
    master_weights: bool = True  # keep an fp32 master copy
    lr: Annotated[float, Range(0, 10, above=True)] = 3e-4
    adam_lr: Annotated[float, Range(0, 10, above=True)] = 3e-4  # MuonH: the Adam groups' learning rate
    betas: tuple[Annotated[float, Range(0, 1)], Annotated[float, Range(0, 1)]] = (0.9, 0.95)
    eps: Annotated[float, Range(0, 1, above=True)] = 1e-8
    momentum: Annotated[float, Range(0, 1)] = 0.95
    weight_decay: Annotated[float, Range(0, 10)] = 0.1
    warmup_fraction: Annotated[float, Range(0, 1)] = 0.01
    lr_floor: Annotated[float, Range(0, 1)] = 0.05

    @classmethod
    def from_recipe(cls, recipe: Recipe, **overrides) -> "OptimizerSpec":
        fields = dict(name=recipe.optimizer, lr=recipe.lr, adam_lr=recipe.adam_lr, betas=recipe.betas,
                      eps=recipe.eps, momentum=recipe.momentum, weight_decay=recipe.weight_decay,
                      warmup_fraction=recipe.warmup_fraction, lr_floor=recipe.lr_floor)
        return cls(**{**fields, **overrides})


@dataclass(frozen=True)
class ExpertTransport:
    mode: Literal["dropless", "capacity"] = "dropless"
    # capacity mode: slots per expert = factor x tokens x top_k / experts
    capacity_factor: Annotated[float, Range(0, 1024, above=True)] = 1.0
    routing: Routing = "uniform"  # rackcast.vocab.ROUTINGS
    zipf_s: Annotated[float, Range(0, 64)] = 1.0  # Zipf exponent for routing: zipf
    histogram: str = ""  # routing: histogram -> path to a recorded histogram (Parquet or YAML)

    def __post_init__(self):
        if self.capacity_factor <= 0:
            raise ValueError(f"expert_transport.capacity_factor must be positive, got {self.capacity_factor}")


@dataclass(frozen=True)
class PredictedBand:
    """The error band a prediction carries (simulator.metrics.error_band): the stack profile's relative band and the
    low-high range it gives step time, MFU and days (a faster step is a higher MFU and fewer days)."""

    relative: Annotated[float, Range(0, 1)]
    stack: str  # the stack profile the band comes from (topologies/profiles/<stack>.yaml cites its source)
    step_time_s: tuple[Annotated[float, Range(0, 1e30)], Annotated[float, Range(0, 1e30)]]
    mfu: tuple[Annotated[float, Range(0, 1e6)], Annotated[float, Range(0, 1e6)]]
    days_to_budget: tuple[Annotated[float, Range(0, 1e30, allow_nan=True)],
                          Annotated[float, Range(0, 1e30, allow_nan=True)]]

    @classmethod
    def of(cls, band: dict) -> "PredictedBand | None":
        """From simulator.metrics.error_band's dict (None where the topology carries no band)."""
        if not band:
            return None
        return cls(relative=band["relative"], stack=band["stack"], step_time_s=tuple(band["step_time_s"]),
                   mfu=tuple(band["mfu"]), days_to_budget=tuple(band["days_to_budget"]))


@dataclass(frozen=True)
class Predicted:
    """What a prediction said about this plan (estimate or simulation), with its error band."""

    source: Literal["estimate", "simulate", "plan"]
    step_time_s: Annotated[float, Range(0, 1e30)]
    tokens_per_s: Annotated[float, Range(0, 1e30)]
    mfu: Annotated[float, Range(0, 1e6)]
    peak_memory_bytes: Annotated[float, Range(0, 1e30)]
    days_to_budget: Annotated[float, Range(0, 1e30, allow_nan=True)]  # NaN: the plan has no token budget
    phases_s: dict[str, Annotated[float, Range(0, 1e30)]] = field(default_factory=dict)
    flops_convention: str = ""
    drop_fraction: Annotated[float, Range(0, 1)] = 0.0
    fits: bool = True
    band: PredictedBand | None = None


@dataclass(frozen=True)
class Provenance:
    rackcast_version: str
    inputs_sha256: dict[str, str] = field(default_factory=dict)
    command: str = ""


@dataclass(frozen=True)
class Plan:
    name: Annotated[str, Text()]
    model: str | ModelSpec  # preset name, YAML path (strict.is_file_reference), or an inline spec
    topology: TopologyRef
    parallel: ParallelSpec
    batch: BatchSpec
    schedule: PlanSchedule = "1f1b"
    recompute: Literal["none", "selective", "full"] = "none"
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    expert_transport: ExpertTransport = field(default_factory=ExpertTransport)
    precision: Precision = "bf16"  # fp32: no autocast (exact CPU references)
    grad_dtype: Literal["bf16", "fp32"] = "fp32"  # gradient accumulation and reduction dtype
    # Data-parallel gradient reduction: false, after the backward and blocking (what rackcast's trainer does:
    # backend.parallel's DDP comm hook and the pipeline stages' flat all-reduce block); true, each layer's gradients
    # reduce while the backward goes on (Megatron-LM's DistributedDataParallelConfig.overlap_grad_reduce, FSDP2's
    # reduce-scatter stream). The estimate and the simulator both read it.
    overlap_grad_reduce: bool = False
    attention_kernel: Literal["flash", "materialized"] = "flash"
    # torch.compile the trainer's transformer blocks (backend.compiled); the default stays eager: see the README's
    # trainer table for where compiling was measured faster. The simulator prices eager steps either way.
    compile: bool = False
    dropout: bool = False
    z_loss_weight: Annotated[float, Range(0, 10)] = 1e-4  # logit z-loss weight (Recipe)
    combine_sum: Annotated[float, Range(0, 1024, above=True)] = 1.0  # per-token sum of the MoE combine weights (Recipe)
    tokens: Annotated[float, Range(0, 1e18)] = 0.0  # token budget for days-to-budget (0: not set)
    start: Annotated[str, IsoDate()] = ""  # ISO date
    deadline: Annotated[str, IsoDate()] = ""  # ISO date, after start
    seed: Annotated[int, Range(0, 2**32 - 1)] = 0
    predicted: Predicted | None = None
    provenance: Provenance | None = None

    def __post_init__(self):
        if self.start and self.deadline and parse_date(self.deadline, "deadline") <= parse_date(self.start, "start"):
            raise RackcastError(f"deadline: {self.deadline} is not after the start {self.start}")

    def model_spec(self) -> ModelSpec:
        return self.model if isinstance(self.model, ModelSpec) else load_model(self.model)

    def topology_spec(self):
        from rackcast.topologies import load_topology

        return load_topology(self.topology.name, self.topology.domains, self.topology.usable_gpus or None,
                             profile=self.topology.profile)

    @property
    def microbatches(self) -> int:
        """Micro-batches per step on one data-parallel rank (rackcast.layout.ParallelSpec.microbatches)."""
        return self.parallel.microbatches(self.batch.global_batch, self.batch.micro_batch)

    def tokens_per_microbatch(self, spec: ModelSpec) -> float:
        """Tokens one rank processes per micro-batch (rackcast.layout.ParallelSpec.tokens_per_microbatch)."""
        return self.parallel.tokens_per_microbatch(self.batch.micro_batch, spec.seq_len)

    def routed_tokens_per_microbatch(self, spec: ModelSpec) -> float:
        """Tokens one rank routes to the experts per micro-batch (ParallelSpec.routed_tokens_per_microbatch)."""
        return self.parallel.routed_tokens_per_microbatch(self.batch.micro_batch, spec.seq_len)

    def rank_layers(self, spec: ModelSpec, rank: int = 0) -> list[int]:
        """Layers pipeline rank `rank` holds under this plan's schedule (rackcast.layout.ParallelSpec.rank_layers)."""
        return self.parallel.rank_layers(rank, self.schedule, spec.layers)

    def tokens_per_step(self, spec: ModelSpec) -> int:
        return self.batch.global_batch * spec.seq_len


def validate(plan: Plan, spec: ModelSpec, gpus_available: int, where: str = "") -> None:
    """Refuse layouts that do not divide the hardware or the model; each error names the field."""
    p, b = plan.parallel, plan.batch

    def fail(field_name: str, message: str):
        raise RackcastError(f"{field_name}: {message}", where=where)

    p.check(spec, gpus_available, plan.schedule, fail)
    if b.global_batch <= 0 or b.micro_batch <= 0:
        fail("batch", "global_batch and micro_batch must be positive")
    per_step = p.batch_shards * b.micro_batch
    if b.global_batch % per_step:
        fail("batch.global_batch", f"{b.global_batch} sequences are not divisible by data x fsdp x micro_batch "
                                   f"= {per_step}")
    m = plan.microbatches
    if p.pipeline > 1 and plan.schedule in STAGE_BOUND_SCHEDULES and m < p.pipeline:
        fail("batch", f"{m} micro-batches per step are fewer than the {p.pipeline} pipeline stages that "
                      f"{plan.schedule} needs")
    if p.pipeline > 1 and plan.schedule == "dualpipev" and m < p.chunks:
        fail("batch", f"{m} micro-batches per step are fewer than the {p.chunks} model chunks (2 x pipeline) that "
                      "dualpipev needs")
    if plan.schedule == "interleaved_1f1b" and p.pipeline > 1 and m % p.pipeline:
        fail("batch", f"interleaved_1f1b needs micro-batches ({m}) divisible by pipeline ({p.pipeline})")
    if plan.expert_transport.routing == "histogram" and not plan.expert_transport.histogram:
        fail("expert_transport.histogram", "routing: histogram needs the path of a recorded histogram")
    if plan.tokens < 0:
        fail("tokens", f"must be >= 0, got {plan.tokens}")


def _resolve(field_name: str, build, path: str):
    """Build the plan's model or topology; an error is reported against this plan's field (and names the model or
    topology file too when it lies there)."""
    try:
        return build()
    except RackcastError as exc:
        raise RackcastError(f"{field_name}: {exc}", where=str(path)) from None


def load_plan(path: str, check: bool = True) -> Plan:
    """Load and (by default) validate a plan file against its model and topology."""
    plan = from_data(Plan, load_yaml(path), where=str(path))
    if check:
        from rackcast.topologies.profiles import load_profile

        spec = _resolve("model", plan.model_spec, path)
        _resolve("topology.profile", lambda: load_profile(plan.topology.profile), path)
        topo = _resolve("topology", plan.topology_spec, path)
        validate(plan, spec, topo.gpus, where=str(path))
        # compute is priced at the precision's peak (simulator.costs.compute_peak): the topology must list it
        _resolve(f"precision (topology {plan.topology.name})", lambda: topo.precision_peak(plan.precision), path)
    return plan


def plan_to_yaml(plan: Plan) -> str:
    return dump_yaml(to_data(plan))


def save_plan(plan: Plan, path: str) -> None:
    write_text_atomic(path, plan_to_yaml(plan))


def inputs_hash(plan: Plan) -> str:
    """SHA-256 of the plan's inputs (everything but the predicted block and provenance)."""
    return hashlib.sha256(plan_to_yaml(replace(plan, predicted=None, provenance=None)).encode()).hexdigest()


def model_hash(spec: ModelSpec) -> str:
    """SHA-256 of a model's shape (its ModelSpec as YAML)."""
    return hashlib.sha256(dump_yaml(to_data(spec)).encode()).hexdigest()


def with_prediction(plan: Plan, predicted: Predicted, command: str = "") -> Plan:
    spec = plan.model_spec()
    hashes = {"plan": inputs_hash(plan), "model": model_hash(spec)}
    return replace(plan, predicted=predicted,
                   provenance=Provenance(rackcast_version=__version__, inputs_sha256=hashes, command=command))


def main(argv: list[str]) -> int:
    """`python -m rackcast.plan FILE...`: validate plan files; 'FILE: ok', or one line and exit code 2 at the first
    refusal (1 for an unexpected error, whose traceback `rackcast --debug estimate FILE` shows)."""
    from rackcast.errors import unexpected_error_line

    if not argv:
        print("usage: python -m rackcast.plan PLAN.yaml [PLAN.yaml ...]", file=sys.stderr)
        return 2
    for plan_path in argv:
        try:
            load_plan(plan_path)
        except RackcastError as exc:
            print(f"rackcast.plan: error: {exc}", file=sys.stderr)
            return 2
        except Exception as exc:  # noqa: BLE001 - one line, never a traceback
            print("rackcast.plan: " + unexpected_error_line(exc, "`rackcast --debug estimate FILE` shows the "
                                                                 "traceback"), file=sys.stderr)
            return 1
        print(f"{plan_path}: ok")
    return 0


if __name__ == "__main__":  # the documented validator entry point (README), not a demo
    sys.exit(main(sys.argv[1:]))
