"""Samples that fail to load during training: skipped on every rank alike, replaced, counted."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import torch

from dflop.data.training import LoadedSample, SampleError
from dflop.errors import UserError
from dflop.scheduler.online import StepPlan
from dflop.runtime.skipping import SkippedSamples, load_without_failures, replacement_rows
from gloo_ranks import run_ranks
from trainer_reference import TWO_RANK_PLAN, config_dict


def test_replacements_are_new_loadable_samples_and_reproducible():
    batch = [4, 9, 1, 7]
    rows = replacement_rows(20, batch, [1, 3], excluded={2, 9, 7, 11}, seed=5, step=3)
    assert [rows[0], rows[2]] == [4, 1]  # untouched positions keep their samples
    for k in (1, 3):
        assert rows[k] not in {4, 1, 2, 9, 7, 11}  # neither in the batch nor skipped before
    assert rows[1] != rows[3]
    np.testing.assert_array_equal(rows, replacement_rows(20, batch, [1, 3], {2, 9, 7, 11}, seed=5, step=3))
    others = {tuple(replacement_rows(20, batch, [1], {9}, seed=5, step=s)) for s in range(8)}
    assert len(others) > 1  # each step draws its own replacements
    with pytest.raises(UserError, match="no loadable sample is left"):
        replacement_rows(5, [0, 1, 2, 3], [0], excluded={4}, seed=0, step=0)


def test_skip_budget_counts_distinct_samples_and_names_the_last():
    skipped = SkippedSamples.for_pool(300, 0.01)
    assert skipped.allowed == 3
    skipped.add([5], "sample demo/a: cannot decode image")
    skipped.add([5], "sample demo/a: cannot decode image")  # the same sample again, a later epoch
    skipped.add([6, 7], "sample demo/c: cannot decode video")
    with pytest.raises(UserError, match=r"4 samples failed .* allows \(3\); the last: sample demo/d: bad"):
        skipped.add([8], "sample demo/d: bad")
    restored = SkippedSamples.for_pool(300, 0.01)
    restored.load_state_dict(json.loads(json.dumps(skipped.state_dict())))
    assert restored.rows == {5, 6, 7, 8}
    assert SkippedSamples.for_pool(8, 0.0).allowed == 0


def _plan(step: int, rows) -> StepPlan:
    rows = tuple(int(r) for r in rows)
    n = len(rows)
    return StepPlan(step=step, rows=rows, n_tiles=(0,) * n, seq_len=(1,) * n, feature_rows=(0,) * n,
                    bins=((tuple(range(n)),),), vision_shares=(((),),), microbatch_ids=(0,))


def _skip_protocol_worker(rank: int, out: str, unreadable: dict, fatal_rank: int | None) -> None:
    """Rank r loads the batch positions k with k % world == r (as pipeline ranks load different
    parts); `unreadable` maps pool rows to the rank that cannot read them. Records what every
    rank ends with."""
    import torch.distributed as dist

    world = dist.get_world_size()

    def reload(plan):
        if fatal_rank == rank:
            raise SampleError("sample demo/x: the trainer builds 3 tokens but shapes.parquet says 4")
        return {row: LoadedSample(row, error=f"sample demo/{row}: unreadable" if unreadable.get(row) == rank else None)
                for k, row in enumerate(plan.rows) if k % world == rank}

    skipped = SkippedSamples.for_pool(20, 0.5)
    start = _plan(3, [0, 1, 2, 3])
    try:
        plan, loaded, n = load_without_failures(
            start, lambda: reload(start), skipped=skipped, describe=str,
            replan=lambda p, rows: _plan(p.step, rows), reload=reload, device=torch.device("cpu"), n_pool=20, seed=7)
        result = {"rows": list(plan.rows), "skipped": n, "skipped_rows": sorted(skipped.rows)}
    except Exception as exc:  # noqa: BLE001 — what each rank raised is the result
        result = {"raised": type(exc).__name__, "message": str(exc)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.distributed
def test_every_rank_drops_the_same_samples_and_replacements_that_fail_too(tmp_path):
    from test_checkpoint_helpers import spawn

    # Row 1 (position 1: only rank 1 loads it) is unreadable; its replacement, drawn from
    # (seed 7, step 3), is unreadable too, so a second round has to replace it again. Rank 0
    # never sees a failure itself.
    first = int(replacement_rows(20, [0, 1, 2, 3], [1], {1}, seed=7, step=3)[1])
    spawn(_skip_protocol_worker, 2, tmp_path, str(tmp_path), {1: 1, first: 1}, None)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1], results
    second = int(replacement_rows(20, [0, first, 2, 3], [1], {1, first}, seed=7, step=3)[1])
    assert results[0] == {"rows": [0, second, 2, 3], "skipped": 2, "skipped_rows": sorted({1, first})}


@pytest.mark.distributed
def test_a_load_error_that_is_not_one_samples_fault_stops_every_rank(tmp_path):
    from test_checkpoint_helpers import spawn

    spawn(_skip_protocol_worker, 2, tmp_path, str(tmp_path), {}, 1)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[1] == {"raised": "SampleError", "message": "sample demo/x: the trainer builds 3 tokens but "
                                                              "shapes.parquet says 4"}
    assert results[0] == {"raised": "UserError", "message": results[1]["message"]}  # not left waiting


def _corrupt_first_image(pool_path: str, manifest: Path) -> str:
    """Cut the first image sample's file of the pool to its first 200 bytes (a header a reader may
    still parse, no pixels); returns the sample's id."""
    pool = pd.read_parquet(pool_path)
    sample_id = pool[pool["modality"] == "image"]["sample_id"].iat[0]
    entry = next(s for s in json.loads(manifest.read_text()) if s["id"] == sample_id)
    image = manifest.parent / entry["image"]
    image.write_bytes(image.read_bytes()[:200])
    return sample_id


def _launch(tmp_path: Path, name: str, settings: dict, plan: Path, pool: str) -> subprocess.CompletedProcess:
    out = tmp_path / name
    return subprocess.run([sys.executable, "-m", "dflop.cli", "train", "--settings", json.dumps(settings),
                           "--plan", str(plan), "--shapes", pool, "--out-dir", str(out), "--no-export"],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.distributed
@pytest.mark.slow
def test_an_unloadable_sample_is_skipped_on_every_rank_and_past_the_budget_stops_the_run(tmp_path, pools,
                                                                                       runtime_demo):
    demo = tmp_path / "demo"
    shutil.copytree(runtime_demo.parent, demo)
    manifest = demo / runtime_demo.name
    bad_id = _corrupt_first_image(pools["llava_ov"], manifest)  # profiled while it was fine
    plan = tmp_path / "plan.yaml"  # vision and LLM on different ranks: only the vision rank decodes pixels
    plan.write_text(TWO_RANK_PLAN)
    # 8 samples, batches of 4: the two steps cover every sample once.
    settings = config_dict("llava_ov", manifest, train={"global_batch_size": 4, "steps": 2, "checkpoint_every": 2},
                           data={"max_skip_frac": 0.2})

    # The ranks as `dflop train` starts them (forked: a launch costs fresh interpreters); the
    # launcher itself runs the stopped run below, whose one-line error is the launcher's to print.
    ok = run_ranks("-m dflop.cli", "train", "--settings", json.dumps(settings), "--plan", plan, "--shapes",
                   pools["llava_ov"], "--out-dir", tmp_path / "ok", "--no-export", nproc=2)
    assert f"skipping sample demo/{bad_id}: " in ok.stderr  # the reason, from the rank that decoded it
    assert f"replaced demo/{bad_id} by demo/" in ok.stderr
    metrics = pd.read_parquet(tmp_path / "ok" / "metrics.parquet")
    assert metrics["skipped_samples"].tolist() in ([1, 0], [0, 1])
    assert (metrics["samples"] == 4).all()  # the batch kept its size

    settings["data"]["max_skip_frac"] = 0.0
    stopped = _launch(tmp_path, "stopped", settings, plan, pools["llava_ov"])
    assert stopped.returncode == 2
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith("dflop train: 1 samples failed to load during training, more than data.max_skip_frac "
                           f"allows (0); the last: sample demo/{bad_id}: "), last
    assert not (tmp_path / "stopped" / "metrics.parquet").exists()


COLOCATED_DP2_PLAN = ("vision: {tp: 1, pp: 1, dp: 2, layers_per_stage: [2]}\n"
                      "llm: {tp: 1, pp: 1, dp: 2, layers_per_stage: [2]}\n"
                      "placement: colocated\nmicrobatches: 2\nglobal_batch_size: 4\nworld_size: 2\n")


@pytest.mark.distributed
@pytest.mark.slow
def test_a_rank_that_computed_before_the_agreement_drops_that_work(tmp_path, pools, runtime_demo):
    """Colocated, dp 2: each sample is loaded by one rank only, so on CPU (each step loads its own
    samples) the other rank computes its microbatches before it learns that a sample failed
    (`Trainer.gradients`). It must drop that work: the run trains exactly like the disjoint run,
    where both ranks load the failing image and so never compute before the agreement."""
    demo = tmp_path / "demo"
    shutil.copytree(runtime_demo.parent, demo)
    manifest = demo / runtime_demo.name
    bad_id = _corrupt_first_image(pools["llava_ov"], manifest)
    settings = config_dict("llava_ov", manifest, train={"global_batch_size": 4, "steps": 2, "checkpoint_every": 2,
                                                        "trace_steps": [1, 2]},
                           data={"max_skip_frac": 0.2})
    runs = {}
    for name, text in (("colocated", COLOCATED_DP2_PLAN), ("disjoint", TWO_RANK_PLAN)):
        plan = tmp_path / f"{name}.yaml"
        plan.write_text(text)
        # The ranks as `dflop train` starts them (the launcher itself is the test above's).
        done = run_ranks("-m dflop.cli", "train", "--settings", json.dumps(settings), "--plan", plan, "--shapes",
                         pools["llava_ov"], "--out-dir", tmp_path / name, "--no-export", nproc=2)
        assert f"replaced demo/{bad_id} by demo/" in done.stderr
        runs[name] = pd.read_parquet(tmp_path / name / "metrics.parquet")
    colocated, disjoint = runs["colocated"], runs["disjoint"]
    assert colocated["skipped_samples"].tolist() == disjoint["skipped_samples"].tolist()
    np.testing.assert_allclose(colocated["loss"], disjoint["loss"], rtol=1e-5)
    np.testing.assert_allclose(colocated["grad_norm"], disjoint["grad_norm"], rtol=1e-4)
    # The colocated run did compute before the agreement: the rank that did shows that work voided
    # (re-filed as data spans, so the step's ops are only those of the rerun), the other none.
    step = int(colocated.loc[colocated["skipped_samples"] > 0, "step"].iat[0])
    events = [e for e in json.loads((tmp_path / "colocated" / "trace.json").read_text())["traceEvents"]
              if e.get("ph") == "X" and e.get("args", {}).get("step") == step]
    voided = {e["pid"] for e in events if e["name"].startswith("voided") and e["cat"] == "data"}
    assert len(voided) == 1, sorted({(e["pid"], e["name"]) for e in events})
    rank = voided.pop()
    replaced = min(e["ts"] for e in events if e["pid"] == rank and e["name"] == "replacing failed samples")
    assert all(e["ts"] > replaced for e in events if e["pid"] == rank and e["cat"] == "forward")
