"""A one-node CPU job started by forking: import the trainer once, then fork one worker per rank.

    python -m rackcast.backend.forkrun NPROC --plan PLAN --steps 4 --out runs/x ...   # the worker's arguments

torchrun starts every worker as a fresh interpreter, and each one imports torch, torch.distributed.checkpoint and
the trainer again (about 3.5 s of CPU a process here, more than a tiny plan's whole training); torchrun itself is one
more such import. Forking after the import shares it, so a test of a 4-process layout on this 2-core machine costs
half as much. The workers are exactly the trainer's (`backend.train.main`, env:// rendezvous on a loopback port);
only the start differs, so this is what the multi-process tests and benchmarks use (backend.tiny_runs), while
`rackcast train` keeps torchrun (backend.launch), which restarts, spans nodes and forwards signals.

Fork is safe here because the parent only imports: it runs no torch op (so no OpenMP pool exists to be broken by
the fork) and starts no thread. When a worker fails the others are stopped, as torchrun does, and the exit code is
the first failure's.
"""

from __future__ import annotations

import os
import signal
import socket
import sys

LOOPBACK_ADDR = "127.0.0.1"


def free_loopback_port() -> int:
    """A port the kernel just handed out on loopback (rank 0's TCPStore binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK_ADDR, 0))
        return s.getsockname()[1]


def fork_command(plan_path: str, world: int, worker_args: list[str]) -> list[str]:
    """The command line that forks `world` ranks of the trainer on this plan (as launch.torchrun_command starts them)."""
    return [sys.executable, "-m", "rackcast.backend.forkrun", str(world), "--plan", plan_path, *worker_args]


def _worker(rank: int, nproc: int, port: int, worker_args: list[str]) -> None:
    """Become rank `rank` and run the trainer; never returns."""
    from rackcast.backend import train

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                      GROUP_RANK="0", MASTER_ADDR=LOOPBACK_ADDR, MASTER_PORT=str(port))
    code = 1
    try:
        code = train.main(worker_args)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(nproc: int, worker_args: list[str]) -> int:
    """Fork `nproc` ranks of the trainer on `worker_args`; the exit code of the first that failed, else 0."""
    from rackcast.backend import train  # noqa: F401  (imported once, before the fork, for every worker)

    port = free_loopback_port()
    pids = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _worker(rank, nproc, port, worker_args)
        pids.append(pid)
    failed = 0
    while pids:
        pid, status = os.wait()
        pids.remove(pid)
        code = os.waitstatus_to_exitcode(status)
        if code and not failed:
            failed = code if code > 0 else 128 - code  # killed by signal N: 128 + N, as a shell reports it
            for other in pids:  # a peer left waiting in a collective would hang until its timeout
                os.kill(other, signal.SIGTERM)
    return failed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or not argv[0].isdigit() or int(argv[0]) < 1:
        print("usage: python -m rackcast.backend.forkrun NPROC WORKER_ARGS...", file=sys.stderr)
        return 2
    return run(int(argv[0]), argv[1:])


if __name__ == "__main__":
    sys.exit(main())
