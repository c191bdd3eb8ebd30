"""Routing rules of today's frontier MoEs, used by backend.moe.MoE when the ModelSpec asks for them:

- node-limited (group-limited) top-k, DeepSeek-V3 (arXiv 2412.19437 sec. 2.1.2): the experts form G equal groups
  (one per node); a group scores the sum of its two highest biased affinities, each token keeps its best
  `node_limit` groups and picks its top-k experts inside them;
- the auxiliary load-balancing loss (Switch Transformer, arXiv 2101.03961 eq. 4): alpha x E x sum_e f_e P_e, f_e the
  fraction of assignments to expert e, P_e the mean router probability of e.
The auxiliary-loss-free bias update (DeepSeek-V3 sec. 2.1.2) lives with the other balancer: backend.balancing.

    .venv/bin/pytest -q tests/test_backend_frontier.py -k routing
"""

from __future__ import annotations

import torch
from torch import Tensor

GROUP_SCORE_TOP = 2  # DeepSeek-V3 scores a group by the sum of its 2 highest affinities


def group_limited(scores: Tensor, groups: int, limit: int) -> Tensor:
    """scores [T, E] with every expert outside a token's best `limit` groups set to -inf."""
    t, e = scores.shape
    grouped = scores.view(t, groups, e // groups)
    group_score = grouped.topk(min(GROUP_SCORE_TOP, e // groups), dim=-1).values.sum(-1)
    keep = torch.zeros(t, groups, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, group_score.topk(limit, dim=-1).indices, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(t, e)


def switch_aux_loss(logits: Tensor, expert_ids: Tensor, weight: float, totals=None) -> Tensor:
    """weight x E x sum_e f_e P_e for router logits [T, E] and chosen experts [T, K] (1 x weight when balanced).
    Where the tokens are one part of each sequence (context or sequence parallelism), `totals` sums a tensor over
    the ranks holding the other parts (backend.context_parallel.sum_over_context, sum_over_sequence_shards): f and P
    are then those of the whole micro-batch (2 E + 2 numbers each way, too few bytes for the simulator to price), so
    every part's loss reads the one-process value."""
    experts = logits.shape[-1]
    probs = torch.softmax(logits.float(), dim=-1).sum(0)
    counts = torch.bincount(expert_ids.reshape(-1), minlength=experts).float()
    sizes = torch.tensor([float(logits.shape[0]), float(expert_ids.numel())], device=logits.device)  # tokens, picks
    if totals is not None:  # one collective for the three
        probs, counts, sizes = totals(torch.cat([probs, counts, sizes])).split([experts, experts, 2])
    return weight * experts * ((counts / sizes[1]) * (probs / sizes[0])).sum()
