"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 sec. 2.2) built from ModelSpec.mtp.

Module k (1..depth) predicts token i + k + 1 at position i: it normalises the previous depth's hidden state h^{k-1}
(the main model's last hidden state for k = 1) and the embedding of token i + k, projects their concatenation
(2 d -> d), runs one block shaped like the main model's last layer, normalises and applies the shared output head.
    L_MTP = loss_weight / depth * sum_k CE_k
The loss is attached to the main logits (backend.attached_loss), so the trainer's loss and the pipeline stay as they
are; `last_loss` keeps the detached value for logging. Embedding and head are the main model's (shared).

    .venv/bin/pytest -q tests/test_backend_frontier.py -k mtp
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rackcast.backend.attached_loss import AttachedLoss
from rackcast.backend.layers import Norm
from rackcast.modelspec import ModelSpec


class MTPModule(nn.Module):
    def __init__(self, spec: ModelSpec, make_block: Callable[[], nn.Module]):
        super().__init__()
        d = spec.d_model
        self.hidden_norm = Norm(d, spec.norm, 0)
        self.embed_norm = Norm(d, spec.norm, 0)
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.block = make_block()
        self.norm = Norm(d, spec.norm, 0)


class MultiTokenPrediction(nn.Module):
    def __init__(self, spec: ModelSpec, make_block: Callable[[], nn.Module]):
        super().__init__()
        assert spec.mtp is not None
        self.loss_weight = spec.mtp.loss_weight
        self.modules_by_depth = nn.ModuleList(MTPModule(spec, make_block) for _ in range(spec.mtp.depth))
        self.last_loss: Tensor | None = None

    def attach(self, logits: Tensor, hidden: Tensor, tokens: Tensor, embed: nn.Embedding, head_weight: Tensor) -> Tensor:
        """Compute the MTP loss from the main hidden states [B, S, d] and tokens [B, S]; return `logits` carrying it."""
        seq = tokens.shape[1]
        h, losses = hidden, []
        for k, module in enumerate(self.modules_by_depth, start=1):
            if seq - k < 2:
                break
            e = embed(tokens[:, k:])
            x = module.proj(torch.cat([module.hidden_norm(h[:, : seq - k]), module.embed_norm(e)], dim=-1))
            x = module.block(x)
            out = F.linear(module.norm(x), head_weight)[:, :-1]  # position i predicts token i + k + 1
            target = tokens[:, k + 1:]
            losses.append(F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), target.reshape(-1)))
            h = x
        if not losses:
            return logits
        loss = self.loss_weight * sum(losses) / len(self.modules_by_depth)
        self.last_loss = loss.detach()
        return AttachedLoss.apply(logits, loss) if self.training else logits

