"""Context parallelism written with PyTorch collectives: each of `parallel.context` ranks holds one contiguous chunk of
every sequence (rank c holds positions [c x chunk, (c + 1) x chunk)).

Attention follows Llama 3's context parallelism (Dubey et al. 2024, "The Llama 3 Herd of Models", arXiv:2407.21783
sec. 3.3.2): keys and values are all-gathered along the sequence and each rank's queries attend to them with the causal
mask offset by the chunk's position. The all-gather is a custom autograd function (`gather_sequence`): all-gather
forward, reduce-scatter of the key/value gradient backward. A sliding-window layer needs only its neighbourhood: the
previous rank's last `window - 1` keys and values (`previous_tail`, one point-to-point send/receive each way), unless
the window reaches further back than one chunk, when it gathers all of them as a global layer does. The causal short
convolutions (backend.layers.ShortConv) take the previous rank's last `kernel - 1` inputs the same way (a halo
exchange); rotary and learned positions start at the chunk's offset. Multi-token prediction (backend.mtp) takes the
next rank's first `depth + 1` token ids (`next_head`, the lookahead its embeddings and targets read).

Modules opt in through one attribute, `cp` (None: one whole sequence, no communication), set by `shard_context`.
The exchanges block (no overlap with compute); what they move is priced by rackcast.simulator.costs.context_bytes
(one home for the formula), exposed, by the estimate and the simulator.

    from rackcast.backend.context_parallel import ContextShard, shard_context
    shard_context(model, ContextShard(group, rank=cp_rank, size=cp))
    .venv/bin/pytest -q tests/test_context_parallel.py
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn


@dataclass(frozen=True)
class ContextShard:
    """This rank's place among the context-parallel ranks: `group` (a process group, or None in single-process unit
    tests of one rank's arithmetic), `rank` and `size`; `timer` (a backend.parallel.PhaseTimer or None) times the
    exchanges as exposed context-parallel communication."""

    group: object
    rank: int
    size: int
    timer: object = None

    def start(self, chunk: int) -> int:
        """Position of this rank's first token, for chunks of `chunk` tokens."""
        return self.rank * chunk


def _timed(ctx: ContextShard, fn):
    if ctx.timer is None:
        return fn()
    t0 = ctx.timer.now()
    out = fn()
    ctx.timer.add("exposed_tensor_comm", ctx.timer.now() - t0)
    return out


def _all_gather(x: Tensor, ctx: ContextShard, dim: int) -> Tensor:
    """The chunks of every context rank, concatenated along `dim` in rank order."""
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((ctx.size * moved.shape[0], *moved.shape[1:]))
    _timed(ctx, lambda: dist.all_gather_single(out, moved, group=ctx.group))
    return out.movedim(0, dim)


def _reduce_scatter(grad: Tensor, ctx: ContextShard, dim: int) -> Tensor:
    """Sum of every rank's gradient of the gathered tensor, this rank's chunk of it."""
    moved = grad.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // ctx.size, *moved.shape[1:]))
    _timed(ctx, lambda: dist.reduce_scatter_single(out, moved, group=ctx.group))
    return out.movedim(0, dim)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x: Tensor, ctx: ContextShard, dim: int) -> Tensor:
        fctx.ctx, fctx.dim = ctx, dim
        return _all_gather(x, ctx, dim)

    @staticmethod
    def backward(fctx, grad: Tensor):
        return _reduce_scatter(grad, fctx.ctx, fctx.dim), None, None


def gather_sequence(x: Tensor, ctx: ContextShard, dim: int = 1) -> Tensor:
    """All-gather of x's sequence chunks along `dim` (differentiable: the backward reduce-scatters the gradient)."""
    return _GatherSequence.apply(x, ctx, dim)


def _all_reduced(x: Tensor, group, ctx: ContextShard | None) -> Tensor:
    """A summed copy of x over `group` (timed as context-parallel communication when a ContextShard is given)."""
    out = x.contiguous().clone()
    if ctx is None:
        dist.all_reduce(out, group=group)
    else:
        _timed(ctx, lambda: dist.all_reduce(out, group=group))
    return out


class _SumOverRanks(torch.autograd.Function):
    """Forward: the sum over `group`; backward: the gradient summed over it too (`sum_gradients`) or passed through."""

    @staticmethod
    def forward(fctx, x: Tensor, group, sum_gradients: bool, ctx: ContextShard | None) -> Tensor:
        fctx.group, fctx.sum_gradients, fctx.ctx = group, sum_gradients, ctx
        return _all_reduced(x, group, ctx)

    @staticmethod
    def backward(fctx, grad: Tensor):
        out = _all_reduced(grad, fctx.group, fctx.ctx) if fctx.sum_gradients else grad
        return out, None, None, None


def sum_over_context(x: Tensor, ctx: ContextShard) -> Tensor:
    """The sum of x over the context ranks, on every rank, for a statistic of whole sequences built from per-chunk
    parts (e.g. the auxiliary balancing loss's f and P, backend.frontier_routing.switch_aux_loss). Differentiable:
    every rank's loss reads the same sum and the context ranks average their gradients, so each part's gradient is
    the sum of the ranks' gradients."""
    return _SumOverRanks.apply(x, ctx.group, True, ctx)


def sum_over_sequence_shards(x: Tensor, group) -> Tensor:
    """The sum of x over the sequence-parallel ranks of `group` (backend.tensor_parallel), on every rank; the
    backward passes the gradient through unchanged: there every rank computes the same one loss, each rank's
    gradient reaches its own part of the sequence, and the replicated parameters' partial gradients are then summed
    over the group (tensor_parallel.reduce_partial_grads). Context ranks instead average their gradients, each rank's
    loss being one term: sum_over_context."""
    return _SumOverRanks.apply(x, group, False, None)


def _shift(x: Tensor, ctx: ContextShard, forward: bool) -> Tensor:
    """Send x to the next context rank and receive the previous rank's x (forward=True), or the reverse; a rank with
    no sender on its side gets zeros."""
    src, dst = (ctx.rank - 1, ctx.rank + 1) if forward else (ctx.rank + 1, ctx.rank - 1)
    x = x.contiguous()
    out = torch.zeros_like(x)
    ops = []
    if 0 <= dst < ctx.size:
        ops.append(dist.P2POp(dist.isend, x, dist.get_global_rank(ctx.group, dst), group=ctx.group))
    if 0 <= src < ctx.size:
        ops.append(dist.P2POp(dist.irecv, out, dist.get_global_rank(ctx.group, src), group=ctx.group))
    if ops:
        def run():
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        _timed(ctx, run)
    return out


class _PreviousTail(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x: Tensor, n: int, ctx: ContextShard, dim: int) -> Tensor:
        fctx.ctx, fctx.dim, fctx.n, fctx.shape = ctx, dim, n, x.shape
        return _shift(x.narrow(dim, x.shape[dim] - n, n), ctx, forward=True)

    @staticmethod
    def backward(fctx, grad: Tensor):
        back = _shift(grad, fctx.ctx, forward=False)  # the next rank's gradient of what we sent it
        out = grad.new_zeros(fctx.shape)
        length = fctx.shape[fctx.dim]
        out.narrow(fctx.dim, length - fctx.n, fctx.n).copy_(back)
        return out, None, None, None


def previous_tail(x: Tensor, n: int, ctx: ContextShard, dim: int = 1) -> Tensor:
    """The previous context rank's last `n` positions of x along `dim` (zeros on rank 0): a halo exchange, one
    point-to-point message each way; differentiable (the gradient goes back to the rank that sent them)."""
    if n > x.shape[dim]:
        raise ValueError(f"a halo of {n} positions reaches past the previous chunk of {x.shape[dim]}")
    return _PreviousTail.apply(x, n, ctx, dim)


def next_head(x: Tensor, n: int, ctx: ContextShard, dim: int = 1) -> Tensor:
    """The next context rank's first `n` positions of x along `dim` (zeros on the last rank): one point-to-point
    message each way. Not differentiable: it moves token ids (multi-token prediction's lookahead, backend.mtp)."""
    if n > x.shape[dim]:
        raise ValueError(f"a lookahead of {n} positions reaches past the next chunk of {x.shape[dim]}")
    return _shift(x.narrow(dim, 0, n), ctx, forward=False)


def context_keys(k: Tensor, v: Tensor, window: int, ctx: ContextShard) -> tuple[Tensor, Tensor, int]:
    """Keys [B, S_chunk, H, D] and values [B, S_chunk, H, Dv] this rank's queries may attend to, and the position of
    the first of them: for a window layer whose window - 1 fits in one chunk, the previous rank's last window - 1 (exchanged together)
    before this chunk; otherwise (global layers, long windows) every rank's chunk."""
    chunk = k.shape[1]
    start = ctx.start(chunk)
    if window and window - 1 <= chunk:
        halo = window - 1
        if halo == 0:
            return k, v, start
        kv = previous_tail(torch.cat([k, v], dim=-1), halo, ctx)
        hk, hv = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
        return torch.cat([hk, k], dim=1), torch.cat([hv, v], dim=1), start - halo
    kv = gather_sequence(torch.cat([k, v], dim=-1), ctx)
    gk, gv = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
    return gk, gv, 0


def context_mask(q_start: int, q_len: int, k_start: int, k_len: int, window: int, device) -> Tensor:
    """Boolean [q_len, k_len] mask, True where query position i may see key position j: 0 <= j <= i, and
    i - j < window for a window layer (window 0: global)."""
    i = torch.arange(q_start, q_start + q_len, device=device)[:, None]
    j = torch.arange(k_start, k_start + k_len, device=device)[None, :]
    mask = (j <= i) & (j >= 0)
    return mask & (i - j < window) if window else mask


def shard_context(model: nn.Module, ctx: ContextShard | None) -> None:
    """Give every module that reads along the sequence (attention, short convolutions, learned positions) its
    ContextShard (None: nothing to do)."""
    if ctx is None:
        return
    for module in model.modules():
        if hasattr(module, "cp"):
            module.cp = ctx


def token_scale(targets: Tensor, ctx: ContextShard | None) -> float:
    """Factor that turns this rank's mean loss over its chunk's counted targets (those != -100) into its share of the
    whole sequences' mean, times the context size (gradients are then averaged over the context ranks too):
    counted_here x size / counted_everywhere. `targets` is the whole micro-batch [B, S]."""
    if ctx is None or ctx.size == 1:
        return 1.0
    valid = targets != -100
    chunk = targets.shape[1] // ctx.size
    here = valid[:, ctx.start(chunk): ctx.start(chunk) + chunk].sum().item()
    return here * ctx.size / max(valid.sum().item(), 1)


def sequence_chunk(t: Tensor, ctx: ContextShard | None) -> Tensor:
    """This rank's chunk of t [B, S, ...] along the sequence."""
    if ctx is None or ctx.size == 1:
        return t
    chunk = t.shape[1] // ctx.size
    return t[:, ctx.start(chunk): ctx.start(chunk) + chunk]


def chunk_loss(loss_fn, module: nn.Module, x: Tensor, y: Tensor, ctx: ContextShard | None):
    """loss_fn(logits, tokens, targets) -> (loss, parts) of `module` on micro-batch x with targets y (whole sequences
    [B, S]): under context parallelism on this rank's chunk, scaled by token_scale so that the average over the
    context ranks is the whole sequences' mean."""
    scale = token_scale(y, ctx)
    xc, yc = sequence_chunk(x, ctx), sequence_chunk(y, ctx)
    loss, parts = loss_fn(module(xc), xc, yc)
    if scale != 1.0:
        loss, parts = loss * scale, {k: v * scale for k, v in parts.items()}
    return loss, parts
