"""`rackcast train PLAN`: run the plan on real processes with the PyTorch backend and write its RunRecord.

Validates the plan for training (backend.parallel.validate_trainable), builds the text cache (backend.data), then
starts torchrun on this machine with the plan's world size (parallel.gpus), rendezvous on 127.0.0.1, running the
worker `backend.train`; rank 0 prints progress (step, loss, tokens/s, MFU). The run folder (default runs/<plan name>)
receives metrics.parquet, record.json, routing.parquet, checkpoints/ and, with --profile, trace.json.

    rackcast train examples/plans/tiny-2proc-ep.yaml --steps 50
    rackcast train examples/plans/tiny-1proc.yaml --steps 400 --out runs/learn --checkpoint-every 100 --resume
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rackcast.backend.launch import torchrun_command, worker_env
from rackcast.cli.common import refuse_unless_fits
from rackcast.errors import RackcastError
from rackcast.plan import load_plan


def register(sub) -> None:
    parser = sub.add_parser("train", help="train a plan with the PyTorch backend (torchrun) and record what it measured")
    parser.add_argument("plan", help="plan YAML file")
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps in total (default 50)")
    parser.add_argument("--out", help="run folder (default runs/<plan name>)")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint interval in steps "
                                                                        "(default: only at the end)")
    parser.add_argument("--resume", action="store_true", help="continue from the run folder's latest complete "
                                                              "checkpoint")
    parser.add_argument("--profile", action="store_true", help="write a torch.profiler Chrome trace (trace.json)")
    parser.add_argument("--data-dir", default="runs/.data", help="token cache folder (default runs/.data)")
    parser.add_argument("--eval-every", type=int, default=0, help="held-out loss every N steps (default: at the end)")
    parser.add_argument("--log-every", type=int, default=1, help="print progress every N steps")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per process (default cores/processes)")
    parser.set_defaults(func=_run)


def _run(args) -> int:
    from rackcast.backend.data import prepare
    from rackcast.backend.parallel import validate_trainable
    from rackcast.simulator.estimate import estimate

    if args.steps <= 0:
        raise RackcastError(f"--steps must be positive, got {args.steps}")
    plan = load_plan(args.plan)
    validate_trainable(plan, where=args.plan)
    predicted = estimate(plan)
    refuse_unless_fits(args.plan, predicted.fits, predicted.memory.total, predicted.hbm_bytes)
    out = args.out or str(Path("runs") / plan.name)
    if not args.resume and (Path(out) / "checkpoints").exists():
        raise RackcastError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
    prepare(args.data_dir)
    worker = ["--steps", str(args.steps), "--out", out, "--checkpoint-every", str(args.checkpoint_every),
              "--data-dir", args.data_dir, "--eval-every", str(args.eval_every), "--log-every", str(args.log_every),
              "--threads", str(args.threads)]
    worker += ["--resume"] if args.resume else []
    worker += ["--profile"] if args.profile else []
    code = subprocess.call(torchrun_command(args.plan, plan.parallel.gpus, worker), env=worker_env())
    if code != 0:
        print(f"rackcast train: training stopped with exit code {code}; continue it with --resume "
              f"(run folder {out})", file=sys.stderr)
        return 1
    print(f"run record: {out}/record.json, {out}/metrics.parquet")
    return 0
