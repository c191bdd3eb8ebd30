"""Max-min fair bandwidth shares of flows over shared links (progressive filling, a.k.a. water-filling).

Input is the flows x links incidence in CSR form (`indptr`, `indices`: flow f crosses links
indices[indptr[f]:indptr[f+1]]), the per-link capacities and a per-flow rate cap (np.inf for none). Output is each
flow's rate: the unique max-min fair allocation (Bertsekas & Gallager, Data Networks, 2nd ed., section 6.5.2):
repeatedly find the link whose remaining capacity divided by its unfrozen flows is smallest (or a flow cap below
that level), freeze those flows at that level, subtract, repeat.

`maxmin_rates` is the numba kernel used by simulator.network: a min-heap of link levels with lazy deletion (an entry
is stale once its link's level changed), all links at the lowest level frozen in one round, O(nnz log nnz).
`maxmin_rates_numpy` is a plain vectorised numpy version of the same algorithm, the reference the tests compare to.

    from rackcast.simulator.fairshare import maxmin_rates
    rates = maxmin_rates(indptr, indices, capacity, caps)

Tests: `.venv/bin/pytest -q tests/test_network.py`; speed: `.venv/bin/python benchmarks/bench_network.py`.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def _heap_push(keys, vals, n, key, val):
    i = n
    while i > 0:
        parent = (i - 1) >> 1
        if keys[parent] < key or (keys[parent] == key and vals[parent] <= val):
            break
        keys[i] = keys[parent]
        vals[i] = vals[parent]
        i = parent
    keys[i] = key
    vals[i] = val
    return n + 1


@njit(cache=True)
def _heap_pop(keys, vals, n):
    n -= 1
    key, val = keys[n], vals[n]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and (keys[c + 1] < keys[c] or (keys[c + 1] == keys[c] and vals[c + 1] < vals[c])):
            c += 1
        if key < keys[c] or (key == keys[c] and val <= vals[c]):
            break
        keys[i] = keys[c]
        vals[i] = vals[c]
        i = c
    if n > 0:
        keys[i] = key
        vals[i] = val
    return n


@njit(cache=True)
def _freeze(f, r, indptr, indices, rem, cnt, rates, frozen, mark, stamp, touched, nt):
    """Freeze flow f at rate r; links it crosses are appended (once per stamp) to touched. Returns the new nt."""
    rates[f] = r
    frozen[f] = True
    for k in range(indptr[f], indptr[f + 1]):
        l = indices[k]
        rem[l] -= r
        cnt[l] -= 1
        if mark[l] != stamp:
            mark[l] = stamp
            touched[nt] = l
            nt += 1
    return nt


@njit(cache=True)
def maxmin_workspace(nf, nl, nnz):
    """How many int64 and float64 values `maxmin_rates_into` needs for nf flows, nl links and nnz CSR entries."""
    return nf + 7 * nl + 2 * nnz + 2, 3 * nl + nnz + 1


@njit(cache=True)
def maxmin_rates(indptr, indices, capacity, caps):
    """Max-min fair rates (numba). indptr, indices: int64 CSR; capacity: float64 per link; caps: float64 per flow.

    A flow that crosses no link gets its cap (np.inf when uncapped)."""
    nf = indptr.shape[0] - 1
    nl = capacity.shape[0]
    nnz = indices.shape[0]
    n_ints, n_floats = maxmin_workspace(nf, nl, nnz)
    ints, floats = np.empty(n_ints, np.int64), np.empty(n_floats)
    rates = np.empty(nf)
    maxmin_rates_into(indptr, indices, capacity, caps, rates, ints, floats)
    return rates


@njit(cache=True)
def maxmin_rates_into(indptr, indices, capacity, caps, rates, ints, floats):
    """maxmin_rates writing the rates into `rates` (nf), its working arrays carved out of `ints` and `floats` (at
    least maxmin_workspace's sizes, any content): a caller solving tens of thousands of small problems
    (simulator.flowslots) keeps them, as allocations cost more than the arithmetic of a few flows."""
    nf = indptr.shape[0] - 1
    nl = capacity.shape[0]
    nnz = indices.shape[0]
    # ints: frozen (nf), cnt (nl), lptr (nl + 1), fill (nl), lflows (nnz), the heap's links (nl + nnz + 1),
    # mark, touched, bottleneck (nl each); floats: rem, level (nl each), the heap's levels (nl + nnz + 1)
    frozen, ints = ints[:nf], ints[nf:]
    cnt, lptr, fill, ints = ints[:nl], ints[nl: 2 * nl + 1], ints[2 * nl + 1: 3 * nl + 1], ints[3 * nl + 1:]
    lflows, hvals, ints = ints[:nnz], ints[nnz: nl + 2 * nnz + 1], ints[nl + 2 * nnz + 1:]
    mark, touched, bottleneck = ints[:nl], ints[nl: 2 * nl], ints[2 * nl: 3 * nl]
    rem, level, hkeys = floats[:nl], floats[nl: 2 * nl], floats[2 * nl:]
    for f in range(nf):
        rates[f] = 0.0
        frozen[f] = 0
    # Only the links some flow crosses are touched (`bottleneck` lists them while the solve starts): a few flows
    # cross a few of the network's links, and passes over every link would cost more than the solve.
    for k in range(nnz):
        cnt[indices[k]] = 0
        mark[indices[k]] = -1
    n_used = 0
    for k in range(nnz):
        l = indices[k]
        if cnt[l] == 0:
            bottleneck[n_used] = l
            n_used += 1
        cnt[l] += 1
    # link -> flows (transpose of the CSR), by counting sort: link l's flows are lflows[lptr[l]:fill[l]], ascending
    start = 0
    for u in range(n_used):
        l = bottleneck[u]
        lptr[l] = start
        fill[l] = start
        start += cnt[l]
    for f in range(nf):
        for k in range(indptr[f], indptr[f + 1]):
            l = indices[k]
            lflows[fill[l]] = f
            fill[l] += 1
    # min-heap of (level, link); an entry is stale when it differs from level[link] or the link has no live flow.
    # Pops come in (level, link) order whatever the order of pushes, so pushing only the crossed links is the same.
    hn = 0
    for u in range(n_used):
        l = bottleneck[u]
        rem[l] = capacity[l]
        level[l] = rem[l] / cnt[l]
        hn = _heap_push(hkeys, hvals, hn, level[l], l)
    nfrozen = 0
    for f in range(nf):
        if indptr[f + 1] == indptr[f]:
            rates[f] = caps[f]
            frozen[f] = True
            nfrozen += 1
    nc = 0
    for f in range(nf):
        nc += caps[f] < np.inf
    order = lflows[:0]  # the capped flows, lowest cap first (none: an empty view, not an allocation)
    if nc:
        capped = np.flatnonzero(caps < np.inf)
        order = capped[np.argsort(caps[capped], kind="mergesort")]
    cp = 0
    stamp = 0
    while nfrozen < nf:
        while hn > 0 and (cnt[hvals[0]] == 0 or hkeys[0] != level[hvals[0]]):
            hn = _heap_pop(hkeys, hvals, hn)
        best = hkeys[0] if hn > 0 else np.inf
        while cp < nc and frozen[order[cp]]:
            cp += 1
        stamp += 1
        nt = 0
        if cp < nc and caps[order[cp]] <= best:
            f = order[cp]
            nt = _freeze(f, caps[f], indptr, indices, rem, cnt, rates, frozen, mark, stamp, touched, nt)
            nfrozen += 1
        else:
            # every link at the lowest level is a bottleneck: freeze all their flows at once
            nb = 0
            while hn > 0:
                l = hvals[0]
                if cnt[l] == 0 or hkeys[0] != level[l]:
                    hn = _heap_pop(hkeys, hvals, hn)
                    continue
                if hkeys[0] != best:
                    break
                bottleneck[nb] = l
                nb += 1
                hn = _heap_pop(hkeys, hvals, hn)
            for b in range(nb):
                l = bottleneck[b]
                for k in range(lptr[l], fill[l]):
                    f = lflows[k]
                    if not frozen[f]:
                        nt = _freeze(f, best, indptr, indices, rem, cnt, rates, frozen, mark, stamp, touched, nt)
                        nfrozen += 1
        for t in range(nt):
            l = touched[t]
            if cnt[l] > 0:
                level[l] = max(rem[l], 0.0) / cnt[l]
                hn = _heap_push(hkeys, hvals, hn, level[l], l)


def maxmin_rates_numpy(indptr, indices, capacity, caps):
    """Max-min fair rates, pure numpy (reference implementation; same contract as `maxmin_rates`)."""
    indptr = np.asarray(indptr, np.int64)
    indices = np.asarray(indices, np.int64)
    capacity = np.asarray(capacity, np.float64)
    caps = np.asarray(caps, np.float64)
    nf, nl = len(indptr) - 1, len(capacity)
    flow_of = np.repeat(np.arange(nf), np.diff(indptr))
    rates = np.zeros(nf)
    frozen = np.diff(indptr) == 0
    rates[frozen] = caps[frozen]
    rem = capacity.copy()
    while not frozen.all():
        live = ~frozen[flow_of]
        cnt = np.bincount(indices[live], minlength=nl)
        with np.errstate(divide="ignore", invalid="ignore"):
            level = np.where(cnt > 0, np.maximum(rem, 0.0) / np.maximum(cnt, 1), np.inf)
        best = level.min()
        cap_min = caps[~frozen].min()
        if cap_min <= best:
            new = ~frozen & (caps == cap_min)
            r = cap_min
        else:
            on_best = np.zeros(nf, bool)
            on_best[flow_of[live & (level[indices] == best)]] = True
            new = on_best & ~frozen
            r = best
        rates[new] = r
        frozen |= new
        rem -= np.bincount(indices, weights=np.where(new[flow_of], r, 0.0), minlength=nl)
    return rates
