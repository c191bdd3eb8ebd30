"""Compute microbenchmarks for `rackcast calibrate`: GEMM, grouped expert GEMM, attention, memory-bound.

Every benchmark runs in the dtype the trainer computes in (fp32 on CPU, where the trainer uses no autocast; bf16 on
CUDA, under autocast) and reports achieved FLOP/s or bytes/s; turning them into fractions of a peak is the job of
validation.calibration (torch-free). Timing: `Timer` takes the fastest of several samples (rackcast.spread.undisturbed:
interference on a shared machine only adds time), each sample an inner loop
sized to last `target_s` (so per-call dispatch overhead, a real cost of small ops, is part of what is measured);
CUDA timings use CUDA events.

    .venv/bin/python -m rackcast.backend.calibrate --quick     # runs these (and the collectives) and prints JSON
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from rackcast.backend.attention import banded_operands
from rackcast.backend.moe import grouped_matmul
from rackcast.presets import load_model
from rackcast.simulator.attention_cost import executed_flops
from rackcast.simulator.op_counts import TABLE_MODELS
from rackcast.spread import undisturbed
from rackcast.units import MIB


class Timer:
    """Seconds per call of fn() in the fastest of `samples` samples, each an inner loop of calls lasting about
    target_s."""

    def __init__(self, device: torch.device, samples: int = 5, target_s: float = 0.02):
        self.device, self.samples, self.target_s = device, samples, target_s
        self.cuda = device.type == "cuda"

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _run(self, fn, inner: int) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / inner
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - t0) / inner

    def __call__(self, fn, sync_each=None) -> float:
        fn()  # warm-up (allocations, kernel selection)
        self._sync()
        one = max(self._run(fn, 1), 1e-7)
        inner = int(min(1000, max(1, self.target_s / one)))
        out = []
        for _ in range(self.samples):
            if sync_each is not None:
                sync_each()
            self._sync()
            out.append(self._run(fn, inner))
        return undisturbed(out)


def compute_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _shapes(device: torch.device, quick: bool) -> dict:
    """Benchmark shapes: tokens x width families around what training runs (scaled up on a GPU). GEMMs run on the
    grid gemm_m x gemm_nk x gemm_nk (m tokens, n and k widths from skinny to square), grouped GEMMs on grouped_rows
    (mean rows per expert) x grouped_nk x grouped_nk; the grids hold the square-weight shapes (n = k) the FLOPs
    curves are built from."""
    if device.type == "cuda":
        gemm_m, gemm_nk = ((2048, 8192), (8, 1024, 4096)) if quick else ((512, 2048, 8192, 32768),
                                                                          (8, 64, 512, 2048, 8192))
        peak_n = (4096, 8192)
        grouped = ((128, 1024), (8, 1024, 2048)) if quick else ((64, 256, 1024, 4096), (8, 64, 512, 2048, 4096))
        attn = [(1, 16, 2048, 128)] if quick else [(4, 16, 1024, 128), (1, 32, 4096, 128), (1, 16, 8192, 128)]
        surface = ((64,), (2048,), (1024,), (128,)) if quick else ((16, 64), (2048, 8192), (512, 2048), (128,))
        mem = (1 << 24,) if quick else (1 << 20, 1 << 24, 1 << 28)
        stream = 1 << 28
    else:
        # Sized for the tiny presets the CPU runs train (simulator.op_counts.TABLE_MODELS): gemm_nk spans their router,
        # gated-norm, d_model and vocabulary widths (tests/test_calibrate.py checks); narrower ones (the 4-wide
        # convolution kernels, per-head gates) read the surface's edge
        gemm_m, gemm_nk = ((32, 128, 512, 2048), (8, 64, 256)) if quick else ((32, 128, 512, 2048, 8192),
                                                                             (8, 32, 64, 256, 1024))
        peak_n = (512,) if quick else (256, 512, 1024)
        grouped = ((32, 256), (8, 32, 128)) if quick else ((16, 64, 256, 1024), (8, 32, 128, 512))
        attn = [(4, 4, 128, 16)] if quick else [(4, 4, 128, 16), (2, 8, 512, 64), (1, 8, 1024, 64)]
        # The attention surface's rows (batch x heads), queries, banded keys (windows) and head widths, bracketing the
        # tiny presets' calls (tests/test_calibrate.py checks): micro-batches 1 to 8 of 4 heads, the sequence and a
        # context-parallel half of it, the window and half of it; larger shapes read its edge (a wider grid cost
        # calibrate 35 s more than this one)
        surface = ((4, 32), (128,), (32,), (16,)) if quick else ((4, 32), (64, 128), (16, 32), (16,))
        mem = (1 << 18,) if quick else (1 << 16, 1 << 18, 1 << 22)
        stream = 1 << 22 if quick else 1 << 24  # out of cache: the memory figure, not a cache figure
    return {"gemm_m": gemm_m, "gemm_nk": gemm_nk, "peak_n": peak_n, "grouped": grouped, "attn": attn, "mem": mem,
            "stream": stream, "attention_surface": surface}


def attention_surface_shapes(device: torch.device, quick: bool) -> list[tuple[str, int, int, int, int]]:
    """(kind, rows, queries, keys, head_dim) of every call the attention surface measures: causal calls (keys =
    queries) on the grid rows x queries x head_dim, banded on rows x queries x windows x head_dim (windows shorter
    than the queries only: a longer one is a causal call, backend.attention)."""
    rows, queries, windows, dims = _shapes(device, quick)["attention_surface"]
    causal = [("causal", r, q, q, d) for r in rows for q in queries for d in dims]
    banded = [("banded", r, q, w, d) for r in rows for q in queries for w in windows for d in dims]
    return causal + banded if all(w < min(queries) for w in windows) else causal


def surface_experts() -> int:
    """The experts per kernel the grouped-GEMM surface is measured at: the most of any MoE model the simulator
    packages op counts for (simulator.op_counts.TABLE_MODELS, the tiny presets the validation runs train), so a
    one-process run of those models runs its grouped kernel at the measured count (simulator.gemm_surface states
    the approximation elsewhere)."""
    return max(spec.moe.experts for spec in map(load_model, TABLE_MODELS) if spec.moe is not None)


def task_count(device: torch.device, quick: bool) -> int:
    s = _shapes(device, quick)
    peak = len(s["peak_n"]) * (1 if device.type == "cuda" else 2)
    return (len(s["gemm_m"]) * len(s["gemm_nk"]) ** 2 + peak + len(s["grouped"][0]) * len(s["grouped"][1]) ** 2
            + len(s["attn"]) + len(attention_surface_shapes(device, quick)) + len(s["mem"]) + 2)


def run_compute(device: torch.device, quick: bool, tick, barrier=lambda: None) -> dict:
    """All compute measurements as plain data. tick(label) is called after each; barrier() before each, so ranks
    that run this together contend for the machine as training processes do."""
    timer = Timer(device, samples=3 if quick else 5, target_s=0.01 if quick else 0.03)
    # The grids hold ~150 shapes (the other benchmarks ~15): shorter samples keep calibrate's time in bounds, and a
    # 10 ms sample still loops a small GEMM hundreds of times (as --quick times everything).
    grid_timer = Timer(device, samples=timer.samples, target_s=0.01)
    dt = compute_dtype(device)
    s = _shapes(device, quick)
    out = {"dtype": str(dt).replace("torch.", ""), "gemm": [], "peak": [], "grouped_gemm": [], "attention": [],
           "attention_surface": [], "memory": []}
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, dtype=dt, grad=False):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_(grad)

    def operand(pool, *shape):
        """The first elements of `pool` (random numbers drawn once) as a contiguous tensor of `shape`: drawing every
        shape of a grid its own operands would take longer than timing it."""
        return pool[:math.prod(shape)].view(*shape)

    widest = max(s["gemm_nk"])
    pool = rand(max(s["gemm_m"]) * widest + widest * widest)
    for m in s["gemm_m"]:
        for n in s["gemm_nk"]:
            for k in s["gemm_nk"]:
                a, b = operand(pool, m, k), operand(pool[m * k:], k, n)
                barrier()
                t = grid_timer(lambda: torch.matmul(a, b))  # what the trainer's linear layers run
                out["gemm"].append({"m": m, "k": k, "n": n, "flops": 2.0 * m * n * k, "seconds": t})
                tick(f"gemm {m}x{n}x{k}")
    peak_dtypes = [torch.bfloat16] if device.type == "cuda" else [torch.bfloat16, torch.float32]
    for pdt in peak_dtypes:
        for n in s["peak_n"]:
            a, b = rand(n, n, dtype=pdt), rand(n, n, dtype=pdt)
            barrier()
            t = timer(lambda: a @ b)
            out["peak"].append({"dtype": str(pdt).replace("torch.", ""), "n": n, "flops": 2.0 * n ** 3,
                                "seconds": t})
            tick(f"peak {pdt} {n}^3")
    experts = surface_experts()
    rows_list, dims = s["grouped"]
    pool = rand(experts * (max(rows_list) + max(dims)) * max(dims))
    for rows in rows_list:
        # Per-expert token counts as a routing draw gives them (uniform top-k routing: multinomial around `rows`),
        # uneven, so the measurement includes what uneven groups cost the kernel.
        counts = torch.multinomial(torch.ones(experts), experts * rows, replacement=True, generator=g)
        offs = torch.bincount(counts, minlength=experts).cumsum(0).to(device=device, dtype=torch.int32)
        for n in dims:
            for k in dims:
                x, w = operand(pool, experts * rows, k), operand(pool[experts * rows * k:], experts, k, n)
                barrier()
                t = grid_timer(lambda: grouped_matmul(x, w, offs))  # the trainer's GroupedExperts kernel
                out["grouped_gemm"].append({"experts": experts, "rows": rows, "n": n, "k": k,
                                            "flops_per_group": 2.0 * rows * n * k, "seconds": t / experts})
                tick(f"grouped gemm {experts}x{rows}x{n}x{k}")
    for (b, h, seq, d) in s["attn"]:
        q, k, v = (rand(b, h, seq, d, grad=True) for _ in range(3))

        def attn():  # forward and backward, as in training
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y.sum().backward()

        barrier()
        t = timer(attn)
        fwd = 4.0 * b * h * seq * seq * d / 2  # causal: half the score and value products
        out["attention"].append({"batch": b, "heads": h, "seq": seq, "head_dim": d, "train_flops": 3 * fwd,
                                 "seconds": t})
        tick(f"attention {b}x{h}x{seq}x{d}")
    for kind, rows, queries, keys, d in attention_surface_shapes(device, quick):
        barrier()
        t = timer(_attention_call(kind, rows, queries, keys, d, rand))
        out["attention_surface"].append({"kind": kind, "rows": rows, "queries": queries, "keys": keys, "head_dim": d,
                                         "train_flops": 3 * executed_flops(kind, rows, queries, keys, d),
                                         "seconds": t})
        tick(f"attention {kind} {rows}x{queries}x{keys}x{d}")
    for elems in s["mem"]:
        out["memory"].append(_memory(timer, rand, elems, barrier))
        tick(f"memory {elems * torch.tensor([], dtype=dt).element_size() / MIB:.2f} MiB")
    out["memory_stream"] = _memory(timer, rand, s["stream"], barrier, stream_only=True)
    tick("memory bandwidth")
    barrier()
    out["op_overhead"] = _op_overhead(device, quick)
    tick("per-op overhead")
    return out


def _attention_call(kind: str, rows: int, queries: int, keys: int, head_dim: int, rand):
    """Forward and backward of one attention-core kernel call as the trainer makes it
    (backend.attention.Attention._attention): causal SDPA on the [1, rows, queries, head_dim] transposed views of
    [1, queries, rows, head_dim] projections (the batch folds into rows: the kernel sees batch x heads), or the SDPA
    call of banded_attention with a window of `keys` on the operands it builds (banded_operands); the reshaping
    around that call is eager ops, priced with the others (simulator.op_counts, op_bytes)."""
    q, k, v = (rand(1, queries, rows, head_dim, grad=kind == "causal").transpose(1, 2) for _ in range(3))
    mask = None
    if kind == "banded":
        *operands, mask = banded_operands(q, k, v, keys)
        q, k, v = (t.requires_grad_() for t in operands)

    def call():
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=kind == "causal")
        y.sum().backward()

    return call


def _op_overhead(device: torch.device, quick: bool) -> dict:
    """Host seconds per framework op, on the trainer's own op mix: a training step of the smallest backend model on
    a few tokens (kernels negligible) over the ops it makes (backend.opcount.host_seconds_per_op)."""
    from rackcast.backend.opcount import host_seconds_per_op

    return host_seconds_per_op(samples=3 if quick else 7, device=device)


def _memory(timer: Timer, rand, elems: int, barrier, stream_only: bool = False) -> dict:
    """Bytes/s of copy and add (the bandwidth figure) and of the trainer's elementwise mix (RMSNorm, SiLU-gate,
    residual add) on tensors of `elems` elements; bytes counted as the minimum read + written."""
    width = 64
    x, r, y = rand(elems // width, width), rand(elems // width, width), rand(elems // width, width)
    w = rand(width)
    nbytes = x.numel() * x.element_size()
    res = {"elements": elems, "bytes": nbytes}
    barrier()
    res["copy_Bps"] = 2 * nbytes / timer(lambda: y.copy_(x))
    barrier()
    res["add_Bps"] = 3 * nbytes / timer(lambda: torch.add(x, r, out=y))
    if stream_only:
        return res

    def mix():
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w  # RMSNorm: read x, write n
        g = F.silu(n) * r  # gate: read n, r, write g
        return g + x  # residual: read g, x, write

    barrier()
    res["mix_Bps"] = 8 * nbytes / timer(mix)
    return res
