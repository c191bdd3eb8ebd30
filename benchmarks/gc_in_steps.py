"""Python garbage collections inside and outside the trainer's steps, for the checkout this runs in (gc.callbacks
times every collection, automatic or explicit): inside a step (while Trainer.train_step runs), between steps (after
the first step ends and before the last begins) and elsewhere (setup, evaluation at the end, teardown).
Compare two checkouts by running this with each one's interpreter and working directory:

    .venv/bin/python benchmarks/gc_in_steps.py PLAN [--steps 20]
    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/gc_in_steps.py PLAN
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time

from rackcast.backend import train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--data-dir", default="runs/.data")
    args = ap.parse_args()
    where = {"step": None, "start": 0.0, "finished": 0}
    inside: list[tuple[int, int, float]] = []  # (step, generation, seconds)
    between: list[tuple[float, int]] = []  # (seconds, objects collected)
    elsewhere: list[tuple[float, int]] = []

    def on_collection(phase, info):
        if phase == "start":
            where["start"] = time.perf_counter()
            return
        took = time.perf_counter() - where["start"]
        if where["step"] is None:
            (between if 0 < where["finished"] < args.steps else elsewhere).append((took, info["collected"]))
        else:
            inside.append((where["step"], info["generation"], took))

    step_fn = train.Trainer.train_step

    def spied_step(self, step):
        where["step"] = step
        try:
            return step_fn(self, step)
        finally:
            where["step"] = None
            where["finished"] += 1

    train.Trainer.train_step = spied_step
    gc.callbacks.append(on_collection)
    with tempfile.TemporaryDirectory() as out:
        train.main(["--plan", args.plan, "--steps", str(args.steps), "--out", out, "--quiet", "--threads", "1",
                    "--data-dir", args.data_dir])
    gc.callbacks.remove(on_collection)
    rank = os.environ.get("RANK", "0")
    ms = [t * 1e3 for *_, t in inside]
    print(f"rank {rank}: inside steps {len(inside)} collections in {len({s for s, *_ in inside})} of {args.steps} "
          f"steps, {sum(ms):.2f} ms in all, longest {max(ms, default=0):.2f} ms, by generation "
          f"{[sum(1 for _, g, _ in inside if g == k) for k in range(3)]}")
    for name, times in (("between steps", between), ("elsewhere", elsewhere)):
        ms = sorted(t * 1e3 for t, _ in times)
        freed = sum(n for _, n in times)
        print(f"rank {rank}: {name} {len(ms)} collections freeing {freed} objects, {sum(ms):.2f} ms in all, "
              f"median {ms[len(ms) // 2] if ms else 0:.2f} ms, longest {max(ms, default=0):.2f} ms")


if __name__ == "__main__":
    main()
