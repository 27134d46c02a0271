"""MetricsWriter: a step's cost does not grow with the run, a killed run loses no step up to its
checkpoint and repeats none, and the published metrics.parquet is one ordinary Parquet file."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from dflop.runtime.metrics import MetricsRow, MetricsWriter


def _row(step: int, loss: float | None = None) -> MetricsRow:
    return MetricsRow(step=step, loss=1.0 / step if loss is None else loss, step_s=0.1, samples=4, tokens=100,
                      tflops=1.5, idle_frac=0.25, sched_ms=2.0, sched_gap=1.01, predicted_step_s=0.09,
                      corrected_step_s=np.nan if step < 3 else 0.2, correction_active=step % 2 == 0, run_id="abc",
                      lr=1e-3, grad_norm=0.5, answer_tokens=7, data_wait_s=0.01,
                      member="" if step < 5 else "demo", stage_busy_s={"vision0": 0.03, "llm0": 0.05},
                      skipped_samples=step % 3, peak_bytes=np.nan)


def _run(writer: MetricsWriter, steps: range, checkpoint_every: int, loss: float | None = None) -> None:
    """What the training loop does: a row per step, the rows flushed before every checkpoint."""
    for step in steps:
        writer.append(_row(step, loss))
        if step % checkpoint_every == 0:
            writer.flush()


def test_a_step_writes_as_many_rows_at_step_1000_as_at_step_10(tmp_path, monkeypatch):
    written: list[int] = []  # rows of every Parquet write, in order
    original = pd.DataFrame.to_parquet

    def counting(frame, *args, **kwargs):
        written.append(len(frame))
        return original(frame, *args, **kwargs)

    monkeypatch.setattr(pd.DataFrame, "to_parquet", counting)
    writer = MetricsWriter(tmp_path / "metrics")
    per_step = []
    for step in range(1, 1001):
        before = len(written)
        _run(writer, range(step, step + 1), checkpoint_every=10)
        per_step.append(sum(written[before:]))
    assert max(per_step) == 10  # a checkpoint's step writes the 10 rows since the last one, never more
    assert sum(per_step) == 1000  # every row once
    writer.publish(tmp_path / "out.parquet")
    assert pd.read_parquet(tmp_path / "out.parquet")["step"].tolist() == list(range(1, 1001))


def test_a_killed_run_keeps_every_step_up_to_its_checkpoint_and_repeats_none(tmp_path):
    folder = tmp_path / "metrics"
    _run(MetricsWriter(folder), range(1, 26), checkpoint_every=10)  # killed after step 25: checkpoint 20
    # Re-run from 20, killed while saving the checkpoint of step 30 (its rows were flushed first).
    _run(MetricsWriter(folder, resume_step=20), range(21, 31), checkpoint_every=10, loss=-1.0)
    last = MetricsWriter(folder, resume_step=20)  # the newest complete checkpoint is still 20
    _run(last, range(21, 36), checkpoint_every=10, loss=-2.0)
    last.publish(tmp_path / "metrics.parquet")
    frame = pd.read_parquet(tmp_path / "metrics.parquet")
    assert frame["step"].tolist() == list(range(1, 36))
    assert frame["loss"].tolist() == [1.0 / s for s in range(1, 21)] + [-2.0] * 15
    MetricsWriter(folder)  # a fresh run starts afresh
    assert not folder.exists()


def test_the_published_file_is_one_parquet_file_with_the_rows_as_one_frame_gives_them(tmp_path):
    rows = [_row(step) for step in range(1, 13)]
    writer = MetricsWriter(tmp_path / "metrics")
    _run(writer, range(1, 13), checkpoint_every=4)  # three parts, the first with no member and no correction
    writer.publish(tmp_path / "metrics.parquet")
    assert pq.ParquetFile(tmp_path / "metrics.parquet").metadata.num_rows == 12
    expected = pd.DataFrame([row.to_dict() for row in rows])
    expected.to_parquet(tmp_path / "expected.parquet", index=False)
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "metrics.parquet"),
                                  pd.read_parquet(tmp_path / "expected.parquet"))


def test_a_run_resumed_from_the_single_working_file_of_earlier_versions_keeps_its_rows(tmp_path):
    pd.DataFrame([_row(step).to_dict() for step in (1, 2, 3)]).to_parquet(tmp_path / "metrics.parquet", index=False)
    writer = MetricsWriter(tmp_path / "metrics", resume_step=2)  # beside it: the checkpoint of step 2
    _run(writer, range(3, 5), checkpoint_every=2, loss=-1.0)
    writer.publish(tmp_path / "out.parquet")
    frame = pd.read_parquet(tmp_path / "out.parquet")
    assert frame["step"].tolist() == [1, 2, 3, 4] and frame["loss"].tolist() == [1.0, 0.5, -1.0, -1.0]


# The columns and dtypes metrics.parquet had before `MetricsRow` (the dict the trainer built, its
# BASE_COLUMNS first), as main's MetricsWriter wrote that dict under pandas 3 (str columns): what the
# report, compare-runs and users' notebooks read.
BEFORE = [("step", "int64"), ("loss", "float64"), ("step_s", "float64"), ("samples", "int64"), ("tokens", "int64"),
          ("tflops", "float64"), ("idle_frac", "float64"), ("sched_ms", "float64"), ("sched_gap", "float64"),
          ("predicted_step_s", "float64"), ("corrected_step_s", "float64"), ("correction_active", "bool"),
          ("run_id", "str"), ("lr", "float64"), ("grad_norm", "float64"), ("answer_tokens", "int64"),
          ("data_wait_s", "float64"), ("member", "str"), ("busy_s_vision0", "float64"),
          ("idle_s_vision0", "float64"), ("busy_s_llm0", "float64"), ("idle_s_llm0", "float64"),
          ("skipped_samples", "int64"), ("peak_bytes", "float64")]


def test_the_parquet_columns_are_the_rows_fields_with_the_dtypes_they_had(tmp_path):
    writer = MetricsWriter(tmp_path / "metrics")
    _run(writer, range(1, 7), checkpoint_every=4)  # a part file and unflushed rows
    writer.publish(tmp_path / "metrics.parquet")
    frame = pd.read_parquet(tmp_path / "metrics.parquet")
    assert list(frame.columns) == MetricsRow.columns(["vision0", "llm0"])
    assert [(c, str(t)) for c, t in frame.dtypes.items()] == BEFORE
    # idle = step less busy, per stage
    np.testing.assert_allclose(frame["idle_s_llm0"], 0.1 - 0.05)


def test_the_readers_columns_are_metrics_row_fields():
    from dflop.report.summary_plots import SUMMARY_COLUMNS
    from dflop.runtime.comparison import COMPARED_COLUMNS, METRICS_NUMBERS

    names = {f for f in MetricsRow.columns([])}
    assert set(SUMMARY_COLUMNS) | set(COMPARED_COLUMNS) | set(METRICS_NUMBERS) <= names
