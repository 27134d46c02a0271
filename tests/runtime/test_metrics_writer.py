"""MetricsWriter: a step's cost does not grow with the run, a killed run loses no step up to its
checkpoint and repeats none, and the published metrics.parquet is one ordinary Parquet file."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from dflop.runtime.metrics import MetricsWriter


def _row(step: int, loss: float | None = None) -> dict:
    return {"step": step, "loss": 1.0 / step if loss is None else loss, "step_s": 0.1, "busy_s_llm0": 0.05,
            "corrected_step_s": np.nan if step < 3 else 0.2, "member": None if step < 5 else "demo",
            "correction_active": step % 2 == 0, "run_id": "abc"}


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
    expected = pd.DataFrame(rows)
    expected = expected[["step", "loss", "step_s", "corrected_step_s", "correction_active", "run_id", "busy_s_llm0",
                         "member"]]
    expected.to_parquet(tmp_path / "expected.parquet", index=False)
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "metrics.parquet"),
                                  pd.read_parquet(tmp_path / "expected.parquet"))


def test_a_run_resumed_from_the_single_working_file_of_earlier_versions_keeps_its_rows(tmp_path):
    pd.DataFrame([_row(step) for step in (1, 2, 3)]).to_parquet(tmp_path / "metrics.parquet", index=False)
    writer = MetricsWriter(tmp_path / "metrics", resume_step=2)  # beside it: the checkpoint of step 2
    _run(writer, range(3, 5), checkpoint_every=2, loss=-1.0)
    writer.publish(tmp_path / "out.parquet")
    frame = pd.read_parquet(tmp_path / "out.parquet")
    assert frame["step"].tolist() == [1, 2, 3, 4] and frame["loss"].tolist() == [1.0, 0.5, -1.0, -1.0]
