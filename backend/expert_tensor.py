"""Expert tensor parallelism (plan `parallel.expert_tensor > 1`, ETP): every routed expert's width split over the
expert_tensor ranks of a block, as Megatron-Core's expert tensor parallelism splits the expert MLPs
(https://docs.nvidia.com/megatron-core/developer-guide/latest/api-guide/moe.html, "expert_tensor_parallel_size").

Ranks (rackcast.layout.ParallelSpec.expert_coordinates): the expert group is expert x expert_tensor consecutive
token ranks, made of `expert` blocks of expert_tensor consecutive ranks. Block b holds experts
[b E/expert, (b+1) E/expert) (backend.expert_parallel); rank j of the block holds hidden units
[j W/et, (j+1) W/et) of each of them (W = moe.expert_ffn, et = expert_tensor): those columns of gate and of up, those
rows of down. With gate and up fused (GroupedExperts.w_gate_up) rank j's columns are [gate_j, up_j]: the fused
columns are stored rank-major (backend.tensor_parallel.rank_major_order), as tensor parallelism stores its fused rows.

Communication: the pattern the simulator prices (simulator.costs.a2a_bytes: every routed row to each of the et ranks
holding a slice of its expert; simulator.workload.ExpertLoads: "each of a block's expert_tensor ranks receives the
block's rows"), implemented by backend.expert_parallel.ExpertParallelMoE over the whole expert group:
1. dispatch: one all-to-all over the expert group (Groups.expert) sends each routed row to every rank of the block
   holding its expert (et copies: dispatch bytes x et, as priced);
2. each rank runs its width slice of its local experts: a full-width partial output per row (gate/up columns,
   down rows: the hidden units it holds);
3. combine: the reverse all-to-all sends the partial outputs back, and the source rank sums the et partials of
   each row (an index_add) before the combine weights.
Megatron-Core instead dispatches over the expert ranks only, all-gathers the received tokens over the ETP group and
reduce-scatters the partial outputs: the same rows reach each rank, in three collectives instead of one. This
trainer follows the simulator's single all-to-all so the two agree on what is sent and how often.

Parameters are DTensors on the expert-tensor DeviceMesh (Groups.etp_mesh): w_gate_up and w_up Shard(2), w_down
Shard(1), b_gate_up and b_up Shard(1); forward computes with their local shards (`local_weights`, DTensor.to_local,
whose backward gives each shard its own gradient). So MuonH needs nothing new: backend.optim.orthogonalise gathers
each sharded update whole over the ETP ranks (full_tensor), puts gate and up back in order (the `matrix_parts`
carry the stored order), orthogonalises each matrix and part, and keeps this rank's columns or rows; the
hyperball's Frobenius norms are reduced over the ETP ranks by DTensor. Adam is elementwise. The down bias b_down
is a plain tensor every rank of the block holds whole: each adds b_down / et to its partial (the partials sum to one
b_down) and its gradient is summed over the ETP ranks after the backward (backend.parallel.reduce_grads,
`is_width_replicated`). Every rank of a block receives every row routed to its experts from the whole expert group,
so a width slice's gradient is whole for the group; it is summed over the expert-data replicas like an EP slice's.
Checkpoints: `checkpoint_placements` places each slice in the full [E, ...] stack (Shard over "ep" and "etp"), and
backend.tensor_parallel.stored_orders reports the rank-major gate/up columns (`stored_param_orders`), so checkpoints
hold the one-process tensors and resume on any layout.

    experts = shard_width(experts, groups.etp_mesh, layout.etp_rank, layout.etp)   # backend.expert_parallel
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from rackcast.backend.moe import WEIGHT_NAMES, GroupedExperts
from rackcast.backend.tensor_parallel import rank_major_order

# The dimension each GroupedExperts parameter splits along over the ETP ranks (b_down: held whole by every rank).
SHARD_DIMS = {"w_gate_up": 2, "w_up": 2, "w_down": 1, "b_gate_up": 1, "b_up": 1}


class WidthShardedExperts(GroupedExperts):
    """GroupedExperts holding hidden units [etp_rank W/etp, (etp_rank+1) W/etp) of each expert (see the module)."""

    etp: int

    def local_weights(self) -> dict[str, Tensor | None]:
        out: dict[str, Tensor | None] = {}
        for name in WEIGHT_NAMES:
            t = getattr(self, name)
            if t is None:
                out[name] = None
            elif name in SHARD_DIMS:
                out[name] = t.to_local()
            else:  # b_down: the partials of the et ranks sum to one bias
                out[name] = t / self.etp
        return out


def is_width_replicated(name: str) -> bool:
    """Whether the expert parameter `name` is under ETP held whole by every rank of its block (b_down), so its
    gradient on one rank is a partial sum over the block (backend.parallel.reduce_grads sums it over "etp"). By
    name: under FSDP2 every expert parameter is a DTensor."""
    return name.rpartition(".")[2] not in SHARD_DIMS


def shard_width(experts: GroupedExperts, mesh, etp_rank: int, etp: int) -> WidthShardedExperts:
    """A WidthShardedExperts holding this rank's hidden units of every expert of `experts` (copied out of the whole
    tensors, so the slices of one identically seeded model fit together), as DTensors on the 1-D `mesh`."""
    from torch.distributed.tensor import DTensor, Shard

    width = experts.width
    if width % etp:
        raise ValueError(f"expert width {width} is not divisible by expert_tensor={etp}")
    part = width // etp
    swiglu = experts.w_gate_up is not None
    stored = rank_major_order((width, width), etp) if swiglu else None
    out = WidthShardedExperts.__new__(WidthShardedExperts)
    nn.Module.__init__(out)
    out.activation, out.width, out.etp = experts.activation, part, etp
    out.matrix_parts = {"w_gate_up": (-1, (width, width), stored)} if swiglu else {}
    out.stored_param_orders = {"w_gate_up": (2, stored), "b_gate_up": (1, stored)} if swiglu else {}
    for name in WEIGHT_NAMES:
        p = getattr(experts, name)
        if p is None:
            setattr(out, name, None)
            continue
        whole = p.detach()
        if name not in SHARD_DIMS:
            setattr(out, name, nn.Parameter(whole.clone(), requires_grad=p.requires_grad))
            continue
        dim = SHARD_DIMS[name]
        if name in ("w_gate_up", "b_gate_up"):
            whole = whole.index_select(dim, stored.to(whole.device))
        size = whole.shape[dim] // etp
        local = whole.narrow(dim, etp_rank * size, size).contiguous()
        shard = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=whole.shape,
                                   stride=whole.stride())
        setattr(out, name, nn.Parameter(shard, requires_grad=p.requires_grad))
    return out


def checkpoint_placements(name: str) -> list:
    """Placements of an ETP rank's expert tensor on the (edp, ep, etp) mesh of the stage (backend.checkpoint.ShardOf):
    replicated over the expert-data replicas, experts split over "ep", width over "etp" (b_down: whole)."""
    from torch.distributed.tensor import Replicate, Shard

    dim = SHARD_DIMS.get(name.rpartition(".")[2])
    return [Replicate(), Shard(0), Shard(dim) if dim is not None else Replicate()]
