"""Helpers for the trainer tests: write a tiny plan, run the worker (one process or torchrun), read what it wrote."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def write_plan(path: Path, parallel: dict, *, global_batch: int = 8, micro_batch: int = 2, schedule: str = "1f1b",
               **extra) -> Path:
    p = dict(parallel)
    world = p.get("data", 1) * p.get("fsdp", 1) * p.get("pipeline", 1)
    plan = {"name": path.stem, "model": "tiny-moe",
            "topology": {"name": "local-cpu", "domains": 1, "usable_gpus": world},
            "parallel": p, "batch": {"global_batch": global_batch, "micro_batch": micro_batch},
            "schedule": schedule, "optimizer": {"name": "muonh", "lr": 0.01, "adam_lr": 0.003}, **extra}
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def run_worker(plan: Path, out: Path, steps: int, *extra: str, world: int = 1, env: dict | None = None,
               data_dir: Path | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    from rackcast.backend.launch import torchrun_command, worker_command, worker_env

    args = ["--steps", str(steps), "--out", str(out), "--quiet", "--threads", "1",
            "--data-dir", str(data_dir or ROOT / "runs" / ".data"), *extra]
    cmd = torchrun_command(str(plan), world, args) if world > 1 else worker_command(str(plan), args)
    full_env = worker_env(env, override=True)
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def losses(out: Path) -> list[float]:
    import pyarrow.parquet as pq

    return pq.read_table(out / "metrics.parquet", columns=["loss"]).to_pydict()["loss"]


def manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())
