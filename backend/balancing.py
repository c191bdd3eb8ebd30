"""Quantile balancing (QB) of MoE router biases, Marin 535B-A23B's balancer
(https://github.com/marin-community/marin/issues/8435; marin experiments/grug/moe_hero_ep/model.py).

Per token t and expert e, with router logit s_te and bias b_e (no gradient):
1. the top K+1 of s_te + b_e: the first K are the chosen experts, the (K+1)-th biased value is the threshold a_t;
2. margins m_te = s_te - a_t (recorded by backend.moe.MoE.route during training forwards);
3. beta_e = the (1 - K/E) quantile over the step's tokens of m_te, i.e. the margin above which exactly K/E of the
   tokens sit, read from a per-expert histogram over the live [min, max] margin range (Marin's HIST estimator,
   `_bincount_upper_quantile`, linear interpolation inside the crossing bin);
4. for the next step b = -beta, mean-centred (Marin's apply_qb_betas; a uniform shift does not change any top-k).
The update replaces the bias (it is not an increment) and is applied after the step's forward passes, so routing
lags the statistics by one step.

Data-parallel ranks route different tokens, so the histogram must pool them: pass `reduce_counts`, a callable that
sums a tensor across the ranks in place (e.g. `torch.distributed.all_reduce`, default op SUM), and `reduce_max`,
which takes the elementwise max in place (`lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX)`), used for the
shared [min, max] grid. Every rank then computes the same beta. Without hooks the statistics are local.

    balancer = QuantileBalancer(model, bins=1000, reduce_counts=dist.all_reduce, reduce_max=...)
    ... forward/backward of every micro-batch, optimizer.step() ...
    balancer.step()       # sets each MoE layer's router bias for the next step; returns beta per layer

DeepSeek-V3's auxiliary-loss-free bias (AuxFreeBiasBalancer) is the other rule that sets the bias: a fixed step
gamma x sign(mean load - load) per step instead of a quantile.

    .venv/bin/pytest -q tests/test_backend_model.py -k balancing
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from rackcast.backend.moe import MoE
from rackcast.vocab import BALANCE_BINS

Reduce = Callable[[Tensor], object]  # reduces its argument in place (a return value, if a tensor, is used instead)

RANGE_EPS = 1e-6  # Marin: hi = max(hi, lo + 1e-6) guards an all-equal range


def _apply(reduce: Reduce | None, t: Tensor) -> Tensor:
    if reduce is None:
        return t
    out = reduce(t)
    return out if isinstance(out, Tensor) else t


def histogram_upper_quantile(
    margins: Tensor,
    top_k: int,
    *,
    bins: int = BALANCE_BINS,
    reduce_counts: Reduce | None = None,
    reduce_max: Reduce | None = None,
) -> Tensor:
    """beta [..., E]: per expert, the value with (tokens x K / E) margins above it, from a histogram of margins
    [..., T, E]. Leading dims (e.g. the MoE layers of a model, stacked) are independent problems, each with its own
    [min, max] grid, computed together: one histogram and one reduction of each kind for all of them."""
    m = margins.float()
    lead, (tokens, num_experts) = m.shape[:-2], m.shape[-2:]
    m = m.reshape(-1, tokens, num_experts)  # [L, T, E]
    n = m.shape[0]
    with torch.no_grad():
        if m.numel():
            extremes = torch.stack([-m.amin((1, 2)), m.amax((1, 2))], 1)
        else:
            extremes = m.new_full((n, 2), -torch.inf)
        extremes = _apply(reduce_max, extremes)
        lo, hi = -extremes[:, 0], extremes[:, 1]
        hi = torch.maximum(hi, lo + RANGE_EPS)
        width = (hi - lo) / bins  # [L]
        idx = ((m - lo[:, None, None]) / width[:, None, None]).long().clamp_(0, bins - 1)
        cell = torch.arange(n * num_experts, device=m.device).view(n, 1, num_experts) * bins  # (layer, expert)
        counts = torch.bincount((cell + idx).reshape(-1), minlength=n * num_experts * bins)
        # The token count rides along with the histogram so one reduction pools both.
        packed = torch.cat([counts, counts.new_tensor([tokens])]).to(torch.int64)
        packed = _apply(reduce_counts, packed)
        if int(packed[-1]) == 0:  # no tokens on any rank: nothing to balance
            return margins.new_zeros(*lead, num_experts, dtype=torch.float32)
        counts = packed[:-1].view(n, num_experts, bins).double()
        target = packed[-1].double() * top_k / num_experts
        from_top = counts.flip(-1).cumsum(-1).flip(-1)  # from_top[l, e, b] = margins of e in bins >= b
        bstar = ((from_top >= target).sum(-1) - 1).clamp(0, bins - 1)
        ct_b = from_top.gather(2, bstar[..., None])[..., 0]
        h_b = counts.gather(2, bstar[..., None])[..., 0]
        lower = lo.double()[:, None] + bstar.double() * width.double()[:, None]
        beta = lower + width.double()[:, None] * (ct_b - target) / h_b.clamp(min=1.0)
    return beta.float().reshape(*lead, num_experts)


class QuantileBalancer:
    """Collects each MoE layer's margins during training forwards and sets router biases once per step."""

    def __init__(
        self,
        model: nn.Module,
        *,
        bins: int = BALANCE_BINS,
        reduce_counts: Reduce | None = None,
        reduce_max: Reduce | None = None,
    ):
        self.bins, self.reduce_counts, self.reduce_max = bins, reduce_counts, reduce_max
        # A learned router bias (GPT-OSS) is trained by gradient, not set here.
        self.layers: list[MoE] = [m for m in model.modules()
                                  if isinstance(m, MoE) and m.router.bias is not None and not m.router.learned_bias]
        for moe in self.layers:
            moe.collect_margins = True
            moe.margins.clear()

    def step(self) -> list[Tensor]:
        """Set b = -beta (mean-centred) on every balanced layer from the margins seen since the last call.

        Every rank must call this (the reductions are collectives), even one whose layers saw no tokens.
        Returns beta per balanced layer, in model order.
        """
        if not self.layers:  # a dense model (or a stage without balanced MoE layers): nothing to set
            return []
        margins = []
        for moe in self.layers:
            if moe.margins:
                margins.append(torch.cat(moe.margins))
            else:
                margins.append(moe.router.bias.new_zeros(0, moe.num_experts, dtype=torch.float32))
            moe.margins.clear()
        # Layers whose margins have one shape (in practice all: every layer sees the step's tokens) are balanced as
        # one stacked problem: one histogram and two reductions per step instead of per layer. The grouping depends
        # only on shapes that every data-parallel rank shares, so every rank makes the same collectives.
        groups: dict[tuple, list[int]] = {}
        for i, (moe, m) in enumerate(zip(self.layers, margins)):
            groups.setdefault((tuple(m.shape), moe.top_k), []).append(i)
        betas: list[Tensor] = [margins[0]] * len(self.layers)
        for (_, top_k), idx in groups.items():
            stacked = histogram_upper_quantile(torch.stack([margins[i] for i in idx]), top_k, bins=self.bins,
                                               reduce_counts=self.reduce_counts, reduce_max=self.reduce_max)
            bias = -stacked
            with torch.no_grad():
                torch._foreach_copy_([self.layers[i].router.bias for i in idx],
                                     list((bias - bias.mean(-1, keepdim=True)).unbind(0)))
            for i, beta in zip(idx, stacked.unbind(0)):
                betas[i] = beta
        return betas

    def detach(self) -> None:
        """Stop collecting margins (e.g. before evaluation-only use of the model)."""
        for moe in self.layers:
            moe.collect_margins = False
            moe.margins.clear()


class AuxFreeBiasBalancer:
    """DeepSeek-V3's auxiliary-loss-free balancing (arXiv 2412.19437 sec. 2.1.2): after each step, b_e += gamma x
    sign(mean load - load_e), from the counts each MoE layer routed since the last step (MoE.step_counts), pooled
    by `reduce_counts` (an in-place sum across ranks, e.g. dist.all_reduce). The bias only chooses experts."""

    def __init__(self, model: nn.Module, rate: float, reduce_counts: Reduce | None = None):
        self.moes = [m for m in model.modules() if isinstance(m, MoE)]
        self.rate = rate
        self.reduce_counts = reduce_counts
        for moe in self.moes:
            moe.count_steps = True

    def step(self) -> None:
        for moe in self.moes:
            counts = moe.step_counts
            if counts is None:
                continue
            counts = counts.float()
            if self.reduce_counts is not None:
                self.reduce_counts(counts)
            with torch.no_grad():
                moe.router.bias.add_(self.rate * torch.sign(counts.mean() - counts))
            moe.step_counts = None


def build_balancer(model: nn.Module, spec, reduce_counts: Reduce | None = None, reduce_max: Reduce | None = None):
    """The balancer the model's spec names (spec.moe.balance_method; a dense model's QuantileBalancer does nothing),
    as the trainer builds it (backend.train) and the op count runs it (backend.opcount)."""
    if spec.moe is not None and spec.moe.balance_method == "aux_free_bias":
        return AuxFreeBiasBalancer(model, spec.moe.bias_update_rate, reduce_counts=reduce_counts)
    return QuantileBalancer(model, bins=spec.moe.balance_bins if spec.moe else BALANCE_BINS,
                            reduce_counts=reduce_counts, reduce_max=reduce_max)
