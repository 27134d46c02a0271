"""Re-running a finished training in the same out-dir trains what the new settings say.

One launch of 2 gloo ranks runs, in turn: a 2-step run; the same again (complete: nothing is
trained); a changed learning rate (another run: it starts afresh); the same with train.steps 4
(the same run, longer: it resumes); other data (afresh); ``--fresh``; another LLM (afresh, where a
resume used to crash on the missing ``lm_head``). The references are closed forms and the runs
themselves: a fresh start's first loss equals the first run's (same initial weights and batch),
a resumed run's first rows are the earlier run's, the LR of the added steps is the cosine of the
new length.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from dflop.runtime.optim import warmup_cosine
from trainer_reference import TWO_RANK_PLAN, config_dict, pick_pool
from gloo_ranks import run_ranks

WORKER = Path(__file__).with_name("rerun_worker.py")
LR = 1e-3


@pytest.mark.distributed
@pytest.mark.slow
def test_each_rerun_trains_what_its_settings_say(tmp_path, demo_shapes, runtime_demo):
    plan = tmp_path / "plan.yaml"
    plan.write_text(TWO_RANK_PLAN)
    shapes = demo_shapes["llava_ov"]
    pool_a = pick_pool(shapes, tmp_path / "a.parquet", {"image": 2, "text": 2, "video": 1, "multi_image": 1})
    pool_b = pick_pool(shapes, tmp_path / "b.parquet", {"image": 3, "text": 3})
    config = config_dict("llava_ov", runtime_demo, train={"global_batch_size": 4, "steps": 2, "checkpoint_every": 1,
                                                          "warmup_steps": 1, "lr": LR})
    runs = [
        {"name": "first", "shapes": pool_a},
        {"name": "same", "shapes": pool_a},
        {"name": "lr", "shapes": pool_a, "config_changes": {"train": {"lr": 2 * LR}}},
        {"name": "longer", "shapes": pool_a, "config_changes": {"train": {"lr": 2 * LR, "steps": 4}}},
        {"name": "data", "shapes": pool_b},
        {"name": "fresh", "shapes": pool_b, "fresh": True},
        {"name": "llm", "shapes": pool_b, "config_changes": {"model": {"llm": "llama3-tiny"}}},
    ]
    spec = {"config": config, "plan": str(plan), "runs": runs, "out": str(tmp_path / "out"),
            "record": str(tmp_path / "record")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    result = run_ranks(WORKER, tmp_path / "spec.json", nproc=2, timeout=900)
    log = result.stderr

    def metrics(name):
        return pd.read_parquet(tmp_path / "record" / name / "metrics.parquet")

    def moved(name):
        return json.loads((tmp_path / "record" / name / "previous_runs.json").read_text())

    first, same, lr, longer, data, fresh, llm = (metrics(r["name"]) for r in runs)
    assert first["step"].tolist() == [1, 2] and first["run_id"].nunique() == 1
    run_a = first["run_id"].iat[0]

    # The same settings again: the run is complete, nothing is trained, nothing is moved.
    pd.testing.assert_frame_equal(same, first)
    assert moved("same") == [] and f"run {run_a} is already complete at step 2" in log

    # Another LR: a new run from the initial weights; the old checkpoints are kept aside.
    run_b = lr["run_id"].iat[0]
    assert run_b != run_a and lr["step"].tolist() == [1, 2] and (lr["run_id"] == run_b).all()
    assert math.isclose(lr["loss"].iat[0], first["loss"].iat[0], rel_tol=1e-6)  # same init, same first batch
    assert lr["lr"].iat[1] == pytest.approx(2 * first["lr"].iat[1])
    assert len(moved("lr")) == 1 and moved("lr")[0].startswith(run_a)
    assert (tmp_path / "out" / "previous_runs" / moved("lr")[0] / "step_000002").is_dir()
    assert "differs in train.lr (0.001 -> 0.002)" in log

    # Longer: the same run resumed at step 2; the added steps follow the 4-step schedule.
    assert longer["step"].tolist() == [1, 2, 3, 4] and (longer["run_id"] == run_b).all()
    pd.testing.assert_frame_equal(longer.iloc[:2].reset_index(drop=True), lr, check_dtype=False)
    for step in (3, 4):
        expected = 2 * LR * warmup_cosine(step - 1, total_steps=4, warmup_steps=1, min_lr_ratio=0.1)
        assert longer["lr"].iat[step - 1] == pytest.approx(expected)
    assert len(moved("longer")) == 1 and f"train.steps 2 -> 4: resuming run {run_b} at step 2" in log

    # Other data: afresh; --fresh: afresh again, with the same result (a real fresh start).
    assert data["run_id"].iat[0] not in (run_a, run_b) and len(moved("data")) == 2
    assert "differs in data.shapes" in log
    pd.testing.assert_frame_equal(fresh.drop(columns=_timings(fresh)), data.drop(columns=_timings(data)),
                                  check_exact=False, rtol=1e-5)
    assert len(moved("fresh")) == 3

    # Another LLM: afresh (a resume would need tensors the checkpoint does not have).
    assert llm["step"].tolist() == [1, 2] and llm["run_id"].iat[0] != data["run_id"].iat[0]
    assert len(moved("llm")) == 4 and "differs in model.llm (qwen2.5-tiny -> llama3-tiny)" in log


def _timings(frame: pd.DataFrame) -> list[str]:
    """Columns measured in wall time (they differ between two identical runs)."""
    return [c for c in frame.columns if c.startswith(("step_s", "busy_s_", "idle_s_", "idle_frac", "tflops",
                                                      "sched_ms", "data_wait_s", "member", "sched_gap",
                                                      "predicted_step_s"))]
