"""The plan against the data-blind baseline, both trained on the same global batches (rule
summary): what `make demo` prints last and what the report's summary page reads.

Measured speedup: the baseline's median step over the plan's, over the steady-state steps both runs
have (after `WARMUP_STEPS`, as `prediction_agreement` counts them). Predicted speedup: plan.yaml's
(`planned_steps`): the baseline's mean predicted step over the plan's, both priced by the one
pricing path on the optimizer's sampled global batches. Beside it, the same prediction on the
batches the runs trained on: the ratio of the runs' median ``predicted_step_s`` over the compared
steps (each step's partition priced as profiled, never corrected), which tells a cost-model miss
from the sampled batches differing from the trained ones.
Idle: the median ``idle_frac`` of each run over the compared steps.

Against the Hugging Face `Trainer` (`dflop head-to-head`, whose runs take their steps in turn):
HF's sampler picks its own global batches, so the two are compared by throughput, not step by
step: the samples of the steady-state steps both runs have over the seconds those steps took.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd
import yaml

from dflop.errors import UserError
from dflop.finite import Numbers, check_columns
from dflop.io import read_parquet, write_text_atomic
from dflop.plan import Prediction
from dflop.runtime.metrics import WARMUP_STEPS

# The metrics.parquet numbers a comparison divides and prints: a step's seconds divide, the
# predictions are NaN where a step has none (corrected_step_s before the correction learned).
METRICS_NUMBERS = {"step": Numbers(1, whole=True), "step_s": Numbers(0, above=True), "idle_frac": Numbers(None),
                   "predicted_step_s": Numbers(0, missing_ok=True), "corrected_step_s": Numbers(0, missing_ok=True)}


COMPARED_COLUMNS = ("step", "step_s", "idle_frac")  # what `compare_runs` reads of each run


def read_metrics(path: str | Path, *, missing_hint: str, columns=COMPARED_COLUMNS) -> pd.DataFrame:
    """A run's metrics.parquet for comparing it with a prediction or another run: one-line
    UserError naming the file (and the column and row) for a missing file, a missing one of
    `columns`, strings, NaN or inf."""
    frame = read_parquet(path, missing_hint=missing_hint)
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise UserError(f"{path}: not a metrics.parquet of dflop train (no column {', '.join(missing)})")
    check_columns(frame, str(path), METRICS_NUMBERS)
    return frame


@dataclass(frozen=True)
class RunComparison:
    """Plan vs baseline over `steps` (the steady-state steps both runs have)."""

    steps: list[int]
    plan_step_s: float           # median measured step
    baseline_step_s: float
    measured_speedup: float      # baseline_step_s / plan_step_s
    plan_predicted_s: float      # plan.yaml: mean predicted step over the sampled batches
    baseline_predicted_s: float
    predicted_speedup: float     # baseline_predicted_s / plan_predicted_s
    plan_idle_frac: float        # median idle_frac
    baseline_idle_frac: float
    trained_predicted_speedup: float | None = None  # median predicted_step_s, baseline over plan

    def lines(self) -> list[str]:
        """The three lines `make demo` ends with."""
        return [
            f"measured speedup of the plan over the data-blind baseline: {self.measured_speedup:.2f}x "
            f"(median step {self.baseline_step_s:.3f} s -> {self.plan_step_s:.3f} s, "
            f"steps {self.steps[0]}-{self.steps[-1]} of both runs)",
            f"predicted speedup: {self.predicted_speedup:.2f}x (plan.yaml: mean predicted step "
            f"{self.baseline_predicted_s:.3f} s -> {self.plan_predicted_s:.3f} s over the optimizer's sampled batches"
            + (f"; {self.trained_predicted_speedup:.2f}x on the trained steps' batches)"
               if self.trained_predicted_speedup is not None else ")"),
            f"idle time (median share of rank-time): plan {100 * self.plan_idle_frac:.1f}%, "
            f"baseline {100 * self.baseline_idle_frac:.1f}%",
        ]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["warmup_steps"] = WARMUP_STEPS
        out["lines"] = self.lines()
        return out


def planned_steps(doc: Mapping[str, Any], source: str = "plan.yaml") -> tuple[float, float]:
    """(plan, baseline) mean predicted step of a plan.yaml mapping (`dflop.plan.Prediction`)."""
    plan, base = Prediction.read(doc, None, source), Prediction.read(doc, "baseline", source)
    if plan is None or base is None or plan.step_mean_s is None or base.step_mean_s is None:
        raise UserError(f"{source}: predicted.step_s.mean or baseline.predicted.step_s.mean missing "
                        f"(re-run `dflop optimize`)")
    return float(plan.step_mean_s), float(base.step_mean_s)


def compare_runs(plan: pd.DataFrame, baseline: pd.DataFrame, predicted: tuple[float, float], *,
                 warmup_steps: int = WARMUP_STEPS) -> RunComparison | None:
    """Compare two metrics.parquet frames (the plan's and the baseline's) over their common
    steady-state steps, with `predicted` = (plan, baseline) predicted step (`planned_steps`);
    None when they share no such step (a run of at most `warmup_steps` steps)."""
    for name, frame in (("plan", plan), ("baseline", baseline)):
        missing = [c for c in ("step", "step_s", "idle_frac") if c not in frame]
        if missing:
            raise UserError(f"{name} metrics: missing column(s) {', '.join(missing)}")
    steps = [int(s) for s in sorted(set(plan["step"]) & set(baseline["step"])) if s > warmup_steps]
    if not steps:
        return None
    p = plan.set_index("step").loc[steps]
    b = baseline.set_index("step").loc[steps]
    plan_step, base_step = float(np.median(p["step_s"])), float(np.median(b["step_s"]))
    plan_pred, base_pred = (float(x) for x in predicted)
    trained = None
    if "predicted_step_s" in p and "predicted_step_s" in b:
        plan_trained = float(np.nanmedian(p["predicted_step_s"])) if p["predicted_step_s"].notna().any() else np.nan
        base_trained = float(np.nanmedian(b["predicted_step_s"])) if b["predicted_step_s"].notna().any() else np.nan
        trained = base_trained / plan_trained if plan_trained > 0 and np.isfinite(base_trained) else None
    return RunComparison(steps, plan_step, base_step, base_step / plan_step, plan_pred, base_pred,
                         base_pred / plan_pred, float(np.median(p["idle_frac"])), float(np.median(b["idle_frac"])),
                         trained)


@dataclass(frozen=True)
class HfComparison:
    """The plan against the Hugging Face `Trainer` over `steps` (module docstring)."""

    steps: list[int]
    plan_samples_per_s: float
    hf_samples_per_s: float
    measured_speedup: float      # plan_samples_per_s / hf_samples_per_s
    hf_idle_frac: float          # median idle_frac (`dflop.integrations.hf_run`: wall minus thread CPU time)
    strategy: str = "group_by_length"

    def line(self) -> str:
        return (f"measured speedup of the plan over the Hugging Face Trainer (padded, {self.strategy}): "
                f"{self.measured_speedup:.2f}x ({self.hf_samples_per_s:.1f} -> {self.plan_samples_per_s:.1f} "
                f"samples/s, steps {self.steps[0]}-{self.steps[-1]} of both, taken in turn)")


HF_COLUMNS = ("step", "step_s", "idle_frac", "samples")


def compare_with_hf(plan: pd.DataFrame, hf: pd.DataFrame, *, warmup_steps: int = WARMUP_STEPS,
                    strategy: str = "group_by_length") -> HfComparison | None:
    """Throughput of the plan's run against HF's over their common steady-state steps; None when
    they share none."""
    steps = [int(s) for s in sorted(set(plan["step"]) & set(hf["step"])) if s > warmup_steps]
    if not steps:
        return None
    p = plan.set_index("step").loc[steps]
    h = hf.set_index("step").loc[steps]
    plan_rate = float(p["samples"].sum() / p["step_s"].sum())
    hf_rate = float(h["samples"].sum() / h["step_s"].sum())
    return HfComparison(steps, plan_rate, hf_rate, plan_rate / hf_rate, float(np.median(h["idle_frac"])), strategy)


def no_comparison_line(warmup_steps: int = WARMUP_STEPS) -> str:
    return (f"no speedup measured: the runs share no step after the {warmup_steps} warm-up steps "
            f"(train.steps must be above {warmup_steps})")


def summary_lines(comparison: RunComparison | None, hf: HfComparison | None = None) -> list[str]:
    """What `make demo` ends with: the comparison's lines (or why there is none), then HF's line."""
    lines = comparison.lines() if comparison is not None else [no_comparison_line()]
    return lines + ([hf.line()] if hf is not None else [])


def write_summary(comparison: RunComparison | None, path: str | Path, extra: Mapping | None = None,
                  hf: HfComparison | None = None) -> None:
    """summary.yaml (atomically): the comparison's fields and its lines (None: no steady steps;
    `lines` says so and the other fields are absent), HF's comparison under ``hf_trainer`` when
    given, and `extra` records."""
    doc = comparison.to_dict() if comparison is not None else {"steps": []}
    doc["lines"] = summary_lines(comparison, hf)
    if hf is not None:
        doc["hf_trainer"] = asdict(hf)
    doc.update(extra or {})
    write_text_atomic(path, yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=200))
