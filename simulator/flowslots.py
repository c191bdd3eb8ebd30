"""Compiled bookkeeping of simulator.network's flow slots: starting a batch of flows in free slots, draining flows
over a time step, retiring finished ones, gathering the active flows as a CSR incidence for the max-min fair solve
(simulator.fairshare) and writing their rates back. Each kernel works on the Network's slot arrays in place:

    fl      float64 (F_ROWS, slots): remaining wire bytes, rate, rate cap, route latency, start time, wire bytes;
            F_OUT, F_OUT_GROUP: output rows (delivery times of the flows, then of the groups, that finished)
    ii      int64 (I_ROWS, slots): hop count, flow id (start order), group (the batch a flow belongs to), active
            (0/1), a stack of reusable slots (I_FREE), slots started since the last update (I_PEND); I_OUT,
            I_OUT_GROUP: output rows (the slots, then the groups, that finished)
    hops    int64 (slots, width): link indices, -1 padded
    cnt     int64 (C_ROWS): slots ever used, free slots, next flow id, pending slots
    links   float64 (L_ROWS, links): capacity, bytes/s in use (L_LOAD, written by `_step`)
    groups  float64 (G_ROWS, groups): per batch, flows still moving and its latest delivery so far
    ints, floats: the solve's working arrays (workspace_sizes; any content), kept by the Network

`allot` packs all eight into one float64 and one int64 buffer (sizes in the int buffer's header); `_start` and
`_step` take the two buffers and `unpack` them into these views. Few, packed arguments (numba unboxes each array argument on every call, ~0.2 us each), results written into
preallocated rows and no allocations in an update (working arrays are slices of kept buffers; a few flows finish
per update, sorted by insertion) keep numba's per-call cost down (the step simulator makes tens of thousands of
calls per step). `_step` runs a whole network update (drain, retire, activate, solve) in one dispatch. The
arithmetic and its order are those of the per-array kernels it replaced, so the simulated step stays bit for bit
the same (tests/test_step_digest.py).

Tests: `.venv/bin/pytest -q tests/test_flowslots.py tests/test_network.py tests/test_step_digest.py`.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from rackcast.simulator.fairshare import maxmin_rates_into, maxmin_workspace


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
    n_slots = active.shape[0]
    act, indptr = np.empty(n_slots, np.int64), np.empty(n_slots + 1, np.int64)
    indices, flow_caps = np.empty(n_slots * hops.shape[1], np.int64), np.empty(n_slots)
    n, nnz = _gather_active_into(active, size, nhops, hops, caps, act, indptr, indices, flow_caps)
    return act[:n], indptr[: n + 1], indices[:nnz], flow_caps[:n]


@njit(cache=True)
def _gather_active_into(active, size, nhops, hops, caps, act, indptr, indices, flow_caps):
    """_gather_active into given arrays (room for every slot); returns the active flows and CSR entries written."""
    n = 0
    indptr[0] = 0
    for i in range(size):
        if active[i]:
            act[n] = i
            indptr[n + 1] = indptr[n] + nhops[i]
            n += 1
    for j in range(n):
        s = act[j]
        flow_caps[j] = caps[s]
        for k in range(nhops[s]):
            indices[indptr[j] + k] = hops[s, k]
    return n, indptr[n]


@njit(cache=True)
def _apply_rates(act, indptr, indices, rates, remaining, rate, links, track):
    """Write the solved rates to their slots; returns the earliest time one of the flows finishes from now and
    the bytes/s in use per link (summed in the order np.bincount would)."""
    load = np.zeros(links)
    return _apply_rates_into(act, indptr, indices, rates, remaining, rate, load, track), load


@njit(cache=True)
def _apply_rates_into(act, indptr, indices, rates, remaining, rate, load, track):
    """_apply_rates writing the bytes/s in use per link into `load` when tracked (else `load` is left as it is)."""
    if track:
        for k in range(load.shape[0]):
            load[k] = 0.0
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
    return t_min


def workspace_sizes(slots: int, width: int, links: int) -> tuple[int, int]:
    """How many int64 and float64 values `_resolve` needs for `slots` flow slots of up to `width` hops."""
    ints, floats = maxmin_workspace(slots, links, slots * width)
    return 2 * slots + 1 + slots * width + ints, 2 * slots + floats


@njit(cache=True)
def _resolve(active, size, nhops, hops, caps, capacity, remaining, rate, track, load, ints, floats):
    """Gather the active flows, solve their max-min fair rates (fairshare.maxmin_rates) and write them to their
    slots, in one compiled call (the same steps as `_gather_active`, the solver and `_apply_rates`, so the same rates
    bit for bit), with the working arrays carved out of `ints` and `floats` (workspace_sizes: allocations would cost
    more than the arithmetic). Writes the bytes/s in use per link into `load` when tracked (zeros when none are
    active); returns the active flow count and the earliest time one of them finishes from now (inf when
    none)."""
    n_slots, width = active.shape[0], hops.shape[1]
    act, indptr, ints = ints[:n_slots], ints[n_slots: 2 * n_slots + 1], ints[2 * n_slots + 1:]
    indices, ints = ints[: n_slots * width], ints[n_slots * width:]
    flow_caps, rates, floats = floats[:n_slots], floats[n_slots: 2 * n_slots], floats[2 * n_slots:]
    n, nnz = _gather_active_into(active, size, nhops, hops, caps, act, indptr, indices, flow_caps)
    if n == 0:
        for k in range(load.shape[0] if track else 0):
            load[k] = 0.0
        return 0, np.inf
    maxmin_rates_into(indptr[: n + 1], indices[:nnz], capacity, flow_caps[:n], rates[:n], ints, floats)
    t_min = _apply_rates_into(act[:n], indptr[: n + 1], indices[:nnz], rates[:n], remaining, rate, load, track)
    return n, t_min


F_REM, F_RATE, F_CAP, F_LAT, F_START, F_WIRE, F_OUT, F_OUT_GROUP = range(8)
F_ROWS = 8
I_NHOPS, I_FLOW, I_GROUP, I_ACTIVE, I_FREE, I_PEND, I_OUT, I_OUT_GROUP = range(8)
I_ROWS = 8
C_SIZE, C_FREE, C_FLOW, C_PEND = range(4)
C_ROWS = 4
L_CAP, L_LOAD = range(2)
L_ROWS = 2
G_LEFT, G_LATEST = range(2)
G_ROWS = 2


# The packed buffers (`allot`): ints = header (H_SLOTS, H_WIDTH, H_LINKS, H_GROUPS: the sizes), cnt, ii, hops, the
# solve's ints; floats = fl, links, groups, the solve's floats. Two array arguments per compiled call instead of
# eight: numba unboxes every array argument on every call, and the step simulator makes tens of thousands.
H_SLOTS, H_WIDTH, H_LINKS, H_GROUPS = range(4)
H_ROWS = 4


@njit(cache=True)
def unpack(fbuf, ibuf):
    """The views (fl, ii, hops, cnt, links, groups, ints, floats) of packed buffers (see `allot`)."""
    slots, width, n_links, n_groups = ibuf[H_SLOTS], ibuf[H_WIDTH], ibuf[H_LINKS], ibuf[H_GROUPS]
    i = H_ROWS + C_ROWS
    cnt = ibuf[H_ROWS: i]
    ii = ibuf[i: i + I_ROWS * slots].reshape((I_ROWS, slots))
    i += I_ROWS * slots
    hops = ibuf[i: i + slots * width].reshape((slots, width))
    f = F_ROWS * slots
    fl = fbuf[:f].reshape((F_ROWS, slots))
    links = fbuf[f: f + L_ROWS * n_links].reshape((L_ROWS, n_links))
    f += L_ROWS * n_links
    groups = fbuf[f: f + G_ROWS * n_groups].reshape((G_ROWS, n_groups))
    return fl, ii, hops, cnt, links, groups, ibuf[i + slots * width:], fbuf[f + G_ROWS * n_groups:]


def allot(slots: int, width: int, n_links: int, n_groups: int, old: tuple | None = None):
    """Packed buffers (floats, ints) for `slots` flow slots of up to `width` hops, `n_links` links and `n_groups`
    groups, and their views (`unpack`), holding `old`'s views' contents (each at least as large) when given, else
    empty slots (hops -1) and links with no capacity set."""
    ints, floats = workspace_sizes(slots, width, n_links)
    ibuf = np.zeros(H_ROWS + C_ROWS + (I_ROWS + width) * slots + ints, dtype=np.int64)
    fbuf = np.zeros(F_ROWS * slots + L_ROWS * n_links + G_ROWS * n_groups + floats)
    ibuf[:H_ROWS] = slots, width, n_links, n_groups
    views = unpack(fbuf, ibuf)
    fl, ii, hops, cnt, links, groups = views[:6]
    hops.fill(-1)
    if old is not None:
        o_fl, o_ii, o_hops, o_cnt, o_links, o_groups = old[:6]
        fl[:, : o_fl.shape[1]] = o_fl
        ii[:, : o_ii.shape[1]] = o_ii
        hops[: o_hops.shape[0], : o_hops.shape[1]] = o_hops
        cnt[:] = o_cnt
        links[:] = o_links
        groups[:, : o_groups.shape[1]] = o_groups
    return fbuf, ibuf, views


def _item(x, i):
    """x[i], or x itself when x is one value for all. Compiled code takes `_item_overload`, which picks by x's type
    when numba types the call; this body is what plain Python runs."""
    return x[i] if isinstance(x, np.ndarray) else x


@overload(_item)
def _item_overload(x, i):
    if isinstance(x, types.Array):
        return lambda x, i: x[i]
    return lambda x, i: x


@njit(cache=True)
def _start(hops, nhops, nbytes, efficiency, caps, lat, now, gid, fbuf, ibuf):
    """Start a batch (rows of hops, hop counts, bytes and rate caps (each an array, or one value for all), route
    latencies) as group `gid` in free slots, reused ones first (the most recently freed last), then fresh ones, in
    row order; a flow puts nbytes / efficiency on the wire; flows with no bytes or no link are not started. Sets the
    group's flows still moving and latest delivery so far (groups rows G_LEFT, G_LATEST) when it started any.
    Returns how many were started, when the others are delivered (now + their latency, the latest; now when none)
    and whether a byte count is negative (nothing is started then); or, when the slot arrays lack room for every
    row (fresh slots, hop columns, or the group's column), -1 and nothing is started. fbuf, ibuf: the packed slot
    arrays (`allot`)."""
    fl, ii, s_hops, cnt, _, groups, _, _ = unpack(fbuf, ibuf)
    k = nhops.shape[0]
    if cnt[C_SIZE] + k > ii.shape[1] or hops.shape[1] > s_hops.shape[1] or gid >= groups.shape[1]:
        return -1, now, False
    m = 0
    deliver = now
    negative = False
    for i in range(k):
        wire = _item(nbytes, i) / efficiency
        negative |= wire < 0
        if wire > 0 and nhops[i] > 0:
            m += 1
        elif now + lat[i] > deliver:
            deliver = now + lat[i]
    if negative or m == 0:
        return m, deliver, negative
    free, pend = ii[I_FREE], ii[I_PEND]
    take = min(m, cnt[C_FREE])
    first_reused = cnt[C_FREE] - take
    fresh = cnt[C_SIZE]
    j = 0
    for i in range(k):
        wire = _item(nbytes, i) / efficiency
        if not (wire > 0 and nhops[i] > 0):
            continue
        if j < take:
            s = free[first_reused + j]
        else:
            s = fresh
            fresh += 1
        s_hops[s, :] = -1
        for h in range(hops.shape[1]):
            s_hops[s, h] = hops[i, h]
        ii[I_NHOPS, s] = nhops[i]
        fl[F_REM, s] = wire
        fl[F_WIRE, s] = wire
        fl[F_RATE, s] = 0.0
        fl[F_CAP, s] = _item(caps, i)
        fl[F_LAT, s] = lat[i]
        fl[F_START, s] = now
        ii[I_GROUP, s] = gid
        ii[I_FLOW, s] = cnt[C_FLOW] + j
        pend[cnt[C_PEND]] = s
        cnt[C_PEND] += 1
        j += 1
    cnt[C_FREE] = first_reused
    cnt[C_SIZE] = fresh
    cnt[C_FLOW] += m
    groups[G_LEFT, gid] = m
    groups[G_LATEST, gid] = deliver
    return m, deliver, negative


# Above this many items, _sort_by and _sort use numpy's (allocating) sorts rather than insertion sort.
_INSERTION_SORT_MAX = 32


@njit(cache=True)
def _sort_by(items, n, key):
    """Sort items[:n] in place by key[item], the keys distinct (so every sort gives the same order): insertion sort
    for the handful of flows an update usually finishes, np.argsort beyond _INSERTION_SORT_MAX."""
    if n > _INSERTION_SORT_MAX:
        items[:n] = items[:n][np.argsort(key[items[:n]], kind="mergesort")]
        return
    for i in range(1, n):
        item = items[i]
        j = i - 1
        while j >= 0 and key[items[j]] > key[item]:
            items[j + 1] = items[j]
            j -= 1
        items[j + 1] = item


@njit(cache=True)
def _sort(items, n):
    """Sort items[:n] in place, as _sort_by."""
    if n > _INSERTION_SORT_MAX:
        items[:n] = np.sort(items[:n])
        return
    for i in range(1, n):
        item = items[i]
        j = i - 1
        while j >= 0 and items[j] > item:
            items[j + 1] = items[j]
            j -= 1
        items[j + 1] = item


@njit(cache=True)
def _drain(fl, ii, cnt, dt, eps, now, groups):
    """Drain the active flows over `dt` seconds at their rates, retire those with (nearly) nothing left
    (remaining <= rate x eps) onto the free stack, and write their slots in start order (ii row I_OUT) and delivery
    times (fl row F_OUT). Each group (the batch of a `_start`) counts down its flows still moving (G_LEFT) and keeps
    its latest delivery (G_LATEST); rows I_OUT_GROUP and F_OUT_GROUP get the groups whose last flow finished,
    ascending, and their delivery times. Returns (finished flows, finished groups). The rows it writes are its only
    buffers (no allocations: it runs on every network update)."""
    active, free, out, out_group = ii[I_ACTIVE], ii[I_FREE], ii[I_OUT], ii[I_OUT_GROUP]
    remaining, rate = fl[F_REM], fl[F_RATE]
    g_left, g_latest = groups[G_LEFT], groups[G_LATEST]
    done = 0
    for i in range(cnt[C_SIZE]):
        if active[i]:
            if dt > 0:
                remaining[i] -= rate[i] * dt
            if remaining[i] <= rate[i] * eps:
                out[done] = i
                done += 1
    if done == 0:
        return 0, 0
    _sort_by(out, done, ii[I_FLOW])  # start order
    n = cnt[C_FREE]
    complete = 0
    for j in range(done):
        s = out[j]
        active[s] = 0
        rate[s] = 0.0
        fl[F_OUT, j] = now + fl[F_LAT, s]
        free[n + j] = s
        g = ii[I_GROUP, s]
        g_left[g] -= 1
        if fl[F_OUT, j] > g_latest[g]:
            g_latest[g] = fl[F_OUT, j]
        if g_left[g] == 0:
            out_group[complete] = g
            complete += 1
    cnt[C_FREE] = n + done
    _sort(out_group, complete)
    for j in range(complete):
        fl[F_OUT_GROUP, j] = g_latest[out_group[j]]
    return done, complete


@njit(cache=True)
def _activate(ii, cnt):
    """The flows started since the last update become active."""
    active, pend = ii[I_ACTIVE], ii[I_PEND]
    for j in range(cnt[C_PEND]):
        active[pend[j]] = 1
    cnt[C_PEND] = 0


@njit(cache=True)
def _step(fbuf, ibuf, dt, eps, now, track):
    """One network update in one dispatch: `_drain`, `_activate`, then `_resolve` (gather, solve, write the rates;
    ints and floats: its workspace_sizes). links row L_LOAD receives the bytes/s in use per link when tracked (zeros
    when none are active). Returns (finished flows, finished groups, active flows, the earliest time one of
    them finishes from now: inf when none, the first finished group and its delivery time: rows I_OUT_GROUP and
    F_OUT_GROUP's first entries, returned so the caller need not index them in the usual case of one). fbuf, ibuf:
    the packed slot arrays (`allot`)."""
    fl, ii, hops, cnt, links, groups, ints, floats = unpack(fbuf, ibuf)
    done, complete = _drain(fl, ii, cnt, dt, eps, now, groups)
    _activate(ii, cnt)
    n_act, t_min = _resolve(ii[I_ACTIVE], cnt[C_SIZE], ii[I_NHOPS], hops, fl[F_CAP], links[L_CAP], fl[F_REM],
                            fl[F_RATE], track, links[L_LOAD], ints, floats)
    return done, complete, n_act, t_min, ii[I_OUT_GROUP, 0], fl[F_OUT_GROUP, 0]
