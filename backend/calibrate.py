"""Measure this machine for `rackcast calibrate`: compute (backend.calibrate_compute) and collectives, on `world`
processes started with torch.multiprocessing (spawn), rendezvous on 127.0.0.1, gloo on CPU or NCCL on CUDA.

All ranks run the compute benchmarks at the same moment (barrier before each), as training processes share the
machine; rank 0's figures are kept. Collectives: all_reduce, all_gather (size = gathered output), reduce_scatter
(size = input per rank), all_to_all_single with even and uneven splits (size = bytes sent per rank), send/recv (one
way, from a ping-pong) over group sizes 2 and `world` (when larger), at several message sizes; the reported time is
rank 0's fastest sample per call (rackcast.spread.undisturbed). Results are plain data (JSON-able);
validation.calibration turns them into a topology.

    rackcast calibrate --quick --save-measurements meas.json      # measure, write the topology and the raw JSON
"""

from __future__ import annotations

import datetime
import os
import platform
import queue as queue_mod
import socket
import time
import traceback

import torch
import torch.distributed as dist

from rackcast.backend.calibrate_compute import run_compute, task_count
from rackcast.units import KIB, MIB
from rackcast.spread import undisturbed
from rackcast.backend.cpu_runtime import DEFAULT_THREADS, configure_cpu_process
from rackcast.backend.parallel import close_distributed
from rackcast.backend.speed_probe import calibration_probe

# torch 2.13 renamed the tensor forms; older versions only have the old names
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_uneven", "send_recv")


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def message_sizes(device: torch.device, quick: bool) -> tuple[int, ...]:
    if device.type == "cuda":
        return (1 << 16, 1 << 22, 1 << 27) if quick else (1 << 14, 1 << 17, 1 << 20, 1 << 23, 1 << 26, 1 << 29)
    return (1 << 14, 1 << 20, 1 << 23) if quick else (1 << 14, 1 << 17, 1 << 20, 1 << 23, 1 << 26)


def group_sizes(world: int) -> list[int]:
    return sorted({2, world}) if world >= 2 else []


def comm_task_count(device: torch.device, quick: bool, world: int) -> int:
    return len(group_sizes(world)) * len(KINDS) * len(message_sizes(device, quick))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _machine(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "platform": platform.platform(), "processor": platform.processor() or platform.machine()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device_name=props.name, device_memory_bytes=props.total_memory,
                    device_count=torch.cuda.device_count())
    else:
        info["device_name"] = "CPU process"
        try:
            for line in open("/proc/meminfo"):
                if line.startswith("MemTotal:"):
                    info["host_memory_bytes"] = int(line.split()[1]) * KIB  # /proc/meminfo counts kB
        except OSError:
            pass
    return info


def _host_link_Bps(device: torch.device, quick: bool) -> float:
    """One-way bulk copy bandwidth to the device: pinned host -> GPU on CUDA, a memcpy on CPU."""
    nbytes = (1 << 26) if quick else (1 << 28)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    from rackcast.backend.calibrate_compute import Timer

    t = Timer(device, samples=3, target_s=0.0)(lambda: dst.copy_(src, non_blocking=device.type == "cuda"))
    return nbytes / t


class _CommBench:
    def __init__(self, rank: int, world: int, device: torch.device, quick: bool, tick):
        self.rank, self.world, self.device, self.quick, self.tick = rank, world, device, quick, tick
        self.samples = 3 if quick else 5
        self.target_s = 0.02 if quick else 0.05

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _time(self, fn, member: bool) -> float:
        """Rank 0's seconds per call in its fastest sample (rackcast.spread.undisturbed); every rank runs the same
        number of calls (rank 0 decides)."""
        dist.barrier()
        if member:
            fn()
            self._sync()
        dist.barrier()
        t0 = time.perf_counter()
        if member:
            fn()
            self._sync()
        one = max(time.perf_counter() - t0, 1e-6)
        inner = torch.tensor([int(min(200, max(1, self.target_s / one)))], device=self.device)
        dist.broadcast(inner, 0)
        inner = int(inner.item())
        out = []
        for _ in range(self.samples):
            dist.barrier()
            t0 = time.perf_counter()
            if member:
                for _ in range(inner):
                    fn()
                self._sync()
            out.append((time.perf_counter() - t0) / inner)
        return undisturbed(out)

    def run(self) -> list[dict]:
        results = []
        for n in group_sizes(self.world):
            group = dist.new_group(list(range(n))) if n < self.world else None
            member = self.rank < n
            for nbytes in message_sizes(self.device, self.quick):
                for kind in KINDS:
                    fn = self._op(kind, n, nbytes, group) if member else None
                    t = self._time(fn, member)
                    results.append({"kind": kind, "group": n, "bytes": nbytes, "seconds": t})
                    self.tick(f"{kind} n={n} {nbytes / MIB:.3g} MiB")
        return results

    def _op(self, kind: str, n: int, nbytes: int, group):
        elems = max(nbytes // 4, n * n * 6)
        elems -= elems % (n * n * 6)  # divisible by every split used below
        dev = self.device
        if kind == "all_reduce":
            buf = torch.ones(elems, device=dev)
            return lambda: dist.all_reduce(buf, group=group)
        if kind == "all_gather":
            inp, out = torch.ones(elems // n, device=dev), torch.empty(elems, device=dev)
            return lambda: _all_gather(out, inp, group=group)
        if kind == "reduce_scatter":
            inp, out = torch.ones(elems, device=dev), torch.empty(elems // n, device=dev)
            return lambda: _reduce_scatter(out, inp, group=group)
        if kind.startswith("all_to_all"):
            inp, out = torch.ones(elems, device=dev), torch.empty(elems, device=dev)
            if kind == "all_to_all":
                return lambda: dist.all_to_all_single(out, inp, group=group)
            # Uneven: rank r sends weight ((r + j) % n) + 1 to peer j; symmetric in (r, j), so every rank sends and
            # receives the same total and the receive splits equal the send splits.
            unit = elems // (n * (n + 1) // 2)
            splits = [unit * (((self.rank + j) % n) + 1) for j in range(n)]
            splits[-1] += elems - sum(splits)
            return lambda: dist.all_to_all_single(out, inp, splits, splits, group=group)
        # send_recv: ping-pong between ranks 0 and 1; one way is half of it
        buf = torch.ones(elems, device=dev)
        peer = 1 - self.rank

        def pingpong():
            if self.rank == 0:
                dist.send(buf, peer, group=group) if group is None else dist.send(buf, group_dst=peer, group=group)
                dist.recv(buf, peer, group=group) if group is None else dist.recv(buf, group_src=peer, group=group)
            elif self.rank == 1:
                dist.recv(buf, peer, group=group) if group is None else dist.recv(buf, group_src=peer, group=group)
                dist.send(buf, peer, group=group) if group is None else dist.send(buf, group_dst=peer, group=group)
        if n > 2:  # point-to-point involves ranks 0 and 1 only; the others take part in nothing
            return pingpong if self.rank < 2 else (lambda: None)
        return pingpong


def _mean_over_ranks(values: list[float], world: int, device: torch.device) -> list[float]:
    if world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / world).tolist()


def _worker(rank: int, world: int, port: int, quick: bool, q, threads: int = 0) -> None:
    finished = False
    try:
        device = default_device()
        if device.type == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        else:
            configure_cpu_process(threads, local_rank=rank)
        if world > 1:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                                    init_method=f"tcp://127.0.0.1:{port}",
                                    **({"device_id": device} if device.type == "cuda" else {}))
        tick = (lambda label: q.put(("tick", label))) if rank == 0 else (lambda label: None)
        barrier = dist.barrier if world > 1 else (lambda: None)
        compute = run_compute(device, quick, tick, barrier)
        compute["speed_probe"] = calibration_probe(device, barrier, lambda s: _mean_over_ranks(s, world, device))
        barrier()
        compute["host_link_Bps"] = _host_link_Bps(device, quick)
        comm = _CommBench(rank, world, device, quick, tick).run() if world > 1 else []
        if rank == 0:
            q.put(("result", {"compute": compute, "collectives": comm}))
        finished = True
    except Exception:  # reported to the parent, which raises it there
        q.put(("error", f"rank {rank}: {traceback.format_exc()}"))
    finally:
        close_distributed(finished)


def measure(world: int, quick: bool = False, on_tick=None, threads: int = 0) -> dict:
    """Run every benchmark on `world` processes (CPU: `threads` torch threads each, by default what the trainer
    takes for as many processes, backend.cpu_runtime.DEFAULT_THREADS);
    on_tick(label, done, total) reports progress."""
    import torch.multiprocessing as mp

    device = default_device()
    total = task_count(device, quick) + 1 + comm_task_count(device, quick, world)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    q = mp.get_context("spawn").Queue()
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.perf_counter()
    ctx = mp.start_processes(_worker, args=(world, _free_port(), quick, q, threads), nprocs=world, join=False,
                             start_method="spawn")
    done, result = 0, None
    try:
        while result is None:
            try:
                tag, payload = q.get(timeout=0.5)
            except queue_mod.Empty:
                try:
                    if ctx.join(timeout=0):  # all exited without a result
                        raise RuntimeError("calibration workers exited without a result")
                except mp.ProcessExitedException as exc:
                    raise RuntimeError(f"a calibration worker failed: {exc}") from None
                continue
            if tag == "tick":
                done += 1
                if on_tick:
                    on_tick(payload, done, total)
            elif tag == "error":
                raise RuntimeError(payload)
            else:
                result = payload
        while not ctx.join(timeout=30):
            pass
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
    result.update(world=world, quick=quick, device=device.type, machine=_machine(device),
                  threads=(threads or DEFAULT_THREADS) if device.type == "cpu" else 0,
                  started_utc=started.isoformat(timespec="seconds"), wall_s=time.perf_counter() - t0)
    return result
