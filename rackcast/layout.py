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
optimizer state (ZeRO-3); `context` splits the sequence; `tensor` splits matrices; `pipeline` splits the layers into
stages of `virtual` model chunks each. Expert layers re-fold the ranks of one stage: a run of `expert x
expert_tensor` consecutive ranks (the expert group) holds one full set of experts — `expert` ways by expert,
`expert_tensor` ways by width — and exchanges tokens by all-to-all; the stage's other ranks hold copies of the same
slices (expert data parallelism), sharded ZeRO-3 style over the FSDP part of those copies.

    from rackcast.plan import load_plan
    par = load_plan("examples/plans/marin-535b-hero.yaml").parallel
    par.gpus, par.stage_ranks, par.expert_group, par.expert_data    # 704, 704, 64, 11
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

    # ----------------------------------------------------------------------------------------- expert groups
    @property
    def expert_group(self) -> int:
        """Ranks holding one full set of experts (expert x expert_tensor consecutive ranks); the all-to-all runs
        over them."""
        return self.expert * self.expert_tensor

    @property
    def expert_data(self) -> int:
        """Copies of each expert slice within one pipeline stage (expert data parallelism)."""
        return self.stage_ranks // self.expert_group

    @property
    def expert_fsdp(self) -> int:
        """How many of those copies shard the expert parameters ZeRO-3 style: the FSDP part of the expert-data
        group (fsdp x context x tensor ranks over the expert group, when it divides them), else 1."""
        inner = self.fsdp * self.context * self.tensor
        split = self.expert_group
        shards = (inner % split == 0) & (inner >= split)  # written to hold elementwise for arrays of degrees
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

    def rank_layers(self, rank: int, schedule: str, layers: int) -> list[int]:
        """Layer indices pipeline rank `rank` holds: chunk c holds layers [c x L/chunks, (c + 1) x L/chunks)."""
        per_chunk = layers // self.chunks
        return [c * per_chunk + j for c in self.rank_chunks(rank, schedule) for j in range(per_chunk)]

    def layer_ranks(self, schedule: str, layers: int) -> list[int]:
        """Pipeline rank holding each layer (index = layer): the inverse of rank_layers, for sums over stages."""
        per_chunk = layers // self.chunks
        owner = self.chunk_ranks(schedule)
        return [owner[i // per_chunk] for i in range(layers)]

    # ----------------------------------------------------------------------------------------------- batch
    def microbatches(self, global_batch: int, micro_batch: int) -> int:
        """Micro-batches per step on one rank: global batch / (data x fsdp x micro-batch)."""
        return global_batch // (self.batch_shards * micro_batch)

    def tokens_per_microbatch(self, micro_batch: int, seq_len: int) -> float:
        """Tokens one rank processes per micro-batch (its share of the sequence under context parallelism)."""
        return micro_batch * seq_len / self.context

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
        if spec.layers % (self.pipeline * self.virtual):
            fail("parallel.pipeline", f"{spec.layers} layers are not divisible by pipeline x virtual = "
                                      f"{self.pipeline} x {self.virtual}")
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
        if self.sequence_parallel and self.tensor == 1:
            fail("parallel.sequence_parallel", "needs tensor > 1")
