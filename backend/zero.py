"""ZeRO-1 in the trainer: optimizer state sharded over the data-parallel replicas (the plan's `parallel.zero: 1`).

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (arXiv:1910.02054),
stage 1 (P_os): each of the N_d data-parallel ranks keeps the optimizer state (and fp32 master) of 1/N_d of the
parameters, updates only those, and the updated parameters reach the other ranks. As
torch.distributed.optim.ZeroRedundancyOptimizer does it, whole parameters are assigned to ranks (the largest first,
each to the least-loaded rank, ties to the lowest: deterministic, the same on every rank); the gradients are reduced
as without ZeRO (backend.parallel); before the step a rank drops the gradients of the parameters it does not own, so
the plan's optimizer (MuonH, AdamW, or either offloaded by backend.offload) creates and updates state for its own
parameters only (both skip a parameter without a gradient); after the step each parameter is broadcast from its
owner. Dense parameters shard over the stage's data-parallel group, the expert slices over their
expert-data-parallel group (the ranks holding the same slice). The simulator prices ZeRO-1 as Megatron-LM's
distributed optimizer runs it (a reduce-scatter, then an all-gather; simulator.costs.gradient_reductions); this
trainer's all-reduce and broadcasts move more bytes on its gloo reference runs, and train the same model.

    zero = ZeroOne(named_parameters, dp_group, edp_group, is_expert)
    zero.step(optimizer)        # drop_foreign_grads(), optimizer.step(), broadcast()
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


class ZeroOne:
    """Which rank updates each trained parameter, and the broadcast that shares the updates (see the module)."""

    def __init__(self, named: Iterable[tuple[str, nn.Parameter]], dp_group, edp_group,
                 is_expert: Callable[[str], bool]):
        trained = [(n, p) for n, p in named if p.requires_grad]
        self.assigned: list[tuple[nn.Parameter, object, int, bool]] = []  # (param, group, owner's global rank, mine)
        for expert, group in ((False, dp_group), (True, edp_group)):
            params = [p for n, p in trained if is_expert(n) == expert]
            if group is None or not params:
                continue  # one replica: this rank owns them all
            me = dist.get_rank(group)
            owners = assign_owners([p.numel() for p in params], dist.get_world_size(group))
            self.assigned += [(p, group, dist.get_global_rank(group, o), o == me) for p, o in zip(params, owners)]

    def owned_numel(self) -> int:
        """Elements of the parameters this rank updates among those sharded."""
        return sum(p.numel() for p, _, _, mine in self.assigned if mine)

    def drop_foreign_grads(self) -> None:
        """Before the optimizer step: no gradient, hence no state and no update, for the others' parameters."""
        for p, _, _, mine in self.assigned:
            if not mine:
                p.grad = None

    def step(self, optimizer) -> None:
        """The optimizer step on this rank's parameters, then everyone's updates shared."""
        self.drop_foreign_grads()
        optimizer.step()
        self.broadcast()

    @torch.no_grad()
    def broadcast(self) -> None:
        """After the step: every parameter from the rank that updated it."""
        for p, group, src, _ in self.assigned:
            dist.broadcast(p.data, src=src, group=group)
