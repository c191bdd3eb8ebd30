"""Result metrics of a predicted step, the one definition the closed-form estimate, the step simulator and the
planner use: whether the layout fits (HBM and host memory), tokens per second, MFU and days to a token budget.

MFU = model FLOPs per step / (step time x GPUs x dense bf16 peak); model FLOPs follow the plan's FlopsConvention
(ModelSpec.flops_per_token_train; recomputation is not model FLOPs). Days = token budget / tokens per second, NaN
without a budget. Every function takes numbers or numpy arrays (one element per candidate layout).

    from rackcast.simulator.metrics import fits_memory, step_metrics
"""

from __future__ import annotations

import math
from typing import NamedTuple

from rackcast.modelspec import FlopsConvention, ModelSpec
from rackcast.topologies.spec import Topology
from rackcast.units import SECONDS_PER_DAY


class StepMetrics(NamedTuple):
    tokens_per_s: object  # float or array
    mfu: object
    days_to_budget: object  # NaN without a token budget


def model_flops_per_step(spec: ModelSpec, tokens_per_step, convention: FlopsConvention = FlopsConvention()):
    """Model FLOPs of one training step (forward and backward) under `convention`."""
    return spec.flops_per_token_train(convention) * tokens_per_step


def days_to_budget(token_budget: float, tokens_per_s):
    """Days to train `token_budget` tokens at `tokens_per_s` (NaN without a budget)."""
    return token_budget / tokens_per_s / SECONDS_PER_DAY if token_budget else math.nan * tokens_per_s


def step_metrics(tokens_per_step, step_time_s, model_flops, gpus, topo: Topology, token_budget: float) -> StepMetrics:
    """Tokens/s, MFU (of the dense bf16 peak over `gpus`) and days to `token_budget` (NaN when 0)."""
    tokens_per_s = tokens_per_step / step_time_s
    mfu = model_flops / (step_time_s * gpus * topo.peak_flops("bf16"))
    return StepMetrics(tokens_per_s, mfu, days_to_budget(token_budget, tokens_per_s))


def error_band(step_time_s: float, mfu: float, days: float, topo: Topology) -> dict:
    """The band a prediction carries: the stack profile's relative error band b (topologies.profiles; efficiency
    .error_band of the topology the plan was priced on) around step time and days, and the MFU that goes with them
    (step time x (1 -/+ b), MFU / (1 +/- b), days x (1 -/+ b)); empty where the topology carries no band."""
    b = topo.efficiency.error_band
    if not b:
        return {}
    return {"relative": b, "stack": topo.efficiency.stack,
            "step_time_s": [step_time_s * (1 - b), step_time_s * (1 + b)],
            "mfu": [mfu / (1 + b), mfu / (1 - b)], "days_to_budget": [days * (1 - b), days * (1 + b)]}


def band_text(band: dict) -> str:
    """The prediction's error band in one line (error_band), '' without one."""
    if not band:
        return ""
    step, mfu, days = band["step_time_s"], band["mfu"], band["days_to_budget"]
    out = (f"band +-{100 * band['relative']:.0f}% (stack profile {band['stack']}, topologies/profiles/{band['stack']}"
           f".yaml says where it comes from): step {step[0]:.3g}-{step[1]:.3g} s, MFU {100 * mfu[0]:.1f}-"
           f"{100 * mfu[1]:.1f}%")
    return out if math.isnan(days[0]) else out + f", {days[0]:.1f}-{days[1]:.1f} days"


def host_bytes_per_host(host_bytes_per_gpu, topo: Topology):
    """Host memory one host needs: what each of its GPUs keeps there (offloaded optimizer state) times its GPUs."""
    return host_bytes_per_gpu * topo.host.gpus_per_host


def fits_memory(hbm_bytes_per_gpu, host_bytes_per_gpu, topo: Topology):
    """Whether the peak per GPU fits its HBM and the offloaded state fits host memory (both must)."""
    return (hbm_bytes_per_gpu <= topo.accelerator.hbm_bytes) & \
        (host_bytes_per_host(host_bytes_per_gpu, topo) <= topo.host.memory_bytes)
