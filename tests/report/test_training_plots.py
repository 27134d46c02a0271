"""Training curves on a synthetic metrics table: every line drawn is the metrics column it names."""

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from PIL import Image

from dflop.errors import UserError
from dflop.report.training_plots import draw_training_curves, plot_training_curves, stage_idle_percent

STAGES = ("vision0", "llm0", "llm1")


def _metrics(n: int = 30, seed: int = 0) -> pd.DataFrame:
    """docs/design.md columns plus the trainer's per-stage busy/idle seconds, rows shuffled."""
    rng = np.random.default_rng(seed)
    step = np.arange(1, n + 1)
    predicted = 0.2 + 0.05 * rng.random(n)
    frame = pd.DataFrame({
        "step": step, "loss": 3 * np.exp(-step / 10) + 0.4, "step_s": predicted * 1.15 + 0.01 * rng.random(n),
        "samples": 16, "tokens": 4000 + rng.integers(0, 500, n), "tflops": 0.1, "idle_frac": 0.1 + 0.2 * rng.random(n),
        "sched_ms": 2.0, "sched_gap": 1.01, "predicted_step_s": predicted,
    })
    for stage in STAGES:
        frame[f"busy_s_{stage}"] = rng.random(n)
        frame[f"idle_s_{stage}"] = rng.random(n)
    return frame.sample(frac=1, random_state=1).reset_index(drop=True)


def _line(ax, label: str):
    for line in ax.get_lines():
        if line.get_label() == label:
            return line
    raise AssertionError(f"no line {label!r} in {[l.get_label() for l in ax.get_lines()]}")


def test_lines_are_the_metrics_columns_in_step_order():
    metrics = _metrics()
    fig = draw_training_curves(metrics)
    axes = fig.dflop_axes
    loss_ax, time_ax, idle_ax, scatter_ax = axes["loss"], axes["step_time"], axes["idle"], axes["scatter"]
    ordered = metrics.sort_values("step")
    x = ordered["step"].to_numpy()
    loss = loss_ax.get_lines()[0]
    np.testing.assert_array_equal(loss.get_xdata(), x)
    np.testing.assert_array_equal(loss.get_ydata(), ordered["loss"])
    np.testing.assert_array_equal(_line(time_ax, "measured").get_ydata(), ordered["step_s"])
    np.testing.assert_array_equal(_line(time_ax, "predicted by the cost model").get_ydata(), ordered["predicted_step_s"])
    np.testing.assert_allclose(_line(idle_ax, "all devices").get_ydata(), 100 * ordered["idle_frac"])
    for stage in STAGES:
        busy, idle = ordered[f"busy_s_{stage}"].to_numpy(), ordered[f"idle_s_{stage}"].to_numpy()
        np.testing.assert_allclose(_line(idle_ax, stage).get_ydata(), 100 * idle / (busy + idle))
    steady, warm = scatter_ax.collections[0].get_offsets(), scatter_ax.collections[1].get_offsets()
    np.testing.assert_allclose(np.r_[warm, steady], np.c_[ordered["step_s"], ordered["predicted_step_s"]])
    later = ordered[ordered["step"] > 2]  # WARMUP_STEPS = 2 pay warm-up; out of the ratio
    ratio = np.median(later["step_s"] / later["predicted_step_s"])
    assert f"median measured / predicted: {ratio:.2f} (steps ≤ 2 left out)" in scatter_ax.get_title()
    for key in ("throughput", "tflops", "lr", "grad_norm", "data_wait", "sched", "skipped"):
        assert key in axes
    plt.close(fig)


def test_stage_idle_percent_without_stage_columns_is_empty():
    metrics = _metrics().drop(columns=[c for c in _metrics().columns if c.startswith(("busy_s_", "idle_s_"))])
    assert stage_idle_percent(metrics).shape == (len(metrics), 0)
    zero = _metrics(3)
    zero[["busy_s_llm0", "idle_s_llm0"]] = 0.0
    assert stage_idle_percent(zero)["llm0"].isna().all()  # no rank time: undefined, not 0 % or a crash


def test_png_is_written_and_bad_tables_are_refused(tmp_path):
    _metrics().to_parquet(tmp_path / "metrics.parquet")
    out = plot_training_curves(metrics=tmp_path / "metrics.parquet", out_png=tmp_path / "curves.png")
    with Image.open(out) as img:
        assert img.format == "PNG" and img.width > 1000
    _metrics().drop(columns=["predicted_step_s"]).to_parquet(tmp_path / "old.parquet")
    with pytest.raises(UserError, match=r"old\.parquet: missing column\(s\) predicted_step_s"):
        plot_training_curves(metrics=tmp_path / "old.parquet", out_png=tmp_path / "x.png")
    twice = _metrics(5)
    pd.concat([twice, twice.iloc[[2]]]).to_parquet(tmp_path / "twice.parquet")
    with pytest.raises(UserError, match=rf"twice\.parquet: step {int(twice['step'].iloc[2])} appears twice"):
        plot_training_curves(metrics=tmp_path / "twice.parquet", out_png=tmp_path / "x.png")
    _metrics().iloc[:0].to_parquet(tmp_path / "empty.parquet")
    with pytest.raises(UserError, match=r"empty\.parquet: no steps"):
        plot_training_curves(metrics=tmp_path / "empty.parquet", out_png=tmp_path / "x.png")
