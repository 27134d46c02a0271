"""Held-out error by leaving one shape out, checked by hand on a three-shape example."""

import numpy as np
import pandas as pd
import pytest

from dflop.costmodel.fit import fit_profile
from dflop.costmodel.profile_table import summarize_profile
from dflop.costmodel.regressor import NonNegativeLinearRegression
from dflop.costmodel.validation import leave_one_shape_out

# llm_embed (features tokens, const) at 10, 20, 40 tokens taking 2, 3, 6 ms. With two features, the
# fit on the two remaining shapes is the line through them (all slopes/intercepts are >= 0):
#   leave 10 out: line through (20,3),(40,6): 0.15 t + 0      -> 1.5 at 10,   APE 25 %
#   leave 20 out: line through (10,2),(40,6): 2/15 t + 2/3    -> 10/3 at 20,  APE 11.11 %
#   leave 40 out: line through (10,2),(20,3): 0.1 t + 1       -> 5 at 40,     APE 16.67 %
HAND_APE = [25.0, 100 / 9, 50 / 3]


def test_leave_one_shape_out_matches_hand_computation():
    tokens = np.array([10.0, 20.0, 40.0])
    X = np.stack([tokens, np.ones(3)], axis=1)
    held_out = leave_one_shape_out(X, np.array([2.0, 3.0, 6.0]), NonNegativeLinearRegression)
    np.testing.assert_allclose(held_out.ape_percent, HAND_APE, rtol=1e-9)
    assert held_out.median == pytest.approx(50 / 3)
    # numpy's linear percentile over [11.11, 16.67, 25]: 16.67 + 0.8 * (25 - 16.67)
    assert held_out.p90 == pytest.approx(50 / 3 + 0.8 * (25 - 50 / 3))
    assert (held_out.n_train_shapes, held_out.n_test_shapes) == (2, 3)


def test_validation_table_holds_out_shapes_not_repeats():
    # Two repeats per shape whose median is the hand example; a row-level split would leak repeats.
    rows = []
    for tokens, ms in [(10, 2.0), (20, 3.0), (40, 6.0)]:
        for repeat, jitter in enumerate([0.9, 1.1]):
            rows.append({"module": "llm_embed", "tp": 1, "batch": 1, "seq_len": tokens, "n_layers": 1,
                         "fwd_ms": ms * jitter, "bwd_ms": ms, "act_bytes": 8.0 * tokens, "param_bytes": 100.0,
                         "peak_bytes": np.nan, "device": "cpu", "dtype": "float32", "repeat": repeat})
    _, validation = fit_profile(summarize_profile(pd.DataFrame(rows)))
    fwd = validation[validation["target"] == "fwd_ms"].iloc[0]
    assert (fwd["n_train_shapes"], fwd["n_test_shapes"]) == (2, 3)
    assert fwd["mape_median"] == pytest.approx(50 / 3)
    assert fwd["mape_max"] == pytest.approx(25.0)
    act = validation[validation["target"] == "act_bytes"].iloc[0]
    assert act["mape_median"] == pytest.approx(0.0, abs=1e-9)


def test_too_few_shapes_give_no_error_rather_than_a_fake_zero():
    held_out = leave_one_shape_out(np.array([[1.0, 1.0]]), np.array([2.0]), NonNegativeLinearRegression)
    assert held_out.n_test_shapes == 0 and np.isnan(held_out.median)
