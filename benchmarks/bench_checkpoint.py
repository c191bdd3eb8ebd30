"""Benchmark of checkpoint saving with torch.distributed.checkpoint: how long training is blocked by a synchronous
`dcp.save` against `dcp.async_save` (which stages a copy of the state in host memory, then writes it in a
background thread), for the tiny MoE's training state and for a larger model, in one process.

    .venv/bin/python benchmarks/bench_checkpoint.py [--repeats 5] [--large-params 50e6]

Prints, per state size, the median and spread (min-max) over repeats of: the synchronous save, the time the
asynchronous save blocks the caller, and the time until its background write is done. On a GPU the staging copy
is a device-to-host transfer, so the blocked time there is what `--device cuda` measures.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from rackcast.backend.checkpoint import OPTIONS, _quiet, global_view
from rackcast.backend.model import build_model
from rackcast.backend.optim import build_optimizer
from rackcast.backend.pipeline import build_chunks
from rackcast.presets import load_model
from rackcast.units import MIB

TINY_MODEL = "tiny-moe"
LARGE_WIDTH = 2048  # square layers of the larger synthetic model
SEQ = 16


def _trained_state(model: nn.Module, device: str) -> dict:
    """Model and MuonH optimizer state after one step (so the optimizer state exists), as DCP saves it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model.to(device)
    optimizer = build_optimizer(model, "muonh")
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer, options=OPTIONS)
    return {"model": model_state, "optim": optim_state}


def _tiny(device: str) -> dict:
    from types import SimpleNamespace

    spec = load_model(TINY_MODEL)
    model = build_model(spec, seed=0)
    one = SimpleNamespace(pp=1, virtual=1, stage=0)
    return _trained_state(global_view(build_chunks(model, one, "1f1b")), device)


def _large(params: float, device: str) -> dict:
    layers = max(1, int(params / LARGE_WIDTH**2))
    model = nn.Sequential(*[nn.Linear(LARGE_WIDTH, LARGE_WIDTH, bias=False) for _ in range(layers)])
    return _trained_state(model, device)


def _bytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for part in state.values() for v in part.values()
               if isinstance(v, torch.Tensor))


def _measure(state: dict, folder: Path, repeats: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"sync save": [], "async: caller blocked": [], "async: write done": []}
    for i in range(repeats):
        with _quiet():
            target = folder / f"sync-{i}"
            t0 = time.perf_counter()
            dcp.save(state, checkpoint_id=str(target), no_dist=True)
            out["sync save"].append(time.perf_counter() - t0)
            shutil.rmtree(target)
            target = folder / f"async-{i}"
            t0 = time.perf_counter()
            future = dcp.async_save(state, checkpoint_id=str(target), no_dist=True)
            out["async: caller blocked"].append(time.perf_counter() - t0)
            future.result()
            out["async: write done"].append(time.perf_counter() - t0)
            shutil.rmtree(target)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--large-params", type=float, default=50e6, help="parameters of the larger synthetic model")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        for name, build in ((TINY_MODEL, lambda: _tiny(args.device)),
                            (f"{args.large_params:.0e} params", lambda: _large(args.large_params, args.device))):
            state = build()
            print(f"{name}: {_bytes(state) / MIB:,.1f} MiB of model + optimizer state on {args.device}")
            for label, times in _measure(state, Path(tmp), args.repeats).items():
                print(f"  {label:<24} median {statistics.median(times) * 1e3:8.1f} ms   "
                      f"min {min(times) * 1e3:8.1f}   max {max(times) * 1e3:8.1f}   ({len(times)} repeats)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
