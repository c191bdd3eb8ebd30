"""Expert parallelism through the model's MoE seam: all_to_all_single with uneven splits, dropless or capacity.

`shard_experts(model, ep_group, ep_rank, ep, ...)` turns every MoE layer into an ExpertParallelMoE that keeps experts
[ep_rank*E/ep, (ep_rank+1)*E/ep) of the stacked GroupedExperts weights (sliced from the full, identically seeded
model, so the result matches one process) and overrides only `dispatch_compute_combine`:
1. sort this rank's (token, expert) assignments by expert (MoE.sort_by_expert);
2. capacity mode: keep at most floor(capacity_factor x tokens x top_k / experts) assignments per expert, the
   earliest tokens first; the rest are dropped (their combine weight is lost) and counted;
3. exchange per-expert counts (all_to_all_single of E integers), then the rows (all_to_all_single with uneven
   split sizes, differentiable: its backward is the reverse all_to_all); all three exchanges are timed as the
   exposed_expert_a2a phase;
4. regroup the received rows by local expert, run GroupedExperts on them, undo the regrouping and send them back;
5. MoE.combine scales by the combine weights and sums per token.
With ep == 1 the same class runs without communication (used for capacity mode on one process).
With expert tensor parallelism (etp = plan.parallel.expert_tensor > 1, backend.expert_tensor) the exchange runs over
the whole expert group of ep x etp ranks: each expert rank's block of etp consecutive ranks holds its experts split
by width, step 3 sends each row to every rank of its expert's block, and the rows coming back are partial outputs
that the source sums (one index_add) before step 5.

    from rackcast.backend.expert_parallel import shard_experts
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rackcast.backend.moe import GroupedExperts, MoE


class _AllToAll(torch.autograd.Function):
    """Differentiable all_to_all_single of rows with uneven splits; timed into `timer` as expert dispatch/combine."""

    @staticmethod
    def forward(ctx, x: Tensor, send: list[int], recv: list[int], group, timer) -> Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.timer = send, recv, group, timer
        return _exchange(x, send, recv, group, timer)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _exchange(grad.contiguous(), ctx.recv, ctx.send, ctx.group, ctx.timer), None, None, None, None


def _exchange(x: Tensor, send: list[int], recv: list[int], group, timer) -> Tensor:
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    _timed_all_to_all(out, x.contiguous(), recv, send, group, timer)
    return out


def _timed_all_to_all(out: Tensor, x: Tensor, recv: list[int] | None, send: list[int] | None, group, timer) -> None:
    """all_to_all_single timed into `timer` as exposed_expert_a2a: the rows' exchanges and the per-expert counts'
    exchange before them (communication too, and the wait for the slowest member of the expert group is spent
    there, so the compute phase keeps only computation)."""
    t0 = timer.now() if timer is not None else 0.0
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
    if timer is not None:
        timer.add("exposed_expert_a2a", timer.now() - t0)


class ExpertParallelMoE(MoE):
    """An MoE whose GroupedExperts hold only this rank's experts (set up by shard_experts)."""

    ep: int
    ep_rank: int
    ep_group: object  # the expert group: ep x etp ranks
    etp: int
    capacity_factor: float | None
    timer: object
    dropped: int
    assigned: int

    def _capacity_keep(self, order: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
        """Drop assignments beyond each expert's capacity (earliest tokens kept); returns kept order and counts."""
        tokens = order.numel() // self.top_k
        cap = int(self.capacity_factor * tokens * self.top_k / self.num_experts)
        starts = torch.cumsum(counts, 0) - counts
        expert_of = torch.repeat_interleave(torch.arange(self.num_experts, device=counts.device), counts)
        slot = torch.arange(order.numel(), device=order.device) - starts[expert_of]
        keep = slot < cap
        return order[keep], counts.clamp(max=cap)

    def dispatch_compute_combine(self, tokens: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        order, counts = self.sort_by_expert(expert_ids)
        self.assigned += order.numel()
        if self.capacity_factor is not None:
            order, counts = self._capacity_keep(order, counts)
        self.dropped += expert_ids.numel() - order.numel()
        x_sorted = tokens.index_select(0, order // self.top_k)
        local, group = self.num_experts // self.ep, self.ep * self.etp
        if group == 1:
            y_sorted = self.experts(x_sorted, counts)
            return self.combine(y_sorted, order, weights, tokens.shape[0])
        # Destination d = (expert rank b, expert-tensor rank j) = b etp + j gets block b's rows (etp copies of each).
        block_counts = counts.view(self.ep, local)
        send_counts = block_counts.repeat_interleave(self.etp, 0).reshape(-1)
        recv_counts = torch.empty_like(send_counts)
        _timed_all_to_all(recv_counts, send_counts, None, None, self.ep_group, self.timer)  # [source, local expert]
        send_splits = block_counts.sum(1).repeat_interleave(self.etp)
        recv_matrix = recv_counts.view(group, local)
        recv_splits = recv_matrix.sum(1).tolist()
        copies = None  # the row of x_sorted each sent row is (its block's rows once per expert-tensor rank)
        x_send = x_sorted
        if self.etp > 1:
            block_starts = (torch.cumsum(block_counts.sum(1), 0) - block_counts.sum(1)).repeat_interleave(self.etp)
            send_starts = torch.cumsum(send_splits, 0) - send_splits
            total = int(send_splits.sum())
            copies = (torch.arange(total, device=counts.device)
                      + torch.repeat_interleave(block_starts - send_starts, send_splits, output_size=total))
            x_send = x_sorted.index_select(0, copies)
        send_splits = send_splits.tolist()
        x_recv = _AllToAll.apply(x_send, send_splits, recv_splits, self.ep_group, self.timer)
        # Received rows are grouped by source rank, then expert; the experts want them grouped by expert.
        seg_expert = torch.arange(local, device=counts.device).repeat(group)
        row_expert = torch.repeat_interleave(seg_expert, recv_matrix.reshape(-1))
        regroup = torch.argsort(row_expert, stable=True)
        y = self.experts(x_recv.index_select(0, regroup), recv_matrix.sum(0))
        y_back = torch.empty_like(y).index_copy(0, regroup, y)
        y_sorted = _AllToAll.apply(y_back, recv_splits, send_splits, self.ep_group, self.timer)
        if copies is not None:  # partial outputs of the etp width slices: summed per row
            y_sorted = y_sorted.new_zeros(x_sorted.shape[0], y_sorted.shape[-1]).index_add(0, copies, y_sorted)
        return self.combine(y_sorted, order, weights, tokens.shape[0])


def _slice_experts(experts: GroupedExperts, start: int, stop: int) -> GroupedExperts:
    part = GroupedExperts.__new__(GroupedExperts)
    nn.Module.__init__(part)
    part.activation, part.width, part.matrix_parts = experts.activation, experts.width, experts.matrix_parts
    for name, p in experts.named_parameters(recurse=False):
        setattr(part, name, nn.Parameter(p.detach()[start:stop].clone(), requires_grad=p.requires_grad))
    for name in ("w_gate_up", "w_up", "b_gate_up", "b_up", "b_down"):
        if getattr(experts, name) is None:
            setattr(part, name, None)
    return part


def shard_experts(model: nn.Module, ep_group, ep_rank: int, ep: int, capacity_factor: float | None,
                  timer=None, etp: int = 1, etp_rank: int = 0, etp_mesh=None) -> list[ExpertParallelMoE]:
    """Make every MoE in `model` an ExpertParallelMoE owning this rank's experts (and, with etp > 1, its width
    slice of them, backend.expert_tensor); returns them. ep_group: the expert group (ep x etp ranks)."""
    out = []
    for moe in [m for m in model.modules() if isinstance(m, MoE)]:
        local = moe.num_experts // ep
        if ep > 1:
            moe.experts = _slice_experts(moe.experts, ep_rank * local, (ep_rank + 1) * local)
        if etp > 1:
            from rackcast.backend.expert_tensor import shard_width

            moe.experts = shard_width(moe.experts, etp_mesh, etp_rank, etp)
        moe.__class__ = ExpertParallelMoE
        moe.ep, moe.ep_rank, moe.ep_group, moe.etp = ep, ep_rank, ep_group, etp
        moe.capacity_factor, moe.timer = capacity_factor, timer
        moe.dropped = moe.assigned = 0
        out.append(moe)
    return out


def pop_drop_counts(moes: list[ExpertParallelMoE]) -> tuple[int, int]:
    """(dropped, assigned) assignments since the last call, summed over layers."""
    dropped = sum(m.dropped for m in moes)
    assigned = sum(m.assigned for m in moes)
    for m in moes:
        m.dropped = m.assigned = 0
    return dropped, assigned


def expert_shard_of(groups, layout, fsdp_mesh=None):
    """Where this rank's expert slices sit in the full expert stacks (backend.checkpoint.ShardOf: a
    Replicate x Shard(0) DTensor over the stage's expert mesh (Groups.expert_mesh: "edp", experts split over "ep",
    the tp ranks folded in when tensor > 1); with the slices
    FSDP-sharded again, Replicate x Shard(0) x Shard(0) (x the width placement under ETP) over `fsdp_mesh`,
    backend.fsdp.expert_checkpoint_mesh);
    None without expert parallelism. With expert_tensor > 1 the slices are split by width too: Replicate x Shard(0)
    x Shard(width dim) over ("edp", "ep", "etp"), backend.expert_tensor.checkpoint_placements."""
    if layout.ep == 1 and layout.etp == 1:
        return None
    from torch.distributed.tensor import Replicate, Shard

    from rackcast.backend.expert_tensor import checkpoint_placements
    from rackcast.backend.parallel import is_expert_param

    if fsdp_mesh is not None:  # (replicate, ep, shard[, etp]): the width placement last under ETP
        width = (lambda fqn: checkpoint_placements(fqn)[-1:]) if layout.etp > 1 else (lambda fqn: [])
        return lambda fqn: (fsdp_mesh, [Replicate(), Shard(0), Shard(0), *width(fqn)]) if is_expert_param(fqn) \
            else None
    if layout.etp > 1:
        mesh = groups.expert_mesh["edp", "ep", "etp"]
        return lambda fqn: (mesh, checkpoint_placements(fqn)) if is_expert_param(fqn) else None
    mesh, placements = groups.expert_mesh["edp", "ep"], [Replicate(), Shard(0)]
    return lambda fqn: (mesh, placements) if is_expert_param(fqn) else None
