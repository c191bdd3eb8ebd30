"""Hardware as data: topology presets (YAML), their typed form, and the networkx graph built from them.

    from rackcast.topologies import load_topology, list_topologies
    topo = load_topology("gb200-nvl72", domains=11)       # 11 racks, 64 of 72 GPUs each (the preset's default)
    topo = load_topology("gb200-nvl72", domains=2, usable_gpus=72)
    topo = load_topology("h100-hgx", profile="eager-pytorch")  # the stack profile (default megatron-te)
"""

from __future__ import annotations

from pathlib import Path

from rackcast.errors import RackcastError
from rackcast.strict import load_preset, preset_names
from rackcast.topologies.profiles import apply_profile, load_profile
from rackcast.topologies.spec import Topology
from rackcast.vocab import DEFAULT_STACK_PROFILE

PRESET_DIR = Path(__file__).parent / "presets"


def list_topologies() -> list[str]:
    return preset_names(PRESET_DIR)


def load_topology(name_or_path: str, domains: int | None = None, usable_gpus: int | None = None,
                  profile: str = DEFAULT_STACK_PROFILE) -> Topology:
    """A Topology from a preset name or YAML path, optionally resized (domains) or with fewer GPUs per domain used,
    with a stack profile applied (topologies.profiles; the default one unless named), as each process sees it when
    more processes than cores share a CPU host (Topology.time_shared)."""
    topo = apply_profile(load_preset(Topology, PRESET_DIR, name_or_path, "topology preset"), load_profile(profile))
    if domains is not None:
        if domains <= 0:
            raise RackcastError(f"number of {topo.domain_label}s must be positive, got {domains}")
        try:
            topo = topo.with_domains(domains)
        except ValueError as exc:  # Topology's own checks (a preset without a fabric spans one domain only)
            raise RackcastError(str(exc)) from None
    if usable_gpus is not None:
        if not 0 < usable_gpus <= topo.scale_up.domain_size:
            raise RackcastError(
                f"GPUs used per {topo.domain_label} must lie in 1..{topo.scale_up.domain_size}, got {usable_gpus}"
            )
        topo = topo.with_usable_gpus(usable_gpus)
    return topo.time_shared()
