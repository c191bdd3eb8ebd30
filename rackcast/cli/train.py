"""`rackcast train PLAN`: run the plan on real processes with the PyTorch backend and write its RunRecord.

Validates the plan for training (backend.parallel.validate_trainable), checks that the launch provides the plan's
world size (parallel.gpus) and, with --resume, that the run folder holds a complete checkpoint this plan can continue
(the same model, optimizer, global batch and seed; the layout and the number of processes may differ);
builds the text cache (backend.data), then starts the worker `backend.train` (backend.launch):
- one node (default): torchrun with the plan's world size, rendezvous on loopback;
- several nodes: the same command on every node with --nnodes N --rdzv-endpoint HOST:PORT (torchrun's c10d
  rendezvous; add --node-rank R for a static rendezvous with fixed node ranks), --ifname for the network interface;
- under an existing launcher (srun, torchrun, a Kubernetes PyTorchJob; --launcher env, or auto-detected from RANK
  and WORLD_SIZE): this process is the worker itself.
Rank 0 prints progress (step, loss, tokens/s, MFU) and writes the record. The run folder (default runs/<plan name>;
on several nodes a folder every node sees) receives metrics.parquet, record.json, routing.parquet, checkpoints/ and,
with --profile, trace.json. Ctrl-C or a kill of the launcher stops every worker; the last complete checkpoint stays.

    rackcast train examples/plans/tiny-2proc-ep.yaml --steps 50
    rackcast train examples/plans/tiny-1proc.yaml --steps 400 --out runs/learn --checkpoint-every 100 --resume
    rackcast train p.yaml --check      # can the trainer run it? one line per reason it cannot; launches nothing
    rackcast train PLAN --nnodes 2 --rdzv-endpoint node0:29500 --ifname eth0        # on each of two nodes
    srun rackcast train PLAN --launcher env                                         # see examples/slurm/
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from rackcast.cli.common import refuse_unless_fits
from rackcast.errors import RackcastError
from rackcast.plan import load_plan

LAUNCHERS = ("auto", "torchrun", "env")
EPILOG = """several nodes (the run folder on storage every node sees):
  rackcast train PLAN --nnodes 2 --rdzv-endpoint node0:29500 --ifname eth0    # the same on each node
  srun rackcast train PLAN --launcher env      # one task per process; examples/slurm/train-2node.sbatch
  torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint node0:29500 \\
      -m rackcast.cli train PLAN               # under torchrun or a PyTorchJob: --launcher auto finds RANK"""
SIGNAL_EXIT_BASE = 128  # shell convention: a process stopped by signal N exits 128 + N


def register(sub) -> None:
    parser = sub.add_parser("train", help="train a plan with the PyTorch backend (torchrun) and record what it "
                                          "measured", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plan", help="plan YAML file")
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps in total (default 50)")
    parser.add_argument("--out", help="run folder (default runs/<plan name>)")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint interval in steps "
                                                                        "(default: only at the end)")
    parser.add_argument("--resume", action="store_true", help="continue from the run folder's latest complete "
                                                              "checkpoint")
    parser.add_argument("--async-checkpoint", action="store_true",
                        help="write checkpoints in the background after a copy of the state (dcp.async_save)")
    parser.add_argument("--profile", action="store_true", help="write a torch.profiler Chrome trace (trace.json)")
    parser.add_argument("--data-dir", default="runs/.data", help="token cache folder (default runs/.data)")
    parser.add_argument("--eval-every", type=int, default=0, help="held-out loss every N steps (default: at the end)")
    parser.add_argument("--log-every", type=int, default=1, help="print progress every N steps")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per process (default 1: one process is one core)")
    parser.add_argument("--check", action="store_true", help="say whether the trainer can run the plan (one line "
                                                             "per reason it cannot) and launch nothing")
    nodes = parser.add_argument_group("several nodes")
    nodes.add_argument("--nnodes", type=int, default=1, help="machines in the run (default 1)")
    nodes.add_argument("--nproc-per-node", type=int, help="processes on this machine (default: the plan's world "
                                                          "size / nnodes)")
    nodes.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="torchrun rendezvous, the same on every node "
                                                                    "(default: a free loopback port, one node)")
    nodes.add_argument("--node-rank", type=int, help="this node's rank: static rendezvous with fixed ranks "
                                                     "(default: c10d rendezvous, ranks in the order nodes join)")
    nodes.add_argument("--rdzv-id", help="rendezvous id, the same on every node (default rackcast-<plan name>)")
    nodes.add_argument("--ifname", help="network interface for gloo and NCCL (sets GLOO_SOCKET_IFNAME and "
                                        "NCCL_SOCKET_IFNAME; default: the environment's, loopback on one node)")
    nodes.add_argument("--launcher", choices=LAUNCHERS, default="auto",
                       help="torchrun: start the processes; env: this process is one worker started by srun, "
                            "torchrun or a PyTorchJob (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the "
                            "environment); auto (default): env when RANK and WORLD_SIZE are set")
    parser.set_defaults(func=_run)


def _check_resume(out: str, plan, plan_path: str) -> None:
    """--resume needs a complete checkpoint this plan can continue; refuse in one line otherwise."""
    from rackcast.backend.checkpoint import latest_complete, resume_problem, written_by_old_version

    folder = latest_complete(out)
    if folder is None and written_by_old_version(out):
        raise RackcastError(f"--resume: {out} holds only checkpoints in the per-rank format of earlier rackcast "
                            f"versions, which this version does not read; train into another --out")
    if folder is None:
        raise RackcastError(f"--resume: {out} holds no complete checkpoint to continue from; run without --resume")
    problem = resume_problem(folder, plan)
    if problem:
        raise RackcastError(f"--resume: {folder} {problem}; train into another --out", where=plan_path)


def _worker_args(args, out: str) -> list[str]:
    worker = ["--steps", str(args.steps), "--out", out, "--checkpoint-every", str(args.checkpoint_every),
              "--data-dir", args.data_dir, "--eval-every", str(args.eval_every), "--log-every", str(args.log_every),
              "--threads", str(args.threads)]
    worker += ["--resume"] if args.resume else []
    worker += ["--profile"] if args.profile else []
    worker += ["--async-checkpoint"] if args.async_checkpoint else []
    return worker


def _run_here(args, plan, worker: list[str], provided: dict[str, str]) -> int:
    """This process is one worker of a job another launcher started."""
    from rackcast.backend.launch import IFNAME_VARIABLES, missing_rendezvous
    from rackcast.backend.train import main as worker_main

    world, rank = int(provided["WORLD_SIZE"]), int(provided["RANK"])
    if world != plan.parallel.gpus:
        if rank == 0:  # every process sees the same mismatch; one line is enough
            print(f"rackcast train: error: {args.plan}: parallel: the plan needs {plan.parallel.gpus} processes, "
                  f"the launcher started {world}", file=sys.stderr)
        return 2
    env = dict(os.environ, **provided)
    missing = missing_rendezvous(env) if world > 1 else []
    if missing:
        raise RackcastError(f"--launcher env: {', '.join(missing)} not set; export them from the job script "
                            f"(the first node's address and a free port)")
    if args.ifname:
        env.update({key: args.ifname for key in IFNAME_VARIABLES})
    os.environ.update(env)
    return worker_main(["--plan", args.plan, *worker])


def check_lines(plan_path: str, plan) -> list[str]:
    """Why the trainer cannot run the plan, one line per reason naming the field ([] when it can)."""
    from rackcast.capabilities import refusals
    from rackcast.simulator.estimate import estimate

    lines = [f"{plan_path}: {reason}" for reason in refusals(plan, plan.model_spec())]
    try:
        predicted = estimate(plan)
        refuse_unless_fits(plan_path, predicted.fits, predicted.memory.total, predicted.hbm_bytes)
    except RackcastError as exc:
        lines.append(str(exc))
    return lines


def _check(plan_path: str, plan) -> int:
    lines = check_lines(plan_path, plan)
    for line in lines:
        print(f"rackcast train: error: {line}", file=sys.stderr)
    if lines:
        return 2
    print(f"{plan_path}: the trainer can run this plan ({plan.parallel.gpus} processes)")
    return 0


def _run(args) -> int:
    from rackcast.backend.data import prepare
    from rackcast.backend.launch import Nodes, launcher_env, supervise, torchrun_command, worker_env
    from rackcast.backend.parallel import validate_trainable
    from rackcast.simulator.estimate import estimate

    if args.steps <= 0:
        raise RackcastError(f"--steps must be positive, got {args.steps}")
    plan = load_plan(args.plan)
    if args.check:
        return _check(args.plan, plan)
    validate_trainable(plan, where=args.plan)
    predicted = estimate(plan)
    refuse_unless_fits(args.plan, predicted.fits, predicted.memory.total, predicted.hbm_bytes)
    out = args.out or str(Path("runs") / plan.name)
    provided = launcher_env() if args.launcher != "torchrun" else None
    if args.launcher == "env" and provided is None:
        raise RackcastError("--launcher env: neither RANK and WORLD_SIZE nor SLURM_PROCID and SLURM_NTASKS are set; "
                            "start it under srun, torchrun or a PyTorchJob")
    if args.resume:
        _check_resume(out, plan, args.plan)
    elif (Path(out) / "checkpoints").exists():
        raise RackcastError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
    worker = _worker_args(args, out)
    if provided is not None:
        return _run_here(args, plan, worker, provided)

    nodes = Nodes(nnodes=args.nnodes, nproc_per_node=args.nproc_per_node, rdzv_endpoint=args.rdzv_endpoint,
                  node_rank=args.node_rank, rdzv_id=args.rdzv_id or f"rackcast-{plan.name}")
    try:
        command = torchrun_command(args.plan, plan.parallel.gpus, worker, nodes)
    except ValueError as exc:
        raise RackcastError(f"parallel: {exc}", where=args.plan) from None
    prepare(args.data_dir)
    code, stopped_by = supervise(command, worker_env(ifname=args.ifname, nnodes=args.nnodes))
    if stopped_by is not None:
        print(f"rackcast train: stopped by {stopped_by}; every worker ended; {_last_checkpoint(out)}", file=sys.stderr)
        return SIGNAL_EXIT_BASE + int(signal.Signals[stopped_by])
    if code != 0:
        print(f"rackcast train: training stopped with exit code {code}; {_last_checkpoint(out)}", file=sys.stderr)
        return 1
    print(f"run record: {out}/record.json, {out}/metrics.parquet")
    return 0


def _last_checkpoint(out: str) -> str:
    from rackcast.backend.checkpoint import latest_complete

    folder = latest_complete(out)
    if folder is None:
        return f"no complete checkpoint in {out} yet"
    return f"continue from {folder} with --resume (run folder {out})"
