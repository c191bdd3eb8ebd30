"""The parallel layout of a plan: the degrees of its GPU grid, checked once, and every size derived from them.

One object, in the style of torchtitan's ParallelDims (torchtitan/distributed/parallel_dims.py): `ParallelSpec`
holds the degrees a plan file names (its `parallel:` block) and derives what the simulator, the planner and the
trainer need — GPUs, ranks per pipeline stage, the expert group and its data-parallel copies, the two reduction
levels, model chunks per rank and which rank holds each, micro-batches per step, tokens per micro-batch. Nobody
recomputes one of these from raw degrees; they ask the layout.

Grid convention (Megatron-style "MoE parallel folding"):
    gpus = data x fsdp x context x tensor x pipeline
Ranks are numbered innermost first — tensor, context, fsdp, data, then pipeline outermost — so a small group stays
inside one scale-up domain. `data` replicas hold full copies of their shard; `fsdp` shards parameters, gradients and
optimizer state (ZeRO-3); `zero` (1 or 2) shards optimizer state (and gradients) over the data replicas too
(ZeRO-1/2: the derived `state_shards`, `grad_shards`); `context` splits the sequence; `tensor` splits matrices;
`pipeline` splits the layers into stages of `virtual` model chunks each. Expert layers re-fold the ranks of one
stage: a run of `expert x expert_tensor` consecutive ranks (the expert group) holds one full set of experts —
`expert` ways by expert, `expert_tensor` ways by width — and exchanges tokens by all-to-all; the stage's other ranks
hold copies of the same slices (expert data parallelism), sharded ZeRO-3 style over the FSDP part of those copies.

    from rackcast.plan import load_plan
    par = load_plan("examples/plans/marin-535b-hero.yaml").parallel
    par.gpus, par.stage_ranks, par.expert_group, par.expert_data    # 704, 704, 64, 11

Layers split over the model chunks evenly (layers / chunks each) unless `stage_layers` lists each chunk's count
(index = global chunk, in layer order): an uneven split, as Megatron-LM's --decoder-first-pipeline-num-layers /
--decoder-last-pipeline-num-layers set the first and last stages apart, for models whose layers do not divide the
chunks (DeepSeek-V3's 61 over PP4 x VP4). `uneven_split` builds the splits the planner offers. `chunk_layers` /
`layer_ranks` / `rank_layers` are the one place layers are assigned to chunks and ranks: the stage work, the memory
model, the simulator's workload and the trainer's pipeline (backend.pipeline) all ask them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Callable

from rackcast.bounds import Range
from rackcast.modelspec import ModelSpec
from rackcast.vocab import V_SHAPED_SCHEDULES, VIRTUAL_SCHEDULES


def chunk_ranks(schedule: str, pipeline: int, chunks_per_rank: int) -> list[int]:
    """Pipeline rank holding each global model chunk (index = chunk): loop-style (chunk c on rank c mod p), or
    V-style for the V-shaped schedules. The order torch.distributed.pipelining places stages in."""
    n = pipeline * chunks_per_rank
    if schedule in V_SHAPED_SCHEDULES:
        return [c if c < pipeline else 2 * pipeline - 1 - c for c in range(n)]
    return [c % pipeline for c in range(n)]


def rank_chunks(schedule: str, pipeline: int, chunks_per_rank: int, rank: int) -> list[int]:
    """Model chunks pipeline rank `rank` holds, in the order it first runs them (the inverse of chunk_ranks)."""
    if schedule in V_SHAPED_SCHEDULES:
        return [rank, 2 * pipeline - 1 - rank]
    return [rank + i * pipeline for i in range(chunks_per_rank)]


# The planner's uneven splits (uneven_split): where the layers left over from layers // chunks go.
SPLIT_RULES = ("front", "middle", "back")


def uneven_split(layers: int, chunks: int, rule: str) -> tuple[int, ...]:
    """Layers per chunk when `layers` do not divide `chunks`: every chunk gets layers // chunks and the remainder r
    goes one each to r chunks: the first r ("front": the last chunk, which also runs the head and loss, is lighter),
    the last r ("back": the first chunk, whose rank holds the most in-flight micro-batches, is lighter), or the
    middle r ("middle": both ends lighter, as Megatron-LM's account_for_embedding_in_pipeline_split and
    account_for_loss_in_pipeline_split count the embedding and the loss as a layer each)."""
    base, extra = divmod(layers, chunks)
    if rule == "front":
        heavy = range(extra)
    elif rule == "back":
        heavy = range(chunks - extra, chunks)
    elif rule == "middle":
        start = (chunks - extra) // 2
        heavy = range(start, start + extra)
    else:
        raise ValueError(f"uneven_split: rule {rule!r} is not one of {SPLIT_RULES}")
    return tuple(base + (c in heavy) for c in range(chunks))


@dataclass(frozen=True)
class ParallelSpec:
    """Degrees of the plan's GPU grid (the plan file's `parallel:` block) and the sizes derived from them."""

    data: Annotated[int, Range(1, 2**24)] = 1
    fsdp: Annotated[int, Range(1, 2**24)] = 1
    tensor: Annotated[int, Range(1, 2**24)] = 1
    pipeline: Annotated[int, Range(1, 1024)] = 1
    virtual: Annotated[int, Range(1, 1024)] = 1  # model chunks per pipeline rank (interleaved / V schedules)
    expert: Annotated[int, Range(1, 2**24)] = 1
    expert_tensor: Annotated[int, Range(1, 2**24)] = 1
    context: Annotated[int, Range(1, 2**24)] = 1
    sequence_parallel: bool = False  # with tensor > 1: shard norms and dropout along the sequence
    # Layers of each model chunk (index = global chunk, pipeline x virtual entries, summing to the model's layers);
    # empty: layers / chunks each (see the module docstring).
    stage_layers: tuple[Annotated[int, Range(1, 2**20)], ...] = ()
    # ZeRO stage of the data replicas (Rajbhandari et al., ZeRO, arXiv:1910.02054): 0, each replica keeps its
    # optimizer state, fp32 master and gradients whole (DDP); 1, the replicas shard optimizer state and master
    # (ZeRO-1, P_os; Megatron-LM's distributed optimizer); 2, gradients too (ZeRO-2, P_os+g). Weights sharded as
    # well (ZeRO-3, P_os+g+p) is the `fsdp` axis.
    zero: Annotated[int, Range(0, 2)] = 0

    # ------------------------------------------------------------------------------------------ dense groups
    @property
    def gpus(self) -> int:
        return self.data * self.fsdp * self.context * self.tensor * self.pipeline

    @property
    def stage_ranks(self) -> int:
        """Ranks of one pipeline stage (data x fsdp x context x tensor): what one simulated rank class stands for."""
        return self.data * self.fsdp * self.context * self.tensor

    @property
    def batch_shards(self) -> int:
        """Ranks of one stage that read different sequences (data x fsdp); the global batch splits over them."""
        return self.data * self.fsdp

    @property
    def reduction_inner(self) -> int:
        """Inner level of a reduction over the ranks that see different tokens: the fsdp x context group
        (reduce-scatter, then all-gather)."""
        return self.fsdp * self.context

    @property
    def reduction_outer(self) -> int:
        """Outer level of that reduction: the data replicas (all-reduce of the inner level's shard)."""
        return self.data

    # ------------------------------------------------------------------------------------------------ ZeRO
    # Array-friendly: `x ** (stage >= k)` is x where the ZeRO stage shards over x, else 1.
    @property
    def state_shards(self) -> int:
        """Ways the dense optimizer state and fp32 master are sharded: fsdp, times the replicas data x context from
        ZeRO-1 on (context ranks hold the same weights and average their gradients as the data replicas do;
        backend.zero shards over all of them)."""
        return self.fsdp * (self.data * self.context) ** (self.zero >= 1)

    @property
    def grad_shards(self) -> int:
        """Ways the dense gradients are sharded: fsdp, times the replicas data x context under ZeRO-2."""
        return self.fsdp * (self.data * self.context) ** (self.zero >= 2)

    @property
    def expert_state_shards(self) -> int:
        """Ways the experts' optimizer state and master are sharded: expert_fsdp, times the expert replicas from
        ZeRO-1 on (Megatron-LM shards them over the expert-data-parallel group)."""
        return self.expert_fsdp * self.expert_replicas ** (self.zero >= 1)

    @property
    def expert_grad_shards(self) -> int:
        """Ways the experts' gradients are sharded: expert_fsdp, times the expert replicas under ZeRO-2."""
        return self.expert_fsdp * self.expert_replicas ** (self.zero >= 2)

    # ----------------------------------------------------------------------------------------- expert groups
    @property
    def expert_group(self) -> int:
        """Ranks holding one full set of experts (expert x expert_tensor consecutive ranks); the all-to-all runs
        over them."""
        return self.expert * self.expert_tensor

    def expert_coordinates(self, stage_rank: int) -> tuple[int, int, int]:
        """(expert-data replica, expert rank, expert-tensor rank) of the stage's `stage_rank`-th rank (its index in
        the data x fsdp x context x tensor grid, tensor innermost): expert groups are runs of expert x expert_tensor
        consecutive ranks of the stage, tensor ranks included (Megatron-Core's MoE parallel folding: the expert
        group folds over tensor x context x data; simulator.placement.place's expert group, stride 1), each
        `expert` blocks of expert_tensor consecutive ranks (expert_tensor innermost; the block holds one slice of
        the experts, split by width over its ranks), as simulator.workload.ExpertLoads places them."""
        replica, r = divmod(stage_rank, self.expert_group)
        return replica, r // self.expert_tensor, r % self.expert_tensor

    @property
    def expert_data(self) -> int:
        """Copies of each expert slice within one pipeline stage (expert data parallelism)."""
        return self.stage_ranks // self.expert_group

    @property
    def expert_fsdp(self) -> int:
        """How many of those copies shard the expert parameters ZeRO-3 style: the FSDP part of the expert-data
        group (fsdp x context x tensor ranks over the expert group, when it divides them), else 1; without FSDP
        (fsdp 1) nothing is sharded: context and tensor ranks alone keep whole copies (DDP over them)."""
        inner = self.fsdp * self.context * self.tensor
        split = self.expert_group
        # written to hold elementwise for arrays of degrees
        shards = (self.fsdp > 1) & (inner % split == 0) & (inner >= split)
        return inner // split * shards + (1 - shards)

    @property
    def expert_replicas(self) -> int:
        """Copies of one expert shard whose gradients are all-reduced (expert_data / expert_fsdp)."""
        return self.expert_data // self.expert_fsdp

    # -------------------------------------------------------------------------------------- pipeline chunks
    @property
    def chunks_per_rank(self) -> int:
        """Model chunks each pipeline rank holds (2 for the V-shaped schedules: validate requires virtual = 2)."""
        return self.virtual

    @property
    def chunks(self) -> int:
        """Model chunks in all: pipeline x chunks per rank."""
        return self.pipeline * self.chunks_per_rank

    def chunk_ranks(self, schedule: str) -> list[int]:
        """Pipeline rank holding each model chunk under `schedule` (see chunk_ranks)."""
        return chunk_ranks(schedule, self.pipeline, self.chunks_per_rank)

    def rank_chunks(self, rank: int, schedule: str) -> list[int]:
        """Model chunks pipeline rank `rank` holds under `schedule` (see rank_chunks)."""
        return rank_chunks(schedule, self.pipeline, self.chunks_per_rank, rank)

    def chunk_layers(self, layers: int) -> list[int]:
        """Layers of each model chunk (index = chunk): `stage_layers` when set, else layers / chunks each."""
        return list(self.stage_layers) if self.stage_layers else [layers // self.chunks] * self.chunks

    def chunk_layer_range(self, chunk: int, layers: int) -> range:
        """Layer indices model chunk `chunk` holds (consecutive; chunks in layer order)."""
        counts = self.chunk_layers(layers)
        start = sum(counts[:chunk])
        return range(start, start + counts[chunk])

    def rank_layers(self, rank: int, schedule: str, layers: int) -> list[int]:
        """Layer indices pipeline rank `rank` holds: the layers of its chunks (chunk_layer_range), in the order it
        first runs them."""
        return [i for c in self.rank_chunks(rank, schedule) for i in self.chunk_layer_range(c, layers)]

    def layer_ranks(self, schedule: str, layers: int) -> list[int]:
        """Pipeline rank holding each layer (index = layer): the inverse of rank_layers, for sums over stages."""
        owner = self.chunk_ranks(schedule)
        return [owner[c] for c, n in enumerate(self.chunk_layers(layers)) for _ in range(n)]

    # ----------------------------------------------------------------------------------------------- batch
    def microbatches(self, global_batch: int, micro_batch: int) -> int:
        """Micro-batches per step on one rank: global batch / (data x fsdp x micro-batch)."""
        return global_batch // (self.batch_shards * micro_batch)

    def tokens_per_microbatch(self, micro_batch: int, seq_len: int) -> float:
        """Tokens one rank processes per micro-batch (its share of the sequence under context parallelism)."""
        return micro_batch * seq_len / self.context

    def routed_tokens_per_microbatch(self, micro_batch: int, seq_len: int) -> float:
        """Tokens one rank routes to the experts per micro-batch: its tokens, split again over the tensor ranks by
        sequence parallelism (the norms, router and routed experts run on 1/tensor of the sequence: Megatron-Core,
        which requires it with tensor x expert, and backend.tensor_parallel); without it every tensor rank routes
        them all. Array-friendly."""
        return self.tokens_per_microbatch(micro_batch, seq_len) / self.tensor ** self.sequence_parallel

    # -------------------------------------------------------------------------------------------- validity
    def check(self, spec: ModelSpec, gpus_available: int, schedule: str, fail: Callable[[str, str], None]) -> None:
        """Refuse degrees that do not divide the hardware or the model: `fail(field, message)` for the first
        problem (rackcast.plan.validate raises it as a RackcastError naming the plan file)."""
        for name in ("data", "fsdp", "tensor", "pipeline", "virtual", "expert", "expert_tensor", "context"):
            if getattr(self, name) <= 0:
                fail(f"parallel.{name}", f"must be positive, got {getattr(self, name)}")
        if self.gpus != gpus_available:
            fail("parallel", f"data x fsdp x context x tensor x pipeline = {self.gpus} GPUs, but the topology "
                             f"provides {gpus_available} (topology.domains x usable GPUs per domain)")
        a = spec.attention
        if a.heads % self.tensor:
            fail("parallel.tensor", f"{a.heads} attention heads are not divisible by tensor={self.tensor}")
        for kv in {a.kv_heads_local, a.kv_heads_global}:
            if kv % self.tensor and self.tensor % kv:
                fail("parallel.tensor", f"{kv} KV heads neither divide nor are divisible by tensor={self.tensor}")
        if self.stage_layers:
            if len(self.stage_layers) != self.chunks:
                fail("parallel.stage_layers", f"lists {len(self.stage_layers)} chunks, but pipeline x virtual = "
                                              f"{self.pipeline} x {self.virtual} = {self.chunks}")
            if min(self.stage_layers) < 1:
                fail("parallel.stage_layers", f"every chunk needs at least one layer, got {list(self.stage_layers)}")
            if sum(self.stage_layers) != spec.layers:
                fail("parallel.stage_layers", f"sums to {sum(self.stage_layers)} layers, but model {spec.name} has "
                                              f"{spec.layers}")
        elif spec.layers % (self.pipeline * self.virtual):
            fail("parallel.pipeline", f"{spec.layers} layers are not divisible by pipeline x virtual = "
                                      f"{self.pipeline} x {self.virtual}; list each chunk's layers in "
                                      "parallel.stage_layers for an uneven split")
        if self.virtual > 1 and schedule not in VIRTUAL_SCHEDULES:
            fail("parallel.virtual", f"virtual={self.virtual} needs an interleaved or V schedule, not {schedule}")
        if schedule in V_SHAPED_SCHEDULES and self.virtual != 2:
            fail("parallel.virtual", f"the {schedule} schedule places exactly 2 chunks per rank (virtual: 2)")
        if spec.seq_len % self.context:
            fail("parallel.context", f"seq_len {spec.seq_len} is not divisible by context={self.context}")
        if spec.moe is None:
            if self.expert != 1 or self.expert_tensor != 1:
                fail("parallel.expert", f"model {spec.name} has no experts; expert and expert_tensor must be 1")
        else:
            if spec.moe.experts % self.expert:
                fail("parallel.expert", f"{spec.moe.experts} experts are not divisible by expert={self.expert}")
            if spec.moe.expert_ffn % self.expert_tensor:
                fail("parallel.expert_tensor", f"expert width {spec.moe.expert_ffn} is not divisible by "
                                               f"expert_tensor={self.expert_tensor}")
            if self.stage_ranks % self.expert_group:
                fail("parallel.expert", f"expert x expert_tensor = {self.expert_group} must divide "
                                        f"data x fsdp x context x tensor = {self.stage_ranks}")
        if self.zero > 0 and self.data == 1:
            fail("parallel.zero", f"ZeRO-{self.zero} shards over the data replicas and needs data > 1 (fsdp already "
                                  "shards weights, gradients and optimizer state)")
        if self.sequence_parallel and self.tensor == 1:
            fail("parallel.sequence_parallel", "needs tensor > 1")
