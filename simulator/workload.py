"""Workload of a training step: the ops each simulated rank runs per micro-batch, forward and backward.

From a ModelSpec and a Plan, for every pipeline stage (one rank class): per layer the compute ops (attention block
with its norms, gated norms, convolutions and attention core; router and latent projections; shared experts; grouped
expert GEMMs; dense MLP; output head and loss) and the communication they need (tensor-parallel all-reduces,
context-parallel key/value shifts, expert dispatch and combine all-to-alls, FSDP all-gathers, data-parallel gradient
reduce-scatter / all-reduce, pipeline sends), then the optimizer step with its host <-> GPU state movement.

Every duration and every byte count comes from simulator.costs, the cost model the closed-form estimate uses too:
each dense GEMM (simulator.gemms) at the efficiency of its own shape, the attention core at the attention
efficiency (hardware work: causal, over the window), experts at the grouped-GEMM efficiency of the most loaded rank's
grouped GEMM in the routing draw (its rows per local expert set the shape, costs.expert_shape), elementwise
work as the activation bytes written in forward and read in backward, memory-bound; backward = 2 x forward.
Host per-op overhead (only where the topology's efficiency.host_op_s is measured; simulator.host_overhead's model
and HostCosts, op counts from simulator.op_counts): each layer's forward runs its ops (layer_forward_ops, whatever
ep; plus ep_dispatch_ops' forward in an expert group) x host_op_s.forward before its kernels, its backward
bwd_over_fwd times the layer's (plus ep_dispatch_ops' backward; split evenly between the halves of zero-bubble
schedules), its recomputation recompute_share of the forward's; the embedding's ops on the first chunk's stage, head
and loss on the last's; the optimizer's (its share of the layers) in its step. With counted eager bytes
(counted_bytes) each host op also moves its part's bytes, replacing the fused elementwise and update traffic.

Ops are the records of simulator.ops (Compute, Host, Start, Wait, Reduce, Memory; each documented there), run by
simulator.step. Expert all-to-all token counts come from simulator.routing (see ExpertLoads).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import numpy as np

from rackcast.modelspec import ModelSpec
from rackcast.plan import Plan
from rackcast.simulator import costs
from rackcast.simulator.attention_cost import HW, layer_core
from rackcast.simulator.gemms import MLP_PARTS, embed_gemms, gemms_seconds, layer_gemms, tail_seconds
from rackcast.simulator.host_overhead import ep_dispatch_ops, host_costs, layer_forward_ops, recompute_share
from rackcast.simulator.activations import mtp_activation_bytes_per_token
from rackcast.simulator.memory import (BYTES, attention_core_bytes_per_token, layer_activation_bytes_per_token,
                                       rank_params, static_bytes)
from rackcast.simulator.ops import Comm, Compute, Host, Memory, Start, Wait
from rackcast.simulator.optimizer_cost import (balancing_reductions, muon_gather, newton_schulz_flops,
                                               optimizer_traffic_bytes)
from rackcast.simulator.routing import balanced_counts, capacity_rows, expert_probabilities
from rackcast.topologies.spec import Topology

W_BYTES = costs.W_BYTES


@dataclass(frozen=True)
class LayerWork:
    index: int
    moe: bool
    attn_s: float  # attention block GEMMs, norms, gated norms, convs and the attention core (forward)
    core_s: float  # the attention core alone (selective recomputation redoes it)
    router_s: float  # router and latent projections (MoE) or the dense MLP
    shared_s: float  # shared experts (forward)
    expert_flops_per_row: float  # grouped expert GEMM FLOPs per routed row on this rank (forward)
    elem_s: float  # elementwise work of forward + backward
    dense_params: float  # this rank's dense parameters of the layer (after tensor split)
    expert_params: float  # this rank's routed-expert parameters of the layer (after expert split)
    act_bytes: float  # activations saved for backward per micro-batch, no recomputation
    core_bytes: float  # the part selective recomputation does not keep
    kept_bytes: float  # full recomputation keeps only the layer input
    host_ops: float = 0.0  # the layer's framework ops in forward, 0 without measured host_op_s
    ep_ops: tuple[float, float] = (0.0, 0.0)  # the expert-parallel dispatch path's (forward, backward) ops
    host_bytes: float = 0.0  # the layer's counted eager bytes in forward, 0 where not counted


@dataclass
class StageWork:
    stage: int
    chunks: dict[int, list[LayerWork]]  # global chunk -> its layers in order
    head_s: float  # output head, loss and final norm (forward) on the stage holding the last chunk
    embed_s: float  # the embedding's norm (forward) on the stage holding the first chunk
    top_params: float  # embedding, head and final norms held by this stage (after tensor split)
    embed_params: float  # the embedding end's part of top_params (first chunk)
    head_params: float  # the head end's part of top_params (last chunk)
    static_bytes: dict[str, float]  # weights, gradients, master, optimizer
    io_bytes: float  # embedding output and head input (kept once); the MTP modules' saved tensors on the head's stage
    optimizer_s: float
    host_bytes: float  # optimizer state + master moved each way between host and GPU
    reduction_comms: list = None  # the stage's whole gradient reduction, when it runs after the backward
    gather_comms: list = None  # ZeRO-1/2: the updated weights' all-gather after the optimizer step
    embed_ops: float = 0.0  # the embedding's framework ops (forward) on the stage holding the first chunk
    head_ops: float = 0.0  # the head and loss ops (forward) on the stage holding the last chunk
    embed_bytes: float = 0.0  # their counted eager bytes (forward), 0 where not counted
    head_bytes: float = 0.0


class Workload:
    """Per-stage costs of a plan on a topology (see the module docstring)."""

    def __init__(self, spec: ModelSpec, plan: Plan, topo: Topology, seed: int = 0):
        self.spec, self.plan, self.topo = spec, plan, topo
        par = plan.parallel
        self.host_costs = host_costs(spec, plan, topo)  # None counts and bytes without measured host_op_s
        self.counts, self.bytes = self.host_costs.counts, self.host_costs.bytes
        self.tokens_mb = plan.tokens_per_microbatch(spec)
        self.routed_mb = plan.routed_tokens_per_microbatch(spec)  # what the rank dispatches to the experts
        self._expert_time: dict[float, float] = {}
        self._placed = None
        self._comms: dict[tuple, object] = {}  # op programs' Comm records (immutable), built once per layer
        self.n_chunks = par.chunks
        owner = par.chunk_ranks(plan.schedule)
        self.chunk_rank = owner
        moe = spec.moe
        self.x = spec.expert_input_dim if moe else 0
        self.stages: list[StageWork] = []
        for s in range(par.pipeline):
            chunks = {c: [self._layer(i) for i in par.chunk_layer_range(c, spec.layers)]
                      for c in range(self.n_chunks) if owner[c] == s}
            self.stages.append(self._stage(s, chunks))
        self.loads = ExpertLoads(spec, plan, self, seed) if moe else None

    # ------------------------------------------------------------------------------------------------ layers
    def _gemm_s(self, gemms, precision: str | None = None) -> float:
        """Seconds of a micro-batch's `gemms` (simulator.gemms), in the plan's precision unless `precision` says."""
        return gemms_seconds(gemms, self.tokens_mb, self.plan.parallel.tensor, self.topo,
                             precision or self.plan.precision)

    def _layer(self, i: int) -> LayerWork:
        spec, plan, par = self.spec, self.plan, self.plan.parallel
        parts = spec.layer_flops_breakdown(i, HW)
        core = costs.attention_time(parts.get("attn_scores_values", 0.0) * self.tokens_mb / par.tensor, self.topo,
                                    plan.precision, layer_core(spec, i, self.tokens_mb, par.tensor, par.context))
        gemms = layer_gemms(spec, i)
        per_row = 0.0
        if spec.is_moe(i):  # a rank computes its 1/expert_tensor slice of every row routed to its block
            per_row = parts["experts"] / spec.moe.top_k / par.expert_tensor
        act = layer_activation_bytes_per_token(spec, i, plan) * self.tokens_mb
        pb = spec.layer_param_breakdown(i)
        sp = par.tensor if par.sequence_parallel else 1
        return LayerWork(
            index=i, moe=spec.is_moe(i), attn_s=self._gemm_s([g for g in gemms if g.part not in MLP_PARTS]) + core,
            core_s=core, router_s=self._gemm_s([g for g in gemms if g.part in MLP_PARTS[:-1]]),
            shared_s=self._gemm_s([g for g in gemms if g.part == "shared_experts"]), expert_flops_per_row=per_row,
            elem_s=0.0 if self.bytes else costs.memory_bound_time(2 * act, self.topo),
            dense_params=(spec.layer_params(i) - pb.get("experts", 0)) / par.tensor,
            expert_params=pb.get("experts", 0) / par.expert_group,
            act_bytes=act, core_bytes=attention_core_bytes_per_token(spec, i, plan) * self.tokens_mb,
            kept_bytes=BYTES["bf16"] * spec.d_model / sp * self.tokens_mb,
            host_ops=layer_forward_ops(self.counts, plan, i) if self.counts else 0.0,
            ep_ops=ep_dispatch_ops(self.counts, spec, plan, i) if self.counts else (0.0, 0.0),
            host_bytes=self.bytes.layers[i] if self.bytes else 0.0)

    # ------------------------------------------------------------------------------------------------ stages
    def _stage(self, s: int, chunks: dict[int, list[LayerWork]]) -> StageWork:
        spec, plan = self.spec, self.plan
        rp = rank_params(spec, plan, s)
        layers = [lw.index for c in chunks for lw in chunks[c]]
        last = (self.n_chunks - 1) in chunks
        head_s = tail_seconds(spec, self.tokens_mb, self.routed_mb, plan.parallel, self.topo, plan.precision) \
            if last else 0.0
        embed_s = self._gemm_s(embed_gemms(spec), costs.unquantised(plan.precision)) if 0 in chunks else 0.0
        static = static_bytes(rp, plan)
        # The multi-token-prediction modules' saved tensors, held on the head's stage for the step (as the memory
        # model's one in-flight micro-batch of the last chunk under 1F1B; not allocated and freed per micro-batch).
        mtp_bytes = mtp_activation_bytes_per_token(spec, plan) * self.tokens_mb if last else 0.0
        host_bytes = static.pop("host")  # resident on the host; the step moves it in and back out
        opt_bytes = 0.0 if self.bytes else optimizer_traffic_bytes(rp, plan)[0]
        ns = newton_schulz_flops(spec, plan, layers)
        optimizer_s = float(costs.optimizer_time(opt_bytes, ns, costs.newton_schulz_shape(spec), self.topo,
                                                 plan.precision)) + \
            self._balancing_s(layers) + self._muon_gather_s(layers)
        top = rp.dense - sum(lw.dense_params for c in chunks for lw in chunks[c])
        ends = self.host_costs.stage_ends(spec, plan, s, 0 in chunks, last)
        optimizer_s += self.host_costs.optimizer_s(spec, plan, s)
        return StageWork(stage=s, chunks=chunks, head_s=head_s, embed_s=embed_s, top_params=top,
                         embed_params=rp.embed_end, head_params=rp.head_end, static_bytes=static,
                         reduction_comms=self.reduction_comms(rp.dense, rp.expert),
                         gather_comms=self.parameter_gather_comms(rp.dense, rp.expert),
                         io_bytes=2 * W_BYTES * spec.d_model * self.tokens_mb + mtp_bytes, optimizer_s=optimizer_s,
                         host_bytes=host_bytes, **ends)

    def _balancing_s(self, layers: list[int]) -> float:
        """Quantile balancing's reductions for these layers (costs.balancing_time)."""
        count, hist, extremes = balancing_reductions(self.spec, layers)
        if not count:
            return 0.0
        f = {"bal_count": count, "bal_hist_bytes": hist, "bal_max_bytes": extremes,
             **costs.reduction_groups(self.plan, self._placement())}
        return float(costs.balancing_time(f, self.topo))

    def _muon_gather_s(self, layers: list[int]) -> float:
        """MuonH's gathers of fsdp- and tensor-sharded matrices for these layers (costs.muon_gather_time)."""
        gathered, norms, tp_gathered, tp_norms = muon_gather(self.spec, self.plan, layers)
        if not gathered and not tp_gathered:
            return 0.0
        pl = self._placement()
        f = {"muon_gather_bytes": gathered, "muon_norm_count": norms, "fsdp_n": self.plan.parallel.fsdp,
             "fsdp_out": pl.fsdp.span == "scale_out", "fsdp_pd": costs.group_per_domain(pl.fsdp),
             "muon_tp_gather_bytes": tp_gathered, "muon_tp_norm_count": tp_norms, "tp_n": self.plan.parallel.tensor,
             "tp_out": pl.tensor.span == "scale_out", "tp_pd": costs.group_per_domain(pl.tensor)}
        return float(costs.muon_gather_time(f, self.topo))

    def _placement(self):
        """The plan's placement (simulator.placement.place), worked out once for all stages."""
        if self._placed is None:
            from rackcast.simulator.placement import place

            self._placed = place(self.plan, self.topo.scale_up.usable_gpus)
        return self._placed

    # ------------------------------------------------------------------------------------------ op programs
    def layer_forward(self, lw: LayerWork, mb: int | None, key: str, recompute: bool = False) -> list:
        """Ops of one layer's forward (or its recomputation) for micro-batch mb (None: a template, where the ops
        that depend on the micro-batch are PerMicrobatch records)."""
        par = self.plan.parallel
        pre = "recompute " if recompute else ""
        ops: list = []
        attn_s = lw.attn_s + (0.0 if recompute else lw.elem_s / 2)
        if lw.host_ops > 0.0:  # the trainer's recomputation (backend.recompute) reruns the whole block's ops
            ops.append(Host(pre + "host ops", self.host_costs.forward_s(lw.host_ops + lw.ep_ops[0], lw.host_bytes)))
        if par.context > 1:  # the trainer's K/V exchange blocks before the attention that reads it
            ops += [Start(key + "cp", self._cp_comm(lw)), Wait(key + "cp", "exposed_tensor_comm")]
        ops.append(Compute(pre + "attention", attn_s))
        ops += self._tp(key + "tpa")
        if lw.moe:
            ops.append(Compute(pre + "router", lw.router_s))
            ops += self._moe_exchange(lw, mb, key, "d", "c", pre + "experts", 1.0, pre + "shared experts", True)
        else:
            ops.append(Compute(pre + "mlp", lw.router_s))
        ops += self._tp(key + "tpm")
        return ops

    def selective_recompute(self, lw: LayerWork) -> list:
        """Ops of one layer's selective recomputation: the attention core, and its share of the layer's host ops
        and eager bytes (host_overhead.recompute_share)."""
        share = recompute_share(self.spec, self.plan, lw.index) if lw.host_ops > 0.0 else 0.0
        host = [Host("recompute host ops", self.host_costs.forward_s(lw.host_ops, lw.host_bytes, share))]
        return (host if share else []) + [Compute("recompute attention core", lw.core_s)]

    def layer_backward(self, lw: LayerWork, mb: int | None, key: str, kind: str) -> list:
        """Ops of one layer's backward: kind "BW" (input and weight gradients), "B" (inputs) or "W" (weights); mb as
        in layer_forward."""
        host = [Host("backward host ops", self.host_costs.backward_s(lw.host_ops, kind, lw.host_bytes, lw.ep_ops[1]))] \
            if lw.host_ops else []
        if kind == "W":
            return host + [_per_mb(partial(self._weight_grads, lw), mb)]
        f = 2.0 if kind == "BW" else 1.0
        ops = host + self._tp(key + "tpm")
        if lw.moe:
            ops += self._moe_exchange(lw, mb, key, "d", "c", "experts backward", f, "shared experts backward")
            ops.append(Compute("router backward", f * lw.router_s))
        else:
            ops.append(Compute("mlp backward", f * lw.router_s))
        ops += self._tp(key + "tpa")
        ops.append(Compute("attention backward", f * lw.attn_s + lw.elem_s / 2))
        if self.plan.parallel.context > 1:  # the K/V gradients, as many bytes as forward, after the attention backward
            ops += [Start(key + "cp", self._cp_comm(lw)), Wait(key + "cp", "exposed_tensor_comm")]
        return ops

    def _moe_exchange(self, lw, mb, key, first, second, expert_name, factor, shared_name, counts=False) -> list:
        """Dispatch, experts, combine (half the shared experts under each all-to-all); counts: a forward's (lead_s)."""
        a2a_bytes = self._comms.get("a2a_bytes")
        if a2a_bytes is None:
            par, out = self.plan.parallel, self._placement().expert.span == "scale_out"
            a2a_bytes = self._comms["a2a_bytes"] = costs.a2a_bytes(self.routed_mb, self.spec, par.expert_tensor)
            self._comms["count_exchange_s"] = float(costs.count_exchange_time(self.topo, self.spec, par, out))
        ops: list = []
        for n, direction in enumerate((first, second)):
            name = "dispatch" if direction == "d" else "combine"
            lead = self._comms["count_exchange_s"] if counts and n == 0 else 0.0
            ops.append(_per_mb(partial(self._a2a_start, lw.index, direction, key + name, name, a2a_bytes, lead), mb))
            if lw.shared_s:
                ops.append(Compute(shared_name, factor * lw.shared_s / 2))
            ops.append(Wait(key + name, "exposed_expert_a2a"))
            if n == 0:
                ops.append(_per_mb(partial(self._expert_compute, lw, expert_name, factor), mb))
        return ops

    def _a2a_start(self, layer: int, direction: str, key: str, name: str, nbytes, lead_s, mb: int) -> Start:
        comm = self._comms.get(("a2a", layer, mb, direction, lead_s))  # the backward (and a recompute) repeats it
        if comm is None:
            comm = self._comms["a2a", layer, mb, direction, lead_s] = Comm("all_to_all", "expert", nbytes, "ep", name,
                                                                           (layer, mb, direction), lead_s)
        return Start(key, comm)

    def _expert_compute(self, lw: LayerWork, name: str, factor: float, mb: int) -> Compute:
        return Compute(name, factor * self._expert_s(lw, mb))

    def _weight_grads(self, lw: LayerWork, mb: int) -> Compute:
        return Compute("weight grads", lw.attn_s + lw.router_s + lw.shared_s + self._expert_s(lw, mb))

    def _expert_s(self, lw: LayerWork, mb: int) -> float:
        """The grouped expert GEMM of the most loaded rank of the routing draw: its rows over its local experts set
        the GEMM shape (costs.expert_shape), its rows x FLOPs per row the work."""
        if not lw.moe:
            return 0.0
        rows = self.loads.max_rows(lw.index, mb)
        per_flop = self._expert_time.get(rows)
        if per_flop is None and not self._expert_time and not self.topo.efficiency.grouped_gemm:
            self._expert_time = self._expert_times(np.unique(self.loads.max_rows_all()))
            per_flop = self._expert_time.get(rows)
        if per_flop is None:
            per_flop = self._expert_time[rows] = float(costs.grouped_gemm_time(1.0, self._expert_gemm_shape(rows),
                                                                               self.topo, self.plan.precision))
        return lw.expert_flops_per_row * rows * per_flop

    def _expert_gemm_shape(self, rows):
        """The grouped expert GEMM's shape on the rank routing `rows` rows (costs.expert_shape; arrays broadcast)."""
        par = self.plan.parallel
        return costs.expert_shape(rows * par.expert / self.spec.moe.experts, self.spec, par.expert, par.expert_tensor)

    def _expert_times(self, rows: np.ndarray) -> dict[float, float]:
        """Seconds per FLOP of the grouped expert GEMM (costs.grouped_gemm_time) at each of these most-loaded-rank
        row counts, priced together: without a measured curve the shape model is elementwise arithmetic (ceil,
        maximum, + - x /), so each value has the bits it has priced alone."""
        seconds = np.broadcast_to(costs.grouped_gemm_time(1.0, self._expert_gemm_shape(rows), self.topo,
                                                          self.plan.precision), rows.shape)
        return dict(zip(rows.tolist(), seconds.tolist()))

    def _tp(self, key: str) -> list:
        par = self.plan.parallel
        if par.tensor <= 1:
            return []
        comm = self._comms.get("tp")
        if comm is None:
            comm = self._comms["tp"] = Comm("all_reduce", "tensor", costs.tensor_bytes(self.tokens_mb, self.spec),
                                            "tp", "tp all-reduce")
        return [Start(key, comm), Wait(key, "exposed_tensor_comm")]

    def _cp_comm(self, lw: LayerWork) -> Comm:
        comm = self._comms.get(("cp", lw.index))
        if comm is None:
            par = self.plan.parallel
            nbytes = float(costs.context_bytes(self.tokens_mb, self.spec, par.tensor, par.context, lw.index))
            comm = self._comms["cp", lw.index] = Comm("shift", "context", nbytes, "cp", "cp kv exchange")
        return comm

    def mtp_context(self, backward: bool) -> list:
        """Ops of the multi-token-prediction modules' context-parallel exchange (costs.mtp_context_bytes), blocking
        as the trainer's does, on the stage holding the head: the forward's, or the backward's (backward=True)."""
        par = self.plan.parallel
        if par.context <= 1 or self.spec.mtp is None:
            return []
        comm = self._comms.get(("mtp cp", backward))
        if comm is None:
            nbytes = float(costs.mtp_context_bytes(self.tokens_mb, self.spec, par.tensor, par.context, backward))
            comm = self._comms["mtp cp", backward] = Comm("shift", "context", nbytes, "cp", "cp mtp exchange")
        return [Start("mtp cp", comm), Wait("mtp cp", "exposed_tensor_comm")]

    def gather_comms(self, lw: LayerWork) -> list[tuple[Comm, float]]:
        """FSDP all-gathers of one layer's parameters and the bytes of their unsharded buffers (the list is kept:
        callers only read it)."""
        out = self._comms.get(("gather", lw.index))
        if out is not None:
            return out
        par = self.plan.parallel
        out = self._comms["gather", lw.index] = []
        if par.fsdp > 1:
            out.append((Comm("all_gather", "fsdp", lw.dense_params * W_BYTES, "fsdp", "fsdp all-gather"),
                        W_BYTES * lw.dense_params))
        if lw.moe and self.plan.parallel.expert_fsdp > 1:
            out.append((Comm("all_gather", "expert_fsdp", lw.expert_params * W_BYTES, "fsdp",
                             "expert fsdp all-gather"), W_BYTES * lw.expert_params))
        return out

    def top_gather(self, params: float) -> list[tuple[Comm, float]]:
        """FSDP all-gather of a chunk's embedding or head end (its own unit, gathered before the chunk's layers
        run, as FSDP2's root module is) and the bytes of its unsharded buffer."""
        if self.plan.parallel.fsdp <= 1 or params <= 0:
            return []
        return [(Comm("all_gather", "fsdp", params * W_BYTES, "fsdp", "fsdp all-gather (embedding/head)"),
                 W_BYTES * params)]

    def grad_buffer_bytes(self, lw: LayerWork) -> float:
        """Unsharded gradient buffer of one layer during its backward (FSDP or ZeRO-2 only; memory.py counts one
        layer)."""
        par, g = self.plan.parallel, BYTES[self.plan.grad_dtype]
        out = g * lw.dense_params if par.fsdp > 1 or par.zero >= 2 else 0.0
        if lw.moe and (self.plan.parallel.expert_fsdp > 1 or par.zero >= 2):
            out += g * lw.expert_params
        return out

    def reduction_comms(self, dense_params: float, expert_params: float) -> list[Comm]:
        """Gradient reduction of one bucket (costs.gradient_reductions), the collectives that move bytes."""
        par, g = self.plan.parallel, BYTES[self.plan.grad_dtype]
        return [Comm(c.kind, c.axis, c.nbytes, c.stream, c.name)
                for c in costs.gradient_reductions(dense_params * g, expert_params * g, par.reduction_inner,
                                                   par.expert_fsdp, par.zero) if c.nbytes > 0]

    def parameter_gather_comms(self, dense_params: float, expert_params: float) -> list[Comm]:
        """ZeRO-1/2: the updated weights' all-gather after the optimizer step (costs.parameter_gathers)."""
        par = self.plan.parallel
        return [Comm(c.kind, c.axis, c.nbytes, c.stream, c.name)
                for c in costs.parameter_gathers(dense_params * W_BYTES, expert_params * W_BYTES,
                                                 par.reduction_inner, par.expert_fsdp, par.zero) if c.nbytes > 0]


class PerMicrobatch(NamedTuple):
    """A template's op that depends on the micro-batch: make(mb) is the op (see Workload.layer_forward)."""

    make: Callable[[int], object]


def _per_mb(make: Callable[[int], object], mb: int | None):
    """The op make(mb), or a PerMicrobatch record when building a template (mb None)."""
    return PerMicrobatch(make) if mb is None else make(mb)


class ExpertLoads:
    """Routed rows per (micro-batch, layer, source rank, expert), drawn from the plan's routing distribution.

    Each of the expert_group = expert x expert_tensor ranks of an expert group (rackcast.layout) routes its
    micro-batch's tokens top_k ways (multinomial over the expert probabilities of simulator.routing; balanced
    routing draws nothing: the group's assignments, numbered source by source, go round the experts in
    simulator.routing.balanced_counts's order, so every expert gets its share). Experts lie
    contiguously on `expert` blocks of expert_tensor consecutive ranks, each rank of a block holding a 1/expert_tensor
    slice of the block's experts, so every row routed to a block goes to each of its ranks. Capacity mode keeps at
    most floor(c x group tokens x top_k / experts) rows per expert, dropping the excess of every source in
    proportion (the drops counted); the buffers are padded to capacity, so every pair moves and every rank computes
    capacity-sized rows (simulator.routing). Dropless keeps all. All data-parallel replicas replay the same draw
    (the symmetry the reduction relies on).
    """

    def __init__(self, spec: ModelSpec, plan: Plan, work: Workload, seed: int):
        moe, par = spec.moe, plan.parallel
        ep, group = par.expert, par.expert_group
        self.layers = sorted({lw.index for st in work.stages for c in st.chunks.values() for lw in c if lw.moe})
        self.slot = {layer: k for k, layer in enumerate(self.layers)}
        m = plan.microbatches
        tokens = max(int(round(work.routed_mb)), 1)
        rng = np.random.default_rng(seed)
        probs = expert_probabilities(plan.expert_transport, moe.experts, seed)
        size = (m, len(self.layers), group)
        balanced = None
        if plan.expert_transport.routing == "balanced":  # no draw: source s's assignments continue source s-1's
            per_src = np.stack([balanced_counts(tokens * moe.top_k, moe.experts, ep, s * tokens * moe.top_k)
                                for s in range(group)]).astype(np.float64)
            balanced = np.broadcast_to(per_src, size + (moe.experts,))
        if plan.expert_transport.mode == "capacity":
            counts = (balanced.copy() if balanced is not None else
                      rng.multinomial(tokens * moe.top_k, probs, size=size).astype(np.float64))
            total = counts.sum()
            cap = capacity_rows(plan.expert_transport.capacity_factor, tokens * group, moe.top_k, moe.experts)
            per_expert = counts.sum(axis=2, keepdims=True)
            counts = np.floor(counts * np.minimum(1.0, cap / np.maximum(per_expert, 1.0)))
            self.drop_fraction = float(1.0 - counts.sum() / total) if total else 0.0
            # Padded to capacity (simulator.routing): every source fills its share of each expert's buffer, so every
            # pair moves and every rank computes the same capacity-sized rows whatever was kept or dropped.
            rows = np.full(size + (ep,), moe.experts // ep * cap / group)
        else:  # dropless needs only rows per expert rank: a multinomial over ranks is the same distribution
            rank_probs = probs.reshape(ep, moe.experts // ep).sum(axis=1)
            if balanced is not None:
                rows = balanced.reshape(size + (ep, moe.experts // ep)).sum(axis=-1)
            else:
                rows = rng.multinomial(tokens * moe.top_k, rank_probs / rank_probs.sum(), size=size).astype(np.float64)
            self.drop_fraction = 0.0
        # rows[mb, layer, src, dst]: rows source rank src sends to rank dst of the group (each of a block's
        # expert_tensor ranks receives the block's rows)
        self.rows = np.repeat(rows, par.expert_tensor, axis=3)
        self._max_rows = self.rows.sum(axis=2).max(axis=2)  # most loaded expert rank
        self.row_bytes = work.x * W_BYTES
        self.spec = spec
        self._masks: dict[int, tuple] = {}

    def max_rows(self, layer: int, mb: int) -> float:
        return float(self._max_rows[mb, self.slot[layer]])

    def max_rows_all(self) -> np.ndarray:
        """max_rows of every (micro-batch, MoE layer), as an array."""
        return self._max_rows.ravel()

    def port_bytes(self, layer: int, mb: int, direction: str, categories: np.ndarray):
        """(send, recv): (ep, 3) bytes per rank and pair category (stepnet.A2A_CATEGORIES), self excluded."""
        b = self.rows[mb, self.slot[layer]] * self.row_bytes
        if direction == "c":
            b = b.T
        cached = self._masks.get(id(categories))
        if cached is None or cached[0] is not categories:
            cached = self._masks[id(categories)] = self._port_masks(categories)
        _, masks, scale, forward = cached  # pair categories are symmetric: (s, d) and (d, s) are alike
        send = np.einsum("sd,csd->sc", b, masks)
        recv = np.einsum("sd,csd->dc", b, masks)
        if scale is not None:  # node-limited routing: see _port_masks
            forwarded = forward * (recv[:, 1] + recv[:, 2])
            send, recv = send * scale, recv * scale
            send[:, 0] += forwarded
            recv[:, 0] += forwarded
        return send, recv

    def _port_masks(self, categories: np.ndarray) -> tuple:
        """What port_bytes needs of a group's pair categories, worked out once per group: the one-hot masks
        (category, src, dst), self pairs excluded; with node-limited routing (costs.cross_domain_a2a_share: share
        < 1) the factors [1, share, share] of the (local, same rail, other rail) bytes and 1 - share, else None, None.
        Node-limited routing sends only `share` of the cross-domain copies over the NICs; the rest, 1 - share of
        them, is forwarded over the destination domain's scale-up links, each rank relaying as much as it receives
        forwarded (balanced, by symmetry)."""
        off = 1.0 - np.eye(categories.shape[0])
        masks = np.stack([(categories == c) * off for c in range(3)])
        domains = categories.shape[0] / max(int((categories[0] == 0).sum()), 1)
        share = float(costs.cross_domain_a2a_share(self.spec, domains))
        if share >= 1.0:
            return categories, masks, None, None
        return categories, masks, np.array([1.0, share, share]), 1.0 - share
