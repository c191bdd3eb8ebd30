"""Event-driven execution of a pipeline schedule (SimPy).

Each pipeline rank is a SimPy process that runs its ordered action list (from :mod:`simulator.schedules`)
one action at a time. An action starts when its rank is free and its inputs exist:

- ``F`` of chunk s, microbatch i needs ``F`` of chunk s-1, microbatch i (none for chunk 0);
- ``B`` / ``BW`` of chunk s needs ``F`` of chunk s and the input gradient (``B`` or ``BW``) of chunk s+1;
- ``W`` needs ``B`` of the same chunk and microbatch.

A dependency produced on another rank arrives ``p2p_latency_s`` after it finishes (0 = free communication);
one produced on the same rank (the turn of a V schedule) is available at once. Durations are per model chunk:
forward, backward-for-inputs and backward-for-weights; a full backward ``BW`` takes the sum of the last two.
Communication is a fixed latency that does not occupy the rank (sends overlap compute, as in torch's runtime).

Results: per-rank timelines, step time, bubble fraction (idle time / (ranks x step time)), and per rank the
peak number of (chunk, microbatch) pairs in flight: forward done, input-gradient backward not yet done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import simpy

from rackcast.simulator.schedules import Action, num_chunks, pipeline_orders, stage_to_rank

__all__ = ["ChunkDurations", "TimelineEntry", "PipelineResult", "run_pipeline", "run_orders", "in_flight_peaks"]


@dataclass(frozen=True)
class ChunkDurations:
    """Compute time of one model chunk for one microbatch, in seconds."""

    forward_s: float
    backward_input_s: float
    backward_weight_s: float

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_input_s", "backward_weight_s"):
            value = getattr(self, name)
            if not value >= 0.0:
                raise ValueError(f"ChunkDurations.{name} must be >= 0 seconds, got {value!r}")

    @property
    def full_backward_s(self) -> float:
        return self.backward_input_s + self.backward_weight_s

    @classmethod
    def uniform(cls, forward_s: float) -> "ChunkDurations":
        """The usual convention: backward = 2 x forward, split evenly into input and weight gradients."""
        return cls(forward_s, forward_s, forward_s)

    def of(self, kind: str) -> float:
        if kind == "F":
            return self.forward_s
        if kind == "B":
            return self.backward_input_s
        if kind == "W":
            return self.backward_weight_s
        if kind == "BW":
            return self.full_backward_s
        raise ValueError(f"unknown action kind {kind!r}")


@dataclass(frozen=True)
class TimelineEntry:
    start_s: float
    end_s: float
    action: Action


@dataclass(frozen=True)
class PipelineResult:
    schedule: str
    stages: int
    microbatches: int
    virtual: int
    timelines: tuple[tuple[TimelineEntry, ...], ...]  # per rank, in execution order
    total_s: float  # step time: last action's end (all ranks start at 0)
    busy_s: tuple[float, ...]  # per rank
    bubble_fraction: float  # sum of idle time / (ranks x total_s)
    peak_in_flight: tuple[int, ...]  # per rank: (chunk, microbatch) pairs with F done, B/BW not done
    peak_held: tuple[int, ...]  # per rank: F done, weight gradient (W or BW) not done

    @property
    def idle_s(self) -> tuple[float, ...]:
        return tuple(self.total_s - b for b in self.busy_s)


DurationsArg = ChunkDurations | Sequence[ChunkDurations]


def run_pipeline(
    schedule_name: str,
    stages: int,
    microbatches: int,
    virtual: int,
    durations: DurationsArg,
    p2p_latency_s: float = 0.0,
    fuse_pairs: bool = False,
) -> PipelineResult:
    """Simulate one step of ``schedule_name`` on ``stages`` ranks with ``virtual`` chunks per rank.

    ``durations`` is one :class:`ChunkDurations` for every chunk, or one per global chunk (index = chunk).
    ``fuse_pairs``: DualPipeV's paired forward + full backward (torch's OVERLAP_F_B) start only when the inputs
    of both halves have arrived, as an overlapped forward-backward kernel needs (DeepSeek's DualPipe). False
    (default) runs the halves one after the other, each as soon as its own input is in, as torch's runtime does.
    Raises ValueError for an invalid schedule combination (see :func:`simulator.schedules.validate`).
    """
    orders = pipeline_orders(schedule_name, stages, microbatches, virtual)
    n = num_chunks(schedule_name, stages, virtual)
    result = run_orders(orders, stage_to_rank(schedule_name, stages, virtual), n, durations, p2p_latency_s, fuse_pairs)
    return PipelineResult(schedule_name, stages, microbatches, virtual, *result)


def run_orders(
    orders: Sequence[Sequence[Action]],
    chunk_rank: Sequence[int],
    n_chunks: int,
    durations: DurationsArg,
    p2p_latency_s: float = 0.0,
    fuse_pairs: bool = False,
) -> tuple:
    """Execute arbitrary per-rank action lists; returns the fields of PipelineResult after ``virtual``."""
    if isinstance(durations, ChunkDurations):
        per_chunk = [durations] * n_chunks
    else:
        per_chunk = list(durations)
        if len(per_chunk) != n_chunks:
            raise ValueError(f"durations: need one ChunkDurations per model chunk ({n_chunks}), got {len(per_chunk)}")
    if not p2p_latency_s >= 0.0:
        raise ValueError(f"p2p_latency_s must be >= 0, got {p2p_latency_s!r}")

    env = simpy.Environment()
    # done[(tag, chunk, microbatch)]: "F" forward done, "G" input gradient done (B or BW), "W" weights done.
    done: dict[tuple[str, int, int], simpy.Event] = {}

    def event(key: tuple[str, int, int]) -> simpy.Event:
        ev = done.get(key)
        if ev is None:
            ev = done[key] = env.event()
        return ev

    timelines: list[list[TimelineEntry]] = [[] for _ in orders]
    last = n_chunks - 1

    def deps(a: Action) -> list[tuple[str, int, int]]:
        if a.kind == "F":
            return [("F", a.stage - 1, a.microbatch)] if a.stage > 0 else []
        if a.kind == "W":
            return [("G", a.stage, a.microbatch)]
        need = [("F", a.stage, a.microbatch)]
        if a.stage < last:
            need.append(("G", a.stage + 1, a.microbatch))
        return need

    def rank_proc(rank: int, ops: Sequence[Action]):
        for i, a in enumerate(ops):
            need = deps(a)
            if fuse_pairs and a.paired and a.kind == "F" and i + 1 < len(ops) and ops[i + 1].paired:
                need = need + deps(ops[i + 1])
            for key in need:
                ev = event(key)
                if not ev.triggered:
                    yield ev
                if chunk_rank[key[1]] != rank and p2p_latency_s > 0.0:
                    ready = ev.value + p2p_latency_s
                    if env.now < ready:
                        yield env.timeout(ready - env.now)
            start = env.now
            yield env.timeout(per_chunk[a.stage].of(a.kind))
            timelines[rank].append(TimelineEntry(start, env.now, a))
            if a.kind in ("F", "B", "BW"):
                event(("F" if a.kind == "F" else "G", a.stage, a.microbatch)).succeed(env.now)

    for rank, ops in enumerate(orders):
        for a in ops:
            if chunk_rank[a.stage] != rank:
                owner = chunk_rank[a.stage]
                raise ValueError(f"action {a} is on rank {rank} but chunk {a.stage} belongs to rank {owner}")
        env.process(rank_proc(rank, ops))
    env.run()

    stuck = [(r, ops[len(timelines[r])]) for r, ops in enumerate(orders) if len(timelines[r]) < len(ops)]
    if stuck:
        where = ", ".join(f"rank {r} at {a}" for r, a in stuck)
        raise RuntimeError(f"pipeline schedule deadlocks: {where}")

    total = max((tl[-1].end_s for tl in timelines if tl), default=0.0)
    busy = tuple(sum(e.end_s - e.start_s for e in tl) for tl in timelines)
    ranks = len(orders)
    bubble = sum(total - b for b in busy) / (ranks * total) if total > 0 else 0.0
    in_flight, held = zip(*(in_flight_peaks(ops) for ops in orders)) if orders else ((), ())
    return tuple(tuple(tl) for tl in timelines), total, busy, bubble, tuple(in_flight), tuple(held)


def in_flight_peaks(ops: Sequence[Action]) -> tuple[int, int]:
    """Peak (F done, input-gradient backward not done) and peak (F done, weight gradient not done) for one rank.

    A rank runs its actions one at a time, so both depend only on the order, not on durations.
    """
    in_flight = held = peak_in_flight = peak_held = 0
    for a in ops:
        if a.kind == "F":
            in_flight += 1
            held += 1
            peak_in_flight = max(peak_in_flight, in_flight)
            peak_held = max(peak_held, held)
        elif a.kind == "B":
            in_flight -= 1
        elif a.kind == "BW":
            in_flight -= 1
            held -= 1
        else:
            held -= 1
    return peak_in_flight, peak_held
