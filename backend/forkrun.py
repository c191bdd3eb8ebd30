"""Trainer jobs on this machine started by forking from one process that has imported the trainer.

    python -m rackcast.backend.forkrun NPROC --plan PLAN --steps 4 --out runs/x ...   # one job, NPROC ranks

    server = ForkServer(env, cwd)                     # a process that imports the trainer once
    server.run(2, ["--plan", "p.yaml", ...], env, cwd, timeout=240)   # a job forked from it: a CompletedProcess

torchrun starts every worker as a fresh interpreter, and each one imports torch, torch.distributed.checkpoint and
the trainer again (about 3.5 s of CPU a process here, more than a tiny plan's whole training), and torchrun itself
is one more such import. The multi-process tests run over a hundred short jobs, so they fork instead: `ForkServer`
imports once for the whole test session and forks a child per job, which forks one rank per process. The ranks are
exactly the trainer's (`backend.train.main`, env:// rendezvous on a loopback port); only the start differs, so this
is what the tests use (backend.tiny_runs), while `rackcast train` keeps torchrun (backend.launch), which restarts,
spans nodes and forwards signals.

Forking after `import torch` is what torch's own DataLoader workers do on Linux; the server and the job's parent
only import (what a rank would import on its way: the trainer, and torch._dynamo and torch.profiler, which its first
optimizer step and its memory profile pull in) and run no torch op, so no OpenMP pool exists to be broken by the
fork. When a rank fails the others are stopped, as torchrun does, and the job's exit code is the first failure's.
Variables read at import time (OMP_NUM_THREADS) come from the server's environment; a job's own variables
(RACKCAST_FAIL, say) are set before its ranks start.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

LOOPBACK_ADDR = "127.0.0.1"
PRELOAD = ("rackcast.backend.train", "torch._dynamo", "torch.profiler")  # what every rank imports on its way


def _preload() -> None:
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)


def free_loopback_port() -> int:
    """A port the kernel just handed out on loopback (rank 0's TCPStore binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK_ADDR, 0))
        return s.getsockname()[1]


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code  # killed by signal N: 128 + N, as a shell reports it


def _rank(rank: int, nproc: int, port: int, worker_args: list[str]) -> None:
    """Become rank `rank` of `nproc` and run the trainer; never returns."""
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
    """Fork `nproc` ranks of the trainer on `worker_args` (one process runs in this one); the exit code of the
    first rank that failed, else 0."""
    _preload()
    if nproc == 1:
        from rackcast.backend import train

        return train.main(worker_args)
    port = free_loopback_port()
    pids = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _rank(rank, nproc, port, worker_args)
        pids.append(pid)
    failed = 0
    while pids:
        pid, status = os.wait()
        pids.remove(pid)
        code = _exit_code(status)
        if code and not failed:
            failed = code
            for other in pids:  # a peer left waiting in a collective would hang until its timeout
                os.kill(other, signal.SIGTERM)
    return failed


def fork_command(plan_path: str, world: int, worker_args: list[str]) -> list[str]:
    """The command line that forks `world` ranks of the trainer on this plan (as launch.torchrun_command starts them)."""
    return [sys.executable, "-m", "rackcast.backend.forkrun", str(world), "--plan", plan_path, *worker_args]


# ------------------------------------------------------------------------------------------------------ the server
def _job(request: dict) -> None:
    """In a forked child: take the job's directory, environment and output files, run it; never returns."""
    os.setpgrp()  # the job and its ranks are one process group, killed together on a timeout
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    code = 1
    try:
        code = run(request["world"], request["argv"])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> int:
    """Read one JSON job a line from stdin; answer {"pid"} when it starts and {"code"} when it ends."""
    _preload()
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            _job(json.loads(line))
        print(json.dumps({"pid": pid}), flush=True)
        print(json.dumps({"code": _exit_code(os.waitpid(pid, 0)[1])}), flush=True)
    return 0


class ForkServer:
    """A `python -m rackcast.backend.forkrun --serve` process and the jobs sent to it, one at a time."""

    def __init__(self, env: dict[str, str], cwd: Path):
        self._lock = threading.Lock()
        self._buffer = b""
        self.last_pid = 0  # the last job's process (its process group holds its ranks)
        self._proc = subprocess.Popen([sys.executable, "-m", "rackcast.backend.forkrun", "--serve"], cwd=cwd,
                                      env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)

    def alive(self) -> bool:
        return self._proc.poll() is None

    def _reply(self, timeout: float | None) -> dict | None:
        """The server's next line, or None if none came within `timeout` seconds (read unbuffered: a job that
        ends at once sends both of its lines together)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise RuntimeError("the fork server ended")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def run(self, world: int, argv: list[str], env: dict[str, str], cwd: Path,
            timeout: float) -> subprocess.CompletedProcess:
        """Run one job of `world` ranks with these worker arguments, as subprocess.run(capture_output=True)
        would; subprocess.TimeoutExpired after `timeout` seconds, the job killed."""
        with self._lock, tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = dict(world=world, argv=argv, env=env, cwd=str(cwd), stdout=str(out), stderr=str(err))
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
            pid = self.last_pid = self._reply(None)["pid"]
            ended = self._reply(timeout)
            if ended is None:
                os.killpg(pid, signal.SIGKILL)
                self._reply(None)
                raise subprocess.TimeoutExpired(["forkrun", str(world), *argv], timeout, out.read_text(),
                                                err.read_text())
            return subprocess.CompletedProcess(["forkrun", str(world), *argv], ended["code"], out.read_text(),
                                               err.read_text())

    def close(self, grace_s: float = 5.0) -> None:
        """End the server: at once when idle; a job still running (its caller interrupted) is killed with its
        ranks after `grace_s` seconds rather than left to finish."""
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            if self.last_pid:
                try:
                    os.killpg(self.last_pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self._proc.kill()
            self._proc.wait()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--serve"]:
        return serve()
    if not argv or not argv[0].isdigit() or int(argv[0]) < 1:
        print("usage: python -m rackcast.backend.forkrun NPROC WORKER_ARGS... | --serve", file=sys.stderr)
        return 2
    return run(int(argv[0]), argv[1:])


if __name__ == "__main__":
    sys.exit(main())
