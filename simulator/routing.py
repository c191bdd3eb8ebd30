"""Expert routing distributions: how many tokens each expert (and each expert-parallel rank) receives.

A plan's `expert_transport` names the distribution: "uniform" (every expert equally likely), "zipf" (probability
of the i-th most popular expert proportional to 1/(i+1)^s, experts shuffled over ranks by the seed) or "histogram"
(per-expert counts recorded by the trainer, a YAML file `{counts: [[layer0 counts...], ...]}` or a Parquet file with
columns layer, expert, count). Token assignments are drawn multinomially with a seeded generator, so the same seed
gives the same counts. "balanced" draws nothing: every expert receives exactly its share, tokens x top_k / experts
(the force-balanced routing of published throughput benchmarks, Megatron-Core's --moe-router-force-load-balancing;
rackcast.vocab), the remainder going one row each to experts taken in rank-striped order (see `balanced_counts`),
so the most loaded rank is the mean (to one row when ep does not divide the assignments).

Dropless transport: every assignment is computed and the step waits for the most loaded rank. Capacity transport
(factor c): each expert takes at most capacity = floor(c x tokens x top_k / experts) assignments; the rest are
dropped, and every expert's buffer is padded to its capacity, so each rank computes (experts / ep) x capacity rows
and every dispatch and combine moves capacity-sized buffers whatever the routing (the expert-capacity dispatch of
GShard, Lepikhin et al. 2020, arXiv 2006.16668, section 2.2, and the Switch Transformer, Fedus et al. 2021,
arXiv 2101.03961, section 2.2; Megatron-Core's moe_pad_expert_input_to_capacity).

"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import numpy as np

from rackcast.errors import RackcastError
from rackcast.plan import ExpertTransport
from rackcast.strict import load_yaml

LOAD_SAMPLES = 8  # draws averaged by the closed-form estimate


@lru_cache(maxsize=64)
def _histogram_probs(path: str, experts: int) -> tuple[float, ...]:
    p = Path(path)
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(p, columns=["expert", "count"]).to_pydict()
        except Exception as exc:  # pyarrow raises several types for unreadable files
            raise RackcastError(f"cannot read routing histogram: {exc}", where=path) from None
        counts = np.zeros(experts)
        for e, c in zip(table["expert"], table["count"]):
            if not isinstance(e, int) or not 0 <= e < experts:
                raise RackcastError(f"expert index {e} outside 0..{experts - 1}", where=path)
            if not isinstance(c, (int, float)) or not 0 <= c < math.inf:
                raise RackcastError(f"count: {c!r} for expert {e} is not a finite count >= 0", where=path)
            counts[e] += c
    else:
        data = load_yaml(p)
        if not isinstance(data, dict) or "counts" not in data:
            raise RackcastError("counts: required key is missing (a list of per-layer expert counts)", where=path)
        try:
            rows = np.asarray(data["counts"], dtype=float)
        except (TypeError, ValueError):
            raise RackcastError("counts: expected a list of per-layer lists of numbers, one per expert",
                                where=path) from None
        if rows.ndim == 1:
            rows = rows[None, :]
        if rows.ndim != 2 or rows.shape[1] != experts:
            raise RackcastError(f"counts: {rows.shape[-1]} experts per row, the model has {experts}", where=path)
        if not np.all(np.isfinite(rows)) or np.any(rows < 0):
            raise RackcastError("counts: every count must be a finite number >= 0", where=path)
        counts = rows.sum(axis=0)
    if counts.sum() <= 0:
        raise RackcastError("counts: the histogram is empty", where=path)
    return tuple(counts / counts.sum())


def expert_probabilities(transport: ExpertTransport, experts: int, seed: int = 0) -> np.ndarray:
    if transport.routing in ("uniform", "balanced"):  # balanced: the same means, without the draw's spread
        return np.full(experts, 1.0 / experts)
    if transport.routing == "zipf":
        ranks = np.arange(1, experts + 1, dtype=float)
        probs = ranks ** -transport.zipf_s
        probs /= probs.sum()
        return np.random.default_rng(seed).permutation(probs)
    return np.asarray(_histogram_probs(transport.histogram, experts))


def balanced_order(experts: int, ep: int) -> np.ndarray:
    """Experts in rank-striped order (rank 0's first, rank 1's first, ..., rank 0's second, ...), for contiguous
    blocks of experts // ep experts per rank: consecutive assignments land on different ranks."""
    per = experts // ep
    return np.arange(experts).reshape(ep, per).T.reshape(-1)


def balanced_counts(assignments: int, experts: int, ep: int, offset: int = 0) -> np.ndarray:
    """Force-balanced routing: assignment j (counted from `offset`) goes to expert balanced_order[j mod experts],
    so every expert gets floor or ceil of assignments / experts and the remainder is striped over the ranks."""
    counts = np.full(experts, assignments // experts, dtype=np.int64)
    rest = np.arange(offset + assignments - assignments % experts, offset + assignments) % experts
    np.add.at(counts, balanced_order(experts, ep)[rest], 1)
    return counts


def draw_expert_counts(probs: np.ndarray, tokens: int, top_k: int, rng: np.random.Generator) -> np.ndarray:
    """Assignments per expert for `tokens` tokens routed top_k ways (multinomial over all assignments)."""
    return rng.multinomial(int(tokens) * top_k, probs)


def rank_loads(counts: np.ndarray, ep: int, capacity_factor: float | None, tokens: int, top_k: int):
    """Per-rank computed assignments and the dropped count, for experts laid out contiguously over ep ranks."""
    experts = counts.shape[-1]
    if capacity_factor is not None:
        cap = np.floor(capacity_factor * tokens * top_k / experts)
        kept = np.minimum(counts, cap)
    else:
        kept = counts
    dropped = float(counts.sum() - kept.sum())
    return kept.reshape(ep, experts // ep).sum(axis=1), dropped


def capacity_rows(capacity_factor: float, tokens: float, top_k: int, experts: int) -> float:
    """Slots of one expert's padded buffer in capacity mode: floor(c x tokens x top_k / experts)."""
    return float(np.floor(capacity_factor * tokens * top_k / experts))


def expected_max_load_factor(transport: ExpertTransport, experts: int, top_k: int, ep: int, tokens_group: float,
                             seed: int = 0) -> tuple[float, float]:
    """(rows the most loaded rank computes / mean rank load, drop fraction), over LOAD_SAMPLES seeded draws.

    Dropless: the most loaded rank's received rows from the draws (averaged). Capacity: the padded buffers,
    (experts / ep) x capacity rows on every rank, whatever the draw; the drops from the draws.
    `tokens_group` is the number of tokens routed inside one expert-parallel group per micro-batch.
    """
    tokens = max(int(round(tokens_group)), 1)
    cf = transport.capacity_factor if transport.mode == "capacity" else None
    mean_load = tokens * top_k / ep
    if transport.routing == "balanced":  # no draw: every expert its share (balanced_counts)
        loads, dropped = rank_loads(balanced_counts(tokens * top_k, experts, ep), ep, cf, tokens, top_k)
        factor = experts / ep * capacity_rows(cf, tokens, top_k, experts) if cf is not None else loads.max()
        return float(factor / mean_load), float(dropped / (tokens * top_k))
    probs = expert_probabilities(transport, experts, seed)
    rng = np.random.default_rng(seed)
    factors, drops = [], []
    for _ in range(LOAD_SAMPLES):
        loads, dropped = rank_loads(draw_expert_counts(probs, tokens, top_k, rng), ep, cf, tokens, top_k)
        factors.append(loads.max() / mean_load)
        drops.append(dropped / (tokens * top_k))
    if cf is not None:
        return experts / ep * capacity_rows(cf, tokens, top_k, experts) / mean_load, float(np.mean(drops))
    return float(np.mean(factors)), float(np.mean(drops))
