"""Training curves from metrics.parquet (one row per optimizer step, `dflop.runtime.metrics`).

Twelve panels over the step number: throughput (samples/s, tokens/s); model TFLOP/s and MFU when
the device's peak is given (else the panel says the peak is unknown, e.g. on CPU); loss; learning
rate; gradient norm; measured step time against the cost model's prediction for the same step (and
the adaptive correction's ``corrected_step_s`` where the run has it); predicted vs measured as a
scatter with the y = x line (points below it: the model is optimistic); the idle share of device
time, overall and per pipeline stage (``busy_s_<stage>`` / ``idle_s_<stage>``); data-loader wait;
scheduler solve time; samples skipped.

The first `WARMUP_STEPS` steps pay warm-up (allocator growth, thread pools, first collectives) that
no steady-state model predicts: they are shaded, drawn, but kept out of every axis' range (a point
above the range is marked with its value at the top edge) and out of the median measured /
predicted ratio (`prediction_agreement`'s convention).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import MaxNLocator

from dflop.errors import UserError
from dflop.report.style import BASELINE_COLOUR, PLAN_COLOUR, read_table, save_figure
from dflop.runtime.metrics import WARMUP_STEPS

METRICS_COLUMNS = ("step", "loss", "step_s", "idle_frac", "predicted_step_s")
WARMUP_COLOUR = "#DDDDDD"


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


def steady_limits(step: np.ndarray, *series: np.ndarray, warmup_steps: int = WARMUP_STEPS,
                  zero_floor: bool = True) -> tuple[float, float] | None:
    """Y range of the steps after the warm-up (all steps when there are none): 0 (zero_floor) or
    the minimum less 10 % of the spread, up to the maximum plus 10 % (15 % above 0 with zero_floor).
    None when no finite value."""
    values = np.concatenate([np.asarray(s, float) for s in series]) if series else np.array([])
    steps = np.concatenate([np.asarray(step)] * len(series)) if series else np.array([])
    finite = np.isfinite(values)
    keep = finite & (steps > warmup_steps)
    if not keep.any():
        keep = finite
    if not keep.any():
        return None
    lo, hi = float(values[keep].min()), float(values[keep].max())
    if zero_floor:
        return (0.0, hi * 1.15 if hi > 0 else 1.0)
    pad = 0.1 * (hi - lo) if hi > lo else 0.1 * max(abs(hi), 1e-12)
    return (lo - pad, hi + pad)


def _steady_axis(ax, step, *series, zero_floor: bool = True, fmt: str = "{:.3g}") -> None:
    """Set `ax`'s y range from the steady steps; mark warm-up points above it with their value."""
    limits = steady_limits(step, *series, zero_floor=zero_floor)
    if limits is None:
        return
    ax.set_ylim(*limits)
    for values in series:
        values = np.asarray(values, float)
        for s, v in zip(step, values):
            if np.isfinite(v) and v > limits[1]:
                ax.annotate(f"↑ {fmt.format(v)}", (s, limits[1]), xytext=(0, -12), textcoords="offset points",
                            ha="center", fontsize=7, color="dimgrey")


def _shade_warmup(ax, step: np.ndarray, warmup_steps: int) -> None:
    if len(step) and step.min() <= warmup_steps:
        ax.axvspan(step.min() - 0.5, min(warmup_steps, step.max()) + 0.5, color=WARMUP_COLOUR, zorder=0)


def _column(m: pd.DataFrame, name: str) -> np.ndarray | None:
    return m[name].to_numpy(float) if name in m.columns else None


def _missing(ax, what: str) -> None:
    ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes, fontsize=9, color="dimgrey")


def draw_training_curves(metrics: pd.DataFrame, *, title: str = "", peak_tflops: float | None = None,
                         devices: int | None = None, warmup_steps: int = WARMUP_STEPS) -> plt.Figure:
    """The figure (module docstring) for a metrics table.

    peak_tflops: one device's peak TFLOP/s (None: unknown, no MFU); devices: how many devices ran
    the step (metrics' ``tflops`` is the whole run's), needed with peak_tflops.
    """
    if metrics.empty:
        raise UserError("metrics.parquet: no steps")
    m = metrics.sort_values("step").reset_index(drop=True)
    step = m["step"].to_numpy()
    measured, predicted = m["step_s"].to_numpy(float), m["predicted_step_s"].to_numpy(float)
    fig, grid = plt.subplots(4, 3, figsize=(16, 15), layout="constrained")
    axes = {}

    ax = axes["throughput"] = grid[0, 0]
    if "samples" in m:
        samples = m["samples"].to_numpy(float) / measured
        ax.plot(step, samples, marker="o", markersize=3, color=PLAN_COLOUR)
        _steady_axis(ax, step, samples)
        ax.set_ylabel("samples / s", color=PLAN_COLOUR)
    if "tokens" in m:
        twin = ax.twinx()
        tokens = m["tokens"].to_numpy(float) / measured
        twin.plot(step, tokens, marker="s", markersize=3, color=BASELINE_COLOUR)
        _steady_axis(twin, step, tokens, fmt="{:.0f}")
        twin.set_ylabel("LLM tokens / s", color=BASELINE_COLOUR)
    ax.set_title("Throughput (samples/s left, tokens/s right)", fontsize=10)

    ax = axes["tflops"] = grid[0, 1]
    tflops = _column(m, "tflops")
    if tflops is None:
        _missing(ax, "no tflops column")
    else:
        ax.plot(step, tflops, marker="o", markersize=3, color="black", label="model TFLOP/s (all devices)")
        _steady_axis(ax, step, tflops)
        ax.set_ylabel("TFLOP/s")
        if peak_tflops and devices:
            twin = ax.twinx()
            lo, hi = ax.get_ylim()
            total = peak_tflops * devices
            twin.set_ylim(100 * lo / total, 100 * hi / total)
            twin.set_ylabel("MFU (%)")
            mfu = 100 * np.median(tflops[step > warmup_steps] if (step > warmup_steps).any() else tflops) / total
            ax.set_title(f"Model TFLOP/s; MFU {mfu:.1f}% median (peak {peak_tflops:g} TFLOP/s x {devices})",
                         fontsize=10)
        else:
            ax.set_title("Model TFLOP/s (MFU: device peak unknown)", fontsize=10)

    ax = axes["loss"] = grid[0, 2]
    ax.plot(step, m["loss"], marker="o", markersize=3, color=PLAN_COLOUR, label="loss")
    _steady_axis(ax, step, m["loss"].to_numpy(float), zero_floor=False)
    ax.set_title("Training loss (mean over the global batch's answer tokens)", fontsize=10)
    ax.set_ylabel("loss")

    for key, cell, column, label in (("lr", grid[1, 0], "lr", "learning rate"),
                                     ("grad_norm", grid[1, 1], "grad_norm", "gradient norm (before clipping)")):
        ax = axes[key] = cell
        values = _column(m, column)
        if values is None:
            _missing(ax, f"no {column} column")
        else:
            ax.plot(step, values, marker="o", markersize=3, color=PLAN_COLOUR, label=label)
            _steady_axis(ax, step, values)
        ax.set_title(label.capitalize(), fontsize=10)

    ax = axes["step_time"] = grid[1, 2]
    ax.plot(step, measured, marker="o", markersize=3, color="black", label="measured")
    ax.plot(step, predicted, marker="s", markersize=3, linestyle="--", color=BASELINE_COLOUR,
            label="predicted by the cost model")
    series = [measured, predicted]
    corrected = _column(m, "corrected_step_s")
    if corrected is not None and np.isfinite(corrected).any():
        ax.plot(step, corrected, marker="^", markersize=3, linestyle=":", color="#55A868",
                label="predicted after the adaptive correction")
        series.append(corrected)
    _steady_axis(ax, step, *series)
    ax.set_title("Step time: measured vs predicted", fontsize=10)
    ax.set_ylabel("seconds per step")

    ax = axes["scatter"] = grid[2, 0]
    ok = np.isfinite(measured) & np.isfinite(predicted) & (measured > 0) & (predicted > 0)
    warm = step <= warmup_steps
    steady = ok & ~warm if (ok & ~warm).any() else ok
    ax.scatter(measured[ok & ~warm], predicted[ok & ~warm], s=18, color=PLAN_COLOUR, edgecolor="black",
               linewidth=0.3, label="one step")
    ax.scatter(measured[ok & warm], predicted[ok & warm], s=30, marker="^", color="white", edgecolor="black",
               linewidth=0.8, label="warm-up step")
    if steady.any():
        top = max(measured[steady].max(), predicted[steady].max()) * 1.15
        ax.plot([0, top], [0, top], "k--", linewidth=1, label="prediction = measurement")
        ax.set_xlim(0, top)
        ax.set_ylim(0, top)
        ratio = float(np.median(measured[steady] / predicted[steady]))
        left_out = f" (steps ≤ {warmup_steps} left out)" if (ok & warm).any() and steady is not ok else ""
        ax.set_title(f"Predicted vs measured step time\nmedian measured / predicted: {ratio:.2f}{left_out}",
                     fontsize=10)
    else:
        ax.set_title("Predicted vs measured step time (no steps with both)", fontsize=10)
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("predicted step time (s)")

    ax = axes["idle"] = grid[2, 1]
    ax.plot(step, 100 * m["idle_frac"], marker="o", markersize=3, color="black", linewidth=2, label="all devices")
    for stage, values in stage_idle_percent(m).items():
        ax.plot(step, values, linewidth=1, alpha=0.8, label=stage)
    ax.set_ylim(0, 100)
    ax.set_title("Idle share of device time (bubble, imbalance, waits)", fontsize=10)
    ax.set_ylabel("idle (%)")

    for key, cell, column, unit, name in (
            ("data_wait", grid[2, 2], "data_wait_s", "seconds", "Data-loader wait per step"),
            ("sched", grid[3, 0], "sched_ms", "milliseconds", "Scheduler solve time per step")):
        ax = axes[key] = cell
        values = _column(m, column)
        if values is None:
            _missing(ax, f"no {column} column")
        else:
            ax.plot(step, values, marker="o", markersize=3, color=PLAN_COLOUR)
            _steady_axis(ax, step, values)
        ax.set_ylabel(unit)
        ax.set_title(name, fontsize=10)

    ax = axes["skipped"] = grid[3, 1]
    skipped = _column(m, "skipped_samples")
    if skipped is None:
        _missing(ax, "no skipped_samples column")
        ax.set_title("Samples skipped (failed to load)", fontsize=10)
    else:
        ax.bar(step, skipped, color=BASELINE_COLOUR, label="skipped samples")
        ax.set_ylim(0, max(1.0, float(np.nanmax(skipped)) * 1.2))
        ax.set_title(f"Samples skipped (failed to load): {int(np.nansum(skipped))} in all", fontsize=10)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("samples")

    grid[3, 2].axis("off")
    for key, ax in axes.items():
        ax.grid(True, alpha=0.3)
        if key != "scatter":
            _shade_warmup(ax, step, warmup_steps)
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if len(ax.get_legend_handles_labels()[0]) > 1:
            ax.legend(fontsize=7, loc="best")
    fig.suptitle(f"{title or f'Training: {len(m)} steps'}\ngrey: warm-up steps (≤ {warmup_steps}), drawn but kept "
                 "out of the axis ranges (↑ value: a point above the range)", fontsize=12)
    fig.dflop_axes = axes  # the panels by name, for tests
    return fig


def plot_training_curves(*, metrics: str | Path, out_png: str | Path, peak_tflops: float | None = None,
                         devices: int | None = None) -> Path:
    """Read metrics.parquet, draw the training curves, write `out_png`; returns its path."""
    table = read_table(metrics, "metrics.parquet", METRICS_COLUMNS)
    if table.empty:
        raise UserError(f"{metrics}: no steps")
    if table["step"].duplicated().any():
        raise UserError(f"{metrics}: step {int(table['step'][table['step'].duplicated()].iloc[0])} appears twice")
    title = f"Training: {len(table)} steps ({metrics})"
    return save_figure(draw_training_curves(table, title=title, peak_tflops=peak_tflops, devices=devices), out_png)
