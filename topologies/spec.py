"""Topology: the hardware as typed data (accelerator, host memory tier, scale-up domain, scale-out fabric, size),
with the efficiency profile that turns peak figures into achieved ones.

Every number lives in the YAML presets beside this file (topologies/presets/*.yaml), each with its source in a
comment; this module only defines the types, validates them and interpolates the efficiency curves.

Units: bytes, seconds, FLOP/s, bytes/s (suffix _Bps). Link bandwidths are per GPU and per direction.
Collective efficiencies follow the nccl-tests bus-bandwidth convention: the achieved bus bandwidth of a collective is
`efficiency(message_bytes) x link bandwidth of the slowest hop`, and its time is `algorithm bytes / algbw`, with
algbw = busbw / factor (all_reduce 2(n-1)/n, all_gather / reduce_scatter / all_to_all (n-1)/n).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace
from typing import Annotated, Literal

from rackcast.bounds import Items, Range, Text

Span = Literal["scale_up", "scale_out"]
CollectiveKind = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"]
COLLECTIVE_KINDS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
# Largest efficiency.eager_bandwidth a file may hold: a bound on typos, far above any cache's speed-up (it is a share
# of the out-of-cache bandwidth, so it may exceed 1)
EAGER_BANDWIDTH_MAX = 100.0


@dataclass(frozen=True)
class CurvePoint:
    """One measured point of an efficiency curve: at `size` (bytes or FLOPs), `value` (fraction of peak)."""

    size: Annotated[float, Range(0, 1e30, above=True)]
    value: Annotated[float, Range(0, 1, above=True)]

    def __post_init__(self):
        if self.size <= 0:
            raise ValueError(f"curve point size must be positive, got {self.size}")
        if not 0.0 < self.value <= 1.0:
            raise ValueError(f"curve point value must lie in (0, 1], got {self.value}")


def interpolate(curve: list[CurvePoint], size: float) -> float:
    """Piecewise-linear in log(size), clamped at both ends. A one-point curve is a constant."""
    if not curve:
        raise ValueError("empty efficiency curve")
    sizes = [p.size for p in curve]
    if size <= sizes[0]:
        return curve[0].value
    if size >= sizes[-1]:
        return curve[-1].value
    i = bisect.bisect_right(sizes, size)
    lo, hi = curve[i - 1], curve[i]
    t = (math.log(size) - math.log(lo.size)) / (math.log(hi.size) - math.log(lo.size))
    return lo.value + t * (hi.value - lo.value)


def _check_curve(name: str, curve: list[CurvePoint]) -> None:
    if not curve:
        raise ValueError(f"{name} needs at least one point")
    sizes = [p.size for p in curve]
    if sizes != sorted(sizes) or len(set(sizes)) != len(sizes):
        raise ValueError(f"{name} sizes must increase strictly")


@dataclass(frozen=True)
class SurfacePoint:
    """One measured point of a GEMM efficiency surface: `groups` GEMMs of m x n x k each (rows x output columns x
    reduction; a grouped GEMM's m is its mean rows per group) run as one kernel reached `efficiency` of the peak."""

    m: Annotated[float, Range(0, 1e12, above=True)]
    n: Annotated[float, Range(0, 1e12, above=True)]
    k: Annotated[float, Range(0, 1e12, above=True)]
    efficiency: Annotated[float, Range(0, 1, above=True)]
    groups: Annotated[float, Range(1, 1e9)] = 1.0

    def __post_init__(self):
        if min(self.m, self.n, self.k) <= 0:
            raise ValueError(f"surface point m, n, k must be positive, got {self.m} x {self.n} x {self.k}")
        if not 0.0 < self.efficiency <= 1.0:
            raise ValueError(f"surface point efficiency must lie in (0, 1], got {self.efficiency}")

    def scaled(self, factor: float, floor: float) -> "SurfacePoint":
        """This point with its efficiency times `factor`, kept in [floor, 1]."""
        return replace(self, efficiency=min(1.0, max(floor, self.efficiency * factor)))


def _check_surface(name: str, points: list[SurfacePoint]) -> None:
    """A surface is interpolated on its grid (simulator.gemm_surface), so it must be one: every combination of its
    m, n and k values exactly once."""
    shape = [len({getattr(p, axis) for p in points}) for axis in ("m", "n", "k")]
    if len({(p.m, p.n, p.k) for p in points}) != len(points):
        raise ValueError(f"efficiency.{name}: a shape (m, n, k) appears twice")
    if shape[0] * shape[1] * shape[2] != len(points):
        raise ValueError(f"efficiency.{name}: the points must form a full grid over their m, n and k values "
                         f"({shape[0]} x {shape[1]} x {shape[2]} = {shape[0] * shape[1] * shape[2]} shapes), "
                         f"got {len(points)}")


ATTENTION_KINDS = ("causal", "banded")  # simulator.attention_cost: how a layer's attention core is called


@dataclass(frozen=True)
class AttentionPoint:
    """One measured point of the attention efficiency surface: one forward + backward kernel call of `kind` (causal:
    SDPA over the whole sequence, keys = queries; banded: backend.attention.banded_attention's SDPA call with a
    window of `keys`) on
    `rows` (batch x heads) sequences of `queries` positions and head width `head_dim` reached `efficiency` of the
    peak, its FLOPs counted as the kernel executes them (simulator.attention_cost.executed_flops)."""

    kind: Literal["causal", "banded"]
    rows: Annotated[float, Range(0, 1e12, above=True)]
    queries: Annotated[float, Range(0, 1e12, above=True)]
    keys: Annotated[float, Range(0, 1e12, above=True)]
    head_dim: Annotated[float, Range(0, 1e6, above=True)]
    efficiency: Annotated[float, Range(0, 1, above=True)]

    def __post_init__(self):
        if self.kind not in ATTENTION_KINDS:
            raise ValueError(f"attention surface point kind must be one of {ATTENTION_KINDS}, got {self.kind!r}")
        if min(self.rows, self.queries, self.keys, self.head_dim) <= 0:
            raise ValueError("attention surface point rows, queries, keys, head_dim must be positive, got "
                             f"{self.rows}, {self.queries}, {self.keys}, {self.head_dim}")
        if self.kind == "causal" and self.keys != self.queries:
            raise ValueError(f"a causal attention surface point has keys = queries, got {self.keys} != {self.queries}")
        if not 0.0 < self.efficiency <= 1.0:
            raise ValueError(f"attention surface point efficiency must lie in (0, 1], got {self.efficiency}")

    def scaled(self, factor: float, floor: float) -> "AttentionPoint":
        """This point with its efficiency times `factor`, kept in [floor, 1]."""
        return replace(self, efficiency=min(1.0, max(floor, self.efficiency * factor)))


def attention_axes(kind: str) -> tuple[str, ...]:
    """The axes a surface of `kind` spans (a causal call's keys are its queries)."""
    return ("rows", "queries", "head_dim") if kind == "causal" else ("rows", "queries", "keys", "head_dim")


def _check_attention_surface(points: list[AttentionPoint]) -> None:
    """Each kind's points are interpolated on their grid (simulator.attention_cost), so they must form one."""
    for kind in ATTENTION_KINDS:
        mine, axes = [p for p in points if p.kind == kind], attention_axes(kind)
        sizes = [len({getattr(p, a) for p in mine}) for a in axes]
        if len({tuple(getattr(p, a) for a in axes) for p in mine}) != len(mine):
            raise ValueError(f"efficiency.attention_surface: a {kind} shape appears twice")
        if mine and math.prod(sizes) != len(mine):
            raise ValueError(f"efficiency.attention_surface: the {kind} points must form a full grid over their "
                             f"{', '.join(axes)} values ({' x '.join(map(str, sizes))} = {math.prod(sizes)} shapes), "
                             f"got {len(mine)}")


@dataclass(frozen=True)
class CollectiveCurves:
    """Achieved bus-bandwidth fraction of the slowest hop, by message size, inside and across scale-up domains."""

    scale_up: Annotated[list[CurvePoint], Items(256)]
    scale_out: Annotated[list[CurvePoint], Items(256)]

    def __post_init__(self):
        _check_curve("scale_up", self.scale_up)
        _check_curve("scale_out", self.scale_out)


@dataclass(frozen=True)
class HostOpTimes:
    """Host seconds per framework op, by where the op runs: a forward op pays for the module's Python code and for
    recording the autograd graph, a backward op is run by autograd's C++ engine, an optimizer op by the optimizer's
    per-tensor loop under no_grad. Measured apart because they differ by about 2x on a CPU (backend.opcount)."""

    forward: Annotated[float, Range(0, 1)] = 0.0
    backward: Annotated[float, Range(0, 1)] = 0.0
    optimizer: Annotated[float, Range(0, 1)] = 0.0

    def __post_init__(self):
        for name in ("forward", "backward", "optimizer"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"efficiency.host_op_s.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def measured(self) -> bool:
        return self.forward > 0.0 or self.backward > 0.0 or self.optimizer > 0.0

    def scaled(self, factor: float) -> "HostOpTimes":
        return HostOpTimes(self.forward * factor, self.backward * factor, self.optimizer * factor)


@dataclass(frozen=True)
class EfficiencyProfile:
    """Achieved fractions of the peak figures. GEMMs are priced by the shape model of simulator.costs (tiles and
    waves on the accelerator's SMs, HBM roofline, `gemm_ceiling` / `grouped_gemm_ceiling` for large shapes, from
    kernel-level benchmarks) unless `gemm` / `grouped_gemm` hold measured curves (`rackcast calibrate`): a measured
    curve wins, and a measured surface by shape (`gemm_surface` / `grouped_gemm_surface`) wins over its curve. A
    stack profile (topologies.profiles) scales the ceilings, attention, memory-bound and collective efficiencies and
    sets the launch floor and the error band; `stack` names the one applied."""

    attention: Annotated[float, Range(0, 1, above=True)]  # fraction of dense peak achieved by attention kernels
    memory_bound: Annotated[float, Range(0, 1, above=True)]  # fraction of HBM bandwidth achieved by elementwise ops
    host_link: Annotated[float, Range(0, 1, above=True)]  # fraction of the host link bandwidth achieved by copies
    collectives: dict[str, CollectiveCurves]
    # compute slows by this fraction while communication kernels run
    comm_compute_slowdown: Annotated[float, Range(0, 1)] = 0.0
    source: str = ""
    # Host seconds per framework op (eager dispatch, autograd, Python), measured by `rackcast calibrate`; zero where
    # not measured. It dominates when kernels are tiny (small models on a CPU). Where measured, the estimate and the
    # simulator add it for the op counts of the backend model (simulator.host_overhead, simulator.op_counts).
    host_op_s: HostOpTimes = HostOpTimes()
    # Share of accelerator.hbm_bandwidth_Bps (the best out-of-cache copy/add, as calibrate measures it) that the
    # eager ops' counted bytes achieve (simulator.costs.eager_bytes_time); 1 is that measured figure. Not capped at
    # 1: an eager op's tensors are often resident in cache, where they move faster than the out-of-cache copy.
    eager_bandwidth: Annotated[float, Range(0, EAGER_BANDWIDTH_MAX, above=True)] = 1.0
    # Seconds of the machine-speed probe (backend.speed_probe) when `rackcast calibrate` measured this machine, all
    # ranks at once: validate sets each training run's probe beside it (rackcast.spread.MACHINE_MISMATCH_LIMIT); zero
    # where not measured (presets, calibrations from before the probe).
    speed_probe_s: Annotated[float, Range(0, 1)] = 0.0
    # measured efficiency by FLOPs of one GEMM (size) / of one expert's GEMM in a grouped GEMM; empty: shape model
    gemm: Annotated[list[CurvePoint], Items(256)] = field(default_factory=list)
    grouped_gemm: Annotated[list[CurvePoint], Items(256)] = field(default_factory=list)
    # measured efficiency by GEMM shape on a grid of m x n x k (`rackcast calibrate`; a grouped GEMM's m its rows per
    # group), beside the curve above; where present it wins over the curve (simulator.gemm_surface); empty: none
    gemm_surface: Annotated[list[SurfacePoint], Items(4096)] = field(default_factory=list)
    grouped_gemm_surface: Annotated[list[SurfacePoint], Items(4096)] = field(default_factory=list)
    # measured attention-core efficiency by call kind and shape (`rackcast calibrate`); where it holds points of a
    # layer's kind it wins over `attention` (simulator.attention_cost); empty: `attention` for every core
    attention_surface: Annotated[list[AttentionPoint], Items(4096)] = field(default_factory=list)
    # fraction of dense peak a large, well-shaped (grouped) GEMM reaches: the shape model's ceiling
    gemm_ceiling: Annotated[float, Range(0, 1)] = 0.0
    grouped_gemm_ceiling: Annotated[float, Range(0, 1)] = 0.0
    launch_s: Annotated[float, Range(0, 1)] = 0.0  # least time of one kernel (launch floor), from the stack profile
    error_band: Annotated[float, Range(0, 1)] = 0.0  # relative error band of a prediction, from the stack profile
    stack: Annotated[str, Text()] = ""  # the stack profile applied (topologies.profiles)
    # Whether a sliding-window layer's attention kernel computes the masked entries of its query blocks (rackcast
    # train's banded SDPA call: simulator.attention_cost) or skips them (a kernel with a native window, from the
    # stack profile); a measured (calibrated) topology keeps True whatever profile names it: it measured the trainer.
    masked_window_work: bool = True

    def __post_init__(self):
        for name in ("gemm", "grouped_gemm"):
            if getattr(self, name + "_surface"):
                if not getattr(self, name):
                    raise ValueError(f"efficiency.{name}_surface needs the measured curve efficiency.{name} beside "
                                     "it (rackcast calibrate writes both)")
                _check_surface(name + "_surface", getattr(self, name + "_surface"))
            if getattr(self, name):
                _check_curve(name, getattr(self, name))
            elif not 0.0 < getattr(self, name + "_ceiling") <= 1.0:
                raise ValueError(f"efficiency.{name}_ceiling must lie in (0, 1] where efficiency.{name} has no "
                                 "measured curve")
        _check_attention_surface(self.attention_surface)
        for name in ("attention", "memory_bound", "host_link"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"efficiency.{name} must lie in (0, 1], got {getattr(self, name)}")
        missing = [k for k in COLLECTIVE_KINDS if k not in self.collectives]
        if missing:
            raise ValueError(f"efficiency.collectives is missing {', '.join(missing)}")
        unknown = [k for k in self.collectives if k not in COLLECTIVE_KINDS]
        if unknown:
            raise ValueError(f"efficiency.collectives.{unknown[0]}: unknown collective")
        if not 0.0 <= self.comm_compute_slowdown < 1.0:
            raise ValueError("efficiency.comm_compute_slowdown must lie in [0, 1)")
        if not 0.0 < self.eager_bandwidth <= EAGER_BANDWIDTH_MAX:
            raise ValueError(f"efficiency.eager_bandwidth must lie in (0, {EAGER_BANDWIDTH_MAX:g}], got "
                             f"{self.eager_bandwidth}")

    def without_host_ops(self) -> "EfficiencyProfile":
        """This profile with the host per-op overhead left out (no op counting)."""
        return replace(self, host_op_s=HostOpTimes())

    def collective_efficiency(self, kind: str, span: Span, message_bytes: float) -> float:
        curves = self.collectives[kind]
        return interpolate(curves.scale_up if span == "scale_up" else curves.scale_out, message_bytes)


@dataclass(frozen=True)
class AcceleratorSpec:
    name: Annotated[str, Text()]
    peak_flops: dict[str, Annotated[float, Range(0, 1e18, above=True)]]  # dense FLOP/s per dtype (bf16, fp32..)
    hbm_bytes: Annotated[float, Range(0, 2**50, above=True)]  # usable device memory
    hbm_bandwidth_Bps: Annotated[float, Range(0, 1e15, above=True)]
    # streaming multiprocessors and the output tile (rows x columns) one SM computes at a time in a large bf16 GEMM:
    # the shape model's tile and wave quantisation (simulator.costs); 0 where GEMMs are priced from measured curves
    sms: Annotated[int, Range(0, 4096)] = 0
    tile_m: Annotated[int, Range(0, 4096)] = 0
    tile_n: Annotated[int, Range(0, 4096)] = 0

    def __post_init__(self):
        if not self.peak_flops or any(v <= 0 for v in self.peak_flops.values()):
            raise ValueError("accelerator.peak_flops needs at least one positive dtype entry")
        if "bf16" not in self.peak_flops:  # MFU is measured, and bf16 plans priced, against the dense bf16 peak
            raise ValueError(f"accelerator.peak_flops.bf16: required (has {sorted(self.peak_flops)})")
        if self.hbm_bytes <= 0 or self.hbm_bandwidth_Bps <= 0:
            raise ValueError("accelerator.hbm_bytes and hbm_bandwidth_Bps must be positive")


@dataclass(frozen=True)
class HostSpec:
    """The host memory tier (Grace LPDDR5X on GB200) and the GPU-host link (NVLink-C2C or PCIe)."""

    memory_bytes: Annotated[float, Range(0, 2**50, above=True)]  # per host
    memory_bandwidth_Bps: Annotated[float, Range(0, 1e15, above=True)]  # per host
    gpus_per_host: Annotated[int, Range(1, 4096)]
    link_bandwidth_Bps: Annotated[float, Range(0, 1e15, above=True)]  # per GPU, per direction
    link_latency_s: Annotated[float, Range(0, 1)]
    # CPU cores that run the accelerators' work where the "accelerators" are CPU processes (local-cpu); 0 where the
    # accelerators compute for themselves. More processes than cores on one host time-share them (Topology.time_shared)
    cores: Annotated[int, Range(0, 2**20)] = 0

    def __post_init__(self):
        if min(self.memory_bytes, self.memory_bandwidth_Bps, self.link_bandwidth_Bps) <= 0 or self.gpus_per_host <= 0:
            raise ValueError("host figures must be positive")


@dataclass(frozen=True)
class ScaleUpSpec:
    """One NVLink (or shared-memory) domain: an NVL72 rack, an HGX node."""

    domain_size: Annotated[int, Range(1, 4096)]  # GPUs physically in one domain
    usable_gpus: Annotated[int, Range(1, 4096)]  # GPUs a plan may use per domain (64 of 72 on NVL72: 2 trays spare)
    bandwidth_Bps: Annotated[float, Range(0, 1e15, above=True)]  # per GPU, per direction
    latency_s: Annotated[float, Range(0, 1)]
    switches: Annotated[int, Range(0, 4096)]  # switch chips in the domain (non-blocking crossbar)
    # GPUs per compute tray or board (0: the whole domain is one tray)
    gpus_per_tray: Annotated[int, Range(0, 4096)] = 0

    def __post_init__(self):
        if not 0 < self.usable_gpus <= self.domain_size:
            raise ValueError(f"scale_up.usable_gpus must lie in 1..{self.domain_size}, got {self.usable_gpus}")
        if self.bandwidth_Bps <= 0 or self.latency_s < 0 or self.switches < 0:
            raise ValueError("scale_up bandwidth must be positive and latency, switches >= 0")


@dataclass(frozen=True)
class ScaleOutSpec:
    """The fabric between domains: one or more NICs per GPU, rail-optimised, possibly oversubscribed."""

    nics_per_gpu: Annotated[int, Range(0, 64)]
    nic_bandwidth_Bps: Annotated[float, Range(0, 1e15)]  # per NIC, per direction
    latency_s: Annotated[float, Range(0, 1)]
    rails: Annotated[int, Range(0, 4096)]
    oversubscription: Annotated[float, Range(1, 1e4)] = 1.0  # 1 is non-blocking

    def __post_init__(self):
        if self.nics_per_gpu < 0 or self.rails < 0 or self.oversubscription < 1.0 or self.latency_s < 0:
            raise ValueError("scale_out: nics_per_gpu, rails >= 0, latency >= 0 and oversubscription >= 1")

    @property
    def bandwidth_per_gpu_Bps(self) -> float:
        return self.nics_per_gpu * self.nic_bandwidth_Bps / self.oversubscription


@dataclass(frozen=True)
class Topology:
    name: Annotated[str, Text()]
    accelerator: AcceleratorSpec
    host: HostSpec
    scale_up: ScaleUpSpec
    scale_out: ScaleOutSpec
    efficiency: EfficiencyProfile
    domains: Annotated[int, Range(1, 65536)] = 1  # racks or nodes in the cluster
    domain_label: Annotated[str, Text()] = "node"  # what one domain is called: "rack" or "node"
    description: str = ""
    # aggregate storage write bandwidth per domain (0: unknown)
    checkpoint_storage_Bps: Annotated[float, Range(0, 1e15)] = 0.0

    def __post_init__(self):
        if self.domains <= 0:
            raise ValueError(f"domains must be positive, got {self.domains}")
        if self.domains > 1 and self.scale_out.nics_per_gpu == 0:
            raise ValueError(f"domains: {self.name} has no scale-out fabric (scale_out.nics_per_gpu: 0), so it is "
                             f"one {self.domain_label} only, not {self.domains}")
        e, a = self.efficiency, self.accelerator
        if (not e.gemm or not e.grouped_gemm) and min(a.sms, a.tile_m, a.tile_n) <= 0:
            raise ValueError("accelerator.sms: the GEMM shape model needs sms, tile_m and tile_n > 0 where "
                             "efficiency.gemm / grouped_gemm hold no measured curve")
        if self.domains > 1 and (self.scale_out.rails == 0 or self.scale_out.nic_bandwidth_Bps == 0):
            raise ValueError("scale_out: spanning several domains needs rails > 0 and nic_bandwidth_Bps > 0")

    @property
    def gpus(self) -> int:
        """GPUs a plan may use: usable GPUs per domain x domains."""
        return self.scale_up.usable_gpus * self.domains

    def peak_flops(self, dtype: str = "bf16") -> float:
        try:
            return self.accelerator.peak_flops[dtype]
        except KeyError:
            raise ValueError(f"{self.name} has no peak for dtype {dtype!r} (has {sorted(self.accelerator.peak_flops)})")

    def precision_peak(self, precision: str, where: str = "") -> float:
        """FLOP/s a plan of `precision` computes at (the peak_dtype entry); a one-line RackcastError naming the field
        (reported against `where`) when this topology does not list it. The one check: plan loading and
        simulator.costs.compute_peak both call it."""
        from rackcast.errors import RackcastError

        dtype, peaks = self.peak_dtype(precision), self.accelerator.peak_flops
        if dtype not in peaks:
            raise RackcastError(f"accelerator.peak_flops.{dtype}: topology {self.name} does not list it (it lists "
                                f"{', '.join(sorted(peaks))}), and a plan with precision {precision} computes at it",
                                where=where)
        return peaks[dtype]

    def peak_dtype(self, precision: str) -> str:
        """The `accelerator.peak_flops` entry a plan of `precision` computes at (simulator.costs.compute_peak prices
        with it): bf16 and fp32 their own; fp8 the fp8 peak where listed, else bf16 (its GEMMs priced as bf16 ones)."""
        if precision == "fp8" and "fp8" not in self.accelerator.peak_flops:
            return "bf16"
        return precision

    def with_domains(self, domains: int) -> "Topology":
        return replace(self, domains=domains)

    def with_usable_gpus(self, usable: int) -> "Topology":
        return replace(self, scale_up=replace(self.scale_up, usable_gpus=usable))

    def time_share(self) -> float:
        """The share of a core each process gets: cores / processes per host where the processes (usable GPUs per
        domain, at most a host's) outnumber host.cores, else 1."""
        processes = min(self.scale_up.usable_gpus, self.host.gpus_per_host)
        return self.host.cores / processes if 0 < self.host.cores < processes else 1.0

    def time_shared(self) -> "Topology":
        """The topology as each process sees it when processes time-share the host's cores (time_share < 1): every
        rate a process reaches on its own core (peak FLOP/s, memory bandwidth) scaled by its share, and its host time
        per framework op divided by it. Links are left as measured. Unchanged where no cores are shared."""
        share = self.time_share()
        if share == 1.0:
            return self
        a, e = self.accelerator, self.efficiency
        ops = e.host_op_s
        return replace(self, accelerator=replace(a, peak_flops={k: v * share for k, v in a.peak_flops.items()},
                                                 hbm_bandwidth_Bps=a.hbm_bandwidth_Bps * share),
                       efficiency=replace(e, host_op_s=replace(ops, forward=ops.forward / share,
                                                               backward=ops.backward / share,
                                                               optimizer=ops.optimizer / share)))

    def with_memory_cap(self, cap_bytes: float) -> "Topology":
        """The topology with each accelerator's usable memory held to cap_bytes (no change above its HBM)."""
        return replace(self, accelerator=replace(self.accelerator, hbm_bytes=min(self.accelerator.hbm_bytes,
                                                                                 cap_bytes)))

    def with_efficiency(self, efficiency: EfficiencyProfile) -> "Topology":
        return replace(self, efficiency=efficiency)

    def link_bandwidth_Bps(self, span: Span) -> float:
        """Per-GPU, per-direction bandwidth of the slowest hop of a group with this span."""
        if span == "scale_up":
            return self.scale_up.bandwidth_Bps
        return min(self.scale_up.bandwidth_Bps, self.scale_out.bandwidth_per_gpu_Bps)

    def link_latency_s(self, span: Span) -> float:
        if span == "scale_up":
            return self.scale_up.latency_s
        return self.scale_up.latency_s + self.scale_out.latency_s

