"""How a training run is started: the torchrun command line, the worker environment and the launcher's process
handling, in one place.

`rackcast train`, `rackcast validate` and the multi-process tests all start the trainer worker
(`python -m rackcast.backend.train`) through `torchrun_command` with the environment from `worker_env`.

Nodes: one machine by default (c10d rendezvous on a free loopback port). Several machines run the same
`rackcast train PLAN --nnodes N --rdzv-endpoint HOST:PORT` on each node (torchrun's own c10d rendezvous, hosted by the
node whose address is HOST; global ranks follow the order in which the nodes join). With `--node-rank R` as well,
torchrun's static rendezvous is used instead and node R gets ranks [R x nproc, (R+1) x nproc).
Under a launcher that already started every process (`srun`, `torchrun`, a Kubernetes PyTorchJob) the worker runs
directly (`launcher_env`: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; under srun SLURM_PROCID / SLURM_NTASKS /
SLURM_LOCALID stand in for the first two and LOCAL_RANK).

Network interface: `--ifname IF` sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME; values already in the environment
are kept; loopback (`lo`) is only the default of a one-node run.

Processes: torchrun starts each worker in a session of its own, so a signal to the launcher's process group never
reaches the workers. `supervise` therefore runs torchrun in a new session, forwards SIGINT / SIGTERM / SIGHUP to it
(torchrun then stops its workers), kills its whole session if it has not finished SHUTDOWN_GRACE_S later, and asks
the kernel to send torchrun SIGTERM should the launcher itself die (PR_SET_PDEATHSIG, kept across exec). Each worker
watches its parent the same way (`exit_with_parent`), so a torchrun killed with SIGKILL leaves no worker behind.
Checkpoints are written atomically (backend.checkpoint), so a run stopped at any moment keeps its last complete one.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

WORKER_MODULE = "rackcast.backend.train"
LOOPBACK_IFNAME = "lo"
LOOPBACK_ENDPOINT = "127.0.0.1:0"  # one node: c10d rendezvous on a free loopback port
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
SHUTDOWN_GRACE_S = 60.0  # torchrun waits up to 30 s for its workers after SIGTERM before it kills them
SUPERVISE_POLL_S = 0.5  # how often the launcher looks at torchrun while it runs
PARENT_POLL_S = 1.0  # how often a worker checks that its parent is alive where PR_SET_PDEATHSIG is unavailable
PR_SET_PDEATHSIG = 1  # prctl option, <linux/prctl.h>
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# The trainer measures one step's memory with torch's profiler (backend.memprof), which made every run print three
# lines: kineto announces each profiler start and stop at its USDT log level (5, its highest, so only
# KINETO_LOG_LEVEL=6 silences it), and c10's CPU allocator warns that frees of blocks allocated before profiling are
# not reported, which memprof expects and accounts for (a c10 LOG(WARNING); TORCH_CPP_LOG_LEVEL=ERROR keeps errors).
# Both are read when torch loads, so they go in the worker's environment; set them yourself to see the lines again.
QUIET_PROFILER_ENV = {"KINETO_LOG_LEVEL": "6", "TORCH_CPP_LOG_LEVEL": "ERROR"}


@dataclass(frozen=True)
class Nodes:
    """Where a run's processes live: `nnodes` machines of `nproc_per_node` processes meeting at `rdzv_endpoint`."""

    nnodes: int = 1
    nproc_per_node: int | None = None  # None: the plan's world size / nnodes
    rdzv_endpoint: str | None = None  # HOST:PORT; None: a free loopback port (one node only)
    node_rank: int | None = None  # given: static rendezvous with this node rank; None: c10d, ranks in join order
    rdzv_id: str = "rackcast"

    def per_node(self, world: int) -> int:
        return self.nproc_per_node if self.nproc_per_node is not None else world // self.nnodes

    def check(self, world: int) -> None:
        """ValueError (one line) when these nodes cannot host a plan of `world` processes."""
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be at least 1, got {self.nnodes}")
        if self.nproc_per_node is None and world % self.nnodes:
            raise ValueError(f"the plan needs {world} processes, which {self.nnodes} nodes cannot share evenly; "
                             f"pass --nproc-per-node")
        if self.per_node(world) < 1 or self.nnodes * self.per_node(world) != world:
            raise ValueError(f"the plan needs {world} processes, the launch provides {self.nnodes} nodes x "
                             f"{self.per_node(world)} = {self.nnodes * self.per_node(world)}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
        if self.rdzv_endpoint is not None:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--rdzv-endpoint must be HOST:PORT, got {self.rdzv_endpoint!r}")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must lie in [0, {self.nnodes}), got {self.node_rank}")


def torchrun_command(plan_path: str, world: int, worker_args: list[str], nodes: Nodes | None = None) -> list[str]:
    """torchrun for this node's share of `world` processes, no restarts (one node on loopback by default)."""
    nodes = nodes or Nodes()
    nodes.check(world)
    endpoint = nodes.rdzv_endpoint or LOOPBACK_ENDPOINT
    rdzv = ["--rdzv-backend", "c10d"] if nodes.node_rank is None else \
        ["--rdzv-backend", "static", "--node-rank", str(nodes.node_rank)]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes.nnodes),
            "--nproc-per-node", str(nodes.per_node(world)), *rdzv, "--rdzv-endpoint", endpoint,
            "--rdzv-id", nodes.rdzv_id, "--max-restarts", "0",
            "-m", WORKER_MODULE, "--plan", plan_path, *worker_args]


def worker_command(plan_path: str, worker_args: list[str]) -> list[str]:
    """One process without torchrun (a one-process plan)."""
    return [sys.executable, "-m", WORKER_MODULE, "--plan", plan_path, *worker_args]


def worker_env(extra: dict[str, str] | None = None, override: bool = False, *, ifname: str | None = None,
               nnodes: int = 1) -> dict[str, str]:
    """The environment a worker runs in: one OpenMP thread, quiet profiler logging (QUIET_PROFILER_ENV) and, on one
    node, gloo on loopback, unless the caller's environment already says otherwise (override=True forces them, as the measurement suite does). `ifname` names
    the network interface for gloo and NCCL (it wins over the environment)."""
    env = dict(os.environ)
    defaults = {"OMP_NUM_THREADS": "1", **QUIET_PROFILER_ENV}
    if nnodes == 1 and ifname is None:
        defaults["GLOO_SOCKET_IFNAME"] = LOOPBACK_IFNAME
    for key, value in defaults.items():
        if override:
            env[key] = value
        else:
            env.setdefault(key, value)
    if ifname is not None:
        env.update({key: ifname for key in IFNAME_VARIABLES})
    env.update(extra or {})
    return env


# ---------------------------------------------------------------------------------------------- existing launcher
def launcher_env(environ: dict[str, str] | None = None) -> dict[str, str] | None:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE as an existing launcher provides them (torchrun or a
    PyTorchJob directly, srun through SLURM_*), or None when this process was not started by one."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        out = {"RANK": env["RANK"], "WORLD_SIZE": env["WORLD_SIZE"]}
        out["LOCAL_RANK"] = env.get("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        out = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"],
               "LOCAL_RANK": env.get("SLURM_LOCALID", "0")}
    else:
        return None
    local_world = env.get("LOCAL_WORLD_SIZE") or env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    if local_world:
        out["LOCAL_WORLD_SIZE"] = local_world
    return out


def missing_rendezvous(env: dict[str, str]) -> list[str]:
    """The variables a process started by another launcher still needs to find its peers."""
    return [key for key in ("MASTER_ADDR", "MASTER_PORT") if not env.get(key)]


# ---------------------------------------------------------------------------------------------- processes
def _set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send `sig` to this process when its parent dies; False where prctl is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def exit_with_parent() -> None:
    """Make this process end when the process that started it ends (a worker whose torchrun was killed)."""
    parent = os.getppid()
    if _set_parent_death_signal() and os.getppid() == parent:
        return

    def watch():
        while os.getppid() == parent:
            threading.Event().wait(PARENT_POLL_S)
        os._exit(128 + signal.SIGTERM)

    if os.getppid() != parent:
        os._exit(128 + signal.SIGTERM)
    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _kill_session(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def supervise(cmd: list[str], env: dict[str, str]) -> tuple[int, str | None]:
    """Run torchrun (cmd) in a new session and return (exit code, name of the signal that stopped us or None).

    A signal the launcher receives is forwarded to torchrun as SIGTERM; torchrun stops its workers; after
    SHUTDOWN_GRACE_S its session is killed. torchrun is also killed when this function leaves in any other way,
    and by the kernel should this process die."""
    received: list[int] = []
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_set_parent_death_signal)

    def forward(signum, _frame):
        received.append(signum)
        _kill_session(proc, signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    deadline = None
    try:
        while True:
            try:
                code = proc.wait(timeout=SUPERVISE_POLL_S)
                break
            except subprocess.TimeoutExpired:
                if received and deadline is None:
                    deadline = time.monotonic() + SHUTDOWN_GRACE_S
                if deadline is not None and time.monotonic() > deadline:
                    _kill_session(proc, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            _kill_session(proc, signal.SIGKILL)
            proc.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code, signal.Signals(received[0]).name if received else None
