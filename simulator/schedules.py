"""Pipeline-parallel schedules as per-rank ordered action lists.

For each schedule rackcast supports, :func:`pipeline_orders` returns, for every pipeline rank, the ordered
list of compute actions that rank executes in one training step. The orders reproduce what
``torch.distributed.pipelining`` (torch 2.13) executes, so that what the simulator costs is what the backend
trainer runs:

=====================  ==========================================  ===========================  =============
name                   torch class                                 model chunks per rank (v)    stage layout
=====================  ==========================================  ===========================  =============
``gpipe``              ``ScheduleGPipe``                           1                            loop
``1f1b``               ``Schedule1F1B``                            1                            loop
``interleaved_1f1b``   ``ScheduleInterleaved1F1B``                 v >= 1                       loop
``zb_h1``              ``ScheduleInterleavedZeroBubble``           v >= 1 (v=1 is ZB-H1)        loop
``zbv``                ``ScheduleZBVZeroBubble``                   2                            V
``dualpipev``          ``ScheduleDualPipeV``                       2                            V
=====================  ==========================================  ===========================  =============

Stage (model chunk) indices are global: there are ``stages * virtual`` chunks, chunk ``c`` runs on rank
``c % stages`` in the loop layout, and in the V layout rank ``r`` holds chunks ``r`` and ``2*stages-1-r``.

Action kinds: ``F`` forward, ``B`` backward for inputs only (torch ``I``), ``W`` backward for weights
(torch ``W``), ``BW`` full backward, inputs and weights together (torch ``B``). torch's DualPipeV packs a
forward and a full backward into one ``OVERLAP_F_B`` action and runs its two parts one after the other; here
they are two actions, in that order, both marked ``paired=True``.

This module imports neither torch nor simpy.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from rackcast.layout import chunk_ranks
from rackcast.vocab import SCHEDULES as SCHEDULE_NAMES
from rackcast.vocab import INTERLEAVED_SCHEDULES, SINGLE_CHUNK_SCHEDULES, V_SHAPED_SCHEDULES

ACTION_KINDS = ("F", "B", "W", "BW")


@dataclass(frozen=True)
class Action:
    """One compute action: ``kind`` on ``microbatch`` for global model chunk ``stage``."""

    kind: str
    microbatch: int
    stage: int
    # Part of a forward/backward pair that torch issues as one OVERLAP_F_B action (DualPipeV).
    paired: bool = field(default=False, compare=False)

    def __str__(self) -> str:  # torch's spelling: stage, kind, microbatch ("3F0", "7BW2")
        return f"{self.stage}{self.kind}{self.microbatch}"


def num_chunks(name: str, stages: int, virtual: int) -> int:
    """Number of model chunks (global stages) the model is cut into."""
    return stages * virtual


def stage_to_rank(name: str, stages: int, virtual: int) -> list[int]:
    """Rank that holds each global model chunk (index = chunk): rackcast.layout.chunk_ranks."""
    return chunk_ranks(name, stages, virtual)


def validate(name: str, stages: int, microbatches: int, virtual: int) -> None:
    """Raise ValueError, with the reason, when torch would reject (or cannot run) this combination."""
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"unknown pipeline schedule {name!r}; expected one of {', '.join(SCHEDULE_NAMES)}")
    for label, value in (("stages", stages), ("microbatches", microbatches), ("virtual", virtual)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {label} must be a positive integer, got {value!r}")
    if name in SINGLE_CHUNK_SCHEDULES and virtual != 1:
        raise ValueError(f"{name}: runs one model chunk per rank, so virtual must be 1, got {virtual}")
    if name in V_SHAPED_SCHEDULES and virtual != 2:
        raise ValueError(f"{name}: runs exactly 2 model chunks per rank (V shape), so virtual must be 2, got {virtual}")
    if name == "1f1b" and microbatches < stages:
        raise ValueError(f"1f1b: needs microbatches >= stages, got {microbatches} microbatches for {stages} stages")
    if name == "dualpipev" and microbatches < 2 * stages:
        raise ValueError(
            f"dualpipev: needs microbatches >= model chunks (2 x stages = {2 * stages}), got {microbatches}"
        )
    if name in INTERLEAVED_SCHEDULES:
        rounds = max(1, microbatches // stages)
        if microbatches % rounds != 0:
            raise ValueError(
                f"{name}: microbatches ({microbatches}) must be a multiple of the number of rounds "
                f"max(1, microbatches // stages) = {rounds}; e.g. use a multiple of stages ({stages})"
            )


def pipeline_orders(name: str, stages: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """Per-rank ordered action lists for schedule ``name`` (index = pipeline rank)."""
    validate(name, stages, microbatches, virtual)
    return [_BUILDERS[name](rank, stages, microbatches, virtual) for rank in range(stages)]


# --- single-chunk schedules (torch executes these from _step_microbatches, not from an action list) ---


def _gpipe(rank: int, p: int, m: int, v: int) -> list[Action]:
    # ScheduleGPipe: all forwards, then all full backwards, both in microbatch order.
    return [Action("F", i, rank) for i in range(m)] + [Action("BW", i, rank) for i in range(m)]


def _one_f_one_b(rank: int, p: int, m: int, v: int) -> list[Action]:
    # Schedule1F1B._step_microbatches: p - rank warm-up forwards, then backward/forward pairs, then the
    # remaining backwards. (torch 2.13's Schedule1F1B.pipeline_order is off by one on the last rank: it lists
    # F1..Fm instead of F0..F(m-1); what runs is the algorithm below.)
    warmup = min(m, p - rank)
    ops = [Action("F", i, rank) for i in range(warmup)]
    fwd = warmup
    for bwd in range(m):
        ops.append(Action("BW", bwd, rank))
        if fwd < m:
            ops.append(Action("F", fwd, rank))
            fwd += 1
    return ops


# --- interleaved schedules: a port of torch's _get_warmup_ops / _get_1f1b_rank_ops ---


def _interleaved_ops(rank: int, p: int, m: int, v: int, zero_bubble: bool) -> list[Action]:
    rounds = max(1, m // p)
    per_round = m // rounds
    # Narayanan et al. 2021: the last rank warms up (v-1) rounds; each hop towards rank 0 adds 2 forwards.
    # torch's zero-bubble variant adds 1 per hop and fills the gap with W passes (Qi et al. 2023).
    factor = 1 if zero_bubble else 2
    warmup = min((v - 1) * per_round + factor * (p - 1 - rank), m * v)
    total = m * v
    steady = total - warmup

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % v) * p + rank

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * p + rank

    fwd_mb: dict[int, int] = defaultdict(int)
    bwd_mb: dict[int, int] = defaultdict(int)
    w_mb: dict[int, int] = defaultdict(int)
    backward_steps: list[int] = []  # step of each backward so far; W follows them in the same order
    weights_done = 0
    ops: list[Action] = []
    bkind = "B" if zero_bubble else "BW"

    def add(kind: str, stage: int, counter: dict[int, int]) -> None:
        ops.append(Action(kind, counter[stage], stage))
        counter[stage] += 1

    for step in range(warmup + steady + warmup):
        if step < warmup + steady:
            add("F", fwd_stage(step), fwd_mb)
        if step < warmup:
            continue
        add(bkind, bwd_stage(step), bwd_mb)
        backward_steps.append(step)
        # ZB: rank r runs r backwards before it starts interleaving W (torch's num_1f1b_microbatches = rank).
        if zero_bubble and step - warmup >= rank:
            add("W", bwd_stage(backward_steps[weights_done]), w_mb)
            weights_done += 1
    while zero_bubble and weights_done < len(backward_steps):
        add("W", bwd_stage(backward_steps[weights_done]), w_mb)
        weights_done += 1
    return ops


def _interleaved_1f1b(rank: int, p: int, m: int, v: int) -> list[Action]:
    return _interleaved_ops(rank, p, m, v, zero_bubble=False)


def _zb_h1(rank: int, p: int, m: int, v: int) -> list[Action]:
    # Qi et al. 2023 (arXiv 2401.10241) ZB-H1 when v == 1; torch calls the v > 1 form "ZB1P".
    return _interleaved_ops(rank, p, m, v, zero_bubble=True)


# --- V-shaped schedules ---


def _zbv(rank: int, p: int, m: int, v: int) -> list[Action]:
    # ScheduleZBVZeroBubble (Qi et al. 2023, section 6). Plans for max(2p-1, m) microbatches and drops the
    # ones that do not exist, as torch does.
    n_micro = max(2 * p - 1, m)
    c0, c1 = rank, 2 * p - 1 - rank
    cnt = {"f0": 0, "f1": 0, "b0": 0, "b1": 0}
    ops: list[Action] = []

    def add(kind: str, stage: int, key: str) -> None:
        ops.append(Action(kind, cnt[key], stage))

    for _ in range(2 * (p - rank) - 1):
        add("F", c0, "f0"); cnt["f0"] += 1
    for _ in range(rank):
        add("F", c1, "f1"); cnt["f1"] += 1
        add("F", c0, "f0"); cnt["f0"] += 1
    for _ in range(p - rank):
        add("F", c1, "f1"); cnt["f1"] += 1
        add("B", c1, "b1"); add("W", c1, "b1"); cnt["b1"] += 1
    while cnt["f1"] < cnt["f0"] or cnt["f0"] < n_micro:
        if cnt["f0"] < n_micro:
            add("F", c0, "f0"); cnt["f0"] += 1
        add("B", c0, "b0"); add("W", c0, "b0"); cnt["b0"] += 1
        add("F", c1, "f1"); cnt["f1"] += 1
        add("B", c1, "b1"); add("W", c1, "b1"); cnt["b1"] += 1
    w0, w1 = cnt["b0"], cnt["b1"]
    for _ in range(rank):
        add("B", c0, "b0"); cnt["b0"] += 1
        add("B", c1, "b1"); cnt["b1"] += 1
    for _ in range(p - rank):
        add("B", c0, "b0"); cnt["b0"] += 1
        ops.append(Action("W", w0, c0)); w0 += 1
    ops.extend(Action("W", i, c1) for i in range(w1, cnt["b1"]))
    ops.extend(Action("W", i, c0) for i in range(w0, cnt["b0"]))
    return [a for a in ops if a.microbatch < m]


def _dualpipev(rank: int, p: int, m: int, v: int) -> list[Action]:
    # ScheduleDualPipeV, after DeepSeek's DualPipeV (DeepSeek-V3 report arXiv 2412.19437; deepseek-ai/DualPipe).
    c0, c1 = rank, 2 * p - 1 - rank
    fwd: dict[int, int] = defaultdict(int)
    bin_: dict[int, int] = defaultdict(int)  # next microbatch for B / BW of a chunk
    pending_w: list[tuple[int, int]] = []
    ops: list[Action] = []

    def f(stage: int, paired: bool = False) -> None:
        ops.append(Action("F", fwd[stage], stage, paired))
        fwd[stage] += 1

    def b(stage: int, kind: str, paired: bool = False) -> None:
        mb = bin_[stage]
        ops.append(Action(kind, mb, stage, paired))
        bin_[stage] += 1
        if kind == "B":
            pending_w.append((stage, mb))

    def w() -> None:
        if pending_w:
            stage, mb = pending_w.pop(0)
            ops.append(Action("W", mb, stage))

    def overlap(f_stage: int, b_stage: int) -> None:
        f(f_stage, paired=True)
        b(b_stage, "BW", paired=True)

    for _ in range(2 * (p - rank - 1)):
        f(c0)
    for _ in range(rank + 1):
        f(c0)
        f(c1)
    for _ in range(p - rank - 1):
        b(c1, "B")
        w()
        f(c1)
    for i in range(m - 2 * p + rank + 1):
        if i == 0 and rank == p - 1:
            # torch (like DeepSeek's code) does not overlap this first pair on the last rank.
            f(c0)
            b(c1, "BW")
        else:
            overlap(c0, c1)
        overlap(c1, c0)
    for _ in range(p - rank - 1):
        b(c1, "BW")
        overlap(c1, c0)
    zb = False
    half = (rank + 1) // 2
    for i in range(rank + 1):
        if i == half and rank % 2 == 1:
            zb = True
        b(c1, "B" if zb else "BW")
        if i == half and rank % 2 == 0:
            zb = True
        b(c0, "B" if zb else "BW")
    for _ in range(p - rank - 1):
        w()
        b(c0, "B" if zb else "BW")
    for _ in range(rank + 1):
        w()
    return ops


_BUILDERS: dict[str, Callable[[int, int, int, int], list[Action]]] = {
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
    "interleaved_1f1b": _interleaved_1f1b,
    "zb_h1": _zb_h1,
    "zbv": _zbv,
    "dualpipev": _dualpipev,
}

