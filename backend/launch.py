"""How a training run is started: the torchrun command line and the worker environment, in one place.

`rackcast train`, `rackcast validate` and the multi-process tests all start the trainer worker
(`python -m rackcast.backend.train`) through `torchrun_command` with the environment from `worker_env`.
"""

from __future__ import annotations

import os
import sys

WORKER_MODULE = "rackcast.backend.train"


def torchrun_command(plan_path: str, world: int, worker_args: list[str]) -> list[str]:
    """torchrun on this machine: `world` processes, c10d rendezvous on a free loopback port, no restarts."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--max-restarts", "0",
            "-m", WORKER_MODULE, "--plan", plan_path, *worker_args]


def worker_command(plan_path: str, worker_args: list[str]) -> list[str]:
    """One process without torchrun (a one-process plan)."""
    return [sys.executable, "-m", WORKER_MODULE, "--plan", plan_path, *worker_args]


def worker_env(extra: dict[str, str] | None = None, override: bool = False) -> dict[str, str]:
    """The environment a worker runs in: gloo on loopback and one OpenMP thread unless the caller's environment
    already says otherwise (override=True forces them, as the measurement suite does)."""
    env = dict(os.environ)
    defaults = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    for key, value in defaults.items():
        if override:
            env[key] = value
        else:
            env.setdefault(key, value)
    env.update(extra or {})
    return env
