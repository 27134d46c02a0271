"""The adaptive shape grid refines where a curve bends, and only there."""

from __future__ import annotations

import pytest

from dflop.profiling.model_grid import AdaptiveCurve, geometric_points


def _run(curve: AdaptiveCurve, f, noise=0.0) -> list[int]:
    """Drive a curve to the end on function f; return the points in measurement order."""
    order = []
    while points := curve.next_points():
        for x in points:
            curve.record(x, f(x), noise)
            order.append(x)
    return order


def test_geometric_points_double_and_include_the_end():
    assert geometric_points(1, 16) == [1, 2, 4, 8, 16]
    assert geometric_points(32, 100) == [32, 64, 100]
    assert geometric_points(5, 5) == [5]
    with pytest.raises(ValueError):
        geometric_points(0, 4)


def test_linear_curve_needs_only_the_coarse_grid():
    points = _run(AdaptiveCurve(32, 4096), lambda x: 3.0 + 0.25 * x)
    assert points == geometric_points(32, 4096)


def test_kink_is_bisected_and_flat_parts_are_not():
    kink = 1000

    def f(x):  # flat, then steep: one bend at x = 1000
        return 10.0 if x <= kink else 10.0 + 0.5 * (x - kink)

    curve = AdaptiveCurve(32, 4096, tol=0.05)
    points = _run(curve, f)
    extra = sorted(set(points) - set(geometric_points(32, 4096)))
    assert extra, "the bend should be refined"
    # Only next to the kink: the coarse triplets around it are (256, 512, 1024) and (512, 1024, 2048).
    assert all(256 < x < 2048 for x in extra)
    assert sum(abs(x - kink) < 150 for x in extra) >= 2  # bisection closes in on it


def test_quadratic_curve_refines_a_bounded_number_of_times():
    curve = AdaptiveCurve(32, 2048, tol=0.05)
    points = _run(curve, lambda x: 1.0 + 1e-3 * x * x)
    n_coarse = len(geometric_points(32, 2048))
    assert n_coarse < len(points) <= n_coarse + 4 * n_coarse  # refined, but never unbounded
    assert len(points) == len(set(points))


def test_misses_within_measurement_noise_are_not_bends():
    wobbly = {32: 1.0, 64: 1.3, 128: 1.0, 256: 1.2, 512: 1.0}
    quiet = _run(AdaptiveCurve(32, 512, tol=0.05), lambda x: wobbly[x], noise=0.5)
    assert quiet == [32, 64, 128, 256, 512]
    noisy = _run(AdaptiveCurve(32, 512, tol=0.05), lambda x: wobbly.get(x, 1.1), noise=0.0)
    assert len(noisy) > 5
