"""Optimizer state in host memory (`optimizer.state_location: host`): the step runs on host copies of the weights.

`HostOptimizer(optimizer)` keeps an fp32 host copy of every parameter of a freshly built optimizer (pinned memory
on CUDA, so the copies are asynchronous DMA) and points the optimizer's groups at those copies before it has any
state (so its state, momentum and Adam moments, is allocated in host memory next to them), and per step: copies each gradient to the host, steps there, and copies the
updated weights back to the device. The host copy is the fp32 master; the device keeps only weights and gradients.
Traffic per step: one device->host copy of the gradients and one host->device copy of the weights.
On a CPU-only machine "host" and "device" are the same memory, but the same code path runs (separate host copies,
the step on them, the copies back), so it is tested on CPU.

Parameters that are DTensors (FSDP2 shards) get host copies as DTensors on the same mesh when the mesh is on the
CPU; on CUDA a sharded parameter's host copy would need a CPU mesh for MuonH's gather, which is not implemented.

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


class HostOptimizer:
    """An optimizer whose state and step live in host memory; the torch.optim.Optimizer surface the trainer uses."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        if optimizer.state:
            raise ValueError("HostOptimizer needs an optimizer that has not stepped yet")
        self.device_params = [p for g in optimizer.param_groups for p in g["params"]]
        pin = any(p.is_cuda for p in self.device_params)
        host = {id(p): nn.Parameter(_host_copy(p, pin), requires_grad=p.requires_grad) for p in self.device_params}
        for group in optimizer.param_groups:
            group["params"] = [host[id(p)] for p in group["params"]]
        self.host_params = [host[id(p)] for p in self.device_params]
        self.inner = optimizer

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @torch.no_grad()
    def step(self) -> None:
        for dev, host in zip(self.device_params, self.host_params):
            host.grad = None if dev.grad is None else dev.grad.to(host.device, non_blocking=True)
        if any(p.is_cuda for p in self.device_params):
            torch.cuda.synchronize()  # the gradients have landed in host memory
        self.inner.step()
        for dev, host in zip(self.device_params, self.host_params):
            if dev.grad is not None:
                dev.copy_(host, non_blocking=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for dev, host in zip(self.device_params, self.host_params):
            dev.grad = None
            host.grad = None

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)
        for dev, host in zip(self.device_params, self.host_params):
            host.detach().copy_(dev.detach())
