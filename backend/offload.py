"""Optimizer state in host memory (`optimizer.state_location: host`): the step runs on host copies of the weights.

`HostOptimizer(optimizer)` keeps an fp32 host copy of every parameter of a freshly built optimizer (pinned memory
on CUDA, so the copies are asynchronous DMA) and runs the optimizer's step with each parameter's data pointed at
its host copy (so its state, momentum and Adam moments, is allocated in host memory next to them), and per step: copies each gradient to the host, steps there, and copies the
updated weights back to the device. The host copy is the fp32 master; the device keeps only weights and gradients.
Traffic per step: one device->host copy of the gradients and one host->device copy of the weights.
On a CPU-only machine "host" and "device" are the same memory, but the same code path runs (separate host copies,
the step on them, the copies back), so it is tested on CPU.

Parameters that are DTensors (FSDP2 shards, expert-tensor slices) get host copies as DTensors on the same mesh when
the mesh is on the CPU, and for the step their local tensor is swapped for the host copy's (`_point`: assigning a
DTensor's `.data` leaves the local tensor its ops run on, so the step updated the device shards and the copy back
then overwrote them with the stale host copy; FSDP2 runs with host state trained other weights than one process
until this); on CUDA a sharded parameter's host copy would need a CPU mesh for MuonH's gather, which is not
implemented.

    opt = HostOptimizer(build_optimizer(model, "muonh"))
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from rackcast.errors import RackcastError


def _host_copy(p: torch.Tensor, pin: bool) -> torch.Tensor:
    if isinstance(p, DTensor):
        if p.device_mesh.device_type != "cpu":
            raise RackcastError("optimizer.state_location: host-resident state for sharded (fsdp) parameters is "
                                "implemented on CPU meshes only")
        return p.detach().clone()
    host = p.detach().to("cpu", copy=True)
    return host.pin_memory() if pin else host



def _point(p: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """Make parameter p compute with `data` (a host copy, or the device tensor given back) and return what it
    computed with before (for a DTensor: its local tensor). Assigning a DTensor parameter's `.data` does not reach
    its local tensor, on which its ops run, so a DTensor's local tensor is swapped instead."""
    if isinstance(p, DTensor):
        before = p._local_tensor
        p._local_tensor = data.to_local() if isinstance(data, DTensor) else data
        return before
    before = p.data
    p.data = data
    return before


class HostOptimizer:
    """An optimizer whose state and step live in host memory; the torch.optim.Optimizer surface the trainer uses.
    The wrapped optimizer keeps the model's own parameters in its groups (so checkpoints name them as usual); for
    the step each parameter's data is pointed at its host copy, so the state the optimizer allocates is on the host."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        if optimizer.state:
            raise ValueError("HostOptimizer needs an optimizer that has not stepped yet")
        self.inner = optimizer
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        pin = any(p.is_cuda for p in self.params)
        self.host = [_host_copy(p, pin) for p in self.params]

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @torch.no_grad()
    def step(self) -> None:
        device_data, stepped = [], []
        for p, host in zip(self.params, self.host):
            grad = p.grad
            stepped.append(grad is not None)
            device_data.append(_point(p, host))
            p.grad = None
            if grad is not None:
                p.grad = grad.to(host.device, non_blocking=True)
        if any(d.is_cuda for d in device_data):
            torch.cuda.synchronize()  # the gradients have landed in host memory
        try:
            self.inner.step()
        finally:
            for p, data, host, was in zip(self.params, device_data, self.host, stepped):
                p.grad = None
                _point(p, data)
                if was:
                    data.copy_(host.to_local() if isinstance(host, DTensor) else host, non_blocking=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)
        self.sync_from_device()

    def sync_from_device(self) -> None:
        """Refresh the host copies from the device weights (after the weights were loaded from a checkpoint)."""
        for p, host in zip(self.params, self.host):
            host.copy_(p.detach())
