"""simulator.flowslots' packed slot arrays and simulator.fairshare's solve on the links its flows cross: growing
the packed buffers keeps their contents, a batch given one value for all starts the same flows as one given an array
of it, and the max-min solve neither reads nor depends on links no flow crosses."""

from __future__ import annotations

import numpy as np

from rackcast.simulator.fairshare import maxmin_rates, maxmin_rates_into, maxmin_workspace
from rackcast.simulator.flowslots import (C_FLOW, C_SIZE, F_CAP, F_REM, H_GROUPS, H_SLOTS, H_WIDTH, I_GROUP,
                                          _start, allot, unpack)

LINKS = 5


def _filled(slots: int, width: int, groups: int, seed: int):
    fbuf, ibuf, views = allot(slots, width, LINKS, groups)
    rng = np.random.default_rng(seed)
    for view in views[:6]:
        view[...] = rng.integers(-3, 100, size=view.shape) if view.dtype == np.int64 else rng.random(view.shape)
    return fbuf, ibuf, views


def test_allot_grown_buffers_hold_the_old_contents_and_unpack_views_them():
    _, _, old = _filled(64, 3, 10, seed=0)
    fbuf, ibuf, new = allot(128, 5, LINKS, 74, old)
    assert (ibuf[H_SLOTS], ibuf[H_WIDTH], ibuf[H_GROUPS]) == (128, 5, 74)
    fl, ii, hops, cnt, links, groups = new[:6]
    o_fl, o_ii, o_hops, o_cnt, o_links, o_groups = old[:6]
    assert (fl[:, :64] == o_fl).all() and (fl[:, 64:] == 0).all()
    assert (ii[:, :64] == o_ii).all() and (cnt == o_cnt).all() and (links == o_links).all()
    assert (hops[:64, :3] == o_hops).all() and (hops[:, 3:] == -1).all() and (hops[64:] == -1).all()
    assert (groups[:, :10] == o_groups).all() and (groups[:, 10:] == 0).all()
    fl[0, 5] = 42.0  # the views are the buffers' memory: what unpack hands the kernels
    assert unpack(fbuf, ibuf)[0][0, 5] == 42.0


def test_start_with_one_value_for_all_fills_the_slots_as_an_array_of_it():
    hops = np.array([[0, 1], [2, -1], [3, 4]], dtype=np.int64)
    nhops = np.array([2, 1, 2], dtype=np.int64)
    lat = np.array([1e-6, 0.0, 3e-6])
    buffers = []
    for nbytes, caps in ((3e6, np.inf), (np.full(3, 3e6), np.full(3, np.inf))):
        fbuf, ibuf, views = allot(64, 2, LINKS, 4)
        assert _start(hops, nhops, nbytes, 0.7, caps, lat, 2.0, 1, fbuf, ibuf) == (3, 2.0, False)
        buffers.append((fbuf, ibuf))
        fl, ii, _, cnt = views[:4]
        assert cnt[C_SIZE] == cnt[C_FLOW] == 3 and (ii[I_GROUP, :3] == 1).all()
        assert (fl[F_REM, :3] == 3e6 / 0.7).all() and (fl[F_CAP, :3] == np.inf).all()
    assert buffers[0][0].tobytes() == buffers[1][0].tobytes()
    assert buffers[0][1].tobytes() == buffers[1][1].tobytes()


def test_rate_solve_ignores_links_no_flow_crosses():
    rng = np.random.default_rng(7)
    for _ in range(100):
        nl, nf = 30, int(rng.integers(1, 12))
        crossed = rng.choice(nl, size=6, replace=False)  # the flows use 6 of the 30 links
        lens = rng.integers(1, 4, size=nf)
        indices = np.concatenate([rng.choice(crossed, size=k, replace=False) for k in lens]).astype(np.int64)
        indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        capacity = rng.uniform(0.5, 10.0, size=nl)
        caps = np.where(rng.random(nf) < 0.3, rng.uniform(0.05, 3.0, size=nf), np.inf)
        expected = maxmin_rates(indptr, indices, capacity, caps)
        poisoned = capacity.copy()
        poisoned[np.setdiff1d(np.arange(nl), indices)] = np.nan  # never read
        n_ints, n_floats = maxmin_workspace(nf, nl, len(indices))
        ints, floats = np.full(n_ints, -7, dtype=np.int64), np.full(n_floats, np.nan)  # a dirty workspace
        rates = np.empty(nf)
        maxmin_rates_into(indptr, indices, poisoned, caps, rates, ints, floats)
        assert rates.tobytes() == expected.tobytes()
