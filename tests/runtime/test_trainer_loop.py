"""The training loop: metrics rows, checkpoints, final export, and kill-and-resume.

A run stopped after step 3 (its last checkpoint is after step 2) and re-run must end with the same
parameters as an uninterrupted run, and its metrics.parquet must have each step exactly once with
the same losses (the loss curve continues the interrupted one).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from dflop.models.builder import build_model
from dflop.runtime.safe_dcp import SafeFileSystemReader
from trainer_reference import TWO_RANK_PLAN, config_dict
from gloo_ranks import run_ranks

WORKER = Path(__file__).with_name("resume_worker.py")
DESIGN_COLUMNS = ["step", "loss", "step_s", "samples", "tokens", "tflops", "idle_frac", "sched_ms", "sched_gap",
                  "predicted_step_s"]


@pytest.mark.distributed
@pytest.mark.slow
def test_killed_run_resumes_to_the_same_parameters_and_metrics(tmp_path, demo_shapes, runtime_demo):
    plan = tmp_path / "plan.yaml"
    plan.write_text(TWO_RANK_PLAN)
    config = config_dict("llava_ov", runtime_demo, train={"global_batch_size": 4, "steps": 4, "checkpoint_every": 2,
                                                          "warmup_steps": 1, "lr": 1e-3})
    spec = {"config": config, "plan": str(plan), "shapes": str(demo_shapes["llava_ov"]),
            "full": str(tmp_path / "full"), "resumed": str(tmp_path / "resumed"), "stop_after": 3}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    run_ranks(WORKER, tmp_path / "spec.json", nproc=2, timeout=600)

    full = pd.read_parquet(tmp_path / "full" / "metrics.parquet")
    resumed = pd.read_parquet(tmp_path / "resumed" / "metrics.parquet")
    assert list(full.columns[:len(DESIGN_COLUMNS)]) == DESIGN_COLUMNS
    assert {"busy_s_vision0", "idle_s_vision0", "busy_s_llm0", "idle_s_llm0"} <= set(full.columns)
    assert full["step"].tolist() == resumed["step"].tolist() == [1, 2, 3, 4]
    assert (full["samples"] == 4).all() and (full["tokens"] > 0).all()
    assert ((full["idle_frac"] >= 0) & (full["idle_frac"] < 1)).all()
    # Same batches and the exact global-batch mean: equal losses however the scheduler split them.
    torch.testing.assert_close(torch.tensor(resumed["loss"].to_numpy()), torch.tensor(full["loss"].to_numpy()),
                               rtol=1e-5, atol=1e-6)
    assert full["loss"].iloc[-1] < full["loss"].iloc[0]

    steps = sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").glob("step_*"))
    assert steps == ["step_000002", "step_000004"]
    final_full = load_file(tmp_path / "full" / "final" / "model.safetensors")
    final_resumed = load_file(tmp_path / "resumed" / "final" / "model.safetensors")
    assert final_full.keys() == final_resumed.keys()
    for name, value in final_full.items():
        torch.testing.assert_close(final_resumed[name], value, rtol=1e-5, atol=1e-6, msg=name)
    # transformers loads the export; training moved the weights away from the seed-0 init.
    trained = dict(build_model("llava_ov", "siglip-tiny", "qwen2.5-tiny", weights_dir=tmp_path / "full" / "final")
                   .named_parameters())
    init = dict(build_model("llava_ov", "siglip-tiny", "qwen2.5-tiny", seed=0).named_parameters())
    moved = sum(not torch.equal(init[name], trained[name]) for name in init)
    assert moved > len(init) // 2, "training must change the weights"


COLOCATED_DP2 = ("vision: {{tp: {tp}, pp: 1, dp: 2, layers_per_stage: [2]{shard}}}\n"
                 "llm: {{tp: {tp}, pp: 1, dp: 2, layers_per_stage: [2]{shard}}}\n"
                 "placement: colocated\nmicrobatches: 2\nglobal_batch_size: 4\nworld_size: {world}\n")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_sharded_optimizer_trains_as_the_unsharded_one_and_resumes(tp, tmp_path, demo_shapes, runtime_demo):
    """shard_optimizer (FSDP2 over dp = 2, both modules on one rank; with tp = 2 over "dp" of a 2-D
    (dp, tp) mesh): 4 AdamW steps with clipping give the losses and final weights of the unsharded run
    (the reference, proven against transformers); a run killed after step 3 and re-run from the
    sharded checkpoint of step 2 ends the same."""
    world = 2 * tp
    (tmp_path / "sharded.yaml").write_text(COLOCATED_DP2.format(tp=tp, world=world, shard=", shard_optimizer: true"))
    (tmp_path / "plain.yaml").write_text(COLOCATED_DP2.format(tp=tp, world=world, shard=""))
    config = config_dict("llava_ov", runtime_demo, train={"global_batch_size": 4, "steps": 4, "checkpoint_every": 2,
                                                          "warmup_steps": 1, "lr": 1e-3, "grad_clip": 0.5})
    spec = {"config": config, "plan": str(tmp_path / "sharded.yaml"), "shapes": str(demo_shapes["llava_ov"]),
            "full": str(tmp_path / "full"), "resumed": str(tmp_path / "resumed"), "stop_after": 3,
            "reference_plan": str(tmp_path / "plain.yaml"), "reference": str(tmp_path / "reference")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    run_ranks(WORKER, tmp_path / "spec.json", nproc=world, timeout=600)

    losses = {run: torch.tensor(pd.read_parquet(tmp_path / run / "metrics.parquet")["loss"].to_numpy())
              for run in ("full", "resumed", "reference")}
    torch.testing.assert_close(losses["full"], losses["reference"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses["resumed"], losses["full"], rtol=1e-5, atol=1e-6)
    norms = {run: pd.read_parquet(tmp_path / run / "metrics.parquet")["grad_norm"].to_numpy() for run in losses}
    assert (norms["reference"] > 0.5).all()  # every step clips: a miscounted shard would change the weights
    np.testing.assert_allclose(norms["full"], norms["reference"], rtol=1e-5)
    finals = {run: load_file(tmp_path / run / "final" / "model.safetensors") for run in losses}
    # The sharded run's checkpoint holds each replica's half of the AdamW state (the plain one, one
    # copy), of each TP rank's rows of this column-parallel weight.
    key = "optimizer.state.model.language_model.layers.0.mlp.up_proj.weight.exp_avg"
    for run, halves in (("full", 2 * tp), ("reference", tp)):
        meta = SafeFileSystemReader(tmp_path / run / "checkpoints" / "step_000004").read_metadata()
        chunks = meta.state_dict_metadata[key].chunks
        assert len(chunks) == halves and sum(c.sizes[0] for c in chunks) == meta.state_dict_metadata[key].size[0]
    assert finals["full"].keys() == finals["reference"].keys() == finals["resumed"].keys()
    for name, value in finals["reference"].items():
        torch.testing.assert_close(finals["full"][name], value, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(finals["resumed"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    trained = dict(build_model("llava_ov", "siglip-tiny", "qwen2.5-tiny", weights_dir=tmp_path / "full" / "final")
                   .named_parameters())
    init = dict(build_model("llava_ov", "siglip-tiny", "qwen2.5-tiny", seed=0).named_parameters())
    assert sum(not torch.equal(init[name], trained[name]) for name in init) > len(init) // 2, "weights must move"


PP2_COLOCATED = ("vision: {{tp: 1, pp: 1, dp: 1, layers_per_stage: [2]}}\n"
                 "llm: {{tp: 1, pp: 2, dp: 1, layers_per_stage: {layers}{schedule}}}\n"
                 "placement: colocated\nmicrobatches: 4\nglobal_batch_size: 4\nworld_size: 2\n")


# plan.yaml's LLM lines of a schedule that is not plain 1F1B, trained against its 1F1B twin (layers [1, 1])
OTHER_SCHEDULES = {"interleaved": ("[0, 1, 1, 0]", ", schedule: interleaved, chunks: 2"),
                   "zb-h1": ("[1, 1]", ", schedule: zb-h1")}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("schedule", sorted(OTHER_SCHEDULES))
def test_plan_of_another_schedule_trains_as_1f1b_and_resumes(schedule, tmp_path, demo_shapes, runtime_demo):
    """Interleaved 1F1B (pp 2, v = 2 chunks per rank: embedding | layer 0 | layer 1 | head, the
    head's rank holding chunks 1 and 3) or ZB-H1 (pp 2, split backward): 4 AdamW steps with
    clipping give the losses, gradient norms and final weights of the same model under 1F1B
    (layers [1, 1]); a run killed after step 3 and re-run from the checkpoint of step 2 ends the
    same. Fails if a chunk's parameters are missing from the checkpoint or the optimizer (they would
    not resume or not train), or keyed by a chunk-local name; under ZB-H1 if a deferred W is lost
    or runs after the optimizer step, or a step's leftover W leaks into the next."""
    layers, keys = OTHER_SCHEDULES[schedule]
    (tmp_path / "other.yaml").write_text(PP2_COLOCATED.format(layers=layers, schedule=keys))
    (tmp_path / "1f1b.yaml").write_text(PP2_COLOCATED.format(layers="[1, 1]", schedule=""))
    config = config_dict("llava_ov", runtime_demo, train={"global_batch_size": 4, "steps": 4, "checkpoint_every": 2,
                                                          "warmup_steps": 1, "lr": 1e-3, "grad_clip": 0.5})
    spec = {"config": config, "plan": str(tmp_path / "other.yaml"), "shapes": str(demo_shapes["llava_ov"]),
            "full": str(tmp_path / "full"), "resumed": str(tmp_path / "resumed"), "stop_after": 3,
            "reference_plan": str(tmp_path / "1f1b.yaml"), "reference": str(tmp_path / "reference")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    run_ranks(WORKER, tmp_path / "spec.json", nproc=2, timeout=600)

    metrics = {run: pd.read_parquet(tmp_path / run / "metrics.parquet") for run in ("full", "resumed", "reference")}
    assert metrics["full"]["step"].tolist() == metrics["resumed"]["step"].tolist() == [1, 2, 3, 4]
    losses = {run: torch.tensor(m["loss"].to_numpy()) for run, m in metrics.items()}
    torch.testing.assert_close(losses["full"], losses["reference"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses["resumed"], losses["full"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["full"]["grad_norm"], metrics["reference"]["grad_norm"], rtol=1e-5)
    assert (metrics["full"]["predicted_step_s"] > 0).all()
    finals = {run: load_file(tmp_path / run / "final" / "model.safetensors") for run in metrics}
    assert finals["full"].keys() == finals["reference"].keys() == finals["resumed"].keys()
    # The two schedules sum a gradient's float32 terms in other orders (measured: weights apart by
    # up to 4e-6 after 4 steps, where AdamW turns a near-zero gradient's rounding noise into up to
    # lr of change); the resumed run repeats the uninterrupted one exactly.
    for name, value in finals["reference"].items():
        torch.testing.assert_close(finals["full"][name], value, rtol=1e-5, atol=2e-5, msg=name)
        torch.testing.assert_close(finals["resumed"][name], finals["full"][name], rtol=1e-5, atol=1e-6, msg=name)
