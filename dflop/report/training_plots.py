"""Training curves from metrics.parquet (one row per optimizer step, DESIGN.md §4).

Four panels over the step number: the loss; measured step time against the cost model's
prediction for the same step (seconds); the idle share of device time, overall and per pipeline
stage when the per-stage columns ``busy_s_<stage>`` / ``idle_s_<stage>`` are present (percent);
and predicted vs measured step time as a scatter with the y = x line, which shows at a glance
whether the planner's model is optimistic (points below the line) or pessimistic. The first step
drawn pays start-up costs (data loaders, allocator, first scheduling) that no step model predicts,
so it has its own marker and stays out of the median measured / predicted ratio.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import MaxNLocator

from dflop.errors import UserError
from dflop.report.style import PLAN_COLOUR, read_table, save_figure

METRICS_COLUMNS = ("step", "loss", "step_s", "idle_frac", "predicted_step_s")


def stage_idle_percent(metrics: pd.DataFrame) -> pd.DataFrame:
    """[steps, stages] idle share (percent) of each stage's rank time, from busy_s_/idle_s_ columns.

    Columns are the stage names (e.g. vision0, llm0); empty when the metrics have no per-stage columns.
    """
    stages = [c[len("busy_s_"):] for c in metrics.columns
              if c.startswith("busy_s_") and f"idle_s_{c[len('busy_s_'):]}" in metrics.columns]
    out = {}
    for stage in stages:
        busy, idle = metrics[f"busy_s_{stage}"].to_numpy(float), metrics[f"idle_s_{stage}"].to_numpy(float)
        total = busy + idle
        out[stage] = np.divide(100 * idle, total, out=np.full_like(total, np.nan), where=total > 0)
    return pd.DataFrame(out, index=metrics.index)


def draw_training_curves(metrics: pd.DataFrame, *, title: str = "") -> plt.Figure:
    """The figure (module docstring) for a metrics table sorted by step."""
    if metrics.empty:
        raise UserError("metrics.parquet: no steps")
    m = metrics.sort_values("step")
    step = m["step"].to_numpy()
    fig, axes = plt.subplots(2, 2, figsize=(12.5, 8.5), layout="constrained")

    ax = axes[0, 0]
    ax.plot(step, m["loss"], marker="o", markersize=3, color=PLAN_COLOUR)
    ax.set_title("Training loss (mean over the global batch's answer tokens)", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")

    ax = axes[0, 1]
    ax.plot(step, m["step_s"], marker="o", markersize=3, color="black", label="measured")
    ax.plot(step, m["predicted_step_s"], marker="s", markersize=3, linestyle="--", color="#DD8452",
            label="predicted by the cost model")
    ax.set_ylim(bottom=0)
    ax.set_title("Step time: measured vs predicted", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds per step")
    ax.legend(fontsize=8)

    ax = axes[1, 0]
    ax.plot(step, 100 * m["idle_frac"], marker="o", markersize=3, color="black", linewidth=2, label="all devices")
    for stage, values in stage_idle_percent(m).items():
        ax.plot(step, values, linewidth=1, alpha=0.8, label=stage)
    ax.set_ylim(0, 100)
    ax.set_title("Idle share of device time (pipeline bubble, imbalance, waits)", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("idle (%)")
    ax.legend(fontsize=8, ncol=2)

    ax = axes[1, 1]
    measured, predicted = m["step_s"].to_numpy(float), m["predicted_step_s"].to_numpy(float)
    ok = np.isfinite(measured) & np.isfinite(predicted) & (measured > 0) & (predicted > 0)
    first = np.arange(len(m)) == 0  # the run's (or resumed run's) first step pays start-up: loaders, allocator
    steady = ok & ~first if (ok & ~first).any() else ok
    ax.scatter(measured[ok & ~first], predicted[ok & ~first], s=18, color=PLAN_COLOUR, edgecolor="black",
               linewidth=0.3, label="one step")
    ax.scatter(measured[ok & first], predicted[ok & first], s=30, marker="^", color="white", edgecolor="black",
               linewidth=0.8, label=f"step {int(step[0])} (includes start-up)")
    if ok.any():
        top = max(measured[ok].max(), predicted[ok].max()) * 1.1
        ax.plot([0, top], [0, top], "k--", linewidth=1, label="prediction = measurement")
        ax.set_xlim(0, top)
        ax.set_ylim(0, top)
        ratio = float(np.median(measured[steady] / predicted[steady]))
        ax.set_title(f"Predicted vs measured step time\nmedian measured / predicted: {ratio:.2f}"
                     f"{' (first step left out)' if steady is not ok else ''}", fontsize=10)
    else:
        ax.set_title("Predicted vs measured step time (no steps with both)", fontsize=10)
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("predicted step time (s)")
    ax.legend(fontsize=8, loc="upper left")

    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
    for ax in (axes[0, 0], axes[0, 1], axes[1, 0]):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title or f"Training: {len(m)} steps", fontsize=12)
    return fig


def plot_training_curves(*, metrics: str | Path, out_png: str | Path) -> Path:
    """Read metrics.parquet, draw the training curves, write `out_png`; returns its path."""
    table = read_table(metrics, "metrics.parquet", METRICS_COLUMNS)
    if table.empty:
        raise UserError(f"{metrics}: no steps")
    if table["step"].duplicated().any():
        raise UserError(f"{metrics}: step {int(table['step'][table['step'].duplicated()].iloc[0])} appears twice")
    title = f"Training: {len(table)} steps ({metrics})"
    return save_figure(draw_training_curves(table, title=title), out_png)
