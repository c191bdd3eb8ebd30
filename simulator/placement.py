"""Placement of a plan's parallel groups on the hardware: which groups stay inside one scale-up domain.

Ranks are numbered with the innermost axis fastest: tensor, context, fsdp, data, then pipeline outermost; GPUs of
one domain hold consecutive ranks. A group is the set of ranks that differ only along its axis (or, for experts,
a run of consecutive ranks of the folded tensor x context x fsdp x data grid). A group whose ranks all fall in one
domain talks over NVLink ("scale_up"); otherwise its traffic crosses the NICs ("scale_out").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from rackcast.plan import Plan


@dataclass(frozen=True)
class Group:
    size: int
    stride: int  # rank distance between neighbours in the group
    span: Literal["scale_up", "scale_out"]
    per_domain: int  # members that share one domain
    domains: int  # domains the group touches


def make_group(size, stride, usable_per_domain) -> Group:
    """The group of ranks 0, stride, ..., (size - 1) x stride, in closed form (O(1) for groups of millions): the
    first domain holds the members below usable_per_domain; members fewer than a domain apart touch every domain
    from the first to the last one's, members a domain or more apart one domain each. Arrays of sizes, strides or
    GPUs per domain give a Group of arrays (simulator.plan_arrays)."""
    u = usable_per_domain
    per_domain = np.minimum(size, (u - 1) // stride + 1)
    domains = np.where(stride < u, (size - 1) * stride // u + 1, size)
    span = np.where(domains == 1, "scale_up", "scale_out")
    if np.ndim(domains) == 0:
        per_domain, domains, span = int(per_domain), int(domains), str(span)
    return Group(size=size, stride=stride, span=span, per_domain=per_domain, domains=domains)


@dataclass(frozen=True)
class Placement:
    tensor: Group
    context: Group
    fsdp: Group
    data: Group
    pipeline: Group
    expert: Group  # the ranks that split the experts (expert x expert_tensor)
    expert_data: Group  # the copies of one expert slice
    expert_fsdp: Group  # the copies of one expert slice that shard its parameters ZeRO-3 style
    expert_replicas: Group  # the remaining copies, holding the same shard (their gradients are all-reduced)
    dense_replicas: Group  # fsdp x data x context as one group (gradient reduction of dense parameters)
    inner: Group  # the fsdp x context group: the inner level of a reduction over the token-sharding ranks


def place(plan, usable_per_domain) -> Placement:
    """Where a plan's groups lie; for PlanArrays (and arrays of GPUs per domain) every group's fields are arrays."""
    par = plan.parallel
    u = usable_per_domain
    t, c, f, d = par.tensor, par.context, par.fsdp, par.data
    ep, efsdp = par.expert_group, par.expert_fsdp
    return Placement(
        tensor=make_group(t, 1, u),
        context=make_group(c, t, u),
        fsdp=make_group(f, t * c, u),
        data=make_group(d, t * c * f, u),
        pipeline=make_group(par.pipeline, t * c * f * d, u),
        expert=make_group(ep, 1, u),
        expert_data=make_group(par.expert_data, ep, u),
        expert_fsdp=make_group(efsdp, ep, u),
        expert_replicas=make_group(par.expert_replicas, ep * efsdp, u),
        dense_replicas=make_group(par.reduction_inner * par.reduction_outer, t, u),
        inner=make_group(par.reduction_inner, t, u),
    )
