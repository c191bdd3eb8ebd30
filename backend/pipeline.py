"""Pipeline parallelism with torch.distributed.pipelining: stage chunks of the model and the plan's schedule class.

The model's layers split into pipeline x virtual chunks as the plan's layout assigns them
(rackcast.layout.ParallelSpec.chunk_layer_range: equal chunks, or the uneven split parallel.stage_layers lists);
chunk 0 also holds the embedding and the last chunk the output head and the multi-token prediction modules
(backend.mtp; DeepSeek-V3 and Megatron-LM place them on the last stage). A chunk keeps the full model's parameter
names (`embed.*`, `layers.<i>.*`, `head.*`, `mtp.*`) so checkpoints merge back into one model.
Tied embeddings and MTP on a split model (Megatron-LM's shared word embedding): the last chunk reads the token
embedding (as the tied head's matrix, and for the MTP modules' input), so a rank holding the last chunk but not
chunk 0 keeps its own copy of it, registered as `embed.tok` (the first stage's name: a checkpoint holds one
embedding, the two ranks' identical tensors saved once) and equal to the first stage's at the start (every rank
builds the model from the plan's seed, backend.model). After each step's backward the two copies' gradients are
summed over the embedding group, {rank holding chunk 0, rank holding the last chunk} of each pipeline
(`embedding_group`, `Pipeline.sum_embedding_grads`; Megatron-LM's _allreduce_word_embedding_grads), so both take the
gradient the one-process model's single matrix gets and the same optimizer update. The V-shaped schedules hold
chunk 0 and the last chunk on one rank, which shares the one matrix instead. The last stage's MTP modules read the
micro-batch's tokens, which the schedule passes to this rank's stages as the keyword argument `tokens`. Chunks go to ranks loop-style (chunk v*P + stage on stage `stage`) for
gpipe / 1f1b / interleaved_1f1b / zb_h1, and V-style (chunks stage and 2P-1-stage) for dualpipev.
Schedules: gpipe -> ScheduleGPipe, 1f1b -> Schedule1F1B, interleaved_1f1b -> ScheduleInterleaved1F1B,
zb_h1 -> ScheduleInterleavedZeroBubble, dualpipev -> ScheduleDualPipeV. Gradients are averaged over micro-batches by
the schedule (scale_grads). Stage forward/backward calls are timed, so the rest of a schedule step is pipeline wait.
The stages and the schedule are built on the first step, each stage given its input and output shapes
(`Pipeline._static_shapes`; under sequence parallelism the rank's part of the sequence), so torch runs no
shape-inference forward and backward (whose expert all-to-alls hung against other ranks' metadata messages, and under
tensor parallelism against the tp collectives).

With pipeline == 1 the trainer still uses one StageChunk holding the whole model, without a schedule.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rackcast.backend.attached_loss import AttachedLoss
from rackcast.backend.parallel import Layout, PhaseTimer
from rackcast.layout import ParallelSpec, chunk_ranks, rank_chunks
from rackcast.vocab import TORCH_SCHEDULE_CLASSES


class EmbeddingCopy(nn.Module):
    """The last stage's own token embedding (see the module docstring): `tok` under the name the first stage's
    embedding has, so parameter names (`embed.tok.weight`) are the one-process model's."""

    def __init__(self, tok: nn.Embedding):
        super().__init__()
        self.tok = tok


def last_stage_reads_embedding(model: nn.Module) -> bool:
    """Whether the last chunk reads the token embedding: a tied output head, or multi-token prediction."""
    return model.spec.tied_embeddings or model.mtp is not None


class StageChunk(nn.Module):
    """The layers `layers` (a range) of `model`, plus its embedding (first chunk), head and MTP modules (last chunk);
    `copy_embedding`: the last chunk on a rank without chunk 0 registers its own embedding (EmbeddingCopy)."""

    def __init__(self, model: nn.Module, chunk: int, chunks: int, layers: range, copy_embedding: bool = False):
        super().__init__()
        self.chunk, self.chunks, self.spec = chunk, chunks, model.spec
        self.first, last = chunk == 0, chunk == chunks - 1
        self.embed = model.embed if self.first else EmbeddingCopy(model.embed.tok) if copy_embedding else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        self.head = model.head if last else None
        self.mtp = model.mtp if last else None
        self.last_reads_embedding = last_stage_reads_embedding(model)
        self._tok = [model.embed.tok]  # a list: registered by `embed` above where this chunk owns it

    def forward(self, x: Tensor, tokens: Tensor | None = None) -> Tensor:
        """x: the tokens [B, S] (chunk 0) or the previous chunk's hidden states; tokens: the micro-batch's tokens,
        which the last chunk's MTP modules read (the schedule passes them, backend.pipeline.Pipeline.step)."""
        if self.first:
            tokens, x = x, self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.head is None:
            return x
        logits = self.head(x)
        if self.mtp is not None:
            logits = self.mtp.attach(logits, x, tokens, self._tok[0], self.head.weight)
        return logits


def chunk_ids(layout: Layout, schedule: str) -> list[int]:
    """The model chunks this process's stage holds (rackcast.layout.rank_chunks)."""
    return rank_chunks(schedule, layout.pp, layout.virtual, layout.stage)


def build_chunks(model: nn.Module, layout: Layout, par: ParallelSpec, schedule: str) -> list[StageChunk]:
    """This process's stage chunks, each with the layers the plan's layout `par` assigns it."""
    ids = chunk_ids(layout, schedule)
    copy = 0 not in ids and last_stage_reads_embedding(model)  # on the last chunk, below
    return [StageChunk(model, c, par.chunks, par.chunk_layer_range(c, len(model.layers)),
                       copy_embedding=copy and c == par.chunks - 1) for c in ids]


def embedding_group(groups, layout: Layout, schedule: str, last_reads_embedding: bool):
    """This rank's embedding group: the pair {rank of the stage holding chunk 0, rank of the stage holding the last
    chunk} with this rank's place in the stage, or None (this rank is in no pair, the two chunks share a rank, or the
    last chunk does not read the embedding). Collective: every rank creates every pair's group."""
    holders = chunk_ranks(schedule, layout.pp, layout.virtual)
    first, last = holders[0], holders[-1]
    if first == last or not last_reads_embedding:
        return None
    by_stage = groups.mesh.mesh.reshape(layout.pp, -1)  # the mesh's ranks, pipeline stage first
    mine = None
    for pair in zip(by_stage[first].tolist(), by_stage[last].tolist()):
        group = dist.new_group(list(pair))
        mine = group if layout.rank in pair else mine
    return mine


def _timed(fn, timer: PhaseTimer, name: str):
    def wrapper(*args, **kwargs):
        t0 = timer.now()
        try:
            return fn(*args, **kwargs)
        finally:
            timer.add(name, timer.now() - t0)

    return wrapper


class Pipeline:
    """The plan's schedule over this rank's stage chunks (each possibly FSDP-wrapped), and the sum of the token
    embedding's gradients over the embedding group (`sum_embedding_grads`, after the step's backward)."""

    def __init__(self, modules: list[nn.Module], chunk_index: list[int], layout: Layout, schedule: str,
                 microbatches: int, loss_fn: Callable[[Tensor, Tensor], Tensor], groups, device: torch.device,
                 timer: PhaseTimer):
        total = layout.pp * layout.virtual
        self.modules, self.timer = modules, timer
        self.embedding_group = embedding_group(groups, layout, schedule, modules[0].last_reads_embedding)
        # the schedule back-propagates each micro-batch's loss whole and divides the gradients by the micro-batches
        # afterwards (scale_grads), the attached MTP and auxiliary terms' included: they take the loss's gradient
        AttachedLoss.backward_scale = 1.0
        self.chunk_index, self.total, self.layout = chunk_index, total, layout
        self.schedule_name, self.microbatches, self.loss_fn = schedule, microbatches, loss_fn
        self.group, self.device = groups.pp, device
        self.stages: list = []
        self.schedule = None  # built on the first step, from its micro-batch's shape (_build)
        self.has_first = 0 in chunk_index
        self.has_last = total - 1 in chunk_index
        self.last_reads_tokens = any(getattr(m, "mtp", None) is not None for m in modules)  # MTP on this rank

    def _static_shapes(self, tokens: Tensor, module: nn.Module, chunk: int) -> dict:
        """The stage's example input and output (PipelineStage's input_args / output_args) for one micro-batch of
        `tokens` ([rows, seq], this rank's sequence chunk under context parallelism): int64 tokens [mb, seq] into
        chunk 0, hidden states [mb, seq, d_model] between chunks, logits [mb, seq, vocab] out of the last. Given on
        every stage, torch's pipelining skips its metadata-inference forward and backward on the first step, whose
        expert all-to-alls (and FSDP gathers) interleaved with the stages' metadata messages in a rank-dependent
        order and hung (D2 x E2 x P2 x V2 zb_h1; under tensor parallelism TP2 x EP2 x PP2, where the inference
        forward on torch's uninitialised inputs routed differently on the two tp ranks, whose backwards then entered
        the tp all-gather and the expert all-to-all in different orders). Under tensor parallelism the boundaries are
        plain tensors (the row-parallel outputs are local, backend.tensor_parallel), with sequence parallelism the
        rank's part of the sequence (`sequence_part`)."""
        from rackcast.backend.tensor_parallel import sequence_part

        spec = module.spec
        mb = tokens.chunk(self.microbatches)[0].shape  # torch splits the step's rows the same way (tensor_split)
        hidden = next(p for p in module.parameters() if p.is_floating_point()).dtype
        autocast = torch.is_autocast_enabled(self.device.type)
        logits = torch.get_autocast_dtype(self.device.type) if autocast else hidden
        meta = dict(device="meta")  # requires_grad: torch sends gradients back only for inputs that ask
        seq = mb[1]
        if self.layout.tp > 1 and self.layout.sequence_parallel:
            seq = sequence_part(torch.empty(1, seq, **meta), self.layout.tp_rank, self.layout.tp).shape[1]
        hidden_states = torch.empty(mb[0], seq, spec.d_model, dtype=hidden, requires_grad=True, **meta)
        inputs = torch.empty(*mb, dtype=tokens.dtype, **meta) if chunk == 0 else hidden_states
        last = chunk == self.total - 1
        outputs = torch.empty(*mb, spec.vocab, dtype=logits, requires_grad=True, **meta) if last else hidden_states
        return dict(input_args=inputs, output_args=outputs)

    def _build(self, tokens: Tensor) -> None:
        """This rank's PipelineStages (static shapes, `_static_shapes`) and the plan's schedule over them."""
        from torch.distributed.pipelining import PipelineStage, schedules

        for module, c in zip(self.modules, self.chunk_index):
            stage = PipelineStage(module, c, self.total, self.device, group=self.group,
                                  **self._static_shapes(tokens, module, c))
            for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, method, _timed(getattr(stage, method), self.timer, "pipeline_stage_work"))
            self.stages.append(stage)
        cls = getattr(schedules, TORCH_SCHEDULE_CLASSES[self.schedule_name])
        single = issubclass(cls, schedules.PipelineScheduleSingle)
        target = self.stages[0] if single else self.stages
        self.schedule = cls(target, n_microbatches=self.microbatches, loss_fn=self.loss_fn, scale_grads=True)

    def step(self, tokens: Tensor, targets: Tensor) -> list[Tensor]:
        """Run one schedule step; returns the per-micro-batch losses on the rank holding the last chunk."""
        if self.schedule is None:
            self._build(tokens)
        losses: list[Tensor] = []
        args = (tokens,) if self.has_first else ()
        kwargs = dict(target=targets, losses=losses) if self.has_last else {}
        if self.last_reads_tokens:  # split into micro-batches as the first stage's input is (StageChunk.forward)
            kwargs["tokens"] = tokens
        self.schedule.step(*args, **kwargs)
        return losses

    def sum_embedding_grads(self) -> None:
        """Sum the token embedding's gradient over the embedding group (`embedding_group`): the first stage's and
        the last stage's copy then hold the one-process model's gradient. After the data-parallel average (Megatron-LM's
        order: both copies get the same sum, bit for bit), but before a reduction to one owner per parameter (ZeRO-2),
        whose owner may be another data rank on each stage. A no-op without a group."""
        if self.embedding_group is None:
            return
        t0 = self.timer.now()
        for c in self.modules:  # FSDP2's sharded gradient: the two stages shard the matrix alike, so shards pair up
            grad = c.embed.tok.weight.grad if c.embed is not None else None
            if grad is not None:
                dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=self.embedding_group)
        self.timer.add("exposed_dp_comm", self.timer.now() - t0)
