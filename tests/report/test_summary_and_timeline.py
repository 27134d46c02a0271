"""The summary card, the candidates figure, the training curves' warm-up handling and the measured vs
simulated timeline, on small hand-made inputs whose numbers are worked out by hand below."""

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

from dflop.errors import UserError
from dflop.plan import Layout, Plan, PlanFile
from dflop.report.candidates_plots import draw_candidates, unplaced_counts
from dflop.report.summary_plots import Summary, draw_summary, fact_lines, headline, summarize_run
from dflop.report.timeline_plots import draw_timelines, timeline_difference
from dflop.report.training_plots import draw_training_curves, steady_limits
from dflop.runtime.spans import OPS_COLUMNS


def _run(step_s, predicted, idle=0.1, samples=16, skipped=None):
    n = len(step_s)
    frame = pd.DataFrame({"step": np.arange(1, n + 1), "step_s": step_s, "predicted_step_s": predicted,
                          "idle_frac": idle, "samples": samples})
    if skipped is not None:
        frame["skipped_samples"] = skipped
    return frame


def _plan_file(speedup=1.25):
    plan = Plan(Layout("colocated", 1, 1, 2, 1, 1, 2, 1), (2,), (2,))
    return PlanFile(plan, 16, plan, {"speedup": speedup, "predicted": {"step_s": {"mean": 0.2}},
                                     "baseline": {"predicted": {"step_s": {"mean": 0.25}}}})


def test_summary_leaves_warmup_out_and_divides_baseline_by_plan():
    # Steps 1-2 are warm-up (9 s, 5 s): left out. Plan steady steps 1, 2, 3 s -> median 2;
    # baseline 3, 4, 5 s -> median 4: measured speedup 4 / 2 = 2.00. Predicted medians 1 and 1.6 -> 1.60.
    plan = summarize_run(_run([9, 5, 1, 2, 3], [1, 1, 1, 1, 1], skipped=[1, 0, 0, 2, 0]), "DFLOP plan")
    base = summarize_run(_run([9, 5, 3, 4, 5], [1, 1, 1.6, 1.6, 1.6]), "data-blind baseline")
    assert (plan.steady_steps, plan.step_s, plan.predicted_s, plan.skipped) == (3, 2.0, 1.0, 3)
    assert plan.samples_per_s == pytest.approx(48 / 6)  # 3 steps x 16 samples over 1 + 2 + 3 s
    summary = Summary(_plan_file(1.25), plan, base)
    assert summary.measured_speedup == pytest.approx(2.0)
    assert summary.run_predicted_speedup == pytest.approx(1.6)
    text = headline(summary)
    assert "measured 2.00x" in text and "predicted 1.60x (trainer" in text and "1.25x (planner)" in text
    fig = draw_summary(summary)
    assert any("2.00x" in t.get_text() for t in fig.texts)  # the suptitle carries it
    plt.close(fig)


def test_summary_without_baseline_run_says_so_and_short_runs_use_all_steps():
    short = summarize_run(_run([4, 2], [1, 1]), "DFLOP plan")  # no step after the warm-up
    assert short.warm_only and short.step_s == 3.0 and short.steady_steps == 2
    summary = Summary(_plan_file(1.25), short, None)
    assert summary.measured_speedup is None
    assert "measured: no baseline training run" in headline(summary)
    assert "data-blind baseline: no training run, no measured speedup" in fact_lines(summary)
    plt.close(draw_summary(summary))
    with pytest.raises(UserError, match="no steps"):
        summarize_run(_run([], []), "DFLOP plan")


def test_steady_limits_keep_warmup_out_of_the_range():
    step = np.array([1, 2, 3, 4])
    # warm-up values 9 and 5 are ignored; steady max 2 -> top 2 * 1.15
    assert steady_limits(step, np.array([9.0, 5.0, 1.0, 2.0])) == (0.0, pytest.approx(2.3))
    # without zero floor: min 1, max 2, pad 0.1 -> (0.9, 2.1)
    lo, hi = steady_limits(step, np.array([9.0, 5.0, 1.0, 2.0]), zero_floor=False)
    assert (lo, hi) == (pytest.approx(0.9), pytest.approx(2.1))
    # two series share one range; a run with only warm-up steps uses them
    assert steady_limits(step, np.array([0, 0, 1.0, 1.0]), np.array([0, 0, 3.0, 1.0]))[1] == pytest.approx(3.45)
    assert steady_limits(np.array([1, 2]), np.array([4.0, 2.0]))[1] == pytest.approx(4.6)


def test_training_curves_axes_and_corrected_line():
    m = _run([9.0, 5.0, 1.0, 2.0, 1.5], [1.0, 1.0, 0.8, 1.0, 1.0])
    m["loss"], m["tokens"], m["tflops"] = [5, 4, 3, 2.5, 2.2], 1000, [0.1, 0.2, 1.0, 0.5, 0.8]
    m["corrected_step_s"] = [np.nan, np.nan, 1.0, 1.9, 1.5]
    fig = draw_training_curves(m, peak_tflops=2.0, devices=2)
    axes = fig.dflop_axes
    # step time axis: steady measured/predicted/corrected max 2.0 -> 2.3; the 9 s and 5 s warm-up steps are off it
    assert axes["step_time"].get_ylim()[1] == pytest.approx(2.3)
    labels = [line.get_label() for line in axes["step_time"].get_lines()]
    assert "predicted after the adaptive correction" in labels
    # scatter ratio: steady steps 3..5 ratios 1.25, 2, 1.5 -> median 1.50
    assert "median measured / predicted: 1.50" in axes["scatter"].get_title()
    # MFU: steady TFLOP/s 1.0, 0.5, 0.8 -> median 0.8 over 2 devices x 2 TFLOP/s = 20.0 %
    assert "MFU 20.0% median" in axes["tflops"].get_title()
    plt.close(fig)
    fig = draw_training_curves(m)
    assert "device peak unknown" in fig.dflop_axes["tflops"].get_title()
    plt.close(fig)


def _ops(rows, rank=-1):
    return pd.DataFrame([(rank, s, f"llm{s}", r, 0 if rank >= 0 else -1, op, j, a, b, b - a)
                         for s, r, op, j, a, b in rows], columns=list(OPS_COLUMNS))


def test_timeline_difference_by_hand():
    # Two ops on one device. Measured: F 0-2, B 2-6 (makespan 6). Simulated: F 0-1, B 1-3 (makespan 3).
    measured = _ops([(0, 0, "F", 0, 0.0, 2.0), (0, 0, "B", 0, 2.0, 6.0)], rank=0)
    simulated = _ops([(0, 0, "F", 0, 0.0, 1.0), (0, 0, "B", 0, 1.0, 3.0)])
    diff = timeline_difference(measured, simulated)
    assert (diff.measured_s, diff.simulated_s, diff.step_ratio) == (6.0, 3.0, 2.0)
    assert diff.op_ratio == pytest.approx(2.0)  # 2/1 and 4/2
    assert diff.end_abs_s == pytest.approx(2.0)  # ends differ by 1 and 3 -> median 2
    fig = draw_timelines(measured, simulated, step=3, trainer_predicted_s=2.5)
    assert "measured / simulated 2.00" in fig.get_suptitle()
    assert "the trainer predicted 2.5 s" in fig.axes[1].get_title()
    plt.close(fig)
    with pytest.raises(UserError, match="share no op"):
        timeline_difference(measured, _ops([(1, 0, "F", 0, 0.0, 1.0)]))


def test_candidates_mark_chosen_and_count_unplaced():
    c = pd.DataFrame({
        "kind": ["plan", "plan", "plan", "plan", "baseline", "baseline"],
        "status": ["chosen", "pruned", "pruned", "rejected", "chosen", "pruned"],
        "reason": [None, "racing", "memory", "divisibility", None, "bound"],
        "step_mean_s": [1.0, 2.0, 3.0, np.nan, 1.5, np.nan],
        "peak_memory_gb": [4.0, 2.0, 9.0, np.nan, 5.0, np.nan]})
    counts = unplaced_counts(c)
    assert counts.to_dict() == {("baseline", "pruned", "bound"): 1, ("plan", "rejected", "divisibility"): 1}
    fig = draw_candidates(c, memory_limit_gb=8.0)
    ax = fig.axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert "chosen plan: 1 s" in labels and "data-blind (packed) baseline: 1.5 s" in labels
    assert {"DFLOP search, pruned: memory", "DFLOP search, pruned: racing", "memory limit 8 GB"} <= set(labels)
    assert "4 simulated" in ax.get_title() and "6 looked at" in ax.get_title()
    plt.close(fig)
