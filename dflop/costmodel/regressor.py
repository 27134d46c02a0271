"""Non-negative linear regression on relative error, as a scikit-learn estimator.

Why non-negative: every feature is a sum over samples (plus a constant), and a negative
coefficient would let adding a sample make a stage cheaper, breaking the per-sample additive
costs the scheduler balances. Why relative error: profiled shapes span orders of magnitude, and an
absolute least-squares fit would ignore the small shapes that most microbatches actually are.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import nnls
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils.validation import check_is_fitted, validate_data


class NonNegativeLinearRegression(RegressorMixin, BaseEstimator):
    """``y ≈ X @ coef_`` with ``coef_ >= 0``, minimising the sum of squared relative errors.

    There is no separate intercept: pass a column of ones (the ``const`` feature) for one, so it is
    constrained to be non-negative like the rest.

    Parameters:
        relative: weight each row by ``1 / y`` (relative error). Rows with ``y == 0`` get the weight
            of the smallest positive target. False gives ordinary non-negative least squares.
    """

    def __init__(self, relative: bool = True):
        self.relative = relative

    def fit(self, X, y):
        """X: [n_rows, n_features]; y: [n_rows] non-negative targets."""
        X, y = validate_data(self, X, y, dtype=np.float64, y_numeric=True)
        if np.any(y < 0):
            raise ValueError("NonNegativeLinearRegression needs non-negative targets")
        positive = y[y > 0]
        if positive.size == 0:
            self.coef_ = np.zeros(X.shape[1])
            return self
        weight = 1.0 / np.where(y > 0, y, positive.min()) if self.relative else np.ones_like(y)
        a = X * weight[:, None]
        b = y * weight
        # Column scaling keeps NNLS well conditioned when features differ by orders of magnitude
        # (sum of squared lengths vs a constant); it does not change the minimiser.
        scale = np.linalg.norm(a, axis=0)
        scale[scale == 0] = 1.0
        solution, _ = nnls(a / scale, b)
        self.coef_ = solution / scale
        return self

    def predict(self, X):
        """[n_rows] predictions for X: [n_rows, n_features]."""
        check_is_fitted(self, "coef_")
        X = validate_data(self, X, dtype=np.float64, reset=False)
        return X @ self.coef_
