"""Host seconds per framework op on this machine, forward, backward and optimizer apart: the microbenchmark
`rackcast calibrate` runs (backend.opcount.host_seconds_per_op: a training step of the smallest backend model on 8
tokens, where the kernels' work is negligible, over the aten calls each part makes), on one torch thread, repeated in
fresh processes, timed both by wall clock and by the process's CPU time (a shared machine's waits for a core show in
the first only). Prints every repeat with the load average and the minimum of each; the local-cpu preset's
`efficiency.host_op_s` quotes the CPU-time minimum.

    .venv/bin/python benchmarks/bench_host_op.py [--repeats 3] [--samples 7]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

PARTS = ("forward", "backward", "optimizer")
CHILD = """
import json, sys, time, torch
from rackcast.backend.cpu_runtime import DEFAULT_THREADS
torch.set_num_threads(DEFAULT_THREADS)
from rackcast.backend.opcount import host_seconds_per_op
out = {name: host_seconds_per_op(samples=int(sys.argv[1]), clock=clock)["host_op_s"]
       for name, clock in (("wall", time.perf_counter), ("cpu", time.process_time))}
print(json.dumps(out))
"""


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--samples", type=int, default=7)
    args = ap.parse_args(argv)
    runs = []
    for i in range(args.repeats):
        proc = subprocess.run([sys.executable, "-c", CHILD, str(args.samples)], capture_output=True, text=True,
                              check=True)
        runs.append(json.loads(proc.stdout))
        load = Path("/proc/loadavg").read_text().split()[:3]
        print(f"repeat {i + 1}: " + "; ".join(
            f"{clock} " + " / ".join(f"{runs[-1][clock][p] * 1e6:.2f}" for p in PARTS) for clock in ("wall", "cpu"))
            + f" us (forward / backward / optimizer), load {' '.join(load)}")
    for clock in ("wall", "cpu"):
        best = {p: min(r[clock][p] for r in runs) for p in PARTS}
        print(f"min {clock}: " + ", ".join(f"{p} {best[p] * 1e6:.2f} us" for p in PARTS))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
