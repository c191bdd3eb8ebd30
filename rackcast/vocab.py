"""Vocabularies every layer shares, the one home for each: pipeline schedule names and what each implies, the phase
names a step's time splits into, and the optimizer and balancing constants that the simulator prices and the trainer
runs. Core layer: every layer may import it; it imports nothing from rackcast.

    from rackcast.vocab import PLAN_SCHEDULES, PHASES
"""

from __future__ import annotations

from typing import Literal, get_args

# ---------------------------------------------------------------------------------------------- pipeline schedules
# A plan's `schedule` field; the order is the planner's default search order (1f1b, the plan default, first).
PlanSchedule = Literal["1f1b", "gpipe", "interleaved_1f1b", "zb_h1", "dualpipev"]
PLAN_SCHEDULES: tuple[str, ...] = get_args(PlanSchedule)

# Every schedule the simulator can order (simulator.schedules), with the torch.distributed.pipelining class that runs
# it: the plan's five and ZB-V, which the simulator models for comparison but no plan names.
TORCH_SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zb_h1": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
SCHEDULES: tuple[str, ...] = tuple(TORCH_SCHEDULE_CLASSES)

SINGLE_CHUNK_SCHEDULES = frozenset({"gpipe", "1f1b"})  # one model chunk per pipeline rank (virtual = 1)
V_SHAPED_SCHEDULES = frozenset({"zbv", "dualpipev"})  # exactly two chunks per rank, placed in a V (r and 2p-1-r)
# Looped schedules: rank r holds chunks r, r + p, r + 2p, ... (any virtual >= 1).
INTERLEAVED_SCHEDULES = frozenset({"interleaved_1f1b", "zb_h1"})
# Schedules that accept more than one chunk per rank (parallel.virtual > 1): the interleaved ones and the V ones.
VIRTUAL_SCHEDULES = INTERLEAVED_SCHEDULES | V_SHAPED_SCHEDULES
# Schedules whose pipelined steady state needs at least as many micro-batches as pipeline stages (all but GPipe).
STAGE_BOUND_SCHEDULES = frozenset(SCHEDULES) - {"gpipe"}
# Schedules that split the backward into input- and weight-gradient parts (zero-bubble and DualPipe).
SPLIT_BACKWARD_SCHEDULES = frozenset({"zb_h1", "zbv", "dualpipev"})

# ------------------------------------------------------------------------------------------------- expert routing
# A plan's `expert_transport.routing` (simulator.routing draws each): "uniform" (every expert equally likely, drawn
# multinomially), "zipf" (skewed popularity), "histogram" (counts the trainer recorded) and "balanced" (every expert
# gets exactly its share, tokens x top_k / experts: the force-balanced routing that published MoE throughput
# benchmarks run, Megatron-Core's --moe-router-force-load-balancing, https://docs.nvidia.com/megatron-core/
# developer-guide/latest/api-guide/moe.html; a benchmarking mode, not learned routing).
Routing = Literal["uniform", "zipf", "histogram", "balanced"]
ROUTINGS: tuple[str, ...] = get_args(Routing)

# ------------------------------------------------------------------------------------------------------ precision
# A plan's `precision`: the dtype its matrix products run in (bf16 under autocast, fp8 GEMMs under Transformer
# Engine's recipe, fp32 without autocast as the CPU references run); simulator.costs.compute_peak prices each.
Precision = Literal["bf16", "fp8", "fp32"]
PRECISIONS: tuple[str, ...] = get_args(Precision)

# ------------------------------------------------------------------------------------------------ stack profiles
# The stack profile a plan runs on when it names none (topologies/profiles/*.yaml, a plan's topology.profile).
DEFAULT_STACK_PROFILE = "megatron-te"

# --------------------------------------------------------------------------------------------------- step phases
# Where rank 0's step time goes, as the closed-form estimate and the simulator report it (Estimate.phases_s).
PHASES = ("compute", "exposed_expert_a2a", "exposed_tensor_comm", "exposed_fsdp_gather", "pipeline_p2p",
          "pipeline_bubble", "exposed_dp_comm", "optimizer", "host_transfer")
# What the trainer records (backend.record): the same phases and `other`, the time no timer covered.
MEASURED_PHASES = PHASES + ("other",)

# ----------------------------------------------------------------------------------------- optimizer and balancing
# MuonH orthogonalises each matrix update with this many quintic Newton-Schulz iterations (Jordan et al. 2024,
# "Muon: An optimizer for hidden layers in neural networks", https://kellerjordan.github.io/posts/muon/).
NEWTON_SCHULZ_STEPS = 5
# Quantile balancing's margin histogram: bins per expert (Marin's qb_hist_bins default; the 535B run used 10,000).
BALANCE_BINS = 1000
