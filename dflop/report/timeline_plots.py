"""One traced training step, measured beside simulated (issue 21): two Gantt charts on one time axis.

Top: the step as the trainer measured it (results/train/trace.json, `dflop.runtime.spans.trace_ops`):
one row per rank, forward bars blue and backward bars orange, labelled with the scheduler's
microbatch id. Bottom: the simulator's timeline of the same global batch on the same plan
(`simulate_traced_step`), one row per device (stage x replica). Printed on the figure: the whole-step
difference (first forward to last backward, measured / simulated) and the per-op one
(`op_differences`: median measured / simulated duration and median |end difference| over the ops
matched on stage, replica, op and microbatch id).

The same batch: global batches are a pure function of (seed, step) (`GlobalBatches`), so step n's
samples are recomputed from the run's seed; they are priced by the one pricing path on plan.yaml's
cluster and partitioned by the scheduler, as the trainer's rank 0 does. The trainer's own
partition is not recorded, and its portfolio may pick another member under its time budget (and
its adaptive correction may have moved the costs), so the figure also prints the trainer's own
prediction for that step (metrics.parquet ``predicted_step_s``) beside the re-simulated one.

On a CPU cluster the pricing charges each sample's load to the forward of the stage that decodes it
(`dflop.pricing.pricing.Pricing.load_s`), while the trainer loads the step's samples before its
first forward (trace.json's data spans, not drawn). Both charts leave the loads out: the
re-simulation prices the batch without the cost model's load line, so the bars compare compute
with compute.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.patches import Patch

from dflop.costmodel.model import CostModel
from dflop.errors import UserError
from dflop.planner.expected import simulate_batch
from dflop.planner.whatif import load_plan_context
from dflop.report.style import BASELINE_COLOUR, PLAN_COLOUR, WGRAD_COLOUR, read_table, save_figure
from dflop.runtime.metrics import WARMUP_STEPS
from dflop.runtime.spans import makespan, op_differences, simulated_ops, trace_ops
from dflop.scheduler.online import GlobalBatches
from dflop.sim import SimResult
from dflop.scheduler.policy import Policy

OP_COLOURS = {"F": PLAN_COLOUR, "B": BASELINE_COLOUR, "W": WGRAD_COLOUR}


@dataclass(frozen=True)
class TimelineDifference:
    """How far the simulated step is from the measured one.

    measured_s / simulated_s: first forward's start to last backward's end; op_ratio: median of
    measured / simulated op duration; end_abs_s: median |measured - simulated| op end; n_ops: ops
    matched (stage, replica, op, microbatch)."""

    measured_s: float
    simulated_s: float
    op_ratio: float
    end_abs_s: float
    n_ops: int

    @property
    def step_ratio(self) -> float:
        return self.measured_s / self.simulated_s

    def describe(self) -> str:
        return (f"whole step (first forward to last backward): measured {self.measured_s:.3g} s, simulated "
                f"{self.simulated_s:.3g} s, measured / simulated {self.step_ratio:.2f}\n"
                f"per op ({self.n_ops} matched): median measured / simulated duration {self.op_ratio:.2f}, "
                f"median |end difference| {1e3 * self.end_abs_s:.3g} ms")


def timeline_difference(measured: pd.DataFrame, simulated: pd.DataFrame) -> TimelineDifference:
    """The difference metric of two per-op tables (`trace_ops`, `simulated_ops`)."""
    both = op_differences(measured, simulated)
    if both.empty:
        raise UserError("trace and simulation share no op (stage, replica, op, microbatch): different plans?")
    dur_m = both["end_s_measured"] - both["start_s_measured"]
    dur_s = both["end_s_simulated"] - both["start_s_simulated"]
    ok = dur_s > 0
    ratio = float(np.median(dur_m[ok] / dur_s[ok])) if ok.any() else float("nan")
    return TimelineDifference(makespan(measured), makespan(simulated), ratio,
                              float(np.median(np.abs(both["end_diff_s"]))), len(both))


def simulate_traced_step(plan: str | Path, step: int, seed: int, *, shapes: str | Path | None = None,
                         costmodel: str | Path | None = None) -> SimResult:
    """The simulator's timeline of training step `step` (1-based, as metrics.parquet counts) of the
    run with `seed` on plan.yaml's plan (module docstring)."""
    ctx = load_plan_context(plan, shapes_path=shapes, costmodel_path=costmodel)
    pf = ctx.plan_file
    rows = GlobalBatches(len(ctx.pool), pf.global_batch_size, seed).rows(step - 1)
    compute_only = CostModel(ctx.cost.modules.values(), ctx.cost.provenance,  # loads: before the first forward
                             replace(ctx.cost.step_costs, loading=None))
    _, result = simulate_batch(pf.plan, compute_only, ctx.pool.take(rows), ctx.cluster, ctx.sizes,
                               replace(ctx.scheduler, policy=Policy.DFLOP), seed=seed)
    return result


def _row_label(stage_name: str, replica: int, tp_rank: int, rank: int) -> str:
    text = f"{stage_name} r{replica}"
    if tp_rank > 0:
        text += f" tp{tp_rank}"
    return f"rank {rank}: {text}" if rank >= 0 else text


def draw_ops(ax, ops: pd.DataFrame, span_s: float) -> None:
    """A Gantt chart of a per-op table on `ax`: one row per rank (measured) or device (simulated)."""
    keys = ops[["stage", "replica", "tp_rank", "rank", "stage_name"]].drop_duplicates()
    keys = keys.sort_values(["stage", "replica", "tp_rank"]).reset_index(drop=True)
    labels = []
    for i, key in keys.iterrows():
        y = len(keys) - 1 - i
        mine = ops[(ops["stage"] == key["stage"]) & (ops["replica"] == key["replica"])
                   & (ops["tp_rank"] == key["tp_rank"])]
        for _, op in mine.iterrows():
            width = op["end_s"] - op["start_s"]
            ax.barh(y, width, left=op["start_s"], height=0.75, color=OP_COLOURS[op["op"]], edgecolor="black",
                    linewidth=0.4)
            if width > span_s / 40:
                ax.text(op["start_s"] + width / 2, y, str(int(op["microbatch"])), ha="center", va="center",
                        fontsize=8, color="white")
        labels.append(_row_label(key["stage_name"], int(key["replica"]), int(key["tp_rank"]), int(key["rank"])))
    ax.set_yticks(range(len(keys)), labels[::-1])
    ax.set_xlim(0, span_s * 1.02)
    ax.grid(True, axis="x", alpha=0.3)


def draw_timelines(measured: pd.DataFrame, simulated: pd.DataFrame, *, step: int,
                   trainer_predicted_s: float | None = None) -> plt.Figure:
    """Measured (top) and simulated (bottom) Gantt charts on one time axis, with the difference metric."""
    diff = timeline_difference(measured, simulated)
    span = max(diff.measured_s, diff.simulated_s)
    rows = measured[["stage", "replica", "tp_rank"]].drop_duplicates().shape[0]
    sim_rows = simulated[["stage", "replica"]].drop_duplicates().shape[0]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 3.2 + 0.5 * (rows + sim_rows)), sharex=True,
                                      layout="constrained", height_ratios=[max(rows, 1), max(sim_rows, 1)])
    draw_ops(top, measured, span)
    top.set_title(f"Measured (trace.json): step {step}, first forward to last backward {diff.measured_s:.3g} s",
                  fontsize=10)
    draw_ops(bottom, simulated, span)
    predicted = (f"; the trainer predicted {trainer_predicted_s:.3g} s for this step"
                 if trainer_predicted_s is not None else "")
    bottom.set_title(f"Simulated (same global batch, same plan): {diff.simulated_s:.3g} s{predicted}", fontsize=10)
    bottom.set_xlabel("seconds from the step's first forward")
    handles = [Patch(color=PLAN_COLOUR, label="forward"), Patch(color=BASELINE_COLOUR, label="backward")]
    if (measured["op"] == "W").any() or (simulated["op"] == "W").any():  # ZB-H1: B and W
        handles = [handles[0], Patch(color=BASELINE_COLOUR, label="input grad (B)"),
                   Patch(color=WGRAD_COLOUR, label="weight grad (W)")]
    top.legend(handles=handles, loc="upper right", fontsize=8)
    warm = f" (a warm-up step: steps ≤ {WARMUP_STEPS})" if step <= WARMUP_STEPS else ""
    fig.suptitle(f"One step measured vs simulated{warm}\n{diff.describe()}", fontsize=11)
    return fig


def plot_timelines(*, trace: str | Path, plan: str | Path, seed: int, out_png: str | Path,
                   metrics: str | Path | None = None, step: int | None = None, shapes: str | Path | None = None,
                   costmodel: str | Path | None = None) -> Path:
    """Write the figure for `step` (default: the last traced step); returns its path. A trace with
    no spans (the run's traced steps ran in an earlier process) gives a figure that says so."""
    doc = json.loads(Path(trace).read_text())
    traced = sorted({e["args"]["step"] for e in doc.get("traceEvents", []) if e.get("ph") == "X"
                     and e.get("cat") in ("forward", "backward")})
    if not traced:
        fig, ax = plt.subplots(figsize=(8, 1.5))
        ax.axis("off")
        ax.text(0.5, 0.5, f"{trace} has no traced step (train.trace_steps)", ha="center", va="center")
        return save_figure(fig, out_png)
    step = traced[-1] if step is None else step
    measured = trace_ops(doc, step)
    simulated = simulated_ops(simulate_traced_step(plan, step, seed, shapes=shapes, costmodel=costmodel))
    predicted = None
    if metrics is not None:
        table = read_table(metrics, "metrics.parquet", ("step", "predicted_step_s"))
        row = table[table["step"] == step]
        predicted = float(row["predicted_step_s"].iloc[0]) if len(row) else None
    return save_figure(draw_timelines(measured, simulated, step=step, trainer_predicted_s=predicted), out_png)
