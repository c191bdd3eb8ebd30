"""Op records of the discrete-event step: what simulator.workload emits and simulator.step runs on one rank.

Every kind, in the order a rank meets them:

    Compute(name, seconds)      kernel time on the compute stream; slowed by comm_compute_slowdown while a
                                communication op of the rank is running (communication kernels take SMs)
    Host(name, seconds)         host time of framework ops (dispatch), on the compute stream, never slowed
    Start(key, comm)            start `comm` (a Comm) on its stream, asynchronously; `key` names it
    Wait(key, phase)            wait for the op started under `key`; time waited counts as `phase` (a PHASES name)
    Reduce(comm)                start a gradient reduction and forget it: the rank waits for all of them, as
                                exposed_dp_comm, before its optimizer step
    Memory(nbytes)              allocate (+) or release (-) bytes on this GPU (its peak is the memory figure)
"""

from __future__ import annotations

from typing import NamedTuple


class Comm(NamedTuple):  # immutable; a NamedTuple is cheaper to build than a frozen dataclass (thousands per step)
    """One communication op: a collective over a parallel axis, an all-to-all, a pipeline send or a host copy."""

    kind: str  # all_reduce | reduce_scatter | all_gather | shift | all_to_all | p2p | to_host | from_host
    axis: str  # a simulator.stepnet axis; for p2p the destination stage as text
    nbytes: float  # nccl-tests size (all_to_all: per-rank send buffer)
    stream: str  # tp | cp | ep | fsdp | dp | edp | pp | host: ops of one stream run one after another
    name: str
    a2a: tuple = ()  # all_to_all: (moe layer slot, micro-batch, direction "d" dispatch or "c" combine)
    lead_s: float = 0.0  # all_to_all: seconds paid on the stream besides the transfer (the forward dispatch's
    # count exchange, costs.count_exchange_time)


class Compute(NamedTuple):
    name: str
    seconds: float


class Host(NamedTuple):
    name: str
    seconds: float


class Start(NamedTuple):
    key: str
    comm: Comm


class Wait(NamedTuple):
    key: str
    phase: str


class Reduce(NamedTuple):
    comm: Comm


class Memory(NamedTuple):
    nbytes: float


Op = Compute | Host | Start | Wait | Reduce | Memory
