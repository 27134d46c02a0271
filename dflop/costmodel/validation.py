"""Held-out error of a regressor: leave one profiled shape out, fit on the rest, predict it.

Shapes, not rows, are held out: repeats of a fitted shape say nothing about how well the model
generalises to a shape the profiler never ran. Shapes at the edge of the grid are extrapolated,
which is deliberate: the planner asks for shapes outside the grid too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from sklearn.base import RegressorMixin


@dataclass(frozen=True)
class HeldOutError:
    """Absolute percentage errors of held-out shapes (percent, one per shape with a positive target)."""

    ape_percent: np.ndarray
    n_train_shapes: int
    n_test_shapes: int

    @property
    def median(self) -> float:
        return float(np.median(self.ape_percent)) if self.ape_percent.size else float("nan")

    @property
    def p90(self) -> float:
        return float(np.percentile(self.ape_percent, 90)) if self.ape_percent.size else float("nan")

    @property
    def max(self) -> float:
        return float(np.max(self.ape_percent)) if self.ape_percent.size else float("nan")


def leave_one_shape_out(
    X: np.ndarray, y: np.ndarray, make_estimator: Callable[[], RegressorMixin]
) -> HeldOutError:
    """Fit on all shapes but one and predict that one, for every shape.

    X: [n_shapes, n_features] one row per distinct shape (repeats already reduced to the median);
    y: [n_shapes] target. Shapes whose target is 0 have no percentage error and are skipped as
    test shapes (they still train). Fewer than 2 shapes give no error (empty).
    """
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n = len(y)
    if n < 2:
        return HeldOutError(ape_percent=np.array([]), n_train_shapes=n, n_test_shapes=0)
    errors = []
    for i in range(n):
        if y[i] == 0:
            continue
        keep = np.arange(n) != i
        model = make_estimator().fit(X[keep], y[keep])
        predicted = float(model.predict(X[i : i + 1])[0])
        errors.append(abs(predicted - y[i]) / y[i] * 100.0)
    return HeldOutError(ape_percent=np.array(errors), n_train_shapes=n - 1, n_test_shapes=len(errors))
