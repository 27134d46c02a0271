"""The report's first page: what was planned and why, and what it bought, on one card.

Left, from plan.yaml: the layout per module (placement, tp/pp/dp, microbatches), the layer split
and the memory techniques per stage, with the planner's predicted step and speedup over the
data-blind baseline. Right, from the training runs' metrics.parquet: predicted and measured step
time of the plan and (when its run exists) of the baseline, with the measured and predicted speedup,
idle share and samples skipped.

Measured numbers are steady-state medians: steps after `WARMUP_STEPS` (allocator growth, thread
pools, first collectives), the convention of `dflop.runtime.metrics.prediction_agreement`. A run
with no step after the warm-up is summarised over all its steps, and the card says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.patches import Patch

from dflop.errors import UserError
from dflop.plan import PlanFile, read_plan
from dflop.report.style import BASELINE_COLOUR, PLAN_COLOUR, read_table, save_figure
from dflop.runtime.metrics import WARMUP_STEPS

SUMMARY_COLUMNS = ("step", "step_s", "predicted_step_s", "idle_frac", "samples")


@dataclass(frozen=True)
class RunSummary:
    """One training run in steady state (module docstring).

    step_s / predicted_s / idle_frac: medians over the steady steps; samples_per_s: steady samples
    over steady seconds; skipped: samples replaced over the whole run; warm_only: True when the run
    had no step after the warm-up, so every step was used.
    """

    label: str
    steps: int
    steady_steps: int
    step_s: float
    predicted_s: float
    idle_frac: float
    samples_per_s: float
    skipped: int
    warm_only: bool


def summarize_run(metrics: pd.DataFrame, label: str, warmup_steps: int = WARMUP_STEPS) -> RunSummary:
    """The steady-state summary of one run's metrics table."""
    if metrics.empty:
        raise UserError(f"{label}: metrics.parquet has no steps")
    steady = metrics[metrics["step"] > warmup_steps]
    warm_only = steady.empty
    rows = metrics if warm_only else steady
    skipped = int(metrics["skipped_samples"].sum()) if "skipped_samples" in metrics else 0
    return RunSummary(label, len(metrics), len(rows), float(rows["step_s"].median()),
                      float(rows["predicted_step_s"].median()), float(rows["idle_frac"].median()),
                      float(rows["samples"].sum() / rows["step_s"].sum()), skipped, warm_only)


@dataclass(frozen=True)
class Summary:
    """Everything the card shows. baseline: None when the baseline run is absent."""

    plan_file: PlanFile
    plan: RunSummary | None
    baseline: RunSummary | None

    @property
    def measured_speedup(self) -> float | None:
        """Baseline over plan, median steady steps."""
        if self.plan is None or self.baseline is None:
            return None
        return self.baseline.step_s / self.plan.step_s

    @property
    def run_predicted_speedup(self) -> float | None:
        """The same ratio of the trainer's own per-step predictions."""
        if self.plan is None or self.baseline is None:
            return None
        return self.baseline.predicted_s / self.plan.predicted_s

    @property
    def planner_speedup(self) -> float | None:
        """plan.yaml's: baseline mean / plan mean over the planner's sampled batches."""
        plan, base = self.plan_file.prediction(), self.plan_file.prediction("baseline")
        if plan is None or base is None or plan.step_mean_s is None or base.step_mean_s is None:
            return None
        return base.step_mean_s / plan.step_mean_s


def plan_lines(pf: PlanFile) -> list[str]:
    """What was planned, one fact a line: layout, layer split, techniques per stage."""
    plan, lay = pf.plan, pf.plan.layout
    lines = [f"layout: {lay.describe()}".replace(" (", "\n    (", 1)]
    if lay.colocated:
        lines.append(f"vision tower: {sum(plan.vision_layers)} layers on llm stage 0's GPUs")
    else:
        lines.append(f"vision split: {list(plan.vision_layers)} layers over {lay.pp_v} stage(s)")
    lines.append(f"LLM split: {list(plan.llm_layers)} layers over {lay.pp_l} stage(s)")
    for name, tech in (("vision", plan.vision_techniques), ("LLM", plan.llm_techniques)):
        lines.append(f"{name} techniques: {tech.describe() if tech is not None else 'no memory techniques'}")
    if pf.baseline is not None:
        lines.append(f"data-blind baseline: {pf.baseline.layout.describe()}".replace(" (", "\n    (", 1)
                     + f", layers {list(pf.baseline.vision_layers)} / {list(pf.baseline.llm_layers)}")
    predicted, base = pf.prediction(), pf.prediction("baseline")
    if predicted is not None and predicted.step_mean_s is not None:
        text = f"planner's predicted step: {predicted.step_mean_s:.3g} s"
        if base is not None and base.step_mean_s is not None:
            text += f" (baseline {base.step_mean_s:.3g} s)"
        lines.append(text)
    return lines


def draw_summary(summary: Summary) -> plt.Figure:
    """The summary card (module docstring)."""
    # Portrait and large type: the report's front page shows it in a narrow column beside the DAG.
    fig = plt.figure(figsize=(9, 11.5), layout="constrained")
    grid = fig.add_gridspec(2, 1, height_ratios=[1, 1.15])
    text_ax = fig.add_subplot(grid[1, 0])
    text_ax.axis("off")
    text = ("What was planned\n" + "\n".join(plan_lines(summary.plan_file))
            + "\n\nWhat it measured\n" + "\n".join(fact_lines(summary)))
    text_ax.text(0, 1, text, fontsize=13, va="top", transform=text_ax.transAxes, linespacing=1.45)

    ax = fig.add_subplot(grid[0, 0])
    runs = [r for r in (summary.plan, summary.baseline) if r is not None]
    colours = [PLAN_COLOUR, BASELINE_COLOUR][:len(runs)]
    for i, (run, colour) in enumerate(zip(runs, colours)):
        ax.bar(i - 0.18, run.predicted_s, width=0.34, color=colour, alpha=0.4, hatch="//", edgecolor="black")
        ax.bar(i + 0.18, run.step_s, width=0.34, color=colour, edgecolor="black")
        ax.text(i - 0.18, run.predicted_s, f"{run.predicted_s:.3g} s", ha="center", va="bottom", fontsize=11)
        ax.text(i + 0.18, run.step_s, f"{run.step_s:.3g} s", ha="center", va="bottom", fontsize=11, weight="bold")
    ax.legend(handles=[Patch(facecolor="white", hatch="//", edgecolor="black", label="predicted (trainer's cost model)"),
                       Patch(facecolor="grey", edgecolor="black", label="measured")], fontsize=10, loc="upper left")
    ax.set_xticks(range(len(runs)), [f"{r.label}\n({r.steady_steps} steady steps)" for r in runs], fontsize=11)
    ax.set_xlim(-0.6, max(len(runs), 2) - 0.4)
    if runs:
        ax.set_ylim(0, max(max(r.step_s, r.predicted_s) for r in runs) * 1.35)
    else:
        ax.text(0.5, 0.5, "no training run yet", ha="center", va="center", transform=ax.transAxes, fontsize=12)
    ax.set_ylabel("median step time (s)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_title("Step time per run (median of steady-state steps)", fontsize=13)
    ax.tick_params(labelsize=12)
    fig.suptitle(headline(summary), fontsize=16, weight="bold")
    return fig


def headline(summary: Summary) -> str:
    """The card's one-line answer: measured and predicted speedup, or why there is none."""
    planner = summary.planner_speedup
    planned = f"predicted {planner:.2f}x (planner)" if planner is not None else "no planner prediction"
    if summary.measured_speedup is not None:
        return (f"Speedup over the data-blind baseline:\nmeasured {summary.measured_speedup:.2f}x, "
                f"predicted {summary.run_predicted_speedup:.2f}x (trainer),\n{planned}")
    return f"Speedup over the data-blind baseline:\n{planned}, measured: no baseline training run"


def fact_lines(summary: Summary) -> list[str]:
    """Idle share, throughput, skipped data and prediction error per run."""
    lines = []
    for run in (summary.plan, summary.baseline):
        if run is None:
            continue
        note = " (no step after the warm-up: all steps)" if run.warm_only else f" (steps > {WARMUP_STEPS}, medians)"
        lines.append(f"{run.label}{note}:")
        lines.append(f"    step {run.step_s:.3g} s measured, {run.predicted_s:.3g} s predicted "
                     f"(ratio {run.step_s / run.predicted_s:.2f})")
        lines.append(f"    idle {100 * run.idle_frac:.0f}% of device time, {run.samples_per_s:.3g} samples/s")
        lines.append(f"    {run.skipped} samples skipped (failed to load)")
    if summary.plan is None:
        lines.append("no training run yet: rule train")
    if summary.baseline is None:
        lines.append("data-blind baseline: no training run, no measured speedup")
    return lines


def plot_summary(*, plan: str | Path, out_png: str | Path, metrics: str | Path | None = None,
                 baseline_metrics: str | Path | None = None) -> Path:
    """Read plan.yaml and the runs' metrics (each optional; a missing file counts as no run), write the card."""
    pf = read_plan(plan)

    def run(path, label):
        if path is None or not Path(path).exists():
            return None
        return summarize_run(read_table(path, "metrics.parquet", SUMMARY_COLUMNS), label)

    summary = Summary(pf, run(metrics, "DFLOP plan"), run(baseline_metrics, "data-blind baseline"))
    return save_figure(draw_summary(summary), out_png)
