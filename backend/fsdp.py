"""Fully sharded data parallelism (plan `parallel.fsdp > 1`) with FSDP2, `torch.distributed.fsdp.fully_shard`.

Meshes (ranks as backend.parallel: stage outermost, then data, then fsdp innermost):
- dense parameters: the (data x context, fsdp) mesh of the stage (backend.parallel.dense_fsdp_mesh); fsdp > 1 with
  data > 1 or context > 1 is HSDP (replicated over the data and context ranks, sharded over "fsdp": the weights
  and their all-gathers are fsdp-wide, as simulator.memory and the estimate price them). Each transformer block is
  one FSDP unit (all-gathered before its forward and backward, gradients reduce-scattered after its backward), and
  the chunk itself one more for the embedding, head and norms. Gradients are averaged over data x fsdp x context,
  the token ranks (FSDP2's default divide factor, the mesh size): context ranks hold different tokens of the same
  sequences (backend.context_parallel.token_scale scales each chunk's loss accordingly). The simulator prices that
  reduction as a reduce-scatter inside fsdp x context and an all-reduce across data
  (simulator.costs.gradient_reductions); HSDP runs the reduce-scatter inside fsdp and the all-reduce of the
  1/fsdp shard across data x context, more bytes on the outer level when context > 1.
- expert stacks: when the expert group fits inside the fsdp group, sharded fsdp / expert ways over the ranks of the
  fsdp group holding the same expert slice and replicated over "data" (Layout.expert_fsdp, the layout
  simulator.memory.expert_fsdp prices). Each MoE layer's experts are their own FSDP unit. Each EP rank's expert
  gradient already holds the contributions of its whole EP group (the all-to-all's backward brings them), so the
  reduction sums over the expert-data ranks and divides by the token ranks data x fsdp x context, not by their
  count: `set_gradient_divide_factor(tokens)`. Under expert tensor parallelism the width slices are DTensors on the
  "etp" dim of the expert FSDP mesh's root (backend.parallel.Groups), so FSDP2 shards them again along the expert
  dim (2-D placements, as over the tp DTensors); the down bias every ETP rank holds whole is sharded as a plain
  tensor and its partial gradients summed over "etp" after the reduce-scatter (backend.parallel.reduce_grads).
Parameters without a gradient (the balancing bias) stay out of FSDP. Expert stacks that are not sharded
(Layout.expert_fsdp == 1) stay out of the dense unit and are reduced as without FSDP (backend.parallel.reduce_grads).
Mixed precision: on CUDA with precision bf16, FSDP2's MixedPrecisionPolicy (bf16 compute weights, gradients
reduced in the plan's grad_dtype); on CPU the trainer's bf16 autocast is used instead and FSDP keeps fp32.
Gradient accumulation over micro-batches defers the reduce-scatter to the last one (set_requires_gradient_sync).
MuonH on sharded matrices: backend.optim.orthogonalise gathers each 2-D matrix's update once (see there).
With tensor parallelism (torchtitan's FSDP + TP): backend.tensor_parallel has made the attention and MLP matrices
DTensors on the "tp" mesh first; fully_shard then shards them again along dim 0 over "shard" (the two meshes are
dims of one root, backend.parallel.Groups), so a block's all-gather and reduce-scatter run over the fsdp ranks of
one tp rank and move 1/tp of its weights. The expert stacks, replicated over the tensor ranks, shard over fsdp x tp.

    shard_model(chunks, groups, layout, plan, device)     # in place, before the optimizer is built
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from rackcast.simulator.memory import fsdp_kept_gathered


def _policy(plan, device: torch.device) -> MixedPrecisionPolicy:
    if device.type == "cuda" and plan.precision == "bf16":
        reduce = torch.float32 if plan.grad_dtype == "fp32" else torch.bfloat16
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
    return MixedPrecisionPolicy()


def shard_model(chunks: list[nn.Module], groups, layout, plan, device: torch.device) -> bool:
    """Apply FSDP2 to every chunk in place. Returns whether the expert stacks were sharded; when not, their
    gradients are still reduced by backend.parallel.reduce_grads."""
    policy = _policy(plan, device)
    reshard = reshard_after_forward(plan)
    experts_sharded = groups.expert_fsdp_mesh is not None
    for chunk in chunks:
        for block in chunk.layers.values():
            experts = getattr(getattr(block, "mlp", None), "experts", None)
            if experts is not None and experts_sharded:
                fully_shard(experts, mesh=groups.expert_fsdp_mesh, mp_policy=policy, reshard_after_forward=reshard)
                # the fsdp group spans the tensor ranks (Layout.expert_fsdp = fsdp x tp / expert: the experts
                # replicated over tp with ep 1, the expert groups folded over tp with ep > 1): without sequence
                # parallelism the tp ranks route the same tokens, each a whole gradient's copy, so divide by the
                # token ranks (dp x cp) x tp; with it each routes its part of the sequence, a partial sum that this
                # reduction completes
                experts.set_gradient_divide_factor(float(layout.tokens * layout.tp_copies))
                if device.type == "cpu":  # gloo has no pre-multiplied sum: sum, then scale after the reduction
                    experts.set_force_sum_reduction_for_comms(True)
            kept = _unsharded(block) | (set(experts.parameters()) if experts is not None and not experts_sharded
                                         else set())
            fully_shard(block, mesh=groups.fsdp_mesh, mp_policy=policy, ignored_params=kept or None,
                        reshard_after_forward=reshard)
        fully_shard(chunk, mesh=groups.fsdp_mesh, mp_policy=policy, ignored_params=_unsharded(chunk) or None)
    return experts_sharded


def expert_checkpoint_mesh(layout, device: torch.device):
    """This stage's ranks as (data, expert, expert FSDP shard[, expert tensor]): the mesh on which an FSDP-sharded
    expert stack under expert parallelism is Replicate x Shard(0) x Shard(0) of the full [experts, ...] stack (each
    expert rank's slice, split again over its FSDP shards; under expert tensor parallelism x the width placement,
    backend.expert_tensor.checkpoint_placements), for checkpoints (backend.checkpoint). The ranks are numbered as the expert
    FSDP mesh of backend.parallel.Groups, (pipeline, data, shard, expert), so the expert and shard dims swap.
    Collective: every rank builds it."""
    from torch.distributed.device_mesh import DeviceMesh

    width = (layout.etp,) if layout.etp > 1 else ()  # expert tensor parallelism: the width slices' dim, innermost
    ranks = torch.arange(layout.world).reshape(layout.pp, layout.data, layout.expert_fsdp, layout.ep, *width)
    names = ("replicate", "ep", "shard") + (("etp",) if width else ())
    mesh = DeviceMesh(device.type, ranks.transpose(2, 3), mesh_dim_names=("pp", *names))
    return mesh[names]


def reshard_after_forward(plan) -> bool:
    """Whether FSDP2 frees a unit's gathered weights after its forward (and gathers them again for its backward).

    Not under the split-backward schedules (zb_h1, dualpipev) of a pipeline: their weight-gradient pass
    (torch.distributed.pipelining's stage_backward_weight) runs after later micro-batches' forwards and finds the
    weights through the module's registered parameters, which a reshard after those forwards has swapped back to the
    sharded ones, so part of the weight gradients is lost (measured here: parameters 2-7e-2 off one process's after 5
    steps with Adam; exact with the gathered weights kept: FSDP2's reshard_after_forward=False, the ZeRO-2-like
    mode of torch.distributed.fsdp.fully_shard). The memory model prices the whole rank's gathered weights for these
    layouts (simulator.memory.fsdp_kept_gathered)."""
    return not bool(fsdp_kept_gathered(plan))


def _unsharded(module: nn.Module) -> set[nn.Parameter]:
    """Parameters without a gradient (the router's balancing bias, which the quantile balancer sets identically on
    every rank from pooled statistics) stay whole, plain tensors on every rank."""
    return {p for p in module.parameters() if not p.requires_grad}


def set_gradient_sync(chunks: list[nn.Module], sync: bool) -> None:
    """Reduce-scatter after this backward (the last micro-batch) or keep accumulating unsharded gradients."""
    for chunk in chunks:
        if isinstance(chunk, FSDPModule):
            chunk.set_requires_gradient_sync(sync)
