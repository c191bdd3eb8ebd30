"""Failure rates and recovery costs for the run forecast, as typed data (YAML files beside this module).

Every figure lives in the YAML files here (default.yaml), each with its source in a comment; this module only
defines the types, validates them and loads them strictly (unknown keys and wrong types are refused).

    from rackcast.topologies.reliability import load_reliability
    spec = load_reliability()                      # default.yaml
    spec = load_reliability("my-cluster.yaml")     # a user's own figures

Units: rates are failures per unit in use per day (`_per_gpu_day`, ...), times in seconds, bandwidth in bytes/s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from rackcast.bounds import Range
from rackcast.strict import load_preset, preset_names
from rackcast.units import SECONDS_PER_DAY, SECONDS_PER_HOUR

RELIABILITY_DIR = Path(__file__).parent
SparesPolicy = Literal["shrink", "wait"]
SPARES_POLICIES: tuple[str, ...] = ("shrink", "wait")


@dataclass(frozen=True)
class FailureRates:
    """Interruptions per unit in use per day, by the unit a fault takes out."""

    gpu_per_gpu_day: Annotated[float, Range(0, 1)] = 0.0  # the GPU is replaced by a spare of its domain
    tray_per_tray_day: Annotated[float, Range(0, 1)] = 0.0  # the compute tray (all its GPUs) is replaced by spares
    # the rack-scale fabric of one domain (NVLink switch trays across its compute trays, as NVL72) stops it; reset,
    # no spare used. Single-baseboard domains (HGX, DGX: domain_size == gpus_per_tray) have no such fabric
    rack_per_rack_day: Annotated[float, Range(0, 1)] = 0.0
    # one scale-out link (NIC, cable, switch port); no spare used
    link_per_link_day: Annotated[float, Range(0, 1)] = 0.0
    software_per_gpu_day: Annotated[float, Range(0, 1)] = 0.0  # software / collective faults; no spare used

    def __post_init__(self):
        for name in ("gpu_per_gpu_day", "tray_per_tray_day", "rack_per_rack_day", "link_per_link_day",
                     "software_per_gpu_day"):
            if getattr(self, name) < 0:
                raise ValueError(f"rates.{name} must be >= 0, got {getattr(self, name)}")

    def scaled(self, factor: float) -> "FailureRates":
        return FailureRates(*(factor * getattr(self, n) for n in self.__dataclass_fields__))


@dataclass(frozen=True)
class ReliabilitySpec:
    name: str
    rates: FailureRates
    # from the fault to the job noticing it (watchdog timeouts, silent stalls)
    detection_s: Annotated[float, Range(0, SECONDS_PER_DAY)]
    # gang rescheduling and start-up (the checkpoint reload is added from its size)
    reschedule_s: Annotated[float, Range(0, SECONDS_PER_DAY)]
    # compute time between checkpoints; 0 disables checkpointing
    checkpoint_interval_s: Annotated[float, Range(0, 3.2e7)] = SECONDS_PER_HOUR
    # checkpoint bandwidth when the topology's is unknown (0)
    fallback_storage_Bps_per_gpu: Annotated[float, Range(0, 1e15)] = 0.0
    repair_s: Annotated[float, Range(0, 3.2e7)] = 0.0  # time until a failed GPU or tray is back as a spare
    spares_policy: SparesPolicy = "shrink"
    source: str = ""

    def __post_init__(self):
        for name in ("detection_s", "reschedule_s", "checkpoint_interval_s", "fallback_storage_Bps_per_gpu",
                     "repair_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


def list_reliability() -> list[str]:
    return preset_names(RELIABILITY_DIR)


def load_reliability(name_or_path: str = "default") -> ReliabilitySpec:
    """A ReliabilitySpec from a file name here (without .yaml) or a YAML path."""
    return load_preset(ReliabilitySpec, RELIABILITY_DIR, name_or_path, "reliability figures")
