"""Attention sinks (GPT-OSS): a learned logit per head that joins every query's softmax as one more "key" with no
value, so a head can put weight on nothing. softmax over [scores, sink], the sink's share dropped:
    y_i = sum_j exp(s_ij) v_j / (sum_j exp(s_ij) + exp(sink_h))
Computed explicitly (scores materialised), which is what the small models the trainer runs need.

    .venv/bin/pytest -q tests/test_backend_frontier.py -k sink
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from rackcast.backend.layers import Normal


class SinkLogits(nn.Module):
    """One sink logit per head, zero-initialised."""

    OPTIM_GROUP = "adam"

    def __init__(self, heads: int):
        super().__init__()
        self.logits = nn.Parameter(torch.empty(heads))

    def init_weights(self, normal: Normal) -> None:
        nn.init.zeros_(self.logits)


def attention_with_sinks(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, mask: Tensor) -> Tensor:
    """q, k, v [B, H, S, D]; sinks [H]; mask [S, S] True where query i may attend key j -> [B, H, S, D]."""
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (weights @ v.float()).to(q.dtype)
