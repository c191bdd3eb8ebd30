"""Context-parallel attention and short convolution (backend.context_parallel) against the whole sequence: two gloo
ranks (forked processes, a few seconds) each take half of a sequence; the outputs, the input gradients and the
parameter gradients (summed over the ranks) must equal one module's on the whole sequence. Covered: a sliding-window
layer that fetches only the previous rank's window (tiny-moe layer 0, with the K convolution's halo), the same layer
when the window reaches past one chunk (it gathers everything), a global layer (all-gather of K/V; tiny-moe layer 3,
grouped KV heads, no RoPE), a window layer with sinks and a full layer with RoPE (tiny-gpt-oss), latent attention
(tiny-deepseek-v3: keys and values of other widths, RoPE on the last dims) and ShortConv alone.

    .venv/bin/pytest -q tests/test_context_parallel.py
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dataclasses import replace

from rackcast.backend import context_parallel
from rackcast.backend.context_parallel import ContextShard, context_mask, sequence_chunk, shard_context
from rackcast.backend.layers import ShortConv
from rackcast.backend.model import build_model
from rackcast.backend.parallel import close_distributed
from rackcast.presets import load_model
from rackcast.simulator.costs import W_BYTES, context_bytes, conv_halo_bytes

CP = 2
CASES = {  # name: (preset, layer or None for ShortConv alone, sequence length)
    "window-halo": ("tiny-moe", 0, 64),  # chunk 32 >= window - 1 = 31: only the previous rank's 31 K/V
    "window-gather": ("tiny-moe", 0, 40),  # chunk 20 < 31: the window reaches two chunks back, so gather all
    "global": ("tiny-moe", 3, 64),
    "sinks-window": ("tiny-gpt-oss", 0, 64),
    "rope-full": ("tiny-gpt-oss", 1, 64),
    "latent-global": ("tiny-deepseek-v3", 1, 64),  # latent attention: expanded K (nope | rope) and V gathered
    "conv": ("tiny-moe", None, 64),
}


def _module(preset: str, layer: int | None) -> torch.nn.Module:
    if layer is None:
        conv = ShortConv(24, 4)
        with torch.no_grad():
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=torch.Generator().manual_seed(1)))
        return conv
    return build_model(load_model(preset), seed=0).layers[layer].attn


def _check(rank: int, store: str, case: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=CP)
    try:
        preset, layer, seq = CASES[case]
        full, part = _module(preset, layer), _module(preset, layer)
        width = 24 if layer is None else load_model(preset).d_model
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(2, seq, width, generator=gen)
        upstream = torch.randn(2, seq, width, generator=gen)
        xf = x.clone().requires_grad_()
        yf = full(xf)
        (yf * upstream).sum().backward()
        ctx = ContextShard(dist.group.WORLD, rank, CP)
        shard_context(part, ctx)
        xc = sequence_chunk(x, ctx).clone().requires_grad_()
        received = _count_received()
        yc = part(xc)
        forward_elements = received[0]
        (yc * sequence_chunk(upstream, ctx)).sum().backward()
        if layer is not None:  # the price (simulator.costs.context_bytes) is what the busiest rank received
            most = torch.tensor([forward_elements, received[0] - forward_elements], dtype=torch.float64)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            spec = replace(load_model(preset), seq_len=seq)
            tokens = x.shape[0] * seq / CP  # the attention module alone: without the block's attn/mlp convolutions
            priced = float(context_bytes(tokens, spec, 1, CP, layer) -
                           conv_halo_bytes(tokens, spec, 1, CP, ("attn", "mlp"))) / W_BYTES
            assert most.tolist() == [priced, priced]
        torch.testing.assert_close(yc, sequence_chunk(yf, ctx), atol=1e-5, rtol=0)
        torch.testing.assert_close(xc.grad, sequence_chunk(xf.grad, ctx), atol=1e-5, rtol=0)
        for (name, pf), pc in zip(full.named_parameters(), part.parameters()):
            grad = pc.grad.clone()
            dist.all_reduce(grad)
            # summed in a different order than one process sums them: 1e-5 relative (a gradient of up to ~20)
            torch.testing.assert_close(grad, pf.grad, atol=1e-5, rtol=1e-5, msg=name)
        close_distributed()
    finally:
        close_distributed(finished=False)  # after a failure: leave without waiting for peers


def _count_received() -> list[int]:
    """Count the elements this rank receives through backend.context_parallel's exchanges from now on."""
    count = [0]
    gather, scatter, shift = context_parallel._all_gather, context_parallel._reduce_scatter, context_parallel._shift

    def counted_gather(x, ctx, dim):
        count[0] += x.numel() * (ctx.size - 1)
        return gather(x, ctx, dim)

    def counted_scatter(grad, ctx, dim):
        count[0] += grad.numel() // ctx.size * (ctx.size - 1)
        return scatter(grad, ctx, dim)

    def counted_shift(x, ctx, forward):
        count[0] += x.numel() * (0 < ctx.rank if forward else ctx.rank < ctx.size - 1)
        return shift(x, ctx, forward)

    context_parallel._all_gather, context_parallel._reduce_scatter = counted_gather, counted_scatter
    context_parallel._shift = counted_shift
    return count


def _worker(rank: int, store: str, case: str, errors: str) -> None:
    torch.set_num_threads(1)
    try:
        _check(rank, store, case)
    except BaseException:
        with open(f"{errors}.{rank}", "w") as f:
            f.write(traceback.format_exc())
        raise


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_module_matches_the_whole_sequence(case, tmp_path):
    errors = str(tmp_path / "error")
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_worker, args=(r, str(tmp_path / "store"), case, errors)) for r in range(CP)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    found = [open(f"{errors}.{r}").read() for r in range(CP) if os.path.exists(f"{errors}.{r}")]
    assert not found, found[0]
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def test_context_mask_offsets_the_causal_mask():
    """Chunk 1 of 2 (positions 4..7) over all 8 keys: causal at the offset; with window 3, keys i-2..i."""
    mask = context_mask(4, 4, 0, 8, 0, "cpu")
    assert mask.tolist()[0] == [True] * 5 + [False] * 3
    windowed = context_mask(4, 4, 2, 6, 3, "cpu")  # the previous rank's last 2 keys (positions 2, 3) first
    assert windowed.tolist()[0] == [True, True, True, False, False, False]
    assert windowed.tolist()[3] == [False, False, False, True, True, True]
