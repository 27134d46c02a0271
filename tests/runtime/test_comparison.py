"""Plan vs data-blind baseline (dflop.runtime.comparison): checked against a hand computation on two
small metrics frames."""

import pandas as pd
import pytest
import yaml

from dflop.errors import UserError
from dflop.runtime.comparison import compare_runs, compare_with_hf, planned_steps, summary_lines, write_summary


def _frame(step_s, idle, predicted, steps=None):
    steps = steps or list(range(1, len(step_s) + 1))
    return pd.DataFrame({"step": steps, "step_s": step_s, "predicted_step_s": predicted, "idle_frac": idle})


# Steps 1-2 are warm-up (huge, and must not count); steps 3-6 are steady.
PLAN = _frame([9.0, 4.0, 0.50, 0.70, 0.60, 0.40], [0.9, 0.8, 0.10, 0.30, 0.20, 0.40],
              [50.0, 50.0, 0.40, 0.50, 0.30, 0.60])
BASE = _frame([1.0, 1.0, 0.90, 0.80, 1.20, 1.00], [0.1, 0.1, 0.50, 0.40, 0.60, 0.70],
              [0.01, 0.01, 0.70, 0.60, 0.50, 0.40])
PLAN_YAML = {"predicted": {"step_s": {"mean": 0.2, "p50": 5.0}},
             "baseline": {"predicted": {"step_s": {"mean": 0.3, "p50": 7.0}}}}


def test_against_a_hand_computation():
    c = compare_runs(PLAN, BASE, planned_steps(PLAN_YAML))
    # Hand: plan steady steps 0.5, 0.7, 0.6, 0.4 -> median (0.5 + 0.6) / 2 = 0.55; baseline
    # 0.9, 0.8, 1.2, 1.0 -> (0.9 + 1.0) / 2 = 0.95; speedup 0.95 / 0.55 = 1.727.
    assert c.steps == [3, 4, 5, 6]
    assert c.plan_step_s == pytest.approx(0.55) and c.baseline_step_s == pytest.approx(0.95)
    assert c.measured_speedup == pytest.approx(0.95 / 0.55)
    # Predicted: plan.yaml's means, 0.3 / 0.2 (not the p50s, not the runs' predicted_step_s).
    assert (c.plan_predicted_s, c.baseline_predicted_s) == (0.2, 0.3)
    assert c.predicted_speedup == pytest.approx(1.5)
    # On the trained batches: the runs' own predicted_step_s over the steady steps, medians
    # plan (0.4 + 0.5) / 2 = 0.45, baseline (0.5 + 0.6) / 2 = 0.55 -> 1.222 (warm-up rows excluded).
    assert c.trained_predicted_speedup == pytest.approx(0.55 / 0.45)
    # Idle medians: plan 0.1, 0.3, 0.2, 0.4 -> 0.25; baseline 0.5, 0.4, 0.6, 0.7 -> 0.55.
    assert c.plan_idle_frac == pytest.approx(0.25) and c.baseline_idle_frac == pytest.approx(0.55)
    lines = c.lines()
    assert len(lines) == 3
    assert "1.73x" in lines[0] and "steps 3-6" in lines[0] and "1.50x" in lines[1]
    assert "1.22x on the trained steps' batches" in lines[1]
    assert "plan 25.0%" in lines[2] and "baseline 55.0%" in lines[2]


def test_only_the_steps_both_runs_have_count():
    """A baseline that stopped after step 4 is compared on steps 3-4 only (the same batches)."""
    c = compare_runs(PLAN, BASE.iloc[:4], (0.2, 0.3))
    assert c.steps == [3, 4]
    assert c.plan_step_s == pytest.approx(0.6) and c.baseline_step_s == pytest.approx(0.85)


def test_no_steady_steps_is_none_and_bad_inputs_are_one_line(tmp_path):
    assert compare_runs(PLAN.iloc[:2], BASE, (0.2, 0.3)) is None
    write_summary(None, tmp_path / "s.yaml")
    assert "share no step after the 2 warm-up steps" in yaml.safe_load((tmp_path / "s.yaml").read_text())["lines"][0]
    with pytest.raises(UserError, match="baseline metrics: missing column.*idle_frac"):
        compare_runs(PLAN, BASE.drop(columns="idle_frac"), (0.2, 0.3))
    with pytest.raises(UserError, match="p.yaml: .*baseline.predicted.step_s.mean missing"):
        planned_steps({"predicted": {"step_s": {"mean": 0.2}}}, "p.yaml")


def test_summary_file(tmp_path):
    path = tmp_path / "summary.yaml"
    write_summary(compare_runs(PLAN, BASE, (0.2, 0.3)), path, {"inputs": {"plan_metrics": "a"}})
    doc = yaml.safe_load(path.read_text())
    assert doc["measured_speedup"] == pytest.approx(0.95 / 0.55) and doc["warmup_steps"] == 2
    assert len(doc["lines"]) == 3 and doc["inputs"] == {"plan_metrics": "a"}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.yaml"]  # no temp file left


def test_against_the_hf_trainer_by_throughput(tmp_path):
    # HF's steps hold other samples than the plan's (its own sampler): compared by samples per second
    # over the steady steps both have. Hand: plan steps 3-6 carry 16+16+8+16 = 56 samples in
    # 0.5+0.7+0.6+0.4 = 2.2 s -> 25.45/s; HF 16*4 = 64 in 1.0+1.5+0.5+2.0 = 5.0 s -> 12.8/s; 1.989x.
    # (Medians of step times would give 0.95 / 0.55 = 1.73x with the plan's short step 5 counted as a
    # full one: throughput is what a user's epoch takes.)
    plan = PLAN.assign(samples=[16, 16, 16, 16, 8, 16])
    hf = pd.DataFrame({"step": range(1, 8), "step_s": [30.0, 9.0, 1.0, 1.5, 0.5, 2.0, 9.9],
                       "idle_frac": [0.9, 0.9, 0.1, 0.2, 0.3, 0.4, 0.9], "samples": [16] * 7})
    c = compare_with_hf(plan, hf)
    assert c.steps == [3, 4, 5, 6]  # not HF's step 7: the plan has none
    assert c.plan_samples_per_s == pytest.approx(56 / 2.2) and c.hf_samples_per_s == pytest.approx(64 / 5.0)
    assert c.measured_speedup == pytest.approx((56 / 2.2) / (64 / 5.0))
    assert c.hf_idle_frac == pytest.approx(0.25)
    assert compare_with_hf(plan.iloc[:2], hf) is None
    # The summary names both baselines, the data-blind one first.
    lines = summary_lines(compare_runs(PLAN, BASE, (0.2, 0.3)), c)
    assert "over the data-blind baseline: 1.73x" in lines[0]
    assert lines[-1].startswith("measured speedup of the plan over the Hugging Face Trainer (padded, "
                                "group_by_length): 1.99x (12.8 -> 25.5 samples/s, steps 3-6")
    write_summary(compare_runs(PLAN, BASE, (0.2, 0.3)), tmp_path / "s.yaml", hf=c)
    doc = yaml.safe_load((tmp_path / "s.yaml").read_text())
    assert doc["lines"] == lines and doc["hf_trainer"]["measured_speedup"] == pytest.approx(c.measured_speedup)


@pytest.mark.parametrize("column,value,message", [
    ("step_s", float("nan"), r"row 3 has invalid step_s=nan \(must be a finite number > 0\)"),
    ("step_s", 0.0, r"row 3 has invalid step_s=0.0 \(must be a finite number > 0\)"),
    ("idle_frac", float("inf"), r"row 3 has invalid idle_frac=inf \(must be a finite number\)"),
    ("predicted_step_s", float("-inf"), r"row 3 has invalid predicted_step_s=-inf"),
    ("step", "3", r"column step holds \S+ values, expected numbers \(row 0: '1'\)"),
])
def test_compare_runs_refuses_garbage_metrics_in_one_line(tmp_path, capsys, column, value, message):
    """A NaN step used to print "speedup nanx", a zero one a ZeroDivisionError traceback."""
    from dflop.cli import main

    bad = PLAN.copy()
    if isinstance(value, str):
        bad[column] = bad[column].astype(str)
    else:
        bad.loc[3, column] = value
    bad.to_parquet(tmp_path / "plan_metrics.parquet")
    BASE.to_parquet(tmp_path / "base_metrics.parquet")
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(PLAN_YAML))
    args = ["compare-runs", "--metrics", str(tmp_path / "plan_metrics.parquet"),
            "--baseline-metrics", str(tmp_path / "base_metrics.parquet"), "--plan", str(tmp_path / "plan.yaml")]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and __import__("re").search(rf"plan_metrics\.parquet: {message}", err), err


@pytest.mark.parametrize("mean,shown", [(float("nan"), "nan"), (0.0, "0.0"), ("0.2", "'0.2'"), (float("inf"), "inf")])
def test_planned_steps_must_be_positive_numbers(mean, shown):
    doc = {"predicted": {"step_s": {"mean": mean}}, "baseline": {"predicted": {"step_s": {"mean": 0.3}}}}
    with pytest.raises(UserError, match=rf"^p.yaml: predicted.step_s.mean is {shown}, expected a finite number > 0$"):
        planned_steps(doc, "p.yaml")
