"""Fitting synthetic closed-form profiles recovers the closed form; `fit` writes its two outputs."""

import json

import numpy as np
import pandas as pd
import pytest

from dflop.costmodel.fit import VALIDATION_COLUMNS, fit, fit_profile
from dflop.costmodel.features import MODULE_FEATURES
from dflop.costmodel.jsonio import load_cost_model, save_cost_model
from dflop.costmodel.model import TARGETS, TRANSIENT
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
        for target in (*TARGETS, TRANSIENT):  # a stack's transient is one layer's: not divided by n_layers
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
    assert len(validation) == len(model.modules) * (len(TARGETS) + 1)  # and each module's transient
    assert sorted(p.name for p in out_json.parent.iterdir()) == ["costmodel.json", "validation.parquet"]


def test_missing_module_in_profile_is_reported_by_name_when_asked_for(tmp_path):
    profile = synthetic_profile(modules=("llm_layer", "llm_embed", "llm_head"), tp_degrees=(1, 2))
    model, _ = fit_profile(summarize_profile(profile))
    with pytest.raises(UserError, match=r"^no profile for llm_layer at tp=4; profiled tp: 1, 2$"):
        model.llm_stage_time([100], n_layers=2, first=False, last=False, tp=4)
    with pytest.raises(UserError, match=r"^no profile for vision_layer; profiled modules: llm_embed, llm_head, llm_layer$"):
        model.vision_stage_time([1], n_layers=2, first=False, last=False, tp=1)


RECOMPUTE = ("bwd_ms:selective", "act_bytes:selective", "transient_bytes:selective", "bwd_ms:full", "act_bytes:full",
             "transient_bytes:full")


@pytest.mark.parametrize("n_layers", [1, 3])
def test_recompute_columns_give_back_their_closed_form_coefficients(n_layers, tmp_path):
    """A profile with the recompute columns (timed on 1 of 3 repeats, as the profiler times a mode
    fewer times) fits `bwd_ms:<mode>` / `act_bytes:<mode>` of the layer modules; the fitted model
    prices the modes as the closed form does, also after a JSON round trip."""
    costs = SyntheticCosts()
    profile = synthetic_profile(costs, tp_degrees=(1, 2), n_layers=n_layers, repeats=3, recompute=True,
                                recompute_repeats=1)
    model, validation = fit_profile(summarize_profile(profile))
    for (module, tp), fitted in model.modules.items():
        if module not in ("vision_layer", "llm_layer"):
            assert set(fitted.coef) == {*TARGETS, TRANSIENT}, module
            continue
        assert set(fitted.coef) == {*TARGETS, TRANSIENT, *RECOMPUTE}, module
        for target in RECOMPUTE:
            true = costs.coefficients(module, target, tp)
            np.testing.assert_allclose(fitted.coefficients(target), true, rtol=1e-6, atol=1e-9 * true.max(),
                                       err_msg=f"{module} tp={tp} {target}")
    fitted_targets = validation.groupby("module")["target"].apply(set)
    assert fitted_targets["llm_layer"] == {*TARGETS, TRANSIENT, *RECOMPUTE}
    assert fitted_targets["llm_head"] == {*TARGETS, TRANSIENT}

    # Prediction for an unprofiled bin (7 samples of 300 tokens, 2 layers) against the closed form.
    x = np.array([7 * 300, 7 * 300**1.5, 7 * 300**2, 1.0])
    save_cost_model(model, tmp_path / "costmodel.json")
    loaded = load_cost_model(tmp_path / "costmodel.json")
    for mode in ("selective", "full"):
        kw = dict(n_layers=2, first=False, last=False, tp=1, recompute=mode)
        time = loaded.llm_stage_time([300] * 7, **kw)
        assert time.bwd_s * 1e3 == pytest.approx(2 * x @ costs.coefficients("llm_layer", f"bwd_ms:{mode}"), rel=1e-6)
        assert time.fwd_s == model.llm_stage_time([300] * 7, **kw).fwd_s  # the forward is mode none's
        memory = loaded.llm_stage_memory([300] * 7, in_flight=1, **kw)
        assert memory.activation_bytes == pytest.approx(2 * 7 * 300 * costs.coefficients("llm_layer", f"act_bytes:{mode}")[0])
        # one layer's transient in the mode, whatever the layer count
        assert memory.transient_bytes == pytest.approx(x @ costs.coefficients("llm_layer", f"transient_bytes:{mode}"))
        assert loaded.vision_stage_time([3, 5], **kw) == model.vision_stage_time([3, 5], **kw)


def test_a_profile_without_recompute_columns_still_fits_and_prices_mode_none_only(tmp_path):
    """Profiles written before the profiler measured the modes load and fit as before."""
    profile_path = tmp_path / "model_profile.parquet"
    synthetic_profile(noise=0.02).to_parquet(profile_path)
    fit(profile_path, tmp_path / "costmodel.json", tmp_path / "validation.parquet")
    data = json.loads((tmp_path / "costmodel.json").read_text())
    assert all(set(m["coef"]) == {*TARGETS, TRANSIENT} for m in data["modules"])
    model = load_cost_model(tmp_path / "costmodel.json")
    assert model.llm_stage_time([100], n_layers=2, first=False, last=False, tp=1).bwd_s > 0
    with pytest.raises(UserError, match="has no full-recompute costs for llm_layer"):
        model.llm_stage_time([100], n_layers=2, first=False, last=False, tp=1, recompute="full")


def test_a_recompute_target_missing_on_some_shapes_is_not_fitted(caplog):
    profile = synthetic_profile(modules=("llm_layer",), recompute=True)
    profile.loc[profile["seq_len"] == 4096, "bwd_ms:full"] = np.nan
    model, _ = fit_profile(summarize_profile(profile))
    assert set(model.module("llm_layer", 1).coef) == {*TARGETS, TRANSIENT, *RECOMPUTE} - {"bwd_ms:full"}
    assert "bwd_ms:full measured on 15 of 18 shapes; not fitted" in caplog.text


def test_a_profile_without_transients_derives_them_from_its_cuda_peaks_or_prices_none(tmp_path, caplog):
    """A profile from before the profiler measured transients: where its CUDA allocator peaks are
    measured, ``peak_bytes - act_bytes - grad_bytes`` (at least 0) is fitted as the transient;
    where they are NaN (a CPU profile), the model has none, prices them 0 and says so when loaded."""
    costs = SyntheticCosts()
    profile = synthetic_profile(costs, modules=("llm_layer", "llm_head"), repeats=2).drop(columns=[TRANSIENT])
    profile["grad_bytes"] = profile["param_bytes"]
    head = profile["module"] == "llm_head"
    tokens = profile["batch"] * profile["seq_len"]
    transient = 1.2e6 * tokens  # the head's, per token
    profile["peak_bytes"] = np.where(head, profile["act_bytes"] + profile["grad_bytes"] + transient,
                                     0.5 * profile["act_bytes"])  # a layer's peak below its kept bytes: 0
    model, _ = fit_profile(summarize_profile(profile))
    assert model.has_transients
    np.testing.assert_allclose(model.module("llm_head", 1).coefficients(TRANSIENT), [1.2e6, 0.0], atol=1e-3)
    assert not np.any(model.module("llm_layer", 1).coefficients(TRANSIENT))
    memory = model.llm_stage_memory([300, 200], n_layers=2, first=False, last=True, tp=1, in_flight=1)
    assert memory.transient_bytes == pytest.approx(1.2e6 * 500)

    profile["peak_bytes"] = np.nan  # measured on CPU: no peaks
    model, validation = fit_profile(summarize_profile(profile))
    assert not model.has_transients and TRANSIENT not in set(validation["target"])
    save_cost_model(model, tmp_path / "old.json")
    with caplog.at_level("WARNING", logger="dflop.costmodel.jsonio"):
        loaded = load_cost_model(tmp_path / "old.json")
    assert caplog.text.count("no transient_bytes") == 1
    memory = loaded.llm_stage_memory([300, 200], n_layers=2, first=False, last=True, tp=1, in_flight=3)
    assert memory.transient_bytes == 0 and memory.total_bytes == memory.static_bytes + 3 * memory.activation_bytes


def test_a_mode_without_its_transient_holds_mode_nones_and_what_it_drops():
    """A layer fitted with mode none's transient but not the modes' (a profile from CUDA peaks, which
    only mode none's runs kept): a recomputing layer's transient is mode none's plus the activations
    the mode no longer keeps, which its backward holds again (here the closed form's coefficients)."""
    costs = SyntheticCosts()
    profile = synthetic_profile(costs, modules=("llm_layer",), recompute=True)
    profile = profile.drop(columns=["transient_bytes:selective", "transient_bytes:full"])
    model, _ = fit_profile(summarize_profile(profile))
    lens = [300, 120]
    x = np.array([420, 300**1.5 + 120**1.5, 300**2 + 120**2, 1.0])
    for mode in ("selective", "full"):
        memory = model.llm_stage_memory(lens, n_layers=3, first=False, last=False, tp=1, in_flight=2, recompute=mode)
        dropped = costs.coefficients("llm_layer", "act_bytes") - costs.coefficients("llm_layer", f"act_bytes:{mode}")
        want = x @ (costs.coefficients("llm_layer", TRANSIENT) + dropped)
        assert memory.transient_bytes == pytest.approx(want, rel=1e-6), mode


def test_each_fit_is_the_least_relative_squares_over_every_profiled_shape():
    """On a noisy profile every shape moves the optimum: each fitted (module, tp, time target) must
    reach the least sum of squared relative errors over all the profile's shapes, found here
    independently (scipy's bounded least squares, coefficients >= 0), so a fit that leaves out a
    shape ends measurably above it."""
    from scipy.optimize import lsq_linear

    from dflop.costmodel.features import profile_features

    summary = summarize_profile(synthetic_profile(SyntheticCosts(), noise=0.05, repeats=3, seed=11))
    model, _ = fit_profile(summary)
    for (module, tp), shapes in summary.shapes.groupby(["module", "tp"]):
        fitted = model.modules[(module, int(tp))]
        X = profile_features(fitted.features, shapes["batch"].to_numpy(), shapes["seq_len"].to_numpy())
        for target in ("fwd_ms", "bwd_ms"):
            y = shapes[target].to_numpy(dtype=np.float64)
            a, b = X / y[:, None], np.ones_like(y)  # relative residuals: (X c - y) / y
            scale = np.linalg.norm(a, axis=0)
            best = lsq_linear(a / scale, b, bounds=(0, np.inf), method="bvls", tol=1e-14).x / scale
            least = np.sum((a @ best - b) ** 2)
            got = np.sum((a @ np.asarray(fitted.coefficients(target)) - b) ** 2)
            assert got == pytest.approx(least, rel=1e-7), (module, tp, target)
