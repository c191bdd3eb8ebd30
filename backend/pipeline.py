"""Pipeline parallelism with torch.distributed.pipelining: stage chunks of the model and the plan's schedule class.

The model's layers split into pipeline x virtual chunks as the plan's layout assigns them
(rackcast.layout.ParallelSpec.chunk_layer_range: equal chunks, or the uneven split parallel.stage_layers lists);
chunk 0 also holds the embedding and the last chunk the output head. A chunk keeps the full model's parameter names (`embed.*`, `layers.<i>.*`, `head.*`) so
checkpoints merge back into one model. Chunks go to ranks loop-style (chunk v*P + stage on stage `stage`) for
gpipe / 1f1b / interleaved_1f1b / zb_h1, and V-style (chunks stage and 2P-1-stage) for dualpipev.
Schedules: gpipe -> ScheduleGPipe, 1f1b -> Schedule1F1B, interleaved_1f1b -> ScheduleInterleaved1F1B,
zb_h1 -> ScheduleInterleavedZeroBubble, dualpipev -> ScheduleDualPipeV. Gradients are averaged over micro-batches by
the schedule (scale_grads). Stage forward/backward calls are timed, so the rest of a schedule step is pipeline wait.

With pipeline == 1 the trainer still uses one StageChunk holding the whole model, without a schedule.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from rackcast.backend.parallel import Layout, PhaseTimer
from rackcast.layout import ParallelSpec, rank_chunks
from rackcast.vocab import TORCH_SCHEDULE_CLASSES


class StageChunk(nn.Module):
    """The layers `layers` (a range) of `model`, plus its embedding (first chunk) and head (last chunk)."""

    def __init__(self, model: nn.Module, chunk: int, chunks: int, layers: range):
        super().__init__()
        self.chunk, self.chunks = chunk, chunks
        self.embed = model.embed if chunk == 0 else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        self.head = model.head if chunk == chunks - 1 else None

    def forward(self, x: Tensor) -> Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x) if self.head is not None else x


def chunk_ids(layout: Layout, schedule: str) -> list[int]:
    """The model chunks this process's stage holds (rackcast.layout.rank_chunks)."""
    return rank_chunks(schedule, layout.pp, layout.virtual, layout.stage)


def build_chunks(model: nn.Module, layout: Layout, par: ParallelSpec, schedule: str) -> list[StageChunk]:
    """This process's stage chunks, each with the layers the plan's layout `par` assigns it."""
    return [StageChunk(model, c, par.chunks, par.chunk_layer_range(c, len(model.layers)))
            for c in chunk_ids(layout, schedule)]


def _timed(fn, timer: PhaseTimer, name: str):
    def wrapper(*args, **kwargs):
        t0 = timer.now()
        try:
            return fn(*args, **kwargs)
        finally:
            timer.add(name, timer.now() - t0)

    return wrapper


def _without_statistics(fn, module: nn.Module):
    """Run fn (the stage's metadata-inference forward) without it counting as a training forward: no
    quantile-balancing margins, routing counts or drop counts are kept from it."""
    from rackcast.backend.moe import MoE

    def wrapper(*args, **kwargs):
        moes = [m for m in module.modules() if isinstance(m, MoE)]
        saved = [(m.collect_margins, m.routing_counts_sum, getattr(m, "dropped", 0), getattr(m, "assigned", 0))
                 for m in moes]
        for m in moes:
            m.collect_margins = False
        try:
            return fn(*args, **kwargs)
        finally:
            for m, (collect, counts, dropped, assigned) in zip(moes, saved):
                m.collect_margins, m.routing_counts_sum = collect, counts
                if hasattr(m, "dropped"):
                    m.dropped, m.assigned = dropped, assigned

    return wrapper


class Pipeline:
    """The plan's schedule over this rank's stage chunks (each possibly DDP-wrapped)."""

    def __init__(self, modules: list[nn.Module], chunk_index: list[int], layout: Layout, schedule: str,
                 microbatches: int, loss_fn: Callable[[Tensor, Tensor], Tensor], group, device: torch.device,
                 timer: PhaseTimer):
        from torch.distributed.pipelining import PipelineStage, schedules

        total = layout.pp * layout.virtual
        self.stages = []
        for module, c in zip(modules, chunk_index):
            stage = PipelineStage(module, c, total, device, group=group)
            if hasattr(stage, "_forward_metadata_inference"):  # torch 2.13: a real forward on the first step
                stage._forward_metadata_inference = _without_statistics(stage._forward_metadata_inference, module)
            for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, method, _timed(getattr(stage, method), timer, "pipeline_stage_work"))
            self.stages.append(stage)
        cls = getattr(schedules, TORCH_SCHEDULE_CLASSES[schedule])
        single = issubclass(cls, schedules.PipelineScheduleSingle)
        target = self.stages[0] if single else self.stages
        self.schedule = cls(target, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)
        self.has_first = 0 in chunk_index
        self.has_last = total - 1 in chunk_index

    def step(self, tokens: Tensor, targets: Tensor) -> list[Tensor]:
        """Run one schedule step; returns the per-micro-batch losses on the rank holding the last chunk."""
        losses: list[Tensor] = []
        args = (tokens,) if self.has_first else ()
        kwargs = dict(target=targets, losses=losses) if self.has_last else {}
        self.schedule.step(*args, **kwargs)
        return losses
