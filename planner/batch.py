"""The default global batch of a layout search: the model preset's published recipe where it has one, else the
batch-size scaling law of DeepSeek LLM (2024) for the run's compute budget.

Rule, per model family (dense-gpt and marin-moe alike):
1. The preset's `recipe.global_batch` (rackcast/model_presets/*.yaml, each with its source): Marin 535B-A23B's
   11,264 x 4,096-token batch, the Megatron-LM GPT table's batches (Narayanan et al. 2021, Table 1).
2. Otherwise the compute-optimal batch in tokens B = 0.2920 x C^0.3271 with C the training compute in FLOPs
   (DeepSeek-AI, "DeepSeek LLM: Scaling Open-Source Language Models with Longtermism", arXiv:2401.02954, section
   3.1, fitted on dense models). C is the model's training FLOPs per token
   (rackcast.modelspec, default convention; active parameters for MoE models) times the token budget. Kaplan et al.
   2020 ("Scaling Laws for Neural Language Models", arXiv:2001.08361) give the same picture as a critical batch that
   grows as the loss falls; the DeepSeek form is used because it needs only the compute budget, which a plan has.
   The batch in sequences is rounded to a multiple of the job's GPUs, with the sequences per GPU rounded (in log
   scale) to the nearest 2^k or 3 x 2^k, so every data x fsdp degree divides it and several micro-batch sizes fit
   (the law is a broad optimum: the DeepSeek paper shows a wide band of near-optimal batches around it).

    from rackcast.planner.batch import default_batch
    choice = default_batch(spec, gpus=704, tokens=18e12); choice.global_batch, choice.rule
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rackcast.modelspec import FlopsConvention, ModelSpec

# DeepSeek LLM (arXiv:2401.02954), eq. 1: B_opt = 0.2920 * C^0.3271 tokens for compute C in FLOPs.
BATCH_LAW_COEFFICIENT = 0.2920
BATCH_LAW_EXPONENT = 0.3271


@dataclass(frozen=True)
class BatchChoice:
    global_batch: int  # sequences per step
    rule: str  # one line: which rule gave it, with its inputs


def law_batch_tokens(compute_flops: float) -> float:
    """The DeepSeek LLM compute-optimal batch in tokens for a training compute budget in FLOPs."""
    return BATCH_LAW_COEFFICIENT * compute_flops ** BATCH_LAW_EXPONENT


def default_batch(spec: ModelSpec, gpus: int, tokens: float) -> BatchChoice:
    """The global batch a search uses when none is given (see the module docstring)."""
    if spec.recipe is not None and spec.recipe.global_batch:
        b = spec.recipe.global_batch
        return BatchChoice(b, f"global batch {b:,} x {spec.seq_len:,} tokens ({_tokens(b * spec.seq_len)} per step): "
                              f"the recipe of {spec.name} ({spec.recipe.source})")
    compute = spec.flops_per_token_train(FlopsConvention()) * tokens
    law_tokens = law_batch_tokens(compute)
    b = nice_count(law_tokens / spec.seq_len / gpus) * gpus
    return BatchChoice(b, f"global batch {b:,} x {spec.seq_len:,} tokens ({_tokens(b * spec.seq_len)} per step): "
                          f"DeepSeek LLM's batch law 0.292 x C^0.3271 = {_tokens(law_tokens)} for C = {compute:.3g} "
                          f"FLOPs, as {b // gpus} sequences on each of the {gpus:,} GPUs")


def nice_count(x: float) -> int:
    """The 2^k or 3 x 2^k nearest to x in log scale (at least 1)."""
    if x <= 1:
        return 1
    candidates = [c for k in range(int(math.log2(x)) + 2) for c in (2 ** k, 3 * 2 ** (k - 1) if k else 1)]
    return min(candidates, key=lambda c: (abs(math.log(c / x)), c))


def _tokens(n: float) -> str:
    return f"{n / 1e6:.1f} M tokens" if n >= 1e6 else f"{n / 1e3:.1f} k tokens"
