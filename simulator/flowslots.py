"""Compiled bookkeeping of simulator.network's flow slots: draining flows over a time step, retiring finished ones,
gathering the active flows as a CSR incidence for the max-min fair solve (simulator.fairshare) and writing their
rates back, and filling the slots of a new batch. Each kernel works on the Network's slot arrays in place; the
fused ones (`_drain`, `_resolve`) run several steps in one numba dispatch, with the same arithmetic in the same
order, so the simulated step stays bit for bit the same (tests/test_step_digest.py).

Tests: `.venv/bin/pytest -q tests/test_network.py tests/test_step_digest.py`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from rackcast.simulator.fairshare import maxmin_rates


@njit(cache=True)
def _advance(active, size, remaining, rate, dt, eps):
    """The active slots (ascending) after their flows drained `dt` seconds at their rates, which of them have
    (nearly) nothing left (remaining <= rate x eps), and how many."""
    n = 0
    for i in range(size):
        n += active[i]
    act = np.empty(n, np.int64)
    finished = np.empty(n, np.bool_)
    j = done = 0
    for i in range(size):
        if active[i]:
            if dt > 0:
                remaining[i] -= rate[i] * dt
            act[j] = i
            finished[j] = remaining[i] <= rate[i] * eps
            done += finished[j]
            j += 1
    return act, finished, done


@njit(cache=True)
def _changed(load, previous):
    """Indices (ascending) where load differs from previous."""
    n = 0
    for i in range(load.shape[0]):
        n += load[i] != previous[i]
    out = np.empty(n, np.int64)
    j = 0
    for i in range(load.shape[0]):
        if load[i] != previous[i]:
            out[j] = i
            j += 1
    return out


@njit(cache=True)
def _gather_active(active, size, nhops, hops, caps):
    """The active slots (ascending) and their flows as CSR rows of link indices, with their rate caps."""
    n = 0
    for i in range(size):
        n += active[i]
    act = np.empty(n, np.int64)
    indptr = np.zeros(n + 1, np.int64)
    j = 0
    for i in range(size):
        if active[i]:
            act[j] = i
            indptr[j + 1] = indptr[j] + nhops[i]
            j += 1
    indices = np.empty(indptr[n], np.int64)
    flow_caps = np.empty(n)
    for j in range(n):
        s = act[j]
        flow_caps[j] = caps[s]
        for k in range(nhops[s]):
            indices[indptr[j] + k] = hops[s, k]
    return act, indptr, indices, flow_caps


@njit(cache=True)
def _apply_rates(act, indptr, indices, rates, remaining, rate, links, track):
    """Write the solved rates to their slots; returns the earliest time one of the flows finishes from now and
    the bytes/s in use per link (summed in the order np.bincount would)."""
    load = np.zeros(links)
    t_min = np.inf
    for j in range(act.shape[0]):
        s = act[j]
        rate[s] = rates[j]
        t = remaining[s] / rates[j]
        if t < t_min:
            t_min = t
        if track:
            for k in range(indptr[j], indptr[j + 1]):
                load[indices[k]] += rates[j]
    return t_min, load


@njit(cache=True)
def _resolve(active, size, nhops, hops, caps, capacity, remaining, rate, track):
    """Gather the active flows, solve their max-min fair rates (fairshare.maxmin_rates) and write them to their
    slots, in one compiled call (one dispatch instead of three; the same steps as `_gather_active`, the solver and
    `_apply_rates`, so the same rates bit for bit). Returns the active flow count, the earliest time one of them
    finishes from now (inf when none) and the bytes/s in use per link (zeros when none, or when not tracked)."""
    act, indptr, indices, flow_caps = _gather_active(active, size, nhops, hops, caps)
    if act.shape[0] == 0:
        return 0, np.inf, np.zeros(capacity.shape[0])
    rates = maxmin_rates(indptr, indices, capacity, flow_caps)
    t_min, load = _apply_rates(act, indptr, indices, rates, remaining, rate, capacity.shape[0], track)
    return act.shape[0], t_min, load


@njit(cache=True)
def _batch(wire, nhops, lat, now):
    """Which flows of a batch move bytes over links, how many, when the others are delivered (now + their latency,
    the latest; now when none), and whether any byte count is negative."""
    moving = np.empty(wire.shape[0], np.bool_)
    m = 0
    deliver = now
    negative = False
    for i in range(wire.shape[0]):
        negative |= wire[i] < 0
        moving[i] = wire[i] > 0 and nhops[i] > 0
        if moving[i]:
            m += 1
        elif now + lat[i] > deliver:
            deliver = now + lat[i]
    return moving, m, deliver, negative


@njit(cache=True)
def _fill_slots(slots, moving, hops, nhops, wire, caps, lat, now, gid, first_flow, s_hops, s_nhops, s_remaining,
                s_wire, s_rate, s_cap, s_lat, s_start, s_group, s_flow_id):
    """Write the moving flows of a batch (rows of hops where `moving`) into their slots, in row order."""
    j = 0
    for i in range(hops.shape[0]):
        if not moving[i]:
            continue
        s = slots[j]
        s_hops[s, :] = -1
        for k in range(hops.shape[1]):
            s_hops[s, k] = hops[i, k]
        s_nhops[s] = nhops[i]
        s_remaining[s] = wire[i]
        s_wire[s] = wire[i]
        s_rate[s] = 0.0
        s_cap[s] = caps[i]
        s_lat[s] = lat[i]
        s_start[s] = now
        s_group[s] = gid
        s_flow_id[s] = first_flow + j
        j += 1


@njit(cache=True)
def _finish_slots(slots, flow_id, active, rate, lat, group, now):
    """Retire finished flows: their slots in start order (deactivated, rate 0), their delivery times, and per
    group they belong to (ascending): how many finished and the latest delivery."""
    slots = slots[np.argsort(flow_id[slots], kind="mergesort")]
    deliver = np.empty(slots.shape[0])
    for j in range(slots.shape[0]):
        s = slots[j]
        active[s] = False
        rate[s] = 0.0
        deliver[j] = now + lat[s]
    gids = group[slots]
    order = np.argsort(gids, kind="mergesort")
    uniq = np.empty(slots.shape[0], np.int64)
    counts = np.zeros(slots.shape[0], np.int64)
    latest = np.full(slots.shape[0], -np.inf)
    n = -1
    for j in order:
        g = gids[j]
        if n < 0 or uniq[n] != g:
            n += 1
            uniq[n] = g
        counts[n] += 1
        if deliver[j] > latest[n]:
            latest[n] = deliver[j]
    return slots, deliver, uniq[: n + 1], counts[: n + 1], latest[: n + 1]


@njit(cache=True)
def _drain(active, size, remaining, rate, dt, eps, flow_id, lat, group, now):
    """`_advance` then, for the flows it found finished, `_finish_slots`, in one compiled call. Returns how many
    finished and `_finish_slots`'s arrays (empty when none finished)."""
    act, finished, done = _advance(active, size, remaining, rate, dt, eps)
    slots, deliver, uniq, counts, latest = _finish_slots(act[finished], flow_id, active, rate, lat, group, now)
    return done, slots, deliver, uniq, counts, latest
