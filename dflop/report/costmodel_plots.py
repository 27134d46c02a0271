"""Cost-model fit vs measurement, from model_profile.parquet, costmodel.json and validation.parquet.

The planner trusts the cost model's times and memory; this figure shows how far to trust them.
Three panels put every profiled shape's measured value (median over repeats, per layer for layer
modules) against the fitted model's prediction for that shape: forward time, backward time (ms)
and activation memory (MB), on log axes with the y = x line and a ±25 % band. The fourth panel is
the held-out error from validation.parquet: each shape left out of the fit in turn (median bar,
90th percentile whisker), i.e. the error to expect on shapes the profiler never ran.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from dflop.costmodel.features import profile_features
from dflop.costmodel.model import TARGETS, CostModel
from dflop.costmodel.profile_table import summarize_profile
from dflop.report.style import read_table, save_figure
from dflop.costmodel.jsonio import load_cost_model

VALIDATION_COLUMNS = ("module", "tp", "target", "mape_median", "mape_p90")
PROFILE_COLUMNS = ("module", "tp", "batch", "seq_len", "n_layers", "fwd_ms", "bwd_ms", "act_bytes", "param_bytes",
                   "device", "dtype")
#: Target -> (axis label, factor from the fitted unit to the plotted unit).
TARGET_AXES = {
    "fwd_ms": ("forward time per call (ms)", 1.0),
    "bwd_ms": ("backward time per call (ms)", 1.0),
    "act_bytes": ("activation memory (MB)", 1e-6),
}
_MARKERS = {1: "o", 2: "s", 4: "^", 8: "D"}
BAND = 0.25  # the shaded band: predictions within ±25 % of the measurement


def fit_table(profile: pd.DataFrame, model: CostModel) -> pd.DataFrame:
    """One row per profiled shape and target: module, tp, batch, seq_len, target, measured, predicted.

    measured: the profile's median over repeats (per layer for layer modules, as fitted);
    predicted: the cost model for that shape. Units: ms for times, bytes for act_bytes.
    Shapes of a (module, tp) the model has no fit for are left out.
    """
    shapes = summarize_profile(profile).shapes
    rows = []
    for (module, tp), group in shapes.groupby(["module", "tp"], sort=True):
        if (module, int(tp)) not in model.modules:
            continue
        costs = model.module(module, int(tp))
        features = profile_features(costs.features, group["batch"].to_numpy(), group["seq_len"].to_numpy())
        for target in TARGETS:
            predicted = features @ costs.coefficients(target)
            rows.append(pd.DataFrame({
                "module": module, "tp": int(tp), "batch": group["batch"].to_numpy(),
                "seq_len": group["seq_len"].to_numpy(), "target": target,
                "measured": group[target].to_numpy(dtype=np.float64), "predicted": predicted,
            }))
    columns = ["module", "tp", "batch", "seq_len", "target", "measured", "predicted"]
    return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame(columns=columns)


def draw_costmodel_fit(fit: pd.DataFrame, validation: pd.DataFrame, *, title: str = "") -> plt.Figure:
    """The figure (module docstring) from `fit_table` rows and validation.parquet."""
    fig, axes = plt.subplots(2, 2, figsize=(12.5, 10), layout="constrained")
    modules = sorted(fit["module"].unique())
    colours = {m: f"C{i % 10}" for i, m in enumerate(modules)}
    for ax, target in zip(axes.flat, TARGETS):
        label, factor = TARGET_AXES[target]
        part = fit[(fit["target"] == target) & (fit["measured"] > 0)]
        for (module, tp), g in part.groupby(["module", "tp"], sort=True):
            ax.scatter(g["measured"] * factor, np.maximum(g["predicted"], 0) * factor, s=22, alpha=0.8,
                       color=colours[module], marker=_MARKERS.get(int(tp), "P"), edgecolor="black", linewidth=0.3)
        if len(part):
            values = np.concatenate([part["measured"], part["predicted"].clip(lower=0)]) * factor
            values = values[values > 0]
            lo, hi = values.min() / 1.5, values.max() * 1.5
            line = np.geomspace(lo, hi, 50)
            ax.plot(line, line, "k--", linewidth=1, label="prediction = measurement")
            ax.fill_between(line, line * (1 - BAND), line * (1 + BAND), color="grey", alpha=0.15,
                            label=f"within ±{BAND:.0%}")
            ax.set_xlim(lo, hi)
            ax.set_ylim(lo, hi)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"measured {label}")
        ax.set_ylabel(f"predicted {label}")
        ax.set_title(f"{label.split(' (')[0]}: {len(part)} profiled shapes", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    _draw_validation(axes[1, 1], validation, colours)
    handles = [plt.Line2D([], [], marker="o", linestyle="", color=colours[m], markeredgecolor="black",
                          markeredgewidth=0.3, label=m) for m in modules]
    tps = sorted(fit["tp"].unique())
    handles += [plt.Line2D([], [], marker=_MARKERS.get(int(t), "P"), linestyle="", color="white", markeredgecolor="black",
                           label=f"TP={t}") for t in tps] if len(tps) > 1 else []
    fig.legend(handles=handles, loc="outside right center", title="module", fontsize=9)
    fig.suptitle(title or "Cost model: fitted prediction vs profiled measurement (per layer for layer modules)",
                 fontsize=12)
    return fig


def plot_costmodel_fit(*, profile: str | Path, costmodel: str | Path, validation: str | Path,
                       out_png: str | Path) -> Path:
    """Read the three artifacts, draw the fit figure, write `out_png`; returns its path."""
    model = load_cost_model(costmodel)
    table = read_table(profile, "model_profile.parquet", PROFILE_COLUMNS)
    held_out = read_table(validation, "validation.parquet", VALIDATION_COLUMNS)
    prov = model.provenance
    title = (f"Cost model {prov.preset or ''} on {prov.device} ({prov.dtype}): prediction vs measurement "
             "(per layer for layer modules)")
    return save_figure(draw_costmodel_fit(fit_table(table, model), held_out, title=title), out_png)


def _draw_validation(ax, validation: pd.DataFrame, colours: dict[str, str]) -> None:
    """Horizontal bars: median held-out error per (module, tp, target), whisker to the 90th percentile."""
    rows = validation[validation["target"].isin(TARGETS)].copy()
    rows["order"] = rows["target"].map({t: i for i, t in enumerate(TARGETS)})
    rows = rows.sort_values(["module", "tp", "order"], ascending=[False, False, False]).reset_index(drop=True)
    hatches = {"fwd_ms": "", "bwd_ms": "//", "act_bytes": ".."}
    y = np.arange(len(rows))
    median = rows["mape_median"].fillna(0).to_numpy()
    p90 = rows["mape_p90"].fillna(0).to_numpy()
    for i, r in rows.iterrows():
        ax.barh(y[i], median[i], color=colours.get(r["module"], "grey"), hatch=hatches[r["target"]],
                edgecolor="black", linewidth=0.4)
    ax.errorbar(median, y, xerr=[np.zeros_like(median), np.maximum(p90 - median, 0)], fmt="none", ecolor="black",
                capsize=2, linewidth=0.8)
    labels = [f"{r.module}{'' if r.tp == 1 else f' tp{r.tp}'} {r.target.split('_')[0]}" for r in rows.itertuples()]
    ax.set_yticks(y, labels, fontsize=7)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.set_xlabel("held-out error (%): bar median, whisker 90th percentile")
    ax.set_title("Held-out error, each profiled shape left out of the fit (validation.parquet)", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
