"""A measured GEMM efficiency surface (topologies.spec.SurfacePoint, written by `rackcast calibrate`) read at any
shape: trilinear interpolation in (log m, log n, log k) on the measured grid, clamped at its edges, vectorised.

Why this rule: efficiency rises with each dimension roughly as a saturating function of its logarithm (per-call
overhead amortised over more work, then tiles filling), so log axes make the pieces between grid points short and
near-linear; multilinear interpolation reproduces every measured point exactly, moves monotonically between two
neighbouring points along each axis, and needs no fitted parameters. Outside the grid the edge value holds (no
extrapolation: a shape beyond the largest measured is priced at the largest measured one's efficiency).
The group count of a grouped GEMM is not an axis: the surface is measured at one expert count per kernel (the
packaged tiny presets' experts, backend.calibrate_compute; each point records it as `groups`) and read at any other
as if it were that one. That is exact for a rank holding all those experts (expert = 1 with that expert count) and
an approximation elsewhere: under expert parallelism a rank's kernel runs experts / expert groups (4 at expert 2),
whose per-group efficiency the surface does not resolve.

    from rackcast.simulator.gemm_surface import surface_efficiency
    eff = surface_efficiency(topo.efficiency.gemm_surface, m, n, k)     # arrays broadcast
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from rackcast.topologies.spec import SurfacePoint

AXES = ("m", "n", "k")


class Grid(NamedTuple):
    """The surface as arrays: the log of each axis's sorted values, and efficiency[i_m, i_n, i_k], each axis padded
    with a copy of its last value (the upper neighbour of a clamped lookup, and of a one-value axis)."""

    log_axes: tuple[np.ndarray, np.ndarray, np.ndarray]
    efficiency: np.ndarray


_GRIDS: dict[int, tuple[list[SurfacePoint], Grid]] = {}  # by the identity of a topology's (immutable) point list


def _grid(points: list[SurfacePoint]) -> Grid:
    hit = _GRIDS.get(id(points))
    if hit is not None and hit[0] is points:
        return hit[1]
    axes = [np.array(sorted({getattr(p, a) for p in points}), dtype=float) for a in AXES]
    values = np.empty([len(a) for a in axes])
    for p in points:
        values[tuple(int(np.searchsorted(ax, getattr(p, a))) for ax, a in zip(axes, AXES))] = p.efficiency
    grid = Grid(tuple(np.log(ax) for ax in axes), np.pad(values, [(0, 1)] * len(AXES), mode="edge"))
    if len(_GRIDS) >= 64:
        _GRIDS.clear()
    _GRIDS[id(points)] = (points, grid)  # holding the list keeps its id from being reused
    return grid


def _bracket(log_axis: np.ndarray, x):
    """Lower grid index and weight of the upper neighbour of log values x on one axis, clamped to the axis."""
    if len(log_axis) == 1:
        return np.zeros(np.shape(x), dtype=int), np.zeros(np.shape(x))
    lo = np.clip(np.searchsorted(log_axis, x, side="right") - 1, 0, len(log_axis) - 2)
    return lo, np.clip((x - log_axis[lo]) / (log_axis[lo + 1] - log_axis[lo]), 0.0, 1.0)


def surface_efficiency(points: list[SurfacePoint], m, n, k):
    """Efficiency of GEMMs of m x n x k (floats or arrays, which broadcast) on the surface `points` (a full grid, as
    topologies.spec checks on load)."""
    grid = _grid(points)
    logs = np.broadcast_arrays(*(np.log(np.maximum(np.asarray(v, dtype=float), 1e-30)) for v in (m, n, k)))
    (im, tm), (i_n, tn), (ik, tk) = (_bracket(ax, x) for ax, x in zip(grid.log_axes, logs))
    _, size_n, size_k = grid.efficiency.shape
    # the 8 corners of each point's cell in one gather from the flattened grid, ordered (m, n, k) lower/upper
    corner = np.array([(dm * size_n + dn) * size_k + dk for dm in (0, 1) for dn in (0, 1) for dk in (0, 1)])
    v = grid.efficiency.ravel()[((im * size_n + i_n) * size_k + ik)[..., None] + corner]
    v = v[..., 0::2] + tk[..., None] * (v[..., 1::2] - v[..., 0::2])  # along k: 4 left
    v = v[..., 0::2] + tn[..., None] * (v[..., 1::2] - v[..., 0::2])  # along n: 2 left
    return v[..., 0] + tm * (v[..., 1] - v[..., 0])
