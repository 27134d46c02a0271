"""`prediction_agreement`: measured / predicted step over the steady-state steps, by hand."""

import numpy as np
import pandas as pd

from dflop.costmodel.model import Provenance
from dflop.runtime.metrics import prediction_agreement


def test_warm_up_steps_are_left_out_and_the_ratio_is_per_step():
    frame = pd.DataFrame({"step": [1, 2, 3, 4, 5, 6], "step_s": [40.0, 9.0, 2.0, 6.0, 4.0, 1.0],
                          "predicted_step_s": [1.0, 1.0, 1.0, 2.0, 1.0, 1.0]})
    got = prediction_agreement(frame)
    # steps 3-6: ratios 2, 3, 4, 1 -> sorted 1 2 3 4; linear percentiles by hand
    assert (got.steps, got.first_step) == (4, 3)
    assert np.isclose(got.ratio_p50, 2.5) and np.isclose(got.ratio_p10, 1.3) and np.isclose(got.ratio_p90, 3.7)
    assert got.corrected_p50 is None
    assert "2.5 median (p10 1.3, p90 3.7) over 4 steps from step 3" in got.describe()


def test_corrected_prediction_is_compared_where_present():
    frame = pd.DataFrame({"step": [1, 2, 3, 4, 5], "step_s": [9.0, 9.0, 2.0, 3.0, 4.0],
                          "predicted_step_s": [1.0, 1.0, 1.0, 1.0, 1.0],
                          "corrected_step_s": [np.nan, np.nan, np.nan, 3.0, 2.0]})
    got = prediction_agreement(frame)
    assert np.isclose(got.ratio_p50, 3.0) and np.isclose(got.corrected_p50, 1.5)  # steps 4, 5: 1.0 and 2.0
    assert "against the corrected prediction 1.5 median" in got.describe()


def test_a_run_still_warming_up_has_no_agreement():
    frame = pd.DataFrame({"step": [1, 2], "step_s": [9.0, 3.0], "predicted_step_s": [1.0, 1.0]})
    assert prediction_agreement(frame) is None


def test_cost_model_provenance_says_analytic_or_where_it_was_fitted():
    assert Provenance(preset="p", device="analytic 400 TFLOP/s", dtype="bfloat16").describe().startswith(
        "analytic FLOP model (analytic 400 TFLOP/s")
    fitted = Provenance(preset="llava_ov/a/b", device="NVIDIA H100", dtype="bfloat16", profile="prof.parquet",
                        created="2026-11-24T20:48:59+00:00")
    assert fitted.describe() == "fitted on NVIDIA H100 (llava_ov/a/b, bfloat16; profile prof.parquet, fitted 2026-11-24)"
