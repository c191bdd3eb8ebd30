"""Cost of the optimizer step for one rank: Newton-Schulz FLOPs (MuonH), HBM traffic and host transfers.

Shared by the closed-form estimate and the discrete-event workload so both price the step the same way. The step
also runs quantile balancing's reductions (`balancing_reductions`; priced by simulator.estimate.balancing_time).
MuonH orthogonalises every matrix with NEWTON_SCHULZ_STEPS quintic iterations (Jordan et al. 2024, "Muon");
one iteration on an m x n matrix (m <= n) computes A = X X^T, B = bA + cA^2, X' = aX + BX: 4 m^2 n + 2 m^3 FLOPs.
Dense matrices are orthogonalised whole on every rank that holds a shard of them: with fsdp > 1 or tensor > 1
(backend.optim.orthogonalise: the update is all-gathered in fp32 over the fsdp group and over the tensor group
(backend.tensor_parallel shards the attention and MLP matrices), Newton-Schulz runs on every rank, each keeps its
rows or columns; `muon_gather`), and the hyperball step all-reduces three Frobenius norms (one fp32 scalar each) per
dense matrix over each of those groups. Expert stacks are sharded along the expert dimension, so each rank
orthogonalises only its own experts (split over the expert ranks and the experts' own FSDP shards) without
communication.
"""

from __future__ import annotations

import numpy as np

from rackcast.modelspec import ModelSpec
from rackcast.plan import Plan
from rackcast.simulator.activations import INDEX_BYTES
from rackcast.simulator.memory import BYTES, RankParams, optimizer_state_bytes
from rackcast.simulator.plan_arrays import is_arrays, state_location
from rackcast.vocab import NEWTON_SCHULZ_STEPS


def balancing_reductions(spec: ModelSpec, layers: list[int]) -> tuple[int, float, float]:
    """The balancing rule's reductions on a rank holding `layers`, per step, over the ranks that see different
    tokens. Quantile balancing (backend.balancing.QuantileBalancer): the rank's MoE layers balanced as one stacked
    problem, so one all-reduce of every layer's margin extremes (2 fp32 each, max) and one of every layer's margin
    histogram (experts x bins int64 counts each, plus the token count; sum). The auxiliary-loss-free bias
    (backend.frontier_routing): every MoE layer all-reduces its expert loads (experts int64 counts), no extremes.
    An auxiliary loss or no balancing reduces nothing. Returns (reductions of each kind, histogram bytes and
    extremes bytes of each)."""
    moe = spec.moe
    if moe is None or moe.balance_method not in ("quantile", "aux_free_bias"):
        return 0, 0.0, 0.0
    count = sum(1 for i in layers if spec.is_moe(i))
    if moe.balance_method == "aux_free_bias":
        return count, float(moe.experts * INDEX_BYTES), 0.0
    if not count:
        return 0, 0.0, 0.0
    return 1, float((count * moe.experts * moe.balance_bins + 1) * INDEX_BYTES), float(count * 2 * BYTES["fp32"])


def matrix_ns_flops(m: int, n: int) -> float:
    """FLOPs of one quintic Newton-Schulz iteration on an m x n matrix."""
    m, n = min(m, n), max(m, n)
    return 4 * m * m * n + 2 * m * m * m


def _dense_matrices(spec: ModelSpec, layer: int) -> list[tuple[int, int]]:
    """The MuonH matrices of one layer other than the routed experts (attention, shared experts, latent projections,
    dense MLP)."""
    d, a = spec.d_model, spec.attention
    mlp_matrices = 3 if spec.activation == "swiglu" else 2
    kv = spec.kv_heads_stored(layer) * a.head_dim
    mats = [(d, a.heads * a.head_dim), (d, kv), (d, kv), (a.heads * a.head_dim, d)]
    if spec.is_moe(layer):
        mo = spec.moe
        mats += [(d, mo.shared_ffn)] * mlp_matrices * mo.shared_experts
        mats += [(d, mo.latent_dim)] * 2 if mo.latent_dim else []
    else:
        mats += [(d, spec.ffn)] * mlp_matrices
    return mats


def newton_schulz_parts(spec: ModelSpec, layers) -> tuple[float, float]:
    """MuonH orthogonalisation FLOPs per step of `layers` before their split over ranks: (dense matrices, expert
    matrices)."""
    mlp_matrices = 3 if spec.activation == "swiglu" else 2
    dense = expert = 0.0
    for i in layers:
        if spec.is_moe(i):
            mo = spec.moe
            expert += NEWTON_SCHULZ_STEPS * mo.experts * mlp_matrices * matrix_ns_flops(spec.expert_input_dim,
                                                                                       mo.expert_ffn)
        dense += NEWTON_SCHULZ_STEPS * sum(matrix_ns_flops(*m) for m in _dense_matrices(spec, i))
    return dense, expert


def newton_schulz_split(parts: tuple, plan) -> float:
    """One rank's share of newton_schulz_parts (arrays for PlanArrays): dense matrices orthogonalised whole on every
    rank of the fsdp and tensor groups (backend.optim.orthogonalise; see muon_gather), expert
    matrices over the expert ranks and the experts' own FSDP shards (whole experts per shard); under ZeRO-1/2 the
    data replicas (the expert replicas for experts) split the matrices between them."""
    par = plan.parallel
    dense, expert = parts
    # ZeRO-1/2: each data replica orthogonalises the whole matrices whose state it holds (a 1 / data share).
    return dense / (par.state_shards // par.fsdp) + expert / (par.expert * par.expert_state_shards)


def newton_schulz_flops(spec: ModelSpec, plan: Plan, layers: list[int]) -> float:
    """MuonH orthogonalisation FLOPs per step on one rank holding `layers` (0 for other optimizers)."""
    if plan.optimizer.name != "muonh":
        return 0.0
    return newton_schulz_split(newton_schulz_parts(spec, layers), plan)


def muon_gather_parts(spec: ModelSpec, layers) -> tuple[float, float]:
    """The dense matrices of `layers` that MuonH gathers under FSDP or tensor parallelism: (their fp32 bytes, whole
    matrices; how many)."""
    mats = [m for i in layers for m in _dense_matrices(spec, i)]
    return float(sum(m * n for m, n in mats) * BYTES["fp32"]), float(len(mats))


def muon_gather_split(parts: tuple, plan):
    """One rank's muon_gather from muon_gather_parts (arrays for PlanArrays): (fsdp bytes, fsdp norms, tensor bytes,
    tensor norms); nothing over a group of one."""
    par = plan.parallel
    nbytes, count = parts
    sharded, split = np.asarray(par.fsdp) > 1, np.asarray(par.tensor) > 1
    return (np.where(sharded, nbytes / par.tensor, 0.0), np.where(sharded, 3 * count, 0.0),
            np.where(split, nbytes, 0.0), np.where(split, 3 * count, 0.0))


def muon_gather(spec: ModelSpec, plan: Plan, layers: list[int]) -> tuple[float, float, float, float]:
    """MuonH on fsdp- and tensor-sharded dense matrices, per step on one rank holding `layers`: (bytes of the fp32
    updates all-gathered over the fsdp group, the all_gather's full output: a tensor shard of each matrix; number of
    fp32 scalar norm all-reduces over that group, three per matrix for the hyperball's norms; the same two over the
    tensor group, whose all-gather outputs whole matrices). Zeros over a group of one or for other optimizers."""
    if plan.optimizer.name != "muonh":
        return 0.0, 0.0, 0.0, 0.0
    return tuple(float(v) for v in muon_gather_split(muon_gather_parts(spec, layers), plan))


def optimizer_traffic_bytes(rp: RankParams, plan: Plan) -> tuple[float, float]:
    """(HBM bytes the update touches, bytes moved between host and GPU) per step on one rank.

    The update reads weights and gradients and writes weights, and reads and writes the fp32 master and the
    optimizer state; when those live on the host they cross the host link in and out."""
    par = plan.parallel
    shard = rp.dense / par.state_shards + rp.expert / par.expert_state_shards  # what this rank updates (ZeRO-1/2)
    w_bytes, g_bytes = BYTES["bf16"], BYTES[plan.grad_dtype]
    master, state = optimizer_state_bytes(rp, plan)
    hbm = shard * (2 * w_bytes + g_bytes) + 2 * (master + state)
    host = np.where(state_location(plan) == "host", 2 * (master + state), 0.0)
    return hbm, host if is_arrays(plan) else float(host)
