"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 sec. 2.2) built from ModelSpec.mtp.

Module k (1..depth) predicts token i + k + 1 at position i: it normalises the previous depth's hidden state h^{k-1}
(the main model's last hidden state for k = 1) and the embedding of token i + k, projects their concatenation
(2 d -> d), runs one block shaped like the main model's last layer, normalises and applies the shared output head.
    L_MTP = loss_weight / depth * sum_k CE_k
The loss is attached to the main logits (backend.attached_loss), so the trainer's loss and the pipeline stay as they
are; `last_loss` keeps the detached value for logging. Embedding and head are the main model's (shared).

Under context parallelism (backend.context_parallel) hidden states and tokens are this rank's chunk; position i
reads only its own h^{k-1}, so the one exchange is the next rank's first depth + 1 token ids (`next_head`), whose
embeddings and targets the chunk's last positions need. Every rank runs each module on its whole chunk (the block's
K/V all-gather needs equal chunks); on the last rank the positions past the sequence's end are padding, which the
causal mask keeps from the counted positions and the MoE layers neither route nor count (MoE.valid_positions). Each
rank's loss is its summed cross-entropy over the whole sequences' target count, times the context size (the ranks
average their gradients), so `last_loss` is this rank's share, times the context size.

    .venv/bin/pytest -q tests/test_backend_frontier.py -k mtp
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rackcast.backend.attached_loss import AttachedLoss
from rackcast.backend.context_parallel import next_head
from rackcast.backend.layers import Norm
from rackcast.backend.moe import MoE
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
    cp = None  # backend.context_parallel.ContextShard: hidden and tokens are one chunk of the sequence

    def __init__(self, spec: ModelSpec, make_block: Callable[[], nn.Module]):
        super().__init__()
        assert spec.mtp is not None
        self.loss_weight = spec.mtp.loss_weight
        self.modules_by_depth = nn.ModuleList(MTPModule(spec, make_block) for _ in range(spec.mtp.depth))
        self.last_loss: Tensor | None = None

    def attach(self, logits: Tensor, hidden: Tensor, tokens: Tensor, embed: nn.Embedding, head_weight: Tensor) -> Tensor:
        """Compute the MTP loss from the main hidden states [B, S, d] and tokens [B, S]; return `logits` carrying it.
        Under context parallelism (`cp`) both are this rank's chunk (see the module docstring)."""
        cp = self.cp if self.cp is not None and self.cp.size > 1 else None
        depth, chunk = len(self.modules_by_depth), tokens.shape[1]
        seq, start = (chunk * cp.size, cp.start(chunk)) if cp is not None else (chunk, 0)
        # ahead[:, j] is token start + j, past the chunk from the next rank (zeros past the sequence's end)
        ahead = torch.cat([tokens, next_head(tokens, depth + 1, cp)], dim=1) if cp is not None else tokens
        h, losses = hidden, []
        for k, module in enumerate(self.modules_by_depth, start=1):
            if seq - k < 2:
                break
            rows = chunk if cp is not None else seq - k  # context ranks keep whole chunks (equal K/V gathers)
            inputs = seq - k - start  # rows with an input token i + k; the rest pad the last rank's chunk
            counted = min(rows, inputs - 1)  # rows with a target token i + k + 1
            e = embed(ahead[:, k: k + rows])
            x = module.proj(torch.cat([module.hidden_norm(h[:, :rows]), module.embed_norm(e)], dim=-1))
            for moe in (m for m in module.block.modules() if isinstance(m, MoE)):
                moe.valid_positions = inputs if inputs < rows else None
            x = module.block(x)
            out = F.linear(module.norm(x[:, :counted]), head_weight)  # position i predicts token i + k + 1
            target = ahead[:, k + 1: k + 1 + counted]
            ce = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), target.reshape(-1), reduction="sum")
            # the mean over the whole sequences' targets, times the context ranks that average the gradients
            losses.append(ce * (cp.size if cp is not None else 1) / (tokens.shape[0] * (seq - k - 1)))
            h = x
        if not losses:
            return logits
        loss = self.loss_weight * sum(losses) / len(self.modules_by_depth)
        self.last_loss = loss.detach()
        return AttachedLoss.apply(logits, loss) if self.training else logits
