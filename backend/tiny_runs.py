"""Short trainer runs of the tiny Marin-shaped MoE on this machine, for the trainer's tests and benchmarks: write a
tiny-moe plan on local-cpu, run the worker (one process; several forked from one import by backend.forkrun, or
started by torchrun through backend.launch), read what it wrote.

    plan = write_plan(Path(tmp) / "dp2.yaml", {"data": 2})
    proc = run_worker(plan, Path(tmp) / "run", steps=4, world=2)
    losses(Path(tmp) / "run")
"""

from __future__ import annotations

import atexit
import json
import subprocess
from pathlib import Path

import yaml

from rackcast.atomic import write_text_atomic
from rackcast.backend.forkrun import ForkServer
from rackcast.backend.launch import torchrun_command, worker_command, worker_env

LAUNCHERS = ("fork", "torchrun")  # backend.forkrun.ForkServer (one import for every run) or torchrun
_SERVER: list[ForkServer] = []  # started by the first forked run, ended with this process

ROOT = Path(__file__).resolve().parent.parent


def write_plan(path: Path, parallel: dict, *, global_batch: int = 8, micro_batch: int = 2, schedule: str = "1f1b",
               optimizer: str = "muonh", precision: str = "fp32", **extra) -> Path:
    """A tiny-moe plan on local-cpu with as many processes as the layout needs; fp32 (no autocast) so layouts can
    be compared to one process to 1e-5. `optimizer_extra` adds fields to the optimizer block."""
    p = dict(parallel)
    world = 1
    for axis in ("data", "fsdp", "tensor", "context", "pipeline"):
        world *= p.get(axis, 1)
    opt = {"name": "muonh", "lr": 0.01, "adam_lr": 0.003} if optimizer == "muonh" else {"name": "adamw", "lr": 0.003}
    opt.update(extra.pop("optimizer_extra", {}))
    plan = {"name": path.stem, "model": "tiny-moe",
            "topology": {"name": "local-cpu", "domains": 1, "usable_gpus": world},
            "parallel": p, "batch": {"global_batch": global_batch, "micro_batch": micro_batch},
            "schedule": schedule, "optimizer": opt, "precision": precision, **extra}
    write_text_atomic(path, yaml.safe_dump(plan, sort_keys=False))
    return path


def run_worker(plan: Path, out: Path, steps: int, *extra: str, world: int = 1, env: dict | None = None,
               data_dir: Path | None = None, timeout: float = 240, launcher: str = "fork") -> subprocess.CompletedProcess:
    """The trainer worker on `plan` for `steps` steps on `world` processes, one thread each, writing into `out`:
    forked from the one ForkServer of this process (`launcher="fork"`), or each a fresh interpreter started by
    torchrun (a plain one for one process) as `rackcast train` starts them."""
    args = ["--steps", str(steps), "--out", str(out), "--quiet", "--threads", "1",
            "--data-dir", str(data_dir or ROOT / "runs" / ".data"), *extra]
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r} is not one of {LAUNCHERS}")
    full_env = worker_env(env, override=True)
    if launcher == "fork":
        if not (_SERVER and _SERVER[0].alive()):
            _SERVER[:] = [ForkServer(worker_env(None, override=True), ROOT)]
            atexit.register(_SERVER[0].close)
        return _SERVER[0].run(world, ["--plan", str(plan), *args], full_env, ROOT, timeout)
    cmd = torchrun_command(str(plan), world, args) if world > 1 else worker_command(str(plan), args)
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def losses(out: Path) -> list[float]:
    import pyarrow.parquet as pq

    return pq.read_table(out / "metrics.parquet", columns=["loss"]).to_pydict()["loss"]


def routing(out: Path) -> dict:
    import pyarrow.parquet as pq

    return pq.read_table(out / "routing.parquet").to_pydict()


def manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())
