"""Count the framework ops (aten calls, as torch's dispatcher sees them) the backend runs for one micro-batch of a
model, split by where they run, and for one optimizer step. With the measured host time per op
(EfficiencyProfile.op_overhead_s, from `rackcast calibrate`), planner.overhead turns the counts into the host
overhead of a plan's step: the cost that dominates when kernels are tiny (small models on a CPU).

Counts (one micro-batch of `micro_batch` sequences, forward; backward as one ratio, since autograd runs outside
module hooks): embed (embedding and its norms), per layer (including its routed experts), per layer the routed
experts alone (the GroupedExperts loop, which a rank holding E/ep experts runs for E/ep of them), head (final norm,
head and loss); bwd_over_fwd; optimizer ops for one step with the plan's optimizer and the parameter tensors. Op
counts do not depend on sizes (only on the structure), so a single small sequence is counted.

    .venv/bin/python -m backend.opcount tiny-moe            # prints the counts as JSON
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backend.model import build_model, next_token_loss
from backend.moe import GroupedExperts
from backend.optim import build_optimizer
from rackcast.modelspec import ModelSpec
from rackcast.presets import load_model


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.tags: list[str] = []
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tag = self.tags[-1] if self.tags else "untagged"
        self.counts[tag] = self.counts.get(tag, 0) + 1
        return func(*args, **(kwargs or {}))


def _tag(module, counter: _Counter, name: str) -> None:
    def enter(m, a):
        counter.tags.append(name)

    def leave(m, a, o):  # returning None keeps the module's output
        counter.tags.pop()

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


def count_ops(model, optimizer: str = "muonh", seq: int = 32) -> dict:
    """Counts for a model preset name, YAML path or ModelSpec (see the module docstring)."""
    spec = model if isinstance(model, ModelSpec) else load_model(model)
    torch.manual_seed(0)
    net = build_model(spec, seed=0, device=torch.device("cpu"))
    counter = _Counter()
    _tag(net.embed, counter, "embed")
    for i, layer in enumerate(net.layers):
        _tag(layer, counter, f"layer{i}")
        for sub in layer.modules():
            if isinstance(sub, GroupedExperts):
                _tag(sub, counter, f"experts{i}")
    _tag(net.head, counter, "head")
    tokens = torch.randint(0, spec.vocab, (1, min(seq, spec.seq_len)))
    loss, _ = next_token_loss(net(tokens), tokens)  # warm-up outside the counter (lazy initialisation)
    loss.backward()
    net.zero_grad(set_to_none=True)
    with counter:
        loss, _ = next_token_loss(net(tokens), tokens)
    fwd = dict(counter.counts)
    counter.counts = {}
    with counter:
        loss.backward()
    bwd = sum(counter.counts.values())
    opt = build_optimizer(net, optimizer, lr=1e-3, adam_lr=1e-3 if optimizer == "muonh" else None)
    opt.step()  # state initialisation happens on the first step; count a later one
    counter.counts = {}
    with counter:
        opt.step()
    opt_ops = sum(counter.counts.values())
    layers = [fwd.get(f"layer{i}", 0) + fwd.get(f"experts{i}", 0) for i in range(spec.layers)]
    experts = [fwd.get(f"experts{i}", 0) for i in range(spec.layers)]
    fwd_total = sum(fwd.values())
    return {"model": spec.name, "optimizer": optimizer, "torch": torch.__version__,
            "experts": spec.moe.experts if spec.moe else 0,
            "fwd_embed": fwd.get("embed", 0), "fwd_layers": layers, "fwd_experts": experts,
            "fwd_head": fwd.get("head", 0) + fwd.get("untagged", 0), "fwd_total": fwd_total,
            "bwd_over_fwd": bwd / fwd_total, "optimizer_ops": opt_ops}


def host_seconds_per_op(model: str = "tiny-moe", optimizer: str = "muonh", seq: int = 8, samples: int = 5,
                        device: torch.device | None = None) -> dict:
    """Host seconds per op of the backend's own op mix: one training step (forward, backward, optimizer) of `model`
    on `seq` tokens, where the kernels' work is negligible, timed (median of `samples`) and divided by the ops it
    makes. Views, index ops, autograd nodes and the optimizer's per-tensor loop weigh here as in training."""
    device = device or torch.device("cpu")
    spec = load_model(model)
    net = build_model(spec, seed=0, device=device)
    opt = build_optimizer(net, optimizer, lr=1e-3, adam_lr=1e-3 if optimizer == "muonh" else None)
    tokens = torch.randint(0, spec.vocab, (1, min(seq, spec.seq_len)), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step():
        loss, _ = next_token_loss(net(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    counter = _Counter()
    with counter:
        step()
    ops = sum(counter.counts.values())
    times = []
    for _ in range(samples):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return {"model": spec.name, "tokens": int(tokens.numel()), "ops": ops, "seconds": t, "op_overhead_s": t / ops}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="backend.opcount", description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--optimizer", default="muonh", choices=("muonh", "adamw"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(json.dumps(count_ops(args.model, args.optimizer)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
