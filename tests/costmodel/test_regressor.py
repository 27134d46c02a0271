"""The non-negative relative-error regressor against closed forms and numpy least squares."""

import numpy as np
import pytest
from sklearn.utils.estimator_checks import check_estimator

from dflop.costmodel.regressor import NonNegativeLinearRegression


def test_recovers_exact_coefficients_over_orders_of_magnitude():
    tokens = np.array([16, 64, 256, 1024, 4096, 16384], dtype=float)
    X = np.stack([tokens, tokens**2, np.ones_like(tokens)], axis=1)
    true = np.array([1.5e-3, 2e-7, 0.15])
    model = NonNegativeLinearRegression().fit(X, X @ true)
    np.testing.assert_allclose(model.coef_, true, rtol=1e-9)


def test_unconstrained_case_equals_weighted_least_squares():
    rng = np.random.default_rng(1)
    x = np.geomspace(10, 1e4, 12)
    X = np.stack([x, np.ones_like(x)], axis=1)
    y = (0.01 * x + 2.0) * np.exp(rng.normal(0, 0.05, len(x)))
    # Reference: minimise sum(((X w - y) / y)^2) with numpy's unconstrained least squares.
    reference, *_ = np.linalg.lstsq(X / y[:, None], np.ones_like(y), rcond=None)
    assert np.all(reference > 0)
    np.testing.assert_allclose(NonNegativeLinearRegression().fit(X, y).coef_, reference, rtol=1e-8)


def test_absolute_mode_equals_ordinary_least_squares():
    x = np.array([1.0, 2.0, 3.0, 10.0])
    X = np.stack([x, np.ones_like(x)], axis=1)
    y = np.array([3.1, 4.9, 7.2, 21.0])
    reference, *_ = np.linalg.lstsq(X, y, rcond=None)
    np.testing.assert_allclose(NonNegativeLinearRegression(relative=False).fit(X, y).coef_, reference, rtol=1e-8)


def test_negative_intercept_is_clamped_to_the_constrained_optimum():
    # y = 2x - 5 would need a negative constant; with const >= 0 the optimum has const = 0 and the
    # slope minimising sum((s x_i / y_i - 1)^2), i.e. s = sum(r) / sum(r^2) with r = x / y.
    x = np.array([10.0, 20.0, 40.0])
    y = 2 * x - 5
    X = np.stack([x, np.ones_like(x)], axis=1)
    r = x / y
    model = NonNegativeLinearRegression().fit(X, y)
    np.testing.assert_allclose(model.coef_, [r.sum() / (r**2).sum(), 0.0], atol=1e-12)


def test_all_zero_target_gives_zero_coefficients_and_negative_targets_are_refused():
    X = np.array([[1.0, 1.0], [2.0, 1.0]])
    np.testing.assert_array_equal(NonNegativeLinearRegression().fit(X, [0.0, 0.0]).predict(X), [0.0, 0.0])
    with pytest.raises(ValueError, match="non-negative targets"):
        NonNegativeLinearRegression().fit(X, [1.0, -1.0])


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.SkipTestWarning")
def test_follows_scikit_learn_estimator_conventions():
    # sklearn's generic checks use negative targets, which this model refuses by design; every
    # other check must pass.
    failures = [r for r in check_estimator(NonNegativeLinearRegression(), on_fail=None) if r["status"] == "failed"]
    unexpected = [r["check_name"] for r in failures if "non-negative targets" not in str(r["exception"])]
    assert unexpected == []
