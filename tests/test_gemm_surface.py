"""GEMM efficiency surfaces: a calibrated surface prices a measured shape at its measured time, interpolation between
grid points (trilinear in log m, n, k, clamped), shape-awareness (equal FLOPs, different shapes), the fitted factor,
and a malformed surface refused on load in one line naming the file and the field."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import yaml

from rackcast.simulator import costs
from rackcast.simulator.gemm_surface import surface_efficiency
from rackcast.topologies import load_topology
from rackcast.topologies.spec import SurfacePoint
from rackcast.validation.calibration import build_topology, header_for, write_topology
from rackcast.validation.fit import apply_factors

from test_calibrate import _fake_measurements


def _calibrated():
    meas = _fake_measurements()
    topo, notes = build_topology(meas, load_topology("local-cpu"), "fake")
    return meas, topo, notes


def _without_surfaces(topo):
    return topo.with_efficiency(replace(topo.efficiency, gemm_surface=[], grouped_gemm_surface=[]))


def test_a_calibrated_surface_prices_every_measured_shape_at_its_measured_time():
    meas, topo, _ = _calibrated()
    assert topo.efficiency.gemm_surface and topo.efficiency.grouped_gemm_surface
    for e in meas["compute"]["gemm"]:
        t = costs.gemm_time(e["flops"], costs.GemmShape(e["m"], e["n"], e["k"]), topo, "fp32")
        assert float(t) == pytest.approx(e["seconds"], rel=1e-5)
    for e in meas["compute"]["grouped_gemm"]:
        shape = costs.GemmShape(e["rows"], e["n"], e["k"], e["experts"])
        t = costs.grouped_gemm_time(e["flops_per_group"] * e["experts"], shape, topo, "fp32")
        assert float(t) == pytest.approx(e["seconds"] * e["experts"], rel=1e-5)


def _log_linear_surface(ms, ns, ks):
    """A synthetic surface linear in log m, log n, log k (trilinear interpolation reproduces it inside the grid)."""
    value = lambda m, n, k: 0.01 + 0.01 * math.log(m) + 0.02 * math.log(n) + 0.03 * math.log(k)  # noqa: E731
    return [SurfacePoint(m, n, k, value(m, n, k)) for m in ms for n in ns for k in ks], value


def test_surface_interpolation_is_trilinear_in_log_shape_and_clamped_at_the_grid_edges():
    points, value = _log_linear_surface((16, 256, 4096), (8, 64, 1024), (8, 128))
    m, n, k = np.array([20.0, 100.0, 3000.0]), np.array([9.0, 500.0, 30.0]), np.array([100.0, 10.0, 64.0])
    assert surface_efficiency(points, m, n, k) == pytest.approx([value(*s) for s in zip(m, n, k)], rel=1e-12)
    # outside the grid the nearest edge holds, on each axis apart
    assert float(surface_efficiency(points, 1e6, 2.0, 128)) == pytest.approx(value(4096, 8, 128), rel=1e-12)
    # monotone along an axis where the measured points increase along it
    along_m = surface_efficiency(points, np.geomspace(8, 8192, 50), 64, 32)
    assert np.all(np.diff(along_m) >= 0) and along_m[-1] > along_m[0]


def test_a_skinny_and_a_square_gemm_of_equal_flops_differ_on_the_surface_not_on_the_flops_curve():
    _, topo, _ = _calibrated()
    skinny, square = costs.GemmShape(2048, 8, 1024), costs.GemmShape(2048, 128, 64)  # n k = 8 x 1024 = 128 x 64
    by_surface = [float(costs.gemm_efficiency(s, topo, "fp32")) for s in (skinny, square)]
    assert by_surface[0] < by_surface[1] and by_surface[0] != pytest.approx(by_surface[1], rel=0.1)
    by_curve = [float(costs.gemm_efficiency(s, _without_surfaces(topo), "fp32")) for s in (skinny, square)]
    assert by_curve[0] == by_curve[1]


def test_surface_lookup_is_vectorised_like_the_scalar_lookup():
    _, topo, _ = _calibrated()
    m = np.array([100.0, 700.0, 5000.0])
    shapes = costs.GemmShape(m, 40.0, 500.0, 8.0)
    scalar = [float(costs.grouped_gemm_efficiency(costs.GemmShape(x, 40.0, 500.0, 8.0), topo, "fp32")) for x in m]
    assert costs.grouped_gemm_efficiency(shapes, topo, "fp32") == pytest.approx(scalar, rel=1e-12)


def test_a_fitted_gemm_factor_scales_the_surface():
    _, topo, _ = _calibrated()
    shape = costs.GemmShape(300, 20, 500)
    before = float(costs.gemm_efficiency(shape, topo, "fp32"))
    assert float(costs.gemm_efficiency(shape, apply_factors(topo, {"gemm": 0.5}), "fp32")) == pytest.approx(
        before * 0.5, rel=1e-5)


def _written(tmp_path):
    meas, topo, notes = _calibrated()
    path = tmp_path / "cal.yaml"
    write_topology(path, topo, header_for(meas, notes, "test"))
    return path


@pytest.mark.parametrize("break_it, field", [
    (lambda e: e["gemm_surface"].pop(3), "efficiency.gemm_surface"),  # no longer a full grid
    (lambda e: e["grouped_gemm_surface"].__setitem__(0, dict(e["grouped_gemm_surface"][1])),
     "efficiency.grouped_gemm_surface"),  # a shape twice
    (lambda e: e["gemm_surface"][2].__setitem__("efficiency", 0.0), "efficiency.gemm_surface[2]"),
    (lambda e: e["gemm_surface"][0].pop("k"), "efficiency.gemm_surface[0].k"),
    (lambda e: e.__setitem__("gemm", []), "efficiency.gemm_surface"),  # a surface without its curve
])
def test_a_malformed_surface_is_refused_in_one_line_naming_the_file_and_field(tmp_path, cli, break_it, field):
    path = _written(tmp_path)
    data = yaml.safe_load(path.read_text())
    break_it(data["efficiency"])
    path.write_text(yaml.safe_dump(data))
    proc = cli("topologies", "show", str(path))
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1
    assert str(path) in proc.stderr and field in proc.stderr, proc.stderr


def test_a_calibrated_surface_round_trips_through_its_yaml(tmp_path):
    back = load_topology(str(_written(tmp_path)))
    _, topo, _ = _calibrated()
    assert back.efficiency.gemm_surface == topo.efficiency.gemm_surface
    assert back.efficiency.grouped_gemm_surface == topo.efficiency.grouped_gemm_surface
    assert {p.groups for p in back.efficiency.grouped_gemm_surface} == {8.0}
