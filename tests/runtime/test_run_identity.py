"""Run identity: which changes make a checkpoint another run's, and what a re-run then does."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from dflop.config import Config, deep_merge
from dflop.plan import plan_from_dict
from dflop.runtime.checkpoint import COMPLETE_MARKER, FORMAT_VERSION, TRAIN_STATE_FILE, latest_run_record
from dflop.runtime.optim import warmup_cosine
from dflop.runtime.run_identity import (
    PREVIOUS_RUNS_DIR,
    RunFingerprint,
    decide,
    pool_identity,
    prepare_checkpoints,
    run_fingerprint,
    weights_identity,
)
from dflop.runtime.settings import TrainSettings

PLAN = {"vision": {"tp": 1, "pp": 1, "dp": 1, "layers_per_stage": [2]},
        "llm": {"tp": 1, "pp": 1, "dp": 1, "layers_per_stage": [2]},
        "placement": "disjoint", "microbatches": 2, "global_batch_size": 4, "world_size": 2}


def _pool(ids=("a", "b", "c", "d"), seq=(10, 20, 30, 40)) -> pd.DataFrame:
    return pd.DataFrame({"sample_id": list(ids), "dataset": ["demo"] * len(ids), "n_tiles": [0, 1, 2, 0][:len(ids)],
                         "vision_tokens": [0, 5, 10, 0][:len(ids)], "seq_len": list(seq), "status": ["ok"] * len(ids)})


BASE = {"data": {"datasets": [{"name": "demo", "path": "/data/demo.json"}]}, "train": {"steps": 6}}


def _settings(changes: dict | None = None, **flags) -> TrainSettings:
    """The settings of the BASE config with `changes` (config sections) laid over it."""
    return TrainSettings.from_config(Config.from_dict(deep_merge(BASE, changes or {})), **flags)


def _fp(settings=None, plan=None, pool=None) -> RunFingerprint:
    return run_fingerprint(settings or _settings(), plan_from_dict(plan or PLAN).plan, _pool() if pool is None else pool)


def lr(step: int, total: int) -> float:
    return 1e-3 * warmup_cosine(step, total_steps=total, warmup_steps=2, min_lr_ratio=0.1)


# -- what the fingerprint covers -------------------------------------------------------------------

def _section(key: str, value) -> dict:
    """{"train": {"lr": value}} from "train.lr"."""
    *path, last = key.split(".")
    out = {last: value}
    for name in reversed(path):
        out = {name: out}
    return out


@pytest.mark.parametrize("key, change", [
    ("train.lr", _section("train.lr", 2e-3)),
    ("train.warmup_steps", _section("train.warmup_steps", 3)),
    ("train.weight_decay", _section("train.weight_decay", 0.1)),
    ("train.grad_clip", _section("train.grad_clip", 0.5)),
    ("train.min_lr_ratio", _section("train.min_lr_ratio", 0.0)),
    ("train.global_batch_size", _section("train.global_batch_size", 8)),
    ("run.seed", _section("run.seed", 1)),
    ("model.llm", _section("model.llm", "llama3-tiny")),
    ("model.vision", _section("model.vision", "siglip-small")),
    ("model.dtype", _section("model.dtype", "bfloat16")),
    ("model.freeze", _section("model.freeze.vision", True)),
    ("model.tokenizer", _section("model.tokenizer", "/tok")),
    ("model.llava_ov", _section("model.llava_ov.video_frames", 16)),
    ("scheduler.policy", _section("scheduler.policy", "baseline")),
    ("scheduler.pad_to_longest", _section("scheduler.pad_to_longest", True)),
    ("data.datasets", {"data": {"datasets": [{"name": "demo", "path": "/data/demo.json", "sample": "first:2"}]}}),
    ("data.datasets", {"data": {"datasets": [{"name": "demo", "path": "/data/demo.json", "weight": 2.0}]}}),
])
def test_each_setting_that_defines_the_run_is_named_when_it_changes(key, change):
    assert _fp(_settings(change)).differences(_fp()) == [key]
    assert _fp(_settings(change)).run_id != _fp().run_id


@pytest.mark.parametrize("change", [_section("train.steps", 12), _section("scheduler.budget_ms", 5.0),
                                    _section("scheduler.prefetch", 4), _section("train.loader_workers", 2),
                                    _section("train.overlap_grad_sync", False), _section("train.checkpoint_every", 1),
                                    _section("train.schedule", "gpipe"), _section("data.max_skip_frac", 0.5),
                                    _section("cluster.gpu_memory_gb", 80), _section("train.trace_steps", [1, 2])])
def test_speed_settings_and_the_length_keep_the_run(change):
    assert _fp(_settings(change)).differences(_fp()) == []
    assert _fp(_settings(change)).run_id == _fp().run_id
    assert _fp(_settings(adaptive_correction=False)).run_id == _fp().run_id


def test_dataset_content_defines_the_run_not_where_it_lies(tmp_path):
    a, b, edited = tmp_path / "a" / "demo.json", tmp_path / "b" / "demo.json", tmp_path / "edited.json"
    for path, answer in ((a, "yes"), (b, "yes"), (edited, "no")):
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps([{"id": "s", "conversations": [{"from": "human", "value": "q"},
                                                                  {"from": "gpt", "value": answer}]}]))

    def with_manifest(path):
        return _fp(_settings({"data": {"datasets": [{"name": "demo", "path": str(path)}]}}))

    assert with_manifest(b).differences(with_manifest(a)) == []      # moved: the same run
    assert with_manifest(edited).differences(with_manifest(a)) == ["data.datasets"]  # same shapes, other text
    parts = tmp_path / "parquet"
    parts.mkdir()
    pd.DataFrame({"id": ["s"], "conversations": ["x"]}).to_parquet(parts / "part-0.parquet")
    before = with_manifest(parts)
    pd.DataFrame({"id": ["s"], "conversations": ["y" * 50]}).to_parquet(parts / "part-0.parquet")
    assert with_manifest(parts).differences(before) == ["data.datasets"]


def test_the_layout_and_the_data_define_the_run():
    other_split = {**PLAN, "llm": {**PLAN["llm"], "pp": 2, "layers_per_stage": [1, 1]}, "world_size": 3}
    assert _fp(plan=other_split).differences(_fp()) == ["plan"]
    half = _pool().head(2)
    assert _fp(pool=half).differences(_fp()) == ["data.shapes"]
    reordered = _pool().iloc[::-1].reset_index(drop=True)  # the same samples in another order: other batches
    assert pool_identity(reordered) != pool_identity(_pool())
    longer = _pool(seq=(10, 20, 30, 41))
    assert pool_identity(longer) != pool_identity(_pool())
    assert pool_identity(_pool().copy()) == pool_identity(_pool())


@pytest.mark.parametrize("column,value", [("n_tiles", 3), ("vision_tokens", 15), ("seq_len", 21),
                                          ("sample_id", "z"), ("dataset", "other")])
def test_every_shape_column_of_one_sample_defines_the_run(column, value):
    """A step's batches are partitioned by each sample's tiles, vision tokens and length, and name
    their samples by dataset and id: one sample's value changed in any of these is another run
    (the columns written out here, not read from `POOL_COLUMNS`)."""
    changed = _pool()
    changed.loc[1, column] = value
    assert _fp(pool=changed).differences(_fp()) == ["data.shapes"]


def test_memory_techniques_that_keep_the_maths_keep_the_run():
    """Recomputation and sequence parallelism trade memory for time (same maths): a run that turns
    them on resumes. A sharded optimizer changes what the checkpoint holds: another run. A plan
    with every technique off fingerprints as a plan written before the keys existed, so such
    checkpoints still resume."""
    recompute = {**PLAN, "llm": {**PLAN["llm"], "recompute": ["full"]},
                 "vision": {**PLAN["vision"], "recompute": ["selective"]}}
    assert _fp(plan=recompute).differences(_fp()) == []
    replicated = {**PLAN, "llm": {**PLAN["llm"], "dp": 2}, "world_size": 3}  # sharding needs replicas
    sharded = {**replicated, "llm": {**replicated["llm"], "shard_optimizer": True}}
    assert _fp(plan=sharded).differences(_fp(plan=replicated)) == ["plan"]
    layout = _fp().fields["plan"]
    assert set(layout["llm"]) == {"tp", "pp", "dp", "layers_per_stage"} == set(layout["vision"])
    # The LLM's pipeline schedule: 1F1B (plan.yaml writes it now) is the run of a plan without the
    # keys; another schedule is another run (interleaving holds the LLM as more, smaller modules).
    piped = {**PLAN, "llm": {**PLAN["llm"], "pp": 2, "layers_per_stage": [1, 1]}, "world_size": 3}
    assert _fp(plan={**piped, "llm": {**piped["llm"], "schedule": "1f1b", "chunks": 1}}).differences(
        _fp(plan=piped)) == []
    assert _fp(plan={**piped, "llm": {**piped["llm"], "schedule": "zb-h1", "chunks": 1}}).differences(
        _fp(plan=piped)) == ["plan"]


def test_a_fingerprint_read_back_from_json_is_the_same_run():
    fp = _fp(_settings({"model": {"arch": "internvl", "vision": "internvit-tiny"}}))
    back = RunFingerprint.from_json(json.loads(json.dumps(fp.to_json())))
    assert back is not None and back.differences(fp) == [] and back.run_id == fp.run_id and back.steps == 6
    assert RunFingerprint.from_json({"version": 0}) is None and RunFingerprint.from_json(None) is None


def test_weights_identity_sees_a_changed_tensor_value(tmp_path):
    import torch
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text("{}")
    save_file({"w": torch.zeros(64, 64)}, tmp_path / "model.safetensors")
    before = weights_identity(str(tmp_path))
    save_file({"w": torch.zeros(64, 64).index_fill_(0, torch.tensor([31]), 1.0)}, tmp_path / "model.safetensors")
    assert weights_identity(str(tmp_path)) != before
    assert weights_identity(None) is None
    import shutil

    shutil.copytree(tmp_path, tmp_path.with_name(tmp_path.name + "_moved"))
    assert weights_identity(str(tmp_path.with_name(tmp_path.name + "_moved"))) == weights_identity(str(tmp_path))


# -- the decision ----------------------------------------------------------------------------------

def test_same_run_resumes_and_a_finished_one_is_only_republished():
    fp = _fp()
    assert decide(fp, fp, 4).resume and "resuming run" in decide(fp, fp, 4).message
    done = decide(fp, fp, 6)
    assert done.resume and "already complete at step 6" in done.message
    assert not decide(fp, None, None).resume  # nothing to resume


def test_a_changed_setting_starts_afresh_naming_the_key():
    decision = decide(_fp(_settings(_section("train.lr", 2e-3))), _fp(), 4)
    assert not decision.resume
    assert "train.lr (0.001 -> 0.002)" in decision.message


def test_more_steps_resume_on_the_stretched_schedule_and_says_the_lr():
    decision = decide(_fp(_settings(steps=12)), _fp(), 6, lr_at=lr)
    assert decision.resume and "train.steps 6 -> 12" in decision.message
    # Step 7 (index 6) of a 12-step cosine, not the 6-step schedule's floor.
    assert f"{lr(6, 12):.3g}" in decision.message and f"{lr(6, 6):.3g}" in decision.message
    assert lr(6, 12) > lr(6, 6)


def test_fewer_steps_than_the_checkpoint_fresh_flag_and_old_format_start_afresh():
    assert not decide(_fp(_settings(steps=3)), _fp(), 4).resume
    assert not decide(_fp(), _fp(), 4, fresh=True).resume
    old = decide(_fp(), None, 4)
    assert not old.resume and "older format" in old.message


# -- on disk ---------------------------------------------------------------------------------------

def _fake_checkpoint(root: Path, step: int, run: dict | None, fmt: int = FORMAT_VERSION) -> Path:
    d = root / f"step_{step:06d}"
    d.mkdir(parents=True)
    (d / TRAIN_STATE_FILE).write_text(json.dumps({"format": fmt, "step": step, "world_size": 2, "data_seed": 0,
                                                  "run": run, "extra": {}}))
    (d / COMPLETE_MARKER).write_text("{}")
    return d


def test_prepare_moves_another_runs_checkpoints_aside_and_keeps_them(tmp_path):
    ckpt = tmp_path / "checkpoints"
    _fake_checkpoint(ckpt, 2, _fp().to_json())
    _fake_checkpoint(ckpt, 4, _fp().to_json())
    (ckpt / "metrics.parquet").write_bytes(b"rows of the old run")
    assert latest_run_record(ckpt)[0] == 4

    decision = prepare_checkpoints(ckpt, _fp(_settings(_section("train.lr", 2e-3))))
    assert not decision.resume and not ckpt.exists()
    (moved,) = (tmp_path / PREVIOUS_RUNS_DIR).iterdir()
    assert moved.name.startswith(_fp().run_id) and str(moved) in decision.message
    assert sorted(p.name for p in moved.iterdir()) == ["metrics.parquet", "step_000002", "step_000004"]


def test_prepare_resumes_the_same_run_and_leaves_everything_in_place(tmp_path):
    ckpt = tmp_path / "checkpoints"
    _fake_checkpoint(ckpt, 2, _fp().to_json())
    decision = prepare_checkpoints(ckpt, _fp())
    assert decision.resume and (ckpt / "step_000002").exists()
    assert not (tmp_path / PREVIOUS_RUNS_DIR).exists()


def test_prepare_treats_an_older_format_checkpoint_as_another_run(tmp_path):
    ckpt = tmp_path / "checkpoints"
    _fake_checkpoint(ckpt, 2, _fp().to_json(), fmt=1)
    decision = prepare_checkpoints(ckpt, _fp())
    assert not decision.resume and "older format" in decision.message
    (moved,) = (tmp_path / PREVIOUS_RUNS_DIR).iterdir()
    assert (moved / "step_000002").exists()


def test_a_checkpoint_of_the_previous_format_is_moved_aside_never_resumed(tmp_path):
    """Format 2 (before the state_dict API) records this very run, yet its files are not this
    format's: one line says so and the run starts afresh."""
    ckpt = tmp_path / "checkpoints"
    _fake_checkpoint(ckpt, 2, _fp().to_json(), fmt=2)
    decision = prepare_checkpoints(ckpt, _fp())
    assert not decision.resume and not ckpt.exists()
    assert decision.message.startswith("the checkpoint at step 2 is of an older format")
    assert "\n" not in decision.message


def test_prepare_says_when_a_checkpoint_record_is_unreadable(tmp_path):
    ckpt = tmp_path / "checkpoints"
    _fake_checkpoint(ckpt, 2, _fp().to_json())
    (ckpt / "step_000002" / TRAIN_STATE_FILE).write_text("{not json")
    decision = prepare_checkpoints(ckpt, _fp())
    assert not decision.resume and f"has an unreadable {TRAIN_STATE_FILE}" in decision.message


def test_prepare_with_no_checkpoint_moves_nothing(tmp_path):
    ckpt = tmp_path / "checkpoints"
    (ckpt / "step_000002.tmp").mkdir(parents=True)  # a run killed in its first save
    decision = prepare_checkpoints(ckpt, _fp())
    assert not decision.resume and ckpt.exists() and not (tmp_path / PREVIOUS_RUNS_DIR).exists()
