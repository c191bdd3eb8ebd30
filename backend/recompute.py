"""Activation recomputation as the plan says (`recompute: none | selective | full`), with torch's checkpoint wrappers.

- full: every transformer block runs under torch.utils.checkpoint (non-reentrant): only its input is kept, and the
  whole block (attention, MoE with its expert all-to-all, shared experts) runs again in backward.
- selective: the attention core (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", https://arxiv.org/abs/2205.05198): each block's attention module runs under selective
  activation checkpointing (torch.utils.checkpoint.create_selective_checkpoint_contexts) whose policy saves the
  Q/K/V/gate/output projections' matrix products and recomputes the rest: the fused scaled-dot-product-attention
  kernel (or the materialised kernel's score and value products and softmax) and the pointwise ops around it.
A recomputed forward must not count twice what a forward records: the MoE router's balancing margins, its routing
counts and the expert-parallel drop counters are put back as they were after each recomputation (`_StatsGuard`).

    apply_recompute(chunks, "full")     # wraps the blocks of every pipeline chunk in place
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten
# Saved under selective recomputation: the attention projections' matrix products. Everything else in the attention
# module (the score/softmax/value core, whether fused SDPA or the math kernel's bmm and softmax, and the cheap
# pointwise work around it: rope, q/k norm, exclusive projection, output gate) runs again in backward. Pointwise ops
# cannot be individually saved anyway: the mask and rope tables are cached on first use, so the first forward runs
# ops its recomputation does not, and per-op caching would pair them wrongly.
SAVED_OPS = {_aten.mm.default, _aten.addmm.default}
MODES = ("none", "selective", "full")


def _attention_core_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _StatsGuard(contextlib.AbstractContextManager):
    """Restores, after a recomputed forward, the statistics the MoE layers of `module` record per forward."""

    FIELDS = ("routing_counts_sum", "last_routing_counts", "dropped", "assigned")

    def __init__(self, module: nn.Module):
        self.moes = [m for m in module.modules() if hasattr(m, "margins")]

    def __enter__(self):
        self.saved = [(len(m.margins), {f: getattr(m, f) for f in self.FIELDS if hasattr(m, f)}) for m in self.moes]
        return self

    def __exit__(self, *exc):
        for moe, (kept, fields) in zip(self.moes, self.saved):
            del moe.margins[kept:]
            for name, value in fields.items():
                setattr(moe, name, value)
        return False


def _full_contexts(module: nn.Module):
    return contextlib.nullcontext(), _StatsGuard(module)


def _selective_contexts():
    return create_selective_checkpoint_contexts(_attention_core_policy)


def apply_recompute(chunks: list[nn.Module], mode: str) -> None:
    """Wrap, in place, the blocks (full) or the blocks' attention modules (selective) of every chunk."""
    if mode not in MODES:
        raise ValueError(f"recompute must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return
    for chunk in chunks:
        for name, block in list(chunk.layers.items()):
            if mode == "full":
                chunk.layers[name] = checkpoint_wrapper(block, context_fn=partial(_full_contexts, block))
            else:
                block.attn = checkpoint_wrapper(block.attn, context_fn=_selective_contexts)
