"""Cost-model fit plot: measured values are the profile's per-layer medians, predictions agree with the
closed form a synthetic profile was generated from and with the cost model's stage API."""

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from PIL import Image

from dflop.costmodel.features import LAYER_MODULES, MODULE_FEATURES, profile_features
from dflop.costmodel.fit import fit_profile
from dflop.costmodel.model import TARGETS
from dflop.costmodel.profile_table import summarize_profile
from dflop.costmodel.synthetic import SyntheticCosts, synthetic_profile
from dflop.errors import UserError
from dflop.report.costmodel_plots import draw_costmodel_fit, fit_table, plot_costmodel_fit
from dflop.costmodel.jsonio import save_cost_model

GRID = dict(tiles=(1, 2, 4, 8, 16), patches_per_tile=16, llm_batches=(1, 2, 4), llm_seq_lens=(64, 256, 1024))


def _fitted(profile: pd.DataFrame):
    return fit_profile(summarize_profile(profile))


@pytest.fixture(scope="module")
def noisy():
    """A profile with 5 % timing noise, 4-layer stacks, TP 1 and 2, and the model fitted on it."""
    profile = synthetic_profile(tp_degrees=(1, 2), n_layers=4, repeats=3, noise=0.05, seed=1, **GRID)
    model, validation = _fitted(profile)
    return profile, model, validation


def test_measured_is_the_per_layer_median_over_repeats(noisy):
    profile, model, _ = noisy
    table = fit_table(profile, model)
    for target in TARGETS:
        per_layer = profile[target] / np.where(profile["module"].isin(list(LAYER_MODULES)), profile["n_layers"], 1)
        ref = per_layer.groupby([profile["module"], profile["tp"], profile["batch"], profile["seq_len"]]).median()
        got = table[table["target"] == target].set_index(["module", "tp", "batch", "seq_len"])["measured"]
        assert len(got) == len(ref)
        np.testing.assert_allclose(got.sort_index().to_numpy(), ref.sort_index().to_numpy(), rtol=1e-12)


def test_predictions_match_the_stage_api(noisy):
    """Every module the stages use, predicted per shape, equals the CostModel stage time / memory."""
    profile, model, _ = noisy
    table = fit_table(profile, model)
    stage_args = {  # module -> (vision?, n_layers, first, last)
        "vision_layer": (True, 1, False, False), "vision_embed": (True, 0, True, False),
        "projector": (True, 0, False, True), "llm_layer": (False, 1, False, False),
        "llm_embed": (False, 0, True, False), "llm_head": (False, 0, False, True),
    }
    checked = 0
    for row in table.itertuples():
        if row.module not in stage_args:
            continue
        vision, n_layers, first, last = stage_args[row.module]
        sizes = [1] * row.batch if vision else [row.seq_len] * row.batch
        kw = dict(n_layers=n_layers, first=first, last=last, tp=row.tp)
        if row.target == "act_bytes":
            memory = (model.vision_stage_memory if vision else model.llm_stage_memory)(sizes, in_flight=1, **kw)
            expected = memory.activation_bytes
        else:
            time = (model.vision_stage_time if vision else model.llm_stage_time)(sizes, **kw)
            expected = 1e3 * (time.fwd_s if row.target == "fwd_ms" else time.bwd_s)
        assert row.predicted == pytest.approx(expected, rel=1e-9, abs=1e-12), row
        checked += 1
    assert checked == len(table[table["module"] != "llm_attention"])


def test_noise_free_fit_predicts_the_closed_form_exactly():
    profile = synthetic_profile(tp_degrees=(1,), n_layers=2, repeats=2, noise=0.0, **GRID)
    model, _ = _fitted(profile)
    table = fit_table(profile, model)
    costs = SyntheticCosts()
    for row in table.itertuples():
        x = profile_features(MODULE_FEATURES[row.module][1], np.array([row.batch]), np.array([row.seq_len]))
        closed_form = float((x @ costs.coefficients(row.module, row.target, row.tp))[0])
        assert row.predicted == pytest.approx(closed_form, rel=1e-6, abs=1e-9), row
        assert row.measured == pytest.approx(closed_form, rel=1e-9, abs=1e-12), row


def test_figure_shows_every_shape_and_the_held_out_errors(noisy):
    profile, model, validation = noisy
    table = fit_table(profile, model)
    fig = draw_costmodel_fit(table, validation)
    scale = {"fwd_ms": 1.0, "bwd_ms": 1.0, "act_bytes": 1e-6}
    for ax, target in zip(fig.axes[:3], TARGETS):
        drawn = np.concatenate([c.get_offsets() for c in ax.collections if len(c.get_offsets())
                                and c.get_label().startswith("_")])  # the scatter points, not the band
        part = table[(table["target"] == target) & (table["measured"] > 0)]
        ref = np.c_[part["measured"], part["predicted"].clip(lower=0)] * scale[target]
        assert len(drawn) == len(ref)
        np.testing.assert_allclose(np.sort(drawn, axis=0), np.sort(ref, axis=0), rtol=1e-12)
    bars = [p.get_width() for p in fig.axes[3].patches]
    shown = validation[validation["target"].isin(TARGETS)]  # the time and saved-bytes fits (not the transients)
    assert sorted(bars) == pytest.approx(sorted(shown["mape_median"].fillna(0)))
    plt.close(fig)


def test_png_and_one_line_errors(noisy, tmp_path):
    profile, model, validation = noisy
    profile.to_parquet(tmp_path / "model_profile.parquet")
    save_cost_model(model, tmp_path / "costmodel.json")
    validation.to_parquet(tmp_path / "validation.parquet")
    out = plot_costmodel_fit(profile=tmp_path / "model_profile.parquet", costmodel=tmp_path / "costmodel.json",
                             validation=tmp_path / "validation.parquet", out_png=tmp_path / "fit.png")
    with Image.open(out) as img:
        assert img.format == "PNG" and img.width > 1000
    validation.drop(columns=["mape_p90"]).to_parquet(tmp_path / "bad_validation.parquet")
    with pytest.raises(UserError, match=r"bad_validation\.parquet: missing column\(s\) mape_p90"):
        plot_costmodel_fit(profile=tmp_path / "model_profile.parquet", costmodel=tmp_path / "costmodel.json",
                           validation=tmp_path / "bad_validation.parquet", out_png=tmp_path / "x.png")
    profile.drop(columns=["n_layers"]).to_parquet(tmp_path / "bad_profile.parquet")
    with pytest.raises(UserError, match=r"bad_profile\.parquet: missing column\(s\) n_layers"):
        plot_costmodel_fit(profile=tmp_path / "bad_profile.parquet", costmodel=tmp_path / "costmodel.json",
                           validation=tmp_path / "validation.parquet", out_png=tmp_path / "x.png")
    with pytest.raises(UserError, match="missing.json"):
        plot_costmodel_fit(profile=tmp_path / "model_profile.parquet", costmodel=tmp_path / "missing.json",
                           validation=tmp_path / "validation.parquet", out_png=tmp_path / "x.png")
