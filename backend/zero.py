"""ZeRO-1 and ZeRO-2 in the trainer: optimizer state (and under ZeRO-2 the reduced gradients) sharded over the
data-parallel replicas (the plan's `parallel.zero: 1` or `2`).

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (arXiv:1910.02054).
Stage 1 (P_os): each of the N_d data-parallel ranks keeps the optimizer state (and fp32 master) of 1/N_d of the
parameters, updates only those, and the updated parameters reach the other ranks. As
torch.distributed.optim.ZeroRedundancyOptimizer does it, whole parameters are assigned to ranks (the largest first,
each to the least-loaded rank, ties to the lowest: deterministic, the same on every rank); the gradients are reduced
as without ZeRO (backend.parallel); before the step a rank drops the gradients of the parameters it does not own, so
the plan's optimizer (MuonH, AdamW, or either offloaded by backend.offload) creates and updates state for its own
parameters only (both skip a parameter without a gradient); after the step each parameter is broadcast from its
owner. Dense parameters shard over the stage's data-parallel group, the token ranks data x context (context
ranks hold the same weights and average their gradients like data replicas; ParallelSpec.state_shards prices the
same split), the expert slices over their expert-data-parallel group (the ranks holding the same slice). With
tensor parallelism the dp group is the token ranks of one tp rank: a tensor-parallel DTensor is owned as a whole
parameter, and since the owners are assigned from global sizes, the same on every tp rank, the tp ranks of one dp
rank own the same parameters and step them together (MuonH's gather over "tp" is a collective of those ranks); the
broadcast moves each rank's own part.

Stage 2 (P_os+g): the gradients are sharded too. The trainer does not wrap the model in DDP (DDP all-reduces every
gradient to every rank); after each micro-batch's backward, `reduce_to_owners` concatenates, per owner rank, the
local gradients of the parameters that rank owns into one flat bucket and reduces it to that rank (dist.reduce: one
reduce per owner, together a reduce-scatter over the whole-parameter partition); the owner adds it to its sum of
the step so far, and every rank drops those local gradients (p.grad = None), so between micro-batches a rank holds
reduced gradients of its own parameters only. After the last micro-batch the owner divides by the token ranks
dp x context (the average the replicas' losses need, as backend.parallel does: expert gradients summed over their
expert-data replicas, divided by the token ranks, times tp when the replicas span tp ranks that route the same
tokens, backend.parallel.Layout.expert_divide) and the sums become its parameters' gradients. The reductions
are timed as the data-parallel phase ("exposed_dp_comm"), inside the forward-backward span as DDP's comm hook is.
Under pipeline parallelism the schedule runs every micro-batch itself, so one reduction after the schedule step
replaces the flat all-reduce.

What the simulator prices (simulator.costs.gradient_reductions / parameter_gathers, for zero 1 and 2 alike; for
zero 2, simulator.step and the estimate reduce every micro-batch's gradients, as here): a reduce-scatter of the
gradients, then an all-gather of the updated weights, as Megatron-LM's distributed optimizer runs them. Where this
trainer differs, on its gloo reference runs: ZeRO-1 all-reduces (twice the reduce-scatter's bytes) and broadcasts;
ZeRO-2 moves about the reduce-scatter's bytes as one blocking reduce per owner after each micro-batch's backward (the
simulator overlaps all but the last with the following micro-batches' work), shares the weights by broadcasts (the
all-gather's bytes, one collective per parameter), and under pipeline parallelism reduces once per step. Memory:
the reduced gradients live on their owner only (1/N_d of them per rank between micro-batches, what
simulator.memory counts), but during a micro-batch's backward every rank holds that micro-batch's whole local
gradients until its reduction (DeepSpeed's stage 2 reduces buckets during the backward instead), so the trainer's
measured peak keeps one full gradient buffer.

    zero = Zero(named_parameters, dp_group, edp_group, is_expert, stage=2)
    zero.reduce_to_owners(dp, timer, last)  # ZeRO-2: after each micro-batch's backward, not backend.parallel's
    zero.step(optimizer)                    # drop_foreign_grads(), optimizer.step(), broadcast()
    zero.drop_foreign_state(optimizer)      # after a resume: keep the loaded state of this rank's parameters only

Checkpoints: each rank saves the optimizer state it holds (its own parameters'), so the checkpoint holds every
parameter's state once and any layout can resume it. A resuming rank loads every parameter's state (DCP fills the
state the optimizer was initialised with), then drops what it does not own: a foreign parameter's state would go
stale, and the next checkpoint could save that copy in place of the owner's.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn


def assign_owners(sizes: list[int], ranks: int) -> list[int]:
    """Owner rank of each parameter (by index) among `ranks`: the largest first, each to the least-loaded rank."""
    loads = [0] * ranks
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner = min(range(ranks), key=lambda r: (loads[r], r))
        owners[i] = owner
        loads[owner] += sizes[i]
    return owners


class Zero:
    """Which rank updates each trained parameter, the reduction of gradients to their owners (stage 2) and the
    broadcast that shares the updates (see the module)."""

    def __init__(self, named: Iterable[tuple[str, nn.Parameter]], dp_group, edp_group,
                 is_expert: Callable[[str], bool], stage: int = 1, presum: Callable | None = None):
        if stage not in (1, 2):
            raise ValueError(f"ZeRO stage {stage}: backend.zero runs stages 1 and 2")
        self.stage = stage
        # ZeRO-2: sums partial local gradients (e.g. over expert-tensor ranks) of the parameters given to it, before
        # they are reduced or, unreplicated, become gradients (backend.parallel.expert_tensor_presum)
        self.presum = presum
        trained = [(n, p) for n, p in named if p.requires_grad]
        self.assigned: list[tuple[nn.Parameter, object, int, bool]] = []  # (param, group, owner's global rank, mine)
        # one replica (e.g. expert slices with edp 1): owned, not reduced; (parameter, whether an expert slice)
        self.unreplicated: list[tuple[nn.Parameter, bool]] = []
        self.edp_group = edp_group
        for expert, group in ((False, dp_group), (True, edp_group)):
            params = [p for n, p in trained if is_expert(n) == expert]
            if group is None or not params:
                self.unreplicated += [(p, expert) for p in params]  # one replica: this rank owns them all
                continue
            me = dist.get_rank(group)
            owners = assign_owners([p.numel() for p in params], dist.get_world_size(group))
            self.assigned += [(p, group, dist.get_global_rank(group, o), o == me) for p, o in zip(params, owners)]
        self._sums: dict[tuple[int, int], torch.Tensor] = {}  # ZeRO-2: this rank's reduced buckets of the step so far

    def owned_numel(self) -> int:
        """Elements of the parameters this rank updates among those sharded."""
        return sum(p.numel() for p, _, _, mine in self.assigned if mine)

    def reduced_numel(self) -> int:
        """ZeRO-2, between micro-batches: elements of the reduced gradients this rank holds (its own parameters')."""
        return sum(t.numel() for t in self._sums.values())

    def drop_foreign_grads(self) -> None:
        """Before the optimizer step: no gradient, hence no state and no update, for the others' parameters."""
        for p, _, _, mine in self.assigned:
            if not mine:
                p.grad = None

    def drop_foreign_state(self, optimizer) -> None:
        """After loading a checkpoint: the optimizer state of the others' parameters goes (see the module)."""
        for p, _, _, mine in self.assigned:
            if not mine:
                optimizer.state.pop(p, None)

    @torch.no_grad()
    def reduce_to_owners(self, divide: int, timer=None, last: bool = True, expert_divide: int | None = None) -> None:
        """ZeRO-2, after a micro-batch's backward: each owner's bucket of local gradients reduced to it and added to
        what it holds of the step's earlier micro-batches; every rank then drops those local gradients, so between
        micro-batches a rank holds reduced gradients of its own parameters only. With `last`, the owner's sums,
        divided by `divide` (the token ranks, data x context; the expert slices' by `expert_divide` when given,
        backend.parallel.Layout.expert_divide), become its parameters' gradients. Parameters without
        a local gradient contribute zeros (every rank must join each reduce). Timed as "exposed_dp_comm" when a
        backend.parallel.PhaseTimer is given."""
        t0 = timer.now() if timer is not None else 0.0
        me = dist.get_rank()
        for key, (group, params) in self._buckets().items():  # insertion order: the same on every rank
            if self.presum is not None:
                self.presum(params)
            flat = torch.cat([(_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p))).reshape(-1)
                              for p in params])
            for p in params:
                p.grad = None
            dist.reduce(flat, dst=key[1], group=group)
            if key[1] == me:
                held = self._sums.get(key)
                self._sums[key] = flat if held is None else held.add_(flat)
            del flat
        if last:
            if self.presum is not None:  # their local gradients accumulated over the micro-batches: summed once
                self.presum([p for p, _ in self.unreplicated])
            per_expert = {False: divide, True: expert_divide or divide}
            for p, expert in self.unreplicated:  # e.g. expert slices whose expert group is the whole dp group
                if p.grad is not None:
                    p.grad.div_(per_expert[expert])
            for key, flat in self._sums.items():
                group = self._buckets()[key][0]
                flat.div_(per_expert[self.edp_group is not None and group is self.edp_group])
                offset = 0
                for p in self._buckets()[key][1]:
                    local = _local(p)
                    p.grad = _like(p, flat[offset:offset + local.numel()].view_as(local))  # views of the owned bucket
                    offset += local.numel()
            self._sums = {}
        if timer is not None:
            timer.add("exposed_dp_comm", timer.now() - t0)

    def _buckets(self) -> dict[tuple[int, int], tuple[object, list[nn.Parameter]]]:
        """(group index, owner's global rank) -> (group, the parameters that owner updates), in `assigned` order."""
        buckets: dict[tuple[int, int], tuple[object, list[nn.Parameter]]] = {}
        groups: list = []
        for p, group, owner, _ in self.assigned:
            if all(g is not group for g in groups):
                groups.append(group)
            index = next(i for i, g in enumerate(groups) if g is group)
            buckets.setdefault((index, owner), (group, []))[1].append(p)
        return buckets

    def step(self, optimizer) -> None:
        """The optimizer step on this rank's parameters, then everyone's updates shared."""
        self.drop_foreign_grads()
        optimizer.step()
        self.broadcast()

    @torch.no_grad()
    def broadcast(self) -> None:
        """After the step: every parameter from the rank that updated it."""
        for p, group, src, _ in self.assigned:
            dist.broadcast(_local(p.data), src=src, group=group)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel DTensor's own part (the ranks of one dp group hold the same part of it: the same tp rank),
    or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as a gradient of `p`: a DTensor with p's mesh and placements when p is one."""
    if not hasattr(p, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
