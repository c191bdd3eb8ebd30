"""Tensor parallelism (plan `parallel.tensor > 1`) and sequence parallelism (`parallel.sequence_parallel`) with
DTensor: torch.distributed.tensor.parallel.parallelize_module with ColwiseParallel / RowwiseParallel /
PrepareModuleInput styles over the "tp" DeviceMesh dimension (backend.parallel.Groups), Megatron-LM's layout
(Shoeybi et al. 2019, arXiv 1909.08053; sequence parallelism: Korthikanti et al. 2022, arXiv 2205.05198), applied
per block as torchtitan's apply_tp does (torchtitan/models/llama3/infra/parallelize.py).

Per block:
- attention: the fused Q/K/V projection column-parallel (each rank its heads' q, k and v rows, see `order_rows`),
  the output gate (HeadGate, one output per head) column-parallel, the K short convolution sharded by channel
  (its channels are the rank's K heads), the output projection row-parallel. Learned q/k norm gains (one per head
  dim, shared by the heads) stay whole and their gradients are summed over "tp" (each rank has its heads' part).
- dense MLP and each shared expert: gate/up (fused, `order_rows`) or up column-parallel, down row-parallel.
- replicated: embedding, norms and gated norms, the router, the block-output short convolutions and the output
  head; the routed experts too with expert = 1, while with expert > 1 their expert groups fold over the tp ranks
  (backend.parallel.Groups.expert_mesh, Megatron-Core's MoE parallel folding) and each tp rank dispatches the tokens
  it holds through backend.expert_parallel.
The attention and MLP inputs are one DTensor (PrepareModuleInput), so the column-parallel projections reading them
share one backward reduction: an all-reduce (tensor_bytes per layer output) without sequence parallelism; with it,
the input is all-gathered along the sequence before and the row-parallel output reduce-scattered after, and the
norms, router and routed experts between run on the rank's 1/tp of the sequence. Their parameters' gradients are
then partial sums and are all-reduced over "tp" after the backward (`reduce_partial_grads`). The embedding's output
is split along the sequence and the head's input gathered (`SequenceShard`, `SequenceGather`), so the loss is the
one-process loss on every rank.

Fused projections: a column-parallel shard of the one-process [q; k; v] (or [gate; up]) rows would give rank 0 the
first rows of q only. `order_rows` stores the rows rank-major — [q_0; k_0; v_0; q_1; k_1; v_1; ...], q_r the rows of
rank r's heads — so Shard(0) gives each rank its own heads' q, k and v; the parameter keeps its name and shape,
`stored_orders` records the permutation, backend.optim puts the parts back in order for MuonH (orthogonalisation
and norms per part; the update is gathered whole as for FSDP shards) and backend.checkpoint saves and loads the
one-process order, so checkpoints do not depend on the layout.

    partial = parallelize(chunks, groups, layout)    # in place, after build_chunks, before the optimizer
    reduce_partial_grads(partial, groups, timer)     # after each step's backward
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rackcast.backend.attention import Attention
from rackcast.backend.layers import FusedLinear, Mlp
from rackcast.backend.moe import MoE


def rank_major_order(parts: tuple[int, ...], ways: int) -> Tensor:
    """The rank-major order of a fused dimension made of `parts` split `ways` ways: rank r's 1/ways of every part
    together, rank by rank; stored[i] is the one-process index of stored index i (also backend.expert_tensor's
    order of the experts' fused gate/up columns)."""
    starts = torch.tensor((0,) + tuple(parts)).cumsum(0)[:-1].tolist()
    return torch.cat([torch.arange(start + r * size // ways, start + (r + 1) * size // ways)
                      for r in range(ways) for start, size in zip(starts, parts)])


def order_rows(fused: FusedLinear, tp: int) -> Tensor:
    """Reorder `fused`'s rows rank-major in place (rank r's rows of every part together) and return the stored
    order: stored[i] is the one-process row index of stored row i."""
    stored = rank_major_order(fused.parts, tp)
    with torch.no_grad():
        fused.weight.copy_(fused.weight.index_select(0, stored))
        if fused.bias is not None:
            fused.bias.copy_(fused.bias.index_select(0, stored))
    fused.split_sizes = tuple(size // tp for size in fused.parts)
    fused.matrix_parts = {"weight": (-2, fused.parts, stored)}
    fused.stored_order = stored
    return stored


def sequence_part(x: Tensor, rank: int, tp: int) -> Tensor:
    """Tensor-parallel rank `rank`'s part of the sequence (dim 1) of x under sequence parallelism: what the blocks
    and the pipeline stage boundaries between them hold (backend.pipeline.Pipeline._static_shapes)."""
    return x.chunk(tp, 1)[rank]


class SequenceShard(torch.autograd.Function):
    """Forward: this rank's 1/tp of the sequence (dim 1); backward: the gradient all-gathered along it."""

    @staticmethod
    def forward(ctx, x: Tensor, group, rank: int, tp: int) -> Tensor:
        ctx.group, ctx.tp = group, tp
        return sequence_part(x, rank, tp).contiguous()

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _gather_seq(grad.contiguous(), ctx.group, ctx.tp), None, None, None


class SequenceGather(torch.autograd.Function):
    """Forward: the whole sequence all-gathered (dim 1); backward: this rank's part of the gradient (every rank
    computes the same loss from the same gathered input, so its gradient is already whole)."""

    @staticmethod
    def forward(ctx, x: Tensor, group, rank: int, tp: int) -> Tensor:
        ctx.rank, ctx.tp = rank, tp
        return _gather_seq(x.contiguous(), group, tp)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.chunk(ctx.tp, 1)[ctx.rank].contiguous(), None, None, None


def _gather_seq(x: Tensor, group, tp: int) -> Tensor:
    parts = [torch.empty_like(x) for _ in range(tp)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, 1)


def _mlp_plan(mlp: Mlp, tp: int, sp: bool, seq_dim: int) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    outer = Shard(seq_dim) if sp else Replicate()
    plan = {"": PrepareModuleInput(input_layouts=(outer,), desired_input_layouts=(Replicate(),)),
            "down": RowwiseParallel(output_layouts=outer)}
    if mlp.gate_up is not None:
        order_rows(mlp.gate_up, tp)
        plan["gate_up"] = ColwiseParallel()
    else:
        plan["up"] = ColwiseParallel()
    return plan


def _parallelize_attention(attn: Attention, mesh, tp: int, sp: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, \
        parallelize_module

    order_rows(attn.qkv, tp)
    plan = {"": PrepareModuleInput(input_layouts=(Shard(1) if sp else Replicate(),),
                                   desired_input_layouts=(Replicate(),)),
            "qkv": ColwiseParallel(), "o": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())}
    if attn.gate is not None:
        plan["gate"] = ColwiseParallel()
    for name, style in plan.items():
        parallelize_module(attn.get_submodule(name) if name else attn, mesh, style)
    if attn.conv_k is not None:
        attn.conv_k.weight = nn.Parameter(distribute_tensor(attn.conv_k.weight.data, mesh, [Shard(1)]))
    if attn.conv_v is not None:
        attn.conv_v.weight = nn.Parameter(distribute_tensor(attn.conv_v.weight.data, mesh, [Shard(1)]))
    attn.heads, attn.kv_stored, attn.kv_heads = attn.heads // tp, attn.kv_stored // tp, attn.kv_heads // tp


def parallelize(chunks: list[nn.Module], groups, layout) -> list[nn.Parameter]:
    """Shard every block of this rank's chunks over the tp mesh in place (see the module docstring); returns the
    whole parameters whose gradients reduce_partial_grads must sum (partial_grad_params)."""
    from torch.distributed.tensor.parallel import parallelize_module

    mesh, tp, sp = groups.tp_mesh, layout.tp, layout.sequence_parallel
    for chunk in chunks:
        for block in chunk.layers.values():
            _parallelize_attention(block.attn, mesh, tp, sp)
            mlps = [(block.mlp, 1)] if isinstance(block.mlp, Mlp) else \
                [(shared, 0) for shared in block.mlp.shared] if isinstance(block.mlp, MoE) else []
            for mlp, seq_dim in mlps:  # shared experts read the MoE's flattened tokens [tokens, d_model]
                for name, style in _mlp_plan(mlp, tp, sp, seq_dim).items():
                    parallelize_module(mlp.get_submodule(name) if name else mlp, mesh, style)
            if sp and isinstance(block.mlp, MoE):  # its auxiliary loss totals the sequence over the tp ranks
                block.mlp.sequence_group = groups.tp
        if sp and getattr(chunk, "embed", None) is not None:
            chunk.embed.register_forward_hook(
                lambda _m, _a, out: SequenceShard.apply(out, groups.tp, layout.tp_rank, tp))
        if sp and getattr(chunk, "head", None) is not None:
            chunk.head.register_forward_pre_hook(
                lambda _m, args: (SequenceGather.apply(args[0], groups.tp, layout.tp_rank, tp),) + args[1:])
    return partial_grad_params(chunks, layout)


def partial_grad_params(chunks: list[nn.Module], layout) -> list[nn.Parameter]:
    """Whole (not sharded) parameters whose gradient on one tp rank is a partial sum: the learned q/k norm gains
    (each rank has its heads' part), and with sequence parallelism every whole parameter of the blocks (norms,
    router, routed experts, gated norms: each rank has its part of the sequence), less the routed experts when
    their expert groups fold over the tp ranks (backend.parallel.reduce_grads sums those over the expert-data
    replicas, which span the tp ranks)."""
    from torch.distributed.tensor import DTensor

    out: dict[int, nn.Parameter] = {}
    for chunk in chunks:
        for block in chunk.layers.values():
            if layout.sequence_parallel:
                scope = [block]
            else:
                scope = [m for m in (getattr(block.attn, "q_norm", None), getattr(block.attn, "k_norm", None)) if m]
            routed = {id(p) for p in block.mlp.experts.parameters()} \
                if layout.expert_folds_tp and isinstance(block.mlp, MoE) else set()
            for module in scope:
                for p in module.parameters():
                    if p.requires_grad and not isinstance(p, DTensor) and id(p) not in routed:
                        out[id(p)] = p
    return list(out.values())


def reduce_partial_grads(params: list[nn.Parameter], groups, timer) -> None:
    """Sum the partial gradients of `params` (partial_grad_params) over the tp ranks: one flat all-reduce."""
    # FSDP2-sharded parameters (tensor parallelism with fsdp > 1): their reduce-scattered shards, summed likewise
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
    if not grads:
        return
    t0 = timer.now()
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=groups.tp)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    timer.add("exposed_tensor_comm", timer.now() - t0)


def stored_orders(module: nn.Module) -> dict[str, tuple[int, Tensor]]:
    """Parameter name -> (dim, stored order) of every fused parameter stored in another order than one process's:
    those `order_rows` reordered, and a module's own `stored_param_orders` ({param: (dim, stored order)}, the
    expert-tensor-parallel gate/up columns, backend.expert_tensor); for backend.checkpoint, which saves and loads
    the one-process order."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    out = {}
    for name, m in module.named_modules():
        stored = getattr(m, "stored_order", None)
        name = name.replace(_CHECKPOINT_PREFIX, "")  # state-dict names drop recompute's wrapper (backend.recompute)
        if stored is not None:
            out[f"{name}.weight"] = (0, stored)
            if getattr(m, "bias", None) is not None:
                out[f"{name}.bias"] = (0, stored)
        for param, order in getattr(m, "stored_param_orders", {}).items():
            out[f"{name}.{param}" if name else param] = order
    return out
