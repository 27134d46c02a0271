"""Fitting synthetic closed-form profiles recovers the closed form; `fit` writes its two outputs."""

import json

import numpy as np
import pandas as pd
import pytest

from dflop.costmodel.fit import VALIDATION_COLUMNS, fit, fit_profile
from dflop.costmodel.features import MODULE_FEATURES
from dflop.costmodel.model import TARGETS
from dflop.costmodel.profile_table import summarize_profile
from dflop.costmodel.synthetic import SyntheticCosts, synthetic_profile
from dflop.errors import UserError


@pytest.mark.parametrize("n_layers", [1, 3])
def test_noiseless_profile_gives_back_the_closed_form_coefficients(n_layers):
    costs = SyntheticCosts()
    profile = synthetic_profile(costs, tp_degrees=(1, 2), n_layers=n_layers, repeats=2)
    model, validation = fit_profile(summarize_profile(profile))
    assert set(model.modules) == {(m, tp) for m in MODULE_FEATURES for tp in (1, 2)}
    for (module, tp), fitted in model.modules.items():
        for target in TARGETS:
            true = costs.coefficients(module, target, tp)
            # A true zero comes back as round-off, so zeros are compared on the scale of the others.
            np.testing.assert_allclose(fitted.coefficients(target), true, rtol=1e-6, atol=1e-9 * true.max(),
                                       err_msg=f"{module} tp={tp} {target}")
        assert fitted.param_bytes == pytest.approx(costs.param_bytes[module] / tp)
    assert validation["mape_max"].max() < 1e-6


def test_noisy_profile_predicts_held_out_shapes_within_the_noise():
    costs = SyntheticCosts()
    profile = synthetic_profile(costs, noise=0.03, repeats=5, seed=7)
    model, validation = fit_profile(summarize_profile(profile))
    time_rows = validation[validation["target"] != "act_bytes"]
    # 3 % per-repeat noise, median of 5 repeats: ~1.3 % per shape, so held-out medians are a few %.
    assert time_rows["mape_median"].max() < 5.0
    # Predictions on an unprofiled shape (7 samples of 300 tokens) agree with the closed form.
    x = np.array([7 * 300, 7 * 300**1.5, 7 * 300**2, 1.0])
    exact = x @ costs.coefficients("llm_layer", "fwd_ms")
    predicted = model.llm_stage_time([300] * 7, n_layers=1, first=False, last=False, tp=1).fwd_s * 1e3
    assert predicted == pytest.approx(exact, rel=0.05)


def test_fit_writes_json_and_validation_parquet_atomically(tmp_path):
    profile_path = tmp_path / "model_profile.parquet"
    synthetic_profile(noise=0.02).to_parquet(profile_path)
    out_json = tmp_path / "costmodel" / "costmodel.json"
    out_validation = tmp_path / "costmodel" / "validation.parquet"
    model = fit(profile_path, out_json, out_validation)

    data = json.loads(out_json.read_text())
    assert data["format"] == "dflop-costmodel" and data["version"] == 1
    assert data["provenance"]["preset"] == "synthetic"
    assert data["provenance"]["dtype"] == "float32"
    assert len(data["provenance"]["profile_sha256"]) == 64
    validation = pd.read_parquet(out_validation)
    assert tuple(validation.columns) == VALIDATION_COLUMNS
    assert len(validation) == len(model.modules) * len(TARGETS)
    assert sorted(p.name for p in out_json.parent.iterdir()) == ["costmodel.json", "validation.parquet"]


def test_missing_module_in_profile_is_reported_by_name_when_asked_for(tmp_path):
    profile = synthetic_profile(modules=("llm_layer", "llm_embed", "llm_head"), tp_degrees=(1, 2))
    model, _ = fit_profile(summarize_profile(profile))
    with pytest.raises(UserError, match=r"^no profile for llm_layer at tp=4; profiled tp: 1, 2$"):
        model.llm_stage_time([100], n_layers=2, first=False, last=False, tp=4)
    with pytest.raises(UserError, match=r"^no profile for vision_layer; profiled modules: llm_embed, llm_head, llm_layer$"):
        model.vision_stage_time([1], n_layers=2, first=False, last=False, tp=1)
