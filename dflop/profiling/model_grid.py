"""Adaptive 1-D shape grid: a coarse geometric grid, then bisection where the curve bends.

A cost curve (milliseconds against tiles or tokens) is mostly linear; attention makes it bend. The
coarse grid doubles x from `lo` to `hi`. An interval is refined when linear interpolation
between its ends misses the measured value inside it by more than `tol` (relative):
- after the coarse pass, the middle point of every three consecutive points is that test, and
  both intervals around a point that fails it are opened;
- an open interval is measured at its geometric midpoint; if the midpoint fails the test, both
  halves open again, otherwise the interval is done.
A miss only counts when it also exceeds the scatter of the repeated measurements at the three
points involved (and `abs_floor`), so timer noise does not pass for a bend; intervals narrower
than `min_ratio` (or than 2 integers) are never opened.
"""

from __future__ import annotations

import math


def geometric_points(lo: int, hi: int, ratio: float = 2.0) -> list[int]:
    """lo, lo*ratio, ... up to hi (hi always included), as distinct integers."""
    if not 1 <= lo <= hi:
        raise ValueError(f"bad grid range [{lo}, {hi}]")
    points, x = [], float(lo)
    while x < hi:
        points.append(int(round(x)))
        x *= ratio
    points.append(hi)
    return sorted(set(points))


def interpolation_error(values: dict[int, float], a: int, m: int, b: int, floor: float = 0.0) -> float:
    """Relative error of predicting the value at m linearly from a and b; 0 when the absolute
    error is below `floor` (a difference that small is noise, not a bend)."""
    fa, fm, fb = values[a], values[m], values[b]
    error = abs(fm - (fa + (fb - fa) * (m - a) / (b - a)))
    return 0.0 if error < floor else error / max(abs(fm), 1e-12)


class AdaptiveCurve:
    """The points to measure for one curve; feed measured values back with `record`."""

    def __init__(self, lo: int, hi: int, *, ratio: float = 2.0, tol: float = 0.05, abs_floor: float = 0.0,
                 min_ratio: float = 1.15):
        self.coarse = geometric_points(lo, hi, ratio)
        self.tol = tol
        self.abs_floor = abs_floor
        self.min_ratio = min_ratio
        self.values: dict[int, float] = {}
        self.noise: dict[int, float] = {}
        self._open: list[tuple[int, int]] | None = None  # None until the coarse pass is recorded
        self._pending: dict[int, tuple[int, int]] = {}  # midpoint -> interval it tests

    def record(self, x: int, value: float, noise: float = 0.0) -> None:
        """The value measured at x and its scatter (same unit, e.g. the repeats' interquartile range)."""
        self.values[x] = value
        self.noise[x] = noise
        interval = self._pending.pop(x, None)
        if interval is None:
            return
        a, b = interval
        if self._miss(a, x, b) > self.tol:
            self._open.extend(i for i in ((a, x), (x, b)) if self._splittable(*i))

    def next_points(self) -> list[int]:
        """Points not measured yet: the coarse grid first, then midpoints of open intervals."""
        missing = [x for x in self.coarse if x not in self.values]
        if missing:
            return missing
        if self._open is None:
            self._open = self._bent_coarse_intervals()
        points = []
        for a, b in self._open:
            m = self._midpoint(a, b)
            if m not in self.values and m not in self._pending:
                self._pending[m] = (a, b)
                points.append(m)
        self._open = []
        return sorted(points)

    def _bent_coarse_intervals(self) -> list[tuple[int, int]]:
        xs = self.coarse
        opened: set[tuple[int, int]] = set()
        for a, m, b in zip(xs, xs[1:], xs[2:]):
            if self._miss(a, m, b) > self.tol:
                opened.update(i for i in ((a, m), (m, b)) if self._splittable(*i))
        return sorted(opened)

    def _miss(self, a: int, m: int, b: int) -> float:
        floor = max(self.abs_floor, self.noise[a], self.noise[m], self.noise[b])
        return interpolation_error(self.values, a, m, b, floor)

    def _splittable(self, a: int, b: int) -> bool:
        return b - a >= 2 and b / a >= self.min_ratio

    @staticmethod
    def _midpoint(a: int, b: int) -> int:
        m = int(round(math.sqrt(a * b)))
        return min(max(m, a + 1), b - 1)
