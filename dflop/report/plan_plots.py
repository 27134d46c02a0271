"""The chosen plan vs the data-blind baseline, from plan.yaml (docs/design.md), and a Gantt chart of
a simulated step of each.

The plan and its baselines are re-simulated exactly as the optimizer judged them
(`dflop.planner.expected`: the same sampled global batches, seed, cost model and cluster, the
online scheduler for the plan and fixed-count contiguous microbatches for the baselines), so the
step times drawn here reproduce plan.yaml's ``predicted`` numbers. The panels draw the
Megatron-style packed baseline; the title gives the predicted speedup over it and over the
HF/LLaVA padded one (`dflop.planner.planfile.BASELINE_LABELS`). Figures:

- comparison: predicted step time over the sampled batches (bar: mean; dots: each batch; dotted:
  p90), predicted peak memory per stage against the GPU memory limit, and the compute load of
  every device (pipeline stage x data-parallel replica) in the plan's median batch, against the
  step time (dashed), so the gap above a bar is that device's idle time; below them the plan's
  memory techniques per stage and what each costs and saves (the table `dflop simulate` prints,
  `dflop.planner.techniques`), or "memory techniques: none";
- one Gantt chart per layout for that same median batch (`dflop.sim.plot_gantt`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from dflop.errors import UserError
from dflop.plan import Plan
from dflop.planner.expected import Evaluation, evaluate_plan, sample_batches, simulate_batch
from dflop.planner.planfile import BASELINE_LABELS
from dflop.planner.techniques import format_techniques, technique_costs
from dflop.planner.whatif import load_plan_context
from dflop.report.style import BASELINE_COLOUR, PLAN_COLOUR, save_figure
from dflop.sim import SimResult, plot_gantt
from dflop.scheduler.policy import Policy
from dflop.scheduler.settings import SchedulerSettings


@dataclass(frozen=True)
class LayoutStep:
    """One layout (plan or baseline) re-simulated over the sampled batches.

    evaluation: step seconds [K] over the K sampled batches and peak memory [P] bytes per stage;
    median_step: the exact timeline of the plan's median batch under this layout;
    stages: [P] stage names (vision stages first); label: "DFLOP plan" or "Megatron-style packed
    data-blind baseline".
    """

    label: str
    plan: Plan
    evaluation: Evaluation
    median_step: SimResult
    stages: tuple[str, ...]

    def stage_busy_s(self) -> np.ndarray:
        """[P, max replicas] compute seconds of each stage's replicas in the median batch (NaN: no such replica)."""
        t = self.median_step
        out = np.full((len(self.stages), int(t.row_replica.max()) + 1), np.nan)
        out[t.row_stage, t.row_replica] = t.busy_s
        return out


@dataclass(frozen=True)
class PlanComparison:
    """The plan and (when plan.yaml has them) its baselines, simulated on the same batches.

    baseline: the Megatron-style packed one, drawn; padded_baseline: the HF/LLaVA padded one's
    evaluation (its speedup is in the title); median_batch: index (0..K-1) of the sampled batch
    whose plan step is the median; memory_limit_bytes: GPU memory per rank the planner allowed;
    techniques: the plan's memory techniques and their costs per stage (`technique_costs`).
    """

    plan: LayoutStep
    baseline: LayoutStep | None
    median_batch: int
    memory_limit_bytes: float
    global_batch: int
    techniques: pd.DataFrame | None = None
    padded_baseline: Evaluation | None = None

    def speedups(self) -> dict[str, float]:
        """Predicted mean-step speedup of the plan over each baseline present, by its label."""
        bases = (self.baseline.evaluation if self.baseline is not None else None, self.padded_baseline)
        return {BASELINE_LABELS[b.policy]: b.mean_s / self.plan.evaluation.mean_s for b in bases if b is not None}


def compare_plan(plan_path: str | Path, *, shapes: str | Path | None = None,
                 costmodel: str | Path | None = None) -> PlanComparison:
    """Re-simulate plan.yaml's plan and baselines as the optimizer did (module docstring).

    shapes / costmodel default to the paths recorded in plan.yaml (``inputs``).
    """
    ctx = load_plan_context(plan_path, shapes_path=shapes, costmodel_path=costmodel)
    pf, cost, pool, cluster, sizes, seed = ctx.plan_file, ctx.cost, ctx.pool, ctx.cluster, ctx.sizes, ctx.seed
    shapes, scheduler = ctx.shapes_path, ctx.scheduler
    batches = sample_batches(len(pool), ctx.sample_batches, pf.global_batch_size, seed)

    def simulate(label: str, plan: Plan, settings: SchedulerSettings, median: int | None) -> tuple[LayoutStep, int]:
        ev = evaluate_plan(plan, cost, pool, batches, cluster, sizes, settings, seed=seed)
        if not ev.ok:
            raise UserError(f"{plan_path}: {label} {plan.describe()} cannot run on {shapes}: {ev.failure}")
        if median is None:
            median = int(np.argsort(ev.step_s, kind="stable")[len(ev.step_s) // 2])
        _, timeline = simulate_batch(plan, cost, pool.take(batches[median]), cluster, sizes, settings,
                                     seed=seed + median)
        names = tuple(plan.stage_name(s) for s in range(plan.layout.n_stages))
        return LayoutStep(label, plan, ev, timeline, names), median

    chosen, median = simulate("DFLOP plan", pf.plan, scheduler, None)
    baseline = None
    if pf.baseline is not None:
        baseline, _ = simulate(f"{BASELINE_LABELS['megatron']} baseline", pf.baseline,
                               replace(scheduler, policy=Policy.MEGATRON), median)
    padded = None
    if pf.padded_baseline is not None:
        padded = evaluate_plan(pf.padded_baseline, cost, pool, batches, cluster, sizes,
                               replace(scheduler, policy=Policy.PADDED), seed=seed)
        if not padded.ok:
            raise UserError(f"{plan_path}: padded baseline {pf.padded_baseline.describe()} cannot run on {shapes}: "
                            f"{padded.failure}")
    techniques = technique_costs(pf.plan, cost, pool, cluster, sizes, global_batch=pf.global_batch_size)
    return PlanComparison(chosen, baseline, median, cluster.gpu_memory_bytes, pf.global_batch_size, techniques,
                          padded)


def draw_plan_comparison(cmp: PlanComparison) -> plt.Figure:
    """Step time, memory per stage and load per stage of the plan vs the baseline (module docstring)."""
    layouts = [s for s in (cmp.plan, cmp.baseline) if s is not None]
    colours = [PLAN_COLOUR, BASELINE_COLOUR]
    table = format_techniques(cmp.techniques).splitlines() if cmp.techniques is not None else []
    table_in = 0.25 * (len(table) + 1)
    fig = plt.figure(figsize=(13, 9 + table_in), layout="constrained")
    heights = [4.5, 4.5] + ([table_in] if table else [])  # the technique table below the plots
    grid = fig.add_gridspec(len(heights), 2, height_ratios=heights)
    axes = np.array([[fig.add_subplot(grid[i, j]) for j in range(2)] for i in range(2)])
    _draw_step_times(axes[0, 0], layouts, colours, cmp)
    _draw_memory(axes[0, 1], layouts, colours, cmp.memory_limit_bytes)
    load_axes = [axes[1, 0], axes[1, 1]]
    top = max(s.median_step.step_s for s in layouts) * 1.12
    for ax, step, colour in zip(load_axes, layouts, colours):
        _draw_stage_load(ax, step, colour, top)
    if cmp.baseline is None:
        axes[1, 1].axis("off")
        axes[1, 1].text(0.5, 0.5, "plan.yaml has no data-blind baseline", ha="center", va="center")
    if table:
        text_ax = fig.add_subplot(grid[2, :])
        text_ax.axis("off")
        text_ax.text(0.0, 1.0, "\n".join(table), family="monospace", fontsize=9, va="top", ha="left",
                     transform=text_ax.transAxes)
    speedups = "; ".join(f"{x:.2f}x vs {label}" for label, x in cmp.speedups().items())
    drawn = f" vs {cmp.baseline.label}" if cmp.baseline is not None else ""
    fig.suptitle(f"Chosen plan{drawn} (global batch {cmp.global_batch})"
                 + (f"\npredicted speedup {speedups}" if speedups else ""), fontsize=13)
    return fig


def plot_plan(*, plan: str | Path, out_png: str | Path, gantt_plan_png: str | Path,
              gantt_baseline_png: str | Path, shapes: str | Path | None = None,
              costmodel: str | Path | None = None) -> list[Path]:
    """Write the comparison figure and the two Gantt charts; returns their paths.

    Without a baseline in plan.yaml the baseline chart says so instead of showing a timeline.
    """
    cmp = compare_plan(plan, shapes=shapes, costmodel=costmodel)
    k = len(cmp.plan.evaluation.step_s)
    written = [save_figure(draw_plan_comparison(cmp), out_png)]
    for step, png in ((cmp.plan, gantt_plan_png), (cmp.baseline, gantt_baseline_png)):
        if step is None:
            written.append(_placeholder(png, "plan.yaml has no data-blind baseline to simulate"))
            continue
        t = step.median_step
        # Short lines: plot_gantt sizes its figure by the microbatch count, narrow for few of them.
        which = "median" if step is cmp.plan else "plan's median"
        title = (f"{step.label}: step {t.step_s:.4g} s, idle {100 * t.idle_fraction():.1f}%\n"
                 f"{which} of {k} sampled batches")
        written.append(plot_gantt(t, png, title=title))
    return written


def _draw_step_times(ax, layouts: list[LayoutStep], colours: list[str], cmp: PlanComparison) -> None:
    for i, (step, colour) in enumerate(zip(layouts, colours)):
        ev = step.evaluation
        ax.bar(i, ev.mean_s, width=0.6, color=colour, alpha=0.85, label=f"{step.label}: mean {ev.mean_s:.4g} s")
        jitter = np.linspace(-0.15, 0.15, len(ev.step_s))
        ax.scatter(i + jitter, ev.step_s, s=14, color="black", zorder=3)
        ax.hlines(ev.p90_s, i - 0.3, i + 0.3, colors="black", linestyles=":", linewidth=1.5)
    ax.scatter([], [], s=14, color="black", label="one sampled global batch")
    ax.plot([], [], "k:", label="90th percentile")
    ax.set_xticks(range(len(layouts)), [s.label for s in layouts])
    ax.set_ylabel("predicted step time (s)")
    ax.set_ylim(0, max(s.evaluation.step_s.max() for s in layouts) * 1.3)
    ax.set_title(f"Predicted step time over {len(cmp.plan.evaluation.step_s)} sampled global batches", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)


def _draw_memory(ax, layouts: list[LayoutStep], colours: list[str], limit_bytes: float) -> None:
    labels: list[str] = []
    for step, colour in zip(layouts, colours):
        start = len(labels)
        labels += [f"{step.label.split()[0]}\n{_short_stage(step, s)}" for s in range(len(step.stages))]
        gb = step.evaluation.memory_bytes / 1e9
        bars = ax.bar(np.arange(start, len(labels)), gb, width=0.6, color=colour, label=step.label)
        ax.bar_label(bars, [f"{v:.3g} GB" for v in gb], fontsize=8)
    ax.axhline(limit_bytes / 1e9, color="red", linestyle="--", linewidth=1, label=f"limit {limit_bytes / 1e9:.3g} GB")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_xlim(-0.8, max(len(labels), 2) - 0.2)
    tallest = max([limit_bytes] + [float(np.max(s.evaluation.memory_bytes)) for s in layouts]) / 1e9
    ax.set_ylim(0, tallest * 1.35)  # room for the legend above the bars and the limit
    ax.set_ylabel("predicted peak memory per GPU (GB)")
    ax.set_title("Predicted peak memory per stage (weights, optimizer, activations)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", ncol=3)
    ax.grid(True, axis="y", alpha=0.3)


def _draw_stage_load(ax, step: LayoutStep, colour: str, top: float) -> None:
    """One bar per device (stage x replica) of the median batch, grouped by stage."""
    t = step.median_step
    rows = sorted(range(len(t.busy_s)), key=lambda r: (t.row_stage[r], t.row_replica[r]))
    x, labels, position = [], [], 0.0
    for i, r in enumerate(rows):
        if i and t.row_stage[r] != t.row_stage[rows[i - 1]]:
            position += 0.6  # a gap between stages
        x.append(position)
        stage = int(t.row_stage[r])
        multi = int((t.row_stage == stage).sum()) > 1
        labels.append(f"{_short_stage(step, stage)}\nreplica {int(t.row_replica[r])}" if multi
                      else _short_stage(step, stage))
        position += 1.0
    busy = t.busy_s[rows]
    ax.bar(x, busy, width=0.8, color=colour, label="compute of one device")
    ax.axhline(t.step_s, color="black", linestyle="--", linewidth=1, label=f"step {t.step_s:.4g} s (the rest is idle)")
    ax.set_xticks(x, labels, fontsize=8 if len(x) <= 8 else 6)
    ax.set_xlim(min(x) - 0.8, max(max(x), 1.0) + 0.8)
    ax.set_ylim(0, top)
    ax.set_ylabel("compute seconds in the median batch")
    ax.set_title(f"{step.label}: load per stage and replica\n{step.plan.layout.describe()}", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, axis="y", alpha=0.3)


def _short_stage(step: LayoutStep, s: int) -> str:
    """'vision s0', 'llm s1', or 'llm s0 + vision' (colocated), for tick labels."""
    n_v = step.plan.layout.n_vision_stages
    if s < n_v:
        return f"vision s{s}"
    return f"llm s{s - n_v}" + (" + vision" if step.plan.layout.colocated and s == n_v else "")


def _placeholder(png: str | Path, message: str) -> Path:
    fig, ax = plt.subplots(figsize=(6, 1.5))
    ax.axis("off")
    ax.text(0.5, 0.5, message, ha="center", va="center")
    return save_figure(fig, png)
