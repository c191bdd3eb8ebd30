"""Stack profiles: what the software stack running the kernels changes in a topology's efficiency profile, as typed
data (YAML files beside this module, each figure with its public source in a comment).

A topology preset holds what the hardware and its best kernel libraries reach (GEMM ceilings from kernel-level
sweeps, collective bus bandwidths from nccl-tests, the attention fraction); a stack profile scales those for the
stack a plan runs on and sets the per-kernel launch floor and the prediction's error band. A plan names its profile
(`topology.profile`, default rackcast.vocab.DEFAULT_STACK_PROFILE); topologies.load_topology applies it.

Measured wins: on a topology whose GEMM efficiency was measured (`rackcast calibrate` curves, local-cpu) the
measurement already includes the stack, so a profile only names itself and sets the error band there.

    from rackcast.topologies.profiles import load_profile, apply_profile
    topo = apply_profile(topo, load_profile("eager-pytorch"))
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated

from rackcast.bounds import Range, Text
from rackcast.errors import RackcastError
from rackcast.strict import load_preset, preset_names
from rackcast.topologies.spec import CollectiveCurves, CurvePoint, Topology

PROFILE_DIR = Path(__file__).parent


@dataclass(frozen=True)
class StackProfile:
    """Factors on the topology's efficiencies (1 keeps them), the least time of one kernel, and the relative error
    band a prediction on this stack carries."""

    name: Annotated[str, Text()]
    description: str = ""
    source: str = ""
    gemm: Annotated[float, Range(0, 10, above=True)] = 1.0  # x efficiency.gemm_ceiling
    grouped_gemm: Annotated[float, Range(0, 10, above=True)] = 1.0  # x efficiency.grouped_gemm_ceiling
    attention: Annotated[float, Range(0, 10, above=True)] = 1.0  # x efficiency.attention
    memory_bound: Annotated[float, Range(0, 10, above=True)] = 1.0  # x efficiency.memory_bound
    collectives: Annotated[float, Range(0, 10, above=True)] = 1.0  # x every collective's bus-bandwidth curve
    launch_s: Annotated[float, Range(0, 1)] = 0.0  # least seconds one GEMM kernel takes
    error_band: Annotated[float, Range(0, 1)] = 0.0  # relative band of step time, MFU and days
    # Sliding-window attention computes its blocks' masked entries (rackcast train's banded SDPA call) rather than
    # skipping them (FlashAttention's window_size, TE's sliding-window fused attention): simulator.attention_cost.
    masked_window_work: bool = True


def list_profiles() -> list[str]:
    return preset_names(PROFILE_DIR)


def load_profile(name_or_path: str) -> StackProfile:
    """A stack profile by name (a YAML file here) or YAML path; an unknown name is a RackcastError listing the known
    ones."""
    return load_preset(StackProfile, PROFILE_DIR, name_or_path, "stack profile")


def _scaled(curve: list[CurvePoint], factor: float) -> list[CurvePoint]:
    return [CurvePoint(p.size, min(1.0, p.value * factor)) for p in curve]


def apply_profile(topo: Topology, profile: StackProfile) -> Topology:
    """The topology with the profile's factors on its efficiencies (clamped to 1), its launch floor and error band;
    on a topology with measured GEMM curves only the name and the error band (see the module docstring). A topology
    that already carries a profile (efficiency.stack) is returned as it is for the same profile, refused for
    another."""
    e = topo.efficiency
    if e.gemm or e.grouped_gemm:
        return topo.with_efficiency(replace(e, stack=profile.name, error_band=profile.error_band))
    if e.stack:  # a topology file written with a profile applied (a fitted topology): never scale twice
        if e.stack == profile.name:
            return topo
        raise RackcastError(f"efficiency.stack: this topology was written with stack profile {e.stack!r} applied; "
                            f"it cannot be re-read as {profile.name!r} (name that profile, or the unprofiled preset)")
    f = profile
    coll = {k: CollectiveCurves(_scaled(c.scale_up, f.collectives), _scaled(c.scale_out, f.collectives))
            for k, c in e.collectives.items()}
    return topo.with_efficiency(replace(
        e, gemm_ceiling=min(1.0, e.gemm_ceiling * f.gemm),
        grouped_gemm_ceiling=min(1.0, e.grouped_gemm_ceiling * f.grouped_gemm),
        attention=min(1.0, e.attention * f.attention),
        attention_surface=[p.scaled(f.attention, 0.0) for p in e.attention_surface],
        memory_bound=min(1.0, e.memory_bound * f.memory_bound),
        collectives=coll, launch_s=f.launch_s, error_band=f.error_band, stack=f.name,
        masked_window_work=f.masked_window_work))
