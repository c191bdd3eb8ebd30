"""The expert all-to-alls of a DP2 x EP2 tiny-moe step timed alone, back to back, beside the trainer's measured
exposed_expert_a2a phase and the simulator's (issue 15: what of the DP2 x EP2 gap is the exchange itself and what
is waiting for the other rank).

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/a2a_alone.py \
        --rows 512 --width 64 --calls 32

Each call is what backend.expert_parallel makes per MoE layer and pass: the per-expert counts' exchange (E integers)
(forward only) then the rows' (`rows` x `width` fp32, split evenly); `calls` row exchanges a step (micro-batches x
MoE layers x 2 in forward, x 2 in backward). One torch thread per process, as the trainer's CPU runs. Rank 0 prints the step's total,
the fastest of REPEATS and the median.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

REPEATS = 20
EXPERTS = 8
ROWS_PER_COUNTS = 4  # row exchanges per counts' exchange: dispatch and combine, forward and backward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, required=True)
    ap.add_argument("--width", type=int, required=True)
    ap.add_argument("--calls", type=int, required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    x = torch.randn(a.rows, a.width)
    out = torch.empty_like(x)
    counts, got = torch.ones(EXPERTS, dtype=torch.int64), torch.empty(EXPERTS, dtype=torch.int64)
    split = [a.rows // world] * world
    totals = []
    for _ in range(REPEATS + 1):
        dist.barrier()
        t0 = time.perf_counter()
        for call in range(a.calls):  # per layer and micro-batch: counts, dispatch, combine; two in backward
            if call % ROWS_PER_COUNTS == 0:
                dist.all_to_all_single(got, counts)
            dist.all_to_all_single(out, x, output_split_sizes=split, input_split_sizes=split)
        totals.append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        t, counted = sorted(totals[1:]), -(-a.calls // ROWS_PER_COUNTS)
        print(f"{a.calls} row exchanges of {a.rows}x{a.width} fp32 (+{counted} count exchanges) a step, "
              f"{world} ranks: fastest {t[0] * 1e3:.2f} ms, median {statistics.median(t) * 1e3:.2f} ms "
              f"({statistics.median(t) / (a.calls + counted) * 1e6:.0f} us a call)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
