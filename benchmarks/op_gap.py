"""Which framework ops a real training step runs that the simulator's op count does not (issue 15, deliverable 1).

    .venv/bin/python benchmarks/op_gap.py runs/validate-r5/plans/1p-mb2.yaml
    .venv/bin/python benchmarks/op_gap.py runs/validate-r5/plans/dp2-mb2.yaml

The real trainer (backend.train.Trainer, under torchrun where the plan has several ranks) runs warm-up steps, then
rank 0 counts one step's aten ops by name (backend.opcount's dispatch-mode counter), tagged by where they run:
backward (Tensor.backward, DDP's reducer and comm hook included), ddp_hook (the trainer's DDP comm hook alone),
optimizer (optimizer.step), zero_grad, balancer (the router balancer's step), step (the rest: data, forward, loss,
the .item()s, the expert gradient reduction). Beside it, the model step the simulator's count stands for, counted by
name the same way on the plan's own model and micro-batch (one process: forward + loss, backward, per micro-batch,
times the micro-batches, then one optimizer step), and the simulator's own total (host_overhead.host_ops). Printed:
the totals by tag, and the op names whose count differs, most different first.

Findings (2026-12-03, torch 2.13 CPU, the round-5 plans; op counts, not timings, so the load does not matter).
Ops of rank 0's step, simulator at main (ffde0b2) / this change / real:
    1p-mb2        11942 / 12509 / 12516      dp2-mb2   6470 / 6991 / 7003      dp2-ep2-mb2   6726 / 7247 / 7298
What main's count missed, by where (the tags above; model = the backend model at the plan's micro-batch):
- the windowed attention's branch: the count ran 32 tokens, where tiny-moe's window of 32 is the whole sequence
  (plain causal SDPA), but the plans train 128 tokens, where its three local layers take banded_attention (pad,
  unfold, permute, mask: +18 forward ops each, +54 forward and +45 backward ops a micro-batch). The twin now keeps
  the branches of the model at its own seq_len (simulator.op_counts.window_branches);
- one-sequence micro-batches: the count ran one sequence, where some reshapes are views; the plans' two copy
  (+8 forward ops a micro-batch): counted at two sequences at least (backend.opcount.MIN_SEQUENCES);
- the router balancer: its margins in each MoE layer's forward (+3 ops per layer) and its step (77 ops), and
  zero_grad (2): step_ops;
- data parallel, DDP (gradient_as_bucket_view=True already): zero_grad(set_to_none=True) leaves every gradient
  None, so on the micro-batch that syncs the reducer copies each of the 80 dense gradients into its bucket and
  re-views it there (copy_ + as_strided: 160 ops), plus the comm hook's div_ and allreduce_ and DDP's
  record_function (4): ddp_ops 164; the expert gradients' flat reduction (reduce_grads: cat, div_, a copy back
  each: 34): expert_reduce_ops. Keeping the gradients (set_to_none=False) would trade the copy and re-view for a
  zero_ and an add_ per parameter: no fewer ops, so the trainer is left as it is.
What is left: dp2-ep2-mb2 -51 (-0.7%), the dispatch path at the real (unbalanced) routing.
The time, not the ops: the added ops are 3.1-3.5 ms a step (predicted 1p-mb2 112.9 -> 116.0 ms, dp2-mb2
66.4 -> 69.9, dp2-ep2-mb2 81.0 -> 84.4; benchmarks/step_terms.py's predicted line at main and here). The
DP and DP x EP gaps are not op counts: round 5's measured phases (runs/validate-r5/runs/*/metrics.parquet, medians
of steps 3+, 3 runs) put dp2-mb2's exposed_dp_comm at 10.1 ms against 2.6 predicted and dp2-ep2-mb2's
exposed_expert_a2a at 34.3 ms against 15.9 (dp2-ep2-gb32-mb8 53.9 against 20.2), while the same exchanges alone
take 7.5-7.9 ms a step (benchmarks/a2a_alone.py --rows 512 --width 32 --calls 32, load average 4.5): the rest is
each blocking collective waiting for the other rank (the steps' wall less their CPU time: 15 ms dp2-mb2, 22 ms
dp2-ep2-mb2), which no term prices. benchmarks/step_terms.py at 00:23-00:24 UTC (load average 1.4-2.6, other jobs
running), rank 0's unprofiled step min / median against predicted main / here: 1p-mb2 122.0 / 141.6 against 112.9 /
116.0 ms, dp2-mb2 128.9 / 159.2 against 66.4 / 69.9, dp2-ep2-mb2 147.2 / 177.2 against 81.0 / 84.4; in the
profiled dp2-ep2-mb2 step the expert exchanges' autograd functions hold 85 ms of self time (_AllToAll 45.6,
_AllToAllBackward 39.4: the blocking all_to_all's wait, outside any aten op) against 4.7 ms in the collectives' ops.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

WARMUP_STEPS = 3
TOP = 25


def named_counter():
    """backend.opcount's counter, counting by (tag, op name) instead of by tag."""
    from rackcast.backend import opcount

    class ByName(opcount._Counter):
        def __init__(self):
            super().__init__()
            self.tags = ["step"]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            key = f"{self.tags[-1]}|{func.overloadpacket.__name__}"
            self.counts[key] = self.counts.get(key, 0) + 1
            return func(*args, **(kwargs or {}))

    return ByName()


def tagged(counter, tag: str, fn):
    def run(*a, **k):
        counter.tags.append(tag)
        try:
            return fn(*a, **k)
        finally:
            counter.tags.pop()

    return run


def real_step(plan: str, out: str) -> dict:
    """rank 0's counts by (tag, name) of one real training step after WARMUP_STEPS."""
    import torch

    from rackcast.backend import parallel, train

    counter = named_counter()
    make_hook = parallel._timed_allreduce_hook  # the trainer's DDP comm hook, tagged

    def tagged_hook(*a):
        hook = tagged(counter, "ddp_hook", make_hook(*a))
        return lambda state, bucket: hook(state, bucket)  # DDP checks the hook's parameter names

    parallel._timed_allreduce_hook = tagged_hook
    args = train.parse_args(["--plan", plan, "--out", out, "--steps", str(WARMUP_STEPS + 2), "--quiet",
                             "--threads", "1"])
    trainer = train.Trainer(args)
    trainer._data()
    for step in range(WARMUP_STEPS):
        trainer.train_step(step)
    opt, backward = trainer.optimizer, torch.Tensor.backward
    opt.step, opt.zero_grad = tagged(counter, "optimizer", opt.step), tagged(counter, "zero_grad", opt.zero_grad)
    trainer.balancer.step = tagged(counter, "balancer", trainer.balancer.step)
    torch.Tensor.backward = tagged(counter, "backward", backward)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    with counter:
        trainer.train_step(WARMUP_STEPS)
    torch.Tensor.backward = backward
    return counter.counts


def model_step(plan_path: str) -> dict:
    """Counts by (tag, name) of the one-process model step the simulator's count stands for, at the plan's shapes."""
    import torch

    from rackcast.backend.model import build_model, next_token_loss
    from rackcast.backend.optim import build_optimizer
    from rackcast.plan import load_plan

    plan = load_plan(plan_path)
    spec = plan.model_spec()
    torch.manual_seed(0)
    net = build_model(spec, seed=0, device=torch.device("cpu"))
    opt = build_optimizer(net, plan.optimizer.name, lr=1e-3, adam_lr=1e-3 if plan.optimizer.name == "muonh" else None)
    tokens = torch.randint(0, spec.vocab, (plan.batch.micro_batch, spec.seq_len))
    for _ in range(2):
        next_token_loss(net(tokens), tokens)[0].backward()
        opt.step()
    opt.zero_grad(set_to_none=True)  # as the trainer leaves them: the first micro-batch's backward sets them
    counter = named_counter()
    with counter:
        for _ in range(plan.microbatches):
            counter.tags.append("step")
            loss, _ = next_token_loss(net(tokens), tokens)
            counter.tags.append("backward")
            loss.backward()
            counter.tags[-2:] = []
        counter.tags.append("optimizer")
        opt.step()
    return counter.counts


def by_tag(counts: dict) -> dict:
    out: dict[str, int] = {}
    for key, n in counts.items():
        tag = key.split("|")[0]
        out[tag] = out.get(tag, 0) + n
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--child", metavar="OUT", help=argparse.SUPPRESS)
    a = ap.parse_args()
    out = Path("runs") / f".op-gap-{Path(a.plan).stem}"
    if a.child:
        import torch

        counts = real_step(a.plan, a.child)
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            Path(a.child).mkdir(parents=True, exist_ok=True)
            Path(a.child, "real.json").write_text(json.dumps(counts))
        return 0
    from rackcast.backend.launch import worker_env
    from rackcast.plan import load_plan
    from rackcast.simulator import op_counts
    from rackcast.simulator.host_overhead import host_ops

    plan = load_plan(a.plan)
    world = plan.parallel.gpus
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", "--max-restarts", "0"] if world > 1 else [sys.executable]
    subprocess.run([*cmd, str(Path(__file__).resolve()), a.plan, "--child", str(out)], check=True,
                   env=worker_env(override=True))
    real = json.loads((out / "real.json").read_text())
    model = model_step(a.plan)
    spec = plan.model_spec()
    o = host_ops(op_counts.op_counts(spec, plan.optimizer.name), spec, plan)
    print(f"== {a.plan}: simulator counts {o.forward:.0f} fwd + {o.backward:.0f} bwd + {o.optimizer:.0f} opt = "
          f"{o.forward + o.backward + o.optimizer:.0f} ops (rank 0, its own)")
    print(f"model step by name (one process, plan's micro-batch): {by_tag(model)} = {sum(model.values())}")
    print(f"real step, rank 0: {by_tag(real)} = {sum(real.values())}")
    names = {k.split("|")[1] for k in (*real, *model)}

    def total(counts, name):
        return sum(n for k, n in counts.items() if k.split("|")[1] == name)

    rows = sorted(((total(real, n) - total(model, n), n) for n in names), key=lambda r: -abs(r[0]))
    print(f"op names whose count differs (real - model), top {TOP}; real by tag:")
    for diff, name in rows[:TOP]:
        if diff == 0:
            break
        tags = {k.split('|')[0]: v for k, v in real.items() if k.split("|")[1] == name}
        print(f"  {diff:+5d} {name:32s} real {total(real, name):5d} model {total(model, name):5d}  {tags}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
