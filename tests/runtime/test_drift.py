"""The adaptive correction on a real, known drift: two runs of the real trainer on 2 gloo ranks
(tiny LLaVA-OV, vision colocated with LLM stage 0, LLM stage 1 on rank 1, 4 microbatches, dflop
policy, the same 10 global batches), one with LLM stage 1 slowed K times by the schedule's test
hook (`dflop.runtime.schedule.DRIFT_ENV`: each forward and backward sleeps (K - 1) x its own
compute inside the timed window), one without.

References: the injected slowdown K (closed form); the measured step; the run without the drift
(same batches, same seeds: its partitions are what the scheduler picks without the drift).
The cost model is the FLOP-count one at a CPU-like throughput, so the learned factors stay in range.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import yaml

from dflop.runtime.schedule import DRIFT_ENV
from trainer_reference import config_dict, pick_pool

K = 4.0
STEPS = 12  # WARMUP_STEPS not learned from, then enough steps for the gate to decide a few times
PLAN = {"vision": {"tp": 1, "pp": 1, "dp": 1, "layers_per_stage": [2]},
        "llm": {"tp": 1, "pp": 2, "dp": 1, "layers_per_stage": [1, 1]}, "placement": "colocated",
        "microbatches": 4, "global_batch_size": 8, "world_size": 2}


def _train_worker(rank: int, spec: dict) -> None:
    from dflop.config import Config
    from dflop.runtime.run import train

    train(Config.from_dict(spec["config"]), plan_path=spec["plan"], shapes_path=spec["shapes"],
          costmodel_path=spec["cost"], out_dir=spec["out"], progress=False, export=False)


@pytest.fixture(scope="module")
def runs(demo_shapes, runtime_demo, tmp_path_factory):
    """{"plain" | "drift": (metrics frame, the correction's final state)}."""
    from dflop.config import Config
    from dflop.costmodel.analytic import analytic_cost_model
    from dflop.costmodel.jsonio import save_cost_model
    from dflop.models.handle import ModelHandle
    from test_checkpoint_helpers import spawn

    tmp = tmp_path_factory.mktemp("drift")
    pool = pick_pool(demo_shapes["llava_ov"], tmp / "pool.parquet", {"image": 4, "multi_image": 4, "video": 4, "text": 4})
    (tmp / "plan.yaml").write_text(yaml.safe_dump(PLAN))
    config = config_dict("llava_ov", runtime_demo, train={"global_batch_size": 8, "steps": STEPS,
                                                          "checkpoint_every": STEPS})
    model = ModelHandle.resolve(Config.from_dict(config).model)
    save_cost_model(analytic_cost_model(model.config, tp_degrees=[1], achieved_tflops=0.02, op_overhead_ms=1.0,
                                        dtype=model.spec.dtype, preset=model.spec.preset), tmp / "cost.json")
    out = {}
    for name, drift in (("plain", None), ("drift", f"1:{K}")):
        spec = {"config": config, "plan": str(tmp / "plan.yaml"), "shapes": pool, "out": str(tmp / name),
                "cost": str(tmp / "cost.json")}
        with pytest.MonkeyPatch.context() as mp:  # the forked ranks inherit it
            if drift is None:
                mp.delenv(DRIFT_ENV, raising=False)
            else:
                mp.setenv(DRIFT_ENV, drift)
            spawn(_train_worker, 2, tmp, spec)
        state = json.loads((tmp / name / "checkpoints" / f"step_{STEPS:06d}" / "train_state.json").read_text())
        out[name] = pd.read_parquet(tmp / name / "metrics.parquet"), state["extra"]["correction"]
    return out


@pytest.mark.distributed
def test_correction_learns_the_slowed_stage(runs):
    """(a) The slowed stage's learned scale, relative to the other stage's, grows K-fold (the
    run without the drift gives the machine's own ratio: the two stages' profiles are not equally
    off). Generous bounds: the other rank computes faster while the slowed one sleeps (measured in six
    runs: 3.5-5.7 for K = 4). A module-wide factor gives 1 (checked: per_stage=False fails here and
    in (c)), a scale learned on the wrong stage 1/K."""
    ratio = {name: np.divide(*np.asarray(state["stage_scales_llm"])[::-1]) for name, (_, state) in runs.items()}
    assert K / 2 < ratio["drift"] / ratio["plain"] < 2 * K, ratio


@pytest.mark.distributed
def test_corrected_prediction_approaches_the_measured_step(runs):
    """(b) From step 6 on (learned from 2 steps or more; steps 1-2 are warm-up), the corrected
    prediction removes more than half of the profiled one's error (median measured / predicted, in log terms; the profiled one
    misses the drift). Measured in six runs on a loaded 2-core machine: measured / corrected
    0.74-1.06, measured / profiled 2.2-3.2 (the load moves both runs' early steps, which the
    correction still remembers)."""
    metrics, _ = runs["drift"]
    late = metrics[metrics["step"] >= 6]
    corrected = float(np.median(late["step_s"] / late["corrected_step_s"]))
    profiled = float(np.median(late["step_s"] / late["predicted_step_s"]))
    assert profiled > 1.6 and 0.6 < corrected < 1.6, (corrected, profiled)
    assert abs(np.log(corrected)) < 0.5 * abs(np.log(profiled)), (corrected, profiled)
    assert metrics["corrected_step_s"].iloc[:2].isna().all()  # nothing learned yet (steps 1-2 are warm-up)


@pytest.mark.distributed
def test_partitions_change_where_the_gate_turns_the_correction_on(runs):
    """(c) Same batches and seeds: a step's partition is a pure function of the costs it was solved
    with, and ``predicted_step_s`` (the partition priced as profiled) fingerprints it. Steps where
    neither run's gate was on (and no solve fell back) have the same partition in both runs; the
    drift run's gate turns on, and there the partition differs from the run without the drift (whose
    own gate may be on too, for the machine's natural drift: then both are corrected, differently)."""
    plain, _ = runs["plain"]
    drift, _ = runs["drift"]
    both = plain.merge(drift, on="step", suffixes=("_plain", "_drift"))
    solved = ~both["member_plain"].str.startswith("fallback") & ~both["member_drift"].str.startswith("fallback")
    off = solved & ~both["correction_active_plain"] & ~both["correction_active_drift"]
    assert off.sum() >= 3
    np.testing.assert_array_equal(both.loc[off, "predicted_step_s_plain"], both.loc[off, "predicted_step_s_drift"])
    on = solved & both["correction_active_drift"]
    if not on.any():  # the gate weighs one batch's gain against the tracking cost: under heavy machine
        # load it can stay off for all 12 steps (seen once in CI beside a busy loop); then there is
        # no corrected partition to compare, and (a) and (b) above carry the test
        pytest.skip("the drift run's cost-benefit gate stayed off in this run: no corrected partition to compare")
    assert (both.loc[on, "predicted_step_s_plain"] != both.loc[on, "predicted_step_s_drift"]).any()
