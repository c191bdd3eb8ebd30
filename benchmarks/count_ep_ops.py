"""The framework ops and host time the expert-parallel dispatch path adds to one MoE layer's micro-batch, against the
one-process path, counted on the real code in one process.

    .venv/bin/python benchmarks/count_ep_ops.py [--plan examples/plans/tiny-2proc-ep.yaml] [--sequences 2]

One MoE layer of the plan's model (backend.moe.MoE) runs dispatch_compute_combine forward and backward on a balanced
routing (backend.moe.balanced_assignment) of --sequences sequences, as is (MoE) and as rank 0 of an expert group of
plan.parallel.expert (backend.expert_parallel.shard_experts), every all_to_all_single standing in for a symmetric peer
(it receives what it sends, a copy outside the count: backend.opcount.loopback_all_to_all) so the ep > 1 path runs
without communication. Printed: the aten ops each makes, forward and backward (backend.opcount.dispatch_ops, as the
op-count table's ep_fwd / ep_bwd count them: backend.opcount.count_ep_dispatch), and the
mean wall time of the fastest fifth of --samples forward and backward calls (rackcast.spread.fastest_mean), with the
load average: the EP path's extra ops times the calibrated host time per op (rackcast calibrate's host_op_s) is what
the simulator's host overhead adds per MoE layer and micro-batch for them (simulator.host_overhead.ep_dispatch_ops).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

from rackcast.backend import expert_parallel, opcount
from rackcast.backend.moe import MoE, balanced_assignment
from rackcast.plan import load_plan
from rackcast.spread import fastest_mean

ROOT = Path(__file__).resolve().parents[1]


def _measure(moe: MoE, width: int, ids, weights, samples: int) -> dict:
    forward_ops, backward_ops = opcount.dispatch_ops(moe, ids, weights)
    tokens = ids.shape[0]
    fwd, bwd = [], []
    for _ in range(samples):
        x = torch.randn(tokens, width, requires_grad=True)
        t0 = time.perf_counter()
        y = moe.dispatch_compute_combine(x, ids, weights)
        t1 = time.perf_counter()
        y.sum().backward()
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
    return {"ops_forward": forward_ops, "ops_backward": backward_ops,
            "forward_us": 1e6 * fastest_mean(fwd), "backward_us": 1e6 * fastest_mean(bwd)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", default=str(ROOT / "examples" / "plans" / "tiny-2proc-ep.yaml"))
    ap.add_argument("--sequences", type=int, default=2)
    ap.add_argument("--samples", type=int, default=50)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    plan = load_plan(args.plan)
    spec, ep = plan.model_spec(), plan.parallel.expert
    torch.manual_seed(0)
    tokens = args.sequences * spec.seq_len
    base = MoE(spec)
    sharded = copy.deepcopy(base)
    expert_parallel.shard_experts(sharded, ep_group=None, ep_rank=0, ep=ep, capacity_factor=None)
    ids = balanced_assignment(tokens, spec.moe.top_k, spec.moe.experts)
    weights = torch.rand(tokens, spec.moe.top_k)
    with opcount.loopback_all_to_all():
        rows = {"MoE": _measure(base, spec.expert_input_dim, ids, weights, args.samples),
                f"ExpertParallelMoE ep={ep}": _measure(sharded, spec.expert_input_dim, ids, weights, args.samples)}
    print(f"{spec.name}, one MoE layer, {tokens} tokens (load average {Path('/proc/loadavg').read_text().split()[:3]})")
    for name, r in rows.items():
        print(f"  {name:<24} ops forward {r['ops_forward']:>3} backward {r['ops_backward']:>3}   "
              f"forward {r['forward_us']:7.1f} us  backward {r['backward_us']:7.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
