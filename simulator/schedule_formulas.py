"""Closed forms for pipeline schedules: bubble per rank and peak microbatches in flight.

Uniform stages, free communication. Times are per model chunk and microbatch: ``forward_s`` (F),
``backward_input_s`` (B, input gradient) and ``backward_weight_s`` (W); a full backward is B + W. With one chunk
per rank the chunk is the whole stage. Each rank computes ``virtual * microbatches * (F + B + W)`` and idles
``bubble_time_s``; the bubble fraction is idle / (compute + idle), i.e. idle over step time, as the executor in
:mod:`simulator.pipeline_exec` measures it.

Sources (p ranks, m microbatches, v chunks per rank):

- GPipe (Huang et al. 2019) and 1F1B (Narayanan et al. 2021, PipeDream-Flush): idle (p-1)(F+B+W),
  fraction (p-1)/(m+p-1).
- Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2): idle (p-1)(F+B+W) in chunk times, which are 1/v of
  a stage, fraction (p-1)/(v*m+p-1).
- ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, section 3.1): idle
  (p-1)(F+B-W), valid when W <= F and W <= B (the paper's setting). The DualPipe README writes the same as
  (PP-1)(F+B_full-2W) with B_full = B+W. torch's ScheduleInterleavedZeroBubble with v > 1 chunks gives the same
  idle in chunk times: found by executing torch's order, not taken from a paper.
- DualPipeV (DeepSeek-V3 report arXiv 2412.19437; deepseek-ai/DualPipe README, PP = 2p stages):
  idle (PP/2-1)(F&B + B_full - 3W), where F&B, a forward and a full backward run as one overlapped unit, is
  taken as F + B_full (no communication is modelled here). That holds when each pair starts only once both
  halves' inputs are in (``fuse_pairs=True``). torch's runtime runs the two halves one after the other, so the
  forward may start early; then the idle is half that for F = B = W: (p-1)F. That figure is from executing
  torch's order, not from the paper.
- ZB-V (torch ScheduleZBVZeroBubble, Qi et al. 2023 section 6): idle (p-1)F for F = B = W and m >= 2p, found
  by executing torch's order; other cases are not covered here (use the executor).

Ranks whose chunks differ in cost (interleaved 1F1B and ZB-H1, ``paced_bubble_time_s``): in both orders every
rank's first p actions are the forwards of its first chunk (warm-up (v-1)*m_round + hops*(p-1-rank) >= p for
v >= 2; Narayanan et al. 2021 section 2.2.2, Megatron-LM's interleaved schedule, torch's
ScheduleInterleavedZeroBubble), so the first round's p micro-batches reach rank h through a tandem line of the first
chunks of ranks 0..h-1 and arrive one per slowest first-chunk forward: rank h idles the hops to it plus
(p-1)(max first-chunk F - its own first-chunk F). Interleaved 1F1B's last p actions on every rank are its first
chunk's full backwards (the cool-down), so the drain mirrors it with B + W. With the rank that sets the steady state
last (the output head on the last chunk) this is the executor's critical path exactly; for uniform chunks the pacing
terms vanish and the forms above remain.

Interleaved 1F1B and ZB-H1 forms need m >= p; DualPipeV's cover F = B = W only (the README's form, fused,
does not match the executed order for other ratios). Outside what is covered the functions raise ValueError.

Peak in flight counts (chunk, microbatch) pairs whose forward is done and whose input-gradient backward is not,
per rank: GPipe m; 1F1B p - rank (Narayanan et al. 2021); interleaved 1F1B warm-up + 1 with warm-up
(v-1)*m_round + 2(p-1-rank) (Megatron-LM's interleaved schedule; m_round = microbatches per round as torch
computes it); ZB-H1 the same with 1 forward per hop instead of 2, so p - rank for v = 1 (Qi et al.: same as
1F1B); ZB-V 2p chunks = p stage-sized microbatches on every rank (Qi et al. section 6); DualPipeV 2p + 1 chunks
on every rank (DualPipe README: PP + 1).
"""

from __future__ import annotations

import numpy as np

from rackcast.simulator.schedules import validate
from rackcast.vocab import INTERLEAVED_SCHEDULES


def _per_round(stages: int, microbatches: int) -> int:
    # torch's interleaved schedules split microbatches into max(1, m // p) rounds.
    return microbatches // max(1, microbatches // stages)


def _check_covered(name: str, stages: int, microbatches: int, virtual: int) -> None:
    validate(name, stages, microbatches, virtual)
    # With fewer microbatches the pipeline never fills and these forms do not hold; use the executor.
    if name in INTERLEAVED_SCHEDULES and microbatches < stages:
        raise ValueError(f"{name}: closed form needs microbatches >= stages, got {microbatches} < {stages}")
    if name == "zbv" and microbatches < 2 * stages:
        raise ValueError(f"zbv: closed form needs microbatches >= 2 x stages, got {microbatches} < {2 * stages}")


def bubble_coefficients(
    name: str, stages: int, microbatches: int, virtual: int = 1, fuse_pairs: bool = False
) -> tuple[int, int, int]:
    """(cF, cB, cW): idle per rank = cF x F + cB x B + cW x W for per-chunk forward, input-gradient and
    weight-gradient times (the forms of the module docstring). Linear in the times, so the estimate can apply them
    to arrays of layouts; the V-shaped schedules' forms are those of F = B = W (see bubble_time_s)."""
    _check_covered(name, stages, microbatches, virtual)
    k = stages - 1
    if name in ("gpipe", "1f1b", "interleaved_1f1b"):
        return k, k, k
    if name == "zb_h1":
        return k, k, -k
    if name == "dualpipev" and fuse_pairs:
        return k, 2 * k, -k  # (F + B + W) + (B + W) - 3W
    if name in ("dualpipev", "zbv"):
        return k, 0, 0
    raise ValueError(f"no closed form for schedule {name!r}")


def pacing_coefficients(name: str, stages: int, microbatches: int, virtual: int = 1) -> tuple[int, int]:
    """(forward, backward) multipliers of the first round's and the cool-down's pacing (module docstring: ranks whose
    chunks differ in cost): p-1 each way for interleaved 1F1B, p-1 forward only for ZB-H1 (its cool-down splits
    the backward and fills the drain with weight gradients); 0 for the other schedules and for one chunk per rank
    (v = 1: the derivation needs v >= 2, and there the first chunk is the whole stage, which the uniform form
    prices)."""
    _check_covered(name, stages, microbatches, virtual)
    k = stages - 1
    if name not in INTERLEAVED_SCHEDULES or virtual < 2:
        return 0, 0
    return (k, k) if name == "interleaved_1f1b" else (k, 0)


def paced_bubble_time_s(coefficients, pacing, chain, own, slowest):
    """Idle per rank of an interleaved schedule from first-chunk times, each a (F, B, W) tuple of seconds (arrays
    broadcast): `chain` the mean over the other ranks' first chunks (the hops of the fill and the drain, weighted by
    bubble_coefficients), `own` the first chunk of the rank that sets the steady state, `slowest` the slowest first
    chunk; `pacing` from pacing_coefficients. Reduces to bubble_time_s when the first chunks are equal."""
    (c_f, c_b, c_w), (p_f, p_b) = coefficients, pacing
    hops = c_f * chain[0] + c_b * chain[1] + c_w * chain[2]
    return hops + p_f * np.maximum(0.0, slowest[0] - own[0]) + \
        p_b * np.maximum(0.0, slowest[1] + slowest[2] - own[1] - own[2])


def bubble_time_s(
    name: str,
    stages: int,
    microbatches: int,
    virtual: int = 1,
    forward_s: float = 1.0,
    backward_input_s: float = 1.0,
    backward_weight_s: float = 1.0,
    fuse_pairs: bool = False,
) -> float:
    """Idle time per rank in one step (seconds, given per-chunk durations in seconds)."""
    f, b, w = forward_s, backward_input_s, backward_weight_s
    c_f, c_b, c_w = bubble_coefficients(name, stages, microbatches, virtual, fuse_pairs)
    if name == "zb_h1" and (w > f or w > b):
        raise ValueError("zb_h1 closed form assumes backward_weight_s <= forward_s and <= backward_input_s")
    if name in ("dualpipev", "zbv") and not (f == b == w):
        raise ValueError(f"{name} closed form covers forward_s == backward_input_s == backward_weight_s only")
    return c_f * f + c_b * b + c_w * w


def bubble_fraction(
    name: str,
    stages: int,
    microbatches: int,
    virtual: int = 1,
    forward_s: float = 1.0,
    backward_input_s: float = 1.0,
    backward_weight_s: float = 1.0,
    fuse_pairs: bool = False,
) -> float:
    """Idle time / step time, the same on every rank under these assumptions."""
    idle = bubble_time_s(
        name, stages, microbatches, virtual, forward_s, backward_input_s, backward_weight_s, fuse_pairs
    )
    compute = virtual * microbatches * (forward_s + backward_input_s + backward_weight_s)
    return idle / (compute + idle)


def peak_in_flight(name: str, stages: int, microbatches: int, virtual: int = 1, rank: int = 0) -> int:
    """Peak (chunk, microbatch) pairs with forward done and input-gradient backward not done on ``rank``."""
    _check_covered(name, stages, microbatches, virtual)
    if not 0 <= rank < stages:
        raise ValueError(f"rank must be in [0, {stages}), got {rank}")
    p, m, v = stages, microbatches, virtual
    if name == "gpipe":
        return m
    if name == "1f1b":
        return min(m, p - rank)
    if name in INTERLEAVED_SCHEDULES:
        per_hop = 2 if name == "interleaved_1f1b" else 1
        warmup = (v - 1) * _per_round(p, m) + per_hop * (p - 1 - rank)
        return min(v * m, warmup + 1)
    if name == "zbv":
        return 2 * p
    if name == "dualpipev":
        return 2 * p + 1
    raise ValueError(f"no closed form for schedule {name!r}")
