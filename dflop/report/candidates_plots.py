"""The planner's candidates (candidates.parquet, `dflop.planner.candidates`): predicted step vs
predicted peak memory per layout.

Every layout with a simulated step (``step_mean_s`` and ``peak_memory_gb``) is a point: the data-aware
search's layouts (blue; hollow with a marker per reason when pruned), the data-blind baselines
(orange squares: Megatron-style packed; diamonds: HF/LLaVA padded), the chosen plan as a star and each
chosen baseline with a black edge and its name. Candidates without a simulated step (rejected
degrees, layouts pruned by their lower bound before simulation) cannot be placed; a box counts them
by kind and reason, so nothing the planner looked at is silently missing.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from dflop.errors import UserError
from dflop.report.style import BASELINE_COLOUR, PLAN_COLOUR, read_table, save_figure

CANDIDATE_COLUMNS = ("kind", "status", "reason", "step_mean_s", "peak_memory_gb")
PRUNED_MARKERS = ("o", "v", "^", "<", ">", "p", "h", "X")
KIND_LABELS = {"plan": "DFLOP search", "baseline": "data-blind (packed)", "baseline_padded": "data-blind (padded)"}


def unplaced_counts(candidates: pd.DataFrame) -> pd.Series:
    """Candidates without a simulated step, counted by (kind, status, reason)."""
    placed = candidates["step_mean_s"].notna() & candidates["peak_memory_gb"].notna()
    rest = candidates[~placed].fillna({"reason": ""})
    return rest.groupby(["kind", "status", "reason"]).size()


def draw_candidates(candidates: pd.DataFrame, *, memory_limit_gb: float | None = None) -> plt.Figure:
    """The figure (module docstring)."""
    if candidates.empty:
        raise UserError("candidates.parquet: no candidates")
    c = candidates.copy()
    c["reason"] = c["reason"].fillna("")
    placed = c[c["step_mean_s"].notna() & c["peak_memory_gb"].notna()]
    fig, ax = plt.subplots(figsize=(14, 7), layout="constrained")
    plan = placed[placed["kind"] == "plan"]
    pruned_reasons = sorted(plan.loc[plan["status"] == "pruned", "reason"].unique())
    for i, reason in enumerate(pruned_reasons):
        rows = plan[(plan["status"] == "pruned") & (plan["reason"] == reason)]
        ax.scatter(rows["peak_memory_gb"], rows["step_mean_s"], s=45, marker=PRUNED_MARKERS[i % len(PRUNED_MARKERS)],
                   facecolor="none", edgecolor=PLAN_COLOUR, linewidth=1.2, label=f"DFLOP search, pruned: {reason}")
    other = plan[~plan["status"].isin(["pruned", "chosen"])]
    ax.scatter(other["peak_memory_gb"], other["step_mean_s"], s=45, color=PLAN_COLOUR, alpha=0.8,
               label="DFLOP search, simulated")
    for kind, marker in (("baseline", "s"), ("baseline_padded", "D")):
        rows = placed[(placed["kind"] == kind) & (placed["status"] != "chosen")]
        ax.scatter(rows["peak_memory_gb"], rows["step_mean_s"], s=40, marker=marker, color=BASELINE_COLOUR,
                   alpha=0.6, label=f"{KIND_LABELS[kind]} layout")
    for kind, marker, colour, size in (("plan", "*", PLAN_COLOUR, 380), ("baseline", "s", BASELINE_COLOUR, 150),
                                       ("baseline_padded", "D", BASELINE_COLOUR, 130)):
        chosen = placed[(placed["kind"] == kind) & (placed["status"] == "chosen")]
        for _, row in chosen.iterrows():
            name = "chosen plan" if kind == "plan" else f"{KIND_LABELS[kind]} baseline"
            ax.scatter(row["peak_memory_gb"], row["step_mean_s"], s=size, marker=marker, color=colour,
                       edgecolor="black", linewidth=1.5, zorder=5, label=f"{name}: {row['step_mean_s']:.3g} s")
            ax.annotate(name, (row["peak_memory_gb"], row["step_mean_s"]), xytext=(8, 8), textcoords="offset points",
                        fontsize=10, weight="bold")
    most = float(placed["peak_memory_gb"].max()) if len(placed) else 0.0
    if memory_limit_gb is not None and memory_limit_gb > 1.5 * most:  # a line far right would squash the points
        ax.plot([], [], " ", label=f"memory limit {memory_limit_gb:.3g} GB: off the right edge")
        memory_limit_gb = None
    if memory_limit_gb is not None:
        ax.axvline(memory_limit_gb, color="red", linestyle="--", linewidth=1, label=f"memory limit {memory_limit_gb:.3g} GB")
    counts = unplaced_counts(c)
    if len(counts):
        lines = ["not simulated (no point):"] + [
            f"{n} {KIND_LABELS.get(kind, kind)} {status}{': ' + reason if reason else ''}"
            for (kind, status, reason), n in counts.items()]
        ax.text(0.99, 0.02, "\n".join(lines), transform=ax.transAxes, ha="right", va="bottom", fontsize=9,
                bbox={"facecolor": "white", "edgecolor": "grey", "alpha": 0.9})
    ax.set_xlabel("predicted peak memory per GPU (GB)")
    ax.set_ylabel("predicted step time, mean over sampled batches (s)")
    if len(placed):
        ax.set_ylim(0, placed["step_mean_s"].max() * 1.1)
        ax.set_xlim(0, max(placed["peak_memory_gb"].max(), memory_limit_gb or 0) * 1.1)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"The planner's candidates: {len(c)} looked at, {len(placed)} simulated", fontsize=12)
    return fig


def plot_candidates(*, candidates: str | Path, out_png: str | Path, memory_limit_gb: float | None = None,
                    plan: str | Path | None = None) -> Path:
    """Read candidates.parquet, draw the figure, write `out_png`; returns its path. The memory
    limit defaults to plan.yaml's (``predicted.memory_limit_bytes``) when `plan` is given."""
    if memory_limit_gb is None and plan is not None:
        from dflop.plan import read_plan

        predicted = read_plan(plan).prediction()
        limit = predicted.memory_limit_bytes if predicted is not None else None
        memory_limit_gb = float(limit) / 1e9 if limit is not None else None
    table = read_table(candidates, "candidates.parquet", CANDIDATE_COLUMNS)
    if table.empty:
        raise UserError(f"{candidates}: no candidates")
    return save_figure(draw_candidates(table, memory_limit_gb=memory_limit_gb), out_png)
