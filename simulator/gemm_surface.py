"""A measured GEMM efficiency surface (topologies.spec.SurfacePoint, written by `rackcast calibrate`) read at any
shape: trilinear interpolation in (log m, log n, log k) on the measured grid, clamped at its edges, vectorised.
grid_efficiency is the same rule on any axes (the attention surface's: simulator.attention_cost).

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
    """A surface as arrays: the log of each axis's sorted values, and efficiency[i_0, i_1, ...], each axis padded
    with a copy of its last value (the upper neighbour of a clamped lookup, and of a one-value axis)."""

    log_axes: tuple[np.ndarray, ...]
    efficiency: np.ndarray
    strides: np.ndarray  # of the flattened efficiency, first axis slowest
    corners: np.ndarray  # offsets of a cell's 2^axes corners, by axis lower before upper, the last axis fastest


_GRIDS: dict[tuple, tuple[list, Grid]] = {}  # by the identity of a topology's (immutable) point list, the selection


def _grid(points: list, axes: tuple[str, ...], kind: str | None) -> Grid:
    key = (id(points), axes, kind)
    hit = _GRIDS.get(key)
    if hit is not None and hit[0] is points:
        return hit[1]
    whole, points = points, [p for p in points if kind is None or p.kind == kind]
    values_on = [np.array(sorted({getattr(p, a) for p in points}), dtype=float) for a in axes]
    values = np.empty([len(v) for v in values_on])
    for p in points:
        values[tuple(int(np.searchsorted(v, getattr(p, a))) for v, a in zip(values_on, axes))] = p.efficiency
    padded = np.pad(values, [(0, 1)] * len(axes), mode="edge")
    strides = np.cumprod((1,) + padded.shape[:0:-1])[::-1]
    corners = np.array([sum(b * s for b, s in zip(bits, strides)) for bits in np.ndindex(*(2,) * len(axes))])
    grid = Grid(tuple(np.log(v) for v in values_on), padded, strides, corners)
    if len(_GRIDS) >= 64:
        _GRIDS.clear()
    _GRIDS[key] = (whole, grid)  # holding the list keeps its id from being reused
    return grid


def _bracket(log_axis: np.ndarray, x):
    """Lower grid index and weight of the upper neighbour of log values x on one axis, clamped to the axis."""
    if len(log_axis) == 1:
        return np.zeros(np.shape(x), dtype=int), np.zeros(np.shape(x))
    lo = np.clip(np.searchsorted(log_axis, x, side="right") - 1, 0, len(log_axis) - 2)
    return lo, np.clip((x - log_axis[lo]) / (log_axis[lo + 1] - log_axis[lo]), 0.0, 1.0)


def grid_efficiency(points: list, axes: tuple[str, ...], coords: tuple, kind: str | None = None):
    """Efficiency at `coords` (one float or array per axis, which broadcast) on the surface `points` (those of
    `kind` where given: a full grid over the attributes named `axes`, with an `efficiency` each): multilinear in
    the logs of the axes, clamped."""
    grid = _grid(points, axes, kind)
    logs = np.broadcast_arrays(*(np.log(np.maximum(np.asarray(v, dtype=float), 1e-30)) for v in coords))
    lows, weights = zip(*(_bracket(ax, x) for ax, x in zip(grid.log_axes, logs)))
    # the corners of each point's cell in one gather from the flattened grid
    v = grid.efficiency.ravel()[sum(lo * stride for lo, stride in zip(lows, grid.strides))[..., None] + grid.corners]
    for t in weights[:0:-1]:  # along the last axis first, halving the corners each time
        v = v[..., 0::2] + t[..., None] * (v[..., 1::2] - v[..., 0::2])
    return v[..., 0] + weights[0] * (v[..., 1] - v[..., 0])


def surface_efficiency(points: list[SurfacePoint], m, n, k):
    """Efficiency of GEMMs of m x n x k (floats or arrays, which broadcast) on the surface `points` (a full grid, as
    topologies.spec checks on load)."""
    return grid_efficiency(points, AXES, (m, n, k))
