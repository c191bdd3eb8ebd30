"""The plan's parallel layout on real processes: which layouts the trainer runs, the DeviceMesh, and data parallelism.

Ranks follow rackcast.layout (innermost first: tensor, context, fsdp, data, pipeline outermost), so with
dp = data x fsdp, cp = context and tp = tensor
    stage, r = divmod(rank, dp * cp * tp);  tp_rank = r % tp;  dp_rank, cp_rank = divmod(r // tp, cp)
Tensor-parallel ranks read the same samples and the same tokens; context ranks read the same sequences (the batch
splits by dp_rank) and hold different chunks of them (cp_rank, backend.context_parallel), so the ranks that see
different tokens are the dp x cp "token ranks" of one (stage, tp_rank), u = dp_rank * cp + cp_rank; dense gradients
average over them. The expert groups are runs of expert x expert_tensor consecutive ranks of the stage, tp ranks
included (rackcast.layout.ParallelSpec.expert_group / expert_coordinates: Megatron-Core's MoE parallel folding over
tensor x context x data), expert_tensor innermost:
    edp_rank, ep_rank, etp_rank = ParallelSpec.expert_coordinates(r)   (edp = ParallelSpec.expert_data).
With tp == 1, r = u. With tp > 1 and expert x expert_tensor = 1 the trainer keeps each tp rank's expert replicas
apart instead (coordinates of u, edp = dp x cp): backend.tensor_parallel sums the tp ranks' partial expert gradients
first, which completes the same sum (`Layout.expert_folds_tp` tells the two apart).
The mesh is `init_device_mesh(device, (pipeline, edp, ep, etp, tp), ("pp", "edp", "ep", "etp", "tp"))` with
("edp", "ep", "etp") flattened to "dp" (the token ranks) and ("ep", "etp") to "expert" (the expert group, over which
the expert all-to-all runs; backend.expert_tensor); each axis is one process group, the context ranks of one
sequence form group "cp", and the tensor-parallel reductions run over "tp" (backend.tensor_parallel). When the
expert groups fold over the tp ranks they are not dims of that mesh: its expert dims are then (dp x cp, 1, 1) and
the expert axes come from a mesh of their own, (pipeline, edp, ep, etp) over consecutive ranks (Groups.expert_mesh).

Data parallelism: the dense parameters are wrapped in DDP over "dp", the token ranks (with fsdp > 1 FSDP2 shards
them instead, backend.fsdp; under ZeRO-2 neither, and backend.zero reduces every gradient to its owner instead of all this);
the expert stacks are left out of DDP and their gradients are summed over "edp" only and divided by dp, because each
EP rank already holds the gradient contributions of every rank of its EP group (all_to_all's backward brings them);
with the groups folded over tp ranks that route the same tokens (no sequence parallelism) each token's contribution
arrives tp times, so the divisor is dp x tp (`Layout.expert_divide`).
DDP's all-reduce runs through a comm hook that times it, so the data-parallel reduction is a measured phase.
Pipeline stages are not DDP-wrapped (torch 2.13's DDP reducer fails its bucket rebuild when a PipelineStage runs
several no_sync micro-batch backwards): their dense gradients are averaged over "dp" by one flat all-reduce after
the schedule step, which is what DDP computes, without the overlap.

    from rackcast.backend.parallel import validate_trainable, Layout
    validate_trainable(plan)                    # RackcastError naming the field when the trainer cannot run it
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from rackcast.capabilities import refusals
from rackcast.errors import RackcastError
from rackcast.plan import Plan

def validate_trainable(plan: Plan, where: str = "") -> None:
    """Refuse, in one line naming the field, what the plan asks for that this trainer does not implement (the
    first of rackcast.capabilities.refusals; `rackcast train PLAN --check` prints them all)."""
    reasons = refusals(plan, plan.model_spec())
    if reasons:
        raise RackcastError(reasons[0], where=where)
    if plan.compile:
        from rackcast.backend.compiled import compile_problem

        problem = compile_problem()
        if problem:
            raise RackcastError(f"compile: {problem}; set compile: false", where=where)


def folds_tp(tp: int, expert_group: int) -> bool:
    """Whether the trainer folds the expert groups over the tp ranks: tp > 1 with a group of more than one rank;
    otherwise the expert replicas lie among the token ranks of one tp rank (see the module docstring)."""
    return tp > 1 and expert_group > 1


@dataclass(frozen=True)
class Layout:
    """This process's coordinates in the plan's grid."""

    rank: int
    world: int
    pp: int
    dp: int
    ep: int
    stage: int
    dp_rank: int
    ep_rank: int
    edp_rank: int
    virtual: int
    edp: int = 1  # expert-data replicas of one expert slice (in the stage, or per tp rank unless expert_folds_tp)
    data: int = 1
    fsdp: int = 1
    expert_fsdp: int = 1  # ways FSDP shards the expert stacks (rackcast.layout.ParallelSpec.expert_fsdp; data replicates them)
    tp: int = 1  # tensor-parallel ranks (plan.parallel.tensor), innermost
    tp_rank: int = 0
    sequence_parallel: bool = False
    cp: int = 1  # context-parallel ranks (plan.parallel.context): each holds one chunk of every sequence
    cp_rank: int = 0
    etp: int = 1  # expert-tensor ranks (plan.parallel.expert_tensor): each routed expert's width split over them
    etp_rank: int = 0

    @property
    def expert_folds_tp(self) -> bool:
        """Whether this rank's expert group and expert-data replicas span tp ranks (see `folds_tp`)."""
        return folds_tp(self.tp, self.ep * self.etp)

    @property
    def tp_copies(self) -> int:
        """tp ranks that route the same tokens: all of them without sequence parallelism, else one (each routes its
        1/tp of the sequence)."""
        return 1 if self.sequence_parallel else self.tp

    @property
    def expert_divide(self) -> int:
        """What an expert gradient summed over the expert-data replicas is divided by: the token ranks, times the
        tp copies of each token when the replicas span the tp ranks."""
        return self.tokens * (self.tp_copies if self.expert_folds_tp else 1)

    @property
    def tokens(self) -> int:
        """Ranks of one stage that see different tokens (dp x cp): dense gradients average over them."""
        return self.dp * self.cp

    @classmethod
    def of(cls, plan: Plan, rank: int) -> "Layout":
        p = plan.parallel  # rackcast.layout.ParallelSpec: every size comes from it
        dp, cp, tp = p.batch_shards, p.context, p.tensor
        stage, r = divmod(rank, p.stage_ranks)  # stage_ranks = dp x cp x tp
        tp_rank = r % tp
        dp_rank, cp_rank = divmod(r // tp, cp)
        u = dp_rank * cp + cp_rank  # token rank
        folds = folds_tp(tp, p.expert_group)
        edp_rank, ep_rank, etp_rank = p.expert_coordinates(r if folds else u)
        return cls(rank=rank, world=p.gpus, pp=p.pipeline, dp=dp, ep=p.expert, stage=stage, dp_rank=dp_rank,
                   ep_rank=ep_rank, edp_rank=edp_rank, virtual=p.chunks_per_rank,
                   edp=p.expert_data if folds else p.expert_data // tp, data=p.data,
                   fsdp=p.fsdp, expert_fsdp=p.expert_fsdp, tp=tp, tp_rank=tp_rank,
                   sequence_parallel=p.sequence_parallel, cp=cp, cp_rank=cp_rank, etp=p.expert_tensor,
                   etp_rank=etp_rank)


class Groups:
    """The DeviceMesh and its process groups (None for an axis of size 1)."""

    def __init__(self, layout: Layout, device: torch.device):
        from torch.distributed.device_mesh import init_device_mesh

        folded = layout.expert_folds_tp
        experts = (layout.tokens, 1, 1) if folded else (layout.edp, layout.ep, layout.etp)
        self.mesh = init_device_mesh(device.type, (layout.pp, *experts, layout.tp),
                                     mesh_dim_names=("pp", "edp", "ep", "etp", "tp"))
        # the expert axes: with the groups folded over the tp ranks, runs of ep x etp consecutive ranks of the stage
        # (rackcast.layout.ParallelSpec.expert_coordinates), a mesh of their own
        self.expert_mesh = init_device_mesh(device.type, (layout.pp, layout.edp, layout.ep, layout.etp),
                                            mesh_dim_names=("pp", "edp", "ep", "etp")) if folded else self.mesh
        self.dp_mesh = self.mesh["edp", "ep", "etp"]._flatten("dp")  # the token ranks (data x fsdp x context)
        self.tp_mesh = self.mesh["tp"]  # the tensor-parallel DeviceMesh (backend.tensor_parallel)
        self.tp = self.tp_mesh.get_group() if layout.tp > 1 else None
        self.pp = self.mesh.get_group("pp") if layout.pp > 1 else None
        self.dp = self.dp_mesh.get_group() if layout.tokens > 1 else None
        self.cp = None  # the context ranks of this rank's sequences
        if layout.cp > 1:
            seq = init_device_mesh(device.type, (layout.pp, layout.dp, layout.cp), mesh_dim_names=("pp", "batch", "cp"))
            self.cp = seq.get_group("cp")
        em = self.expert_mesh
        self.ep = em.get_group("ep") if layout.ep > 1 else None
        self.etp = em.get_group("etp") if layout.etp > 1 else None
        self.etp_mesh = em["etp"]  # the expert-tensor DeviceMesh (backend.expert_tensor's DTensors)
        # the expert group (expert x expert_tensor ranks), over which the expert all-to-all runs
        self.expert = self.ep if layout.etp == 1 else em["ep", "etp"]._flatten("expert").get_group()
        self.edp = em.get_group("edp") if layout.edp > 1 else None
        self.edp_mesh = em["edp"] if layout.edp > 1 else None
        # every rank of the stage (dp x tp): sequence-parallel ranks route different tokens, so the balancer pools
        # its statistics over them all
        self.stage = self.mesh["edp", "ep", "etp", "tp"]._flatten("stage").get_group() \
            if layout.tp > 1 and layout.sequence_parallel else self.dp
        self.fsdp_mesh = None  # FSDP2's mesh for the dense parameters (backend.fsdp): (data x context, fsdp) or (fsdp,)
        self.expert_fsdp_mesh = None  # and for the expert stacks: (data, fsdp x context / expert) or (that,)
        if layout.fsdp > 1:
            if layout.cp > 1:  # tensor with context is refused: no tp dim here
                self.fsdp_mesh = dense_fsdp_mesh(layout, device)
            else:
                # with tensor parallelism (tp innermost; the experts replicated over it, or with expert > 1 their
                # groups folded over it) the FSDP and tp meshes are dims of one root mesh (pp, data, fsdp, tp), so that
                # FSDP2 shards the tensor-parallel DTensors again over "shard" (2-D placements, torchtitan's FSDP + TP)
                dense = init_device_mesh(device.type, (layout.pp, layout.data, layout.fsdp, layout.tp),
                                         mesh_dim_names=("pp", "replicate", "shard", "tp"))
                self.fsdp_mesh = dense["replicate", "shard"] if layout.data > 1 else dense["shard"]
                if layout.tp > 1:
                    self.tp_mesh = dense["tp"]  # the same ranks as self.mesh["tp"], under FSDP's root mesh
                    self.tp = self.tp_mesh.get_group()
            efsdp = layout.expert_fsdp
            if efsdp > 1:  # the expert group is the innermost ep x etp ranks of the fsdp (x tp) group
                experts = init_device_mesh(device.type, (layout.pp, layout.data, efsdp, layout.ep, layout.etp),
                                           mesh_dim_names=("pp", "replicate", "shard", "ep", "etp"))
                self.expert_fsdp_mesh = experts["replicate", "shard"] if layout.data > 1 else experts["shard"]
                # the width slices' DTensors on a dim of the same root mesh, so FSDP2 shards them again over
                # "shard" (2-D placements, as over the tp DTensors; one root mesh is what FSDP2 accepts)
                self.etp_mesh = experts["etp"]


def dense_fsdp_mesh(layout: Layout, device: torch.device):
    """FSDP2's mesh for the dense parameters of this rank's stage under context parallelism (cp > 1; Groups builds
    the cp == 1 mesh, with its tp dim): sharded over the fsdp ranks, replicated over the data x context ranks (HSDP:
    reduce-scatter over "shard", all-reduce of the shard over "replicate"). The context ranks of one sequence hold
    different tokens, so their gradients are averaged too: FSDP2 divides by the mesh size, data x fsdp x context,
    the token ranks. Ranks are numbered (pp, data, fsdp, context) innermost last (rackcast.layout; the trainer
    refuses tensor with context), so the replicate dimension is built from a rank tensor, not flattened.
    Collective: every rank builds it."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(layout.world).reshape(layout.pp, layout.data, layout.fsdp, layout.cp)
    ranks = ranks.permute(0, 1, 3, 2).reshape(layout.pp, layout.data * layout.cp, layout.fsdp)
    mesh = DeviceMesh(device.type, ranks, mesh_dim_names=("pp", "replicate", "shard"))
    return mesh["replicate", "shard"]


def init_distributed() -> tuple[int, int, torch.device]:
    """Join the torchrun job (NCCL on CUDA, gloo on CPU); a plain single process needs no process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device
                                if device.type == "cuda" else None)
    return rank, world, device


def close_distributed(finished: bool = True) -> None:
    """Leave the process group. A rank that finished waits at a barrier first: a rank that closed its gloo
    connections while a peer's gloo thread still used them (a broadcast's source returns before its receivers do)
    made that peer abort ("terminate called without an active exception") now and then. A rank leaving on an error
    skips the barrier, which its peers may never reach."""
    if not dist.is_initialized():
        return
    if finished:
        dist.barrier()
    dist.destroy_process_group()


class PhaseTimer:
    """Accumulates seconds per phase name; `sync` makes CUDA timings honest."""

    def __init__(self, cuda: bool = False):
        self.cuda = cuda
        self.totals: dict[str, float] = {}

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def add(self, name: str, seconds: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + seconds

    def pop(self) -> dict[str, float]:
        out, self.totals = self.totals, {}
        return out


def is_expert_param(name: str) -> bool:
    return ".experts." in f".{name}"


def _timed_allreduce_hook(timer: PhaseTimer, group, buckets: dict[int, tuple[int, int]]):
    """DDP comm hook: average the bucket over `group`, blocking, and time it as the data-parallel reduction.
    `buckets` gets (storage address, bytes) of each bucket buffer by bucket index (no reference is kept), so memory
    accounting can count the buffers that only DDP's C++ reducer holds once the gradients are set to None."""

    def hook(state, bucket):
        t0 = timer.now()
        buf = bucket.buffer()
        storage = buf.untyped_storage()
        buckets[bucket.index()] = (storage.data_ptr(), storage.nbytes())
        buf.div_(dist.get_world_size(group))
        dist.all_reduce(buf, group=group)
        timer.add("exposed_dp_comm", timer.now() - t0)
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut

    return hook


def wrap_data_parallel(module: nn.Module, groups: Groups, layout: Layout, timer: PhaseTimer) -> nn.Module:
    """DDP over the dp group (the token ranks) for the dense parameters; expert stacks stay out (see the docstring)."""
    if layout.tokens == 1:
        return module
    from torch.nn.parallel import DistributedDataParallel as DDP

    ignored = [n for n, _ in module.named_parameters() if is_expert_param(n)]
    DDP._set_params_and_buffers_to_ignore_for_model(module, ignored)
    if all(is_expert_param(n) or not p.requires_grad for n, p in module.named_parameters()):
        return module  # nothing dense to reduce on this chunk
    ddp = DDP(module, process_group=groups.dp, gradient_as_bucket_view=True)
    ddp.gradient_buckets = {}
    ddp.register_comm_hook(None, _timed_allreduce_hook(timer, groups.dp, ddp.gradient_buckets))
    return ddp


def _allreduce_flat(grads: list[torch.Tensor], group, divide: int) -> None:
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # tensor-parallel shards: their own part
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group is not None:
        dist.all_reduce(flat, group=group)
    flat.div_(divide)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def expert_tensor_partials(named) -> list[nn.Parameter]:
    """Of these (name, parameter) pairs, the expert parameters every expert-tensor rank holds whole (the
    down-projection bias, backend.expert_tensor): each rank's gradient of them is a partial sum over those ranks."""
    from rackcast.backend.expert_tensor import is_width_replicated

    return [p for n, p in named if is_expert_param(n) and is_width_replicated(n)]


def _sum_grads(params: list[nn.Parameter], group) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        _allreduce_flat(grads, group, 1)


def expert_tensor_presum(modules: list[nn.Module], groups: Groups, layout: Layout):
    """For backend.zero (ZeRO-2, which reduces gradients without reduce_grads): a function that sums, over the
    expert-tensor ranks, the partial gradients of those of the given parameters that need it (expert_tensor_partials)
    before they are reduced; None without expert tensor parallelism."""
    if layout.etp == 1:
        return None
    partial = {id(p) for p in expert_tensor_partials(pair for m in modules for pair in m.named_parameters())}
    return lambda params: _sum_grads([p for p in params if id(p) in partial], groups.etp)


def reduce_grads(modules: list[nn.Module], groups: Groups, layout: Layout, timer: PhaseTimer,
                 dense: bool = False, experts: bool = True) -> None:
    """Expert gradients (unless experts=False: FSDP2 reduces them, all but the expert-tensor partial sums): sum over
    the expert-data replicas, divide by the
    token ranks (dp x cp; times the tp ranks routing the same tokens when the replicas span them,
    Layout.expert_divide); with expert_tensor > 1 the expert parameters each expert-tensor rank holds whole (the
    down-projection bias, backend.expert_tensor) are first summed over the expert-tensor ranks. With dense=True (pipeline stages and tensor-parallel chunks, which are not DDP-wrapped)
    also average the dense gradients over them (the token ranks of this rank's tp_rank). One flat all-reduce per
    kind, timed."""
    if layout.tokens == 1 and layout.expert_divide == 1:  # expert_divide: tp copies of one token rank's tokens
        return
    t0 = timer.now()
    named = [(n, p) for m in modules for n, p in m.named_parameters() if p.grad is not None]
    if layout.etp > 1:  # expert parameters every expert-tensor rank holds whole: partial gradients (also after
        # FSDP2's reduction of FSDP-sharded experts, a sum over the fsdp ranks of one etp rank)
        _sum_grads(expert_tensor_partials(named), groups.etp)
    experts = [p.grad for n, p in named if is_expert_param(n)] if experts else []
    if experts:
        _allreduce_flat(experts, groups.edp, layout.expert_divide)
    if dense and layout.tokens > 1:
        dense_grads = [p.grad for n, p in named if not is_expert_param(n)]
        if dense_grads:
            _allreduce_flat(dense_grads, groups.dp, layout.tokens)
    timer.add("exposed_dp_comm", timer.now() - t0)
