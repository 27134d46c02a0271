"""After a demo run, a changed setting re-run through Snakemake trains what it should.

On a copy of the session's demo run: which rules Snakemake re-runs (a dry run of the target a user
would type) for a changed learning rate, the LLM and the dataset, and one real re-run: train.steps
(the same run, longer), which resumes although Snakemake deletes the train rule's outputs before
the job (the checkpoints live outside them), keeping the earlier steps' rows.

What the trainer does on each change is tested in one launch by tests/runtime/test_reruns.py: a
changed LR or dataset starts afresh from the same initial weights, naming the key, and moves the
old checkpoints to previous_runs/ (nothing is deleted); an LLM change starts afresh where a resume
used to crash on a missing tensor. tests/runtime/test_run_identity.py names data.datasets when a
manifest's content changes. Training runs only target `train`: the dry runs show that the baseline
and the figures follow a retrain.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml

from workflow_run import REPO, run_snakemake

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _configfile(workdir: Path, name: str, change) -> str:
    config = yaml.safe_load((workdir / "config/config.yaml").read_text())
    change(config)
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


def _rules(out) -> set[str]:
    """The rules a Snakemake run (or dry run) lists as jobs."""
    return {line.split()[1].rstrip(":") for line in (out.stdout + out.stderr).splitlines()
            if line.startswith(("rule ", "localrule "))} - {"all"}


def _would_run(workdir: Path, configfile: str, target: str) -> set[str]:
    """The rules `snakemake --dry-run target` with `configfile` would run."""
    return _rules(run_snakemake(workdir, "--profile", str(REPO / "profiles/local"), "--cores", "2", "--dry-run",
                                target, "--configfile", configfile))


def _rerun(workdir: Path, configfile: str, target: str = "train") -> tuple[set[str], pd.DataFrame, str, list[str]]:
    """Re-run `target` with `configfile`; (rules run, metrics.parquet, train log, previous runs)."""
    out = run_snakemake(workdir, "--profile", str(REPO / "profiles/local"), "--cores", "2", target,
                        "--configfile", configfile)
    ran = _rules(out)
    previous = workdir / "results/train/previous_runs"
    return (ran, pd.read_parquet(workdir / "results/train/metrics.parquet"), (workdir / "logs/train.log").read_text(),
            sorted(p.name for p in previous.iterdir()) if previous.exists() else [])


def test_changed_settings_retrain_as_they_should(demo_workdir, tmp_path):
    workdir = tmp_path / "demo"
    shutil.copytree(demo_workdir, workdir)
    first = pd.read_parquet(workdir / "results/train/metrics.parquet")
    assert first["step"].tolist() == [1, 2, 3] and first["run_id"].nunique() == 1
    run_a = first["run_id"].iat[0]
    # The demo compares with the HF Trainer: the data-blind baseline trained beside a second run of
    # the plan, on the same global batches (same tokens, same loss from the same initial weights);
    # the summary names both measured speedups (step 3 is the one after the warm-up).
    base = pd.read_parquet(workdir / "results/train_baseline/metrics.parquet")
    beside = pd.read_parquet(workdir / "results/head_to_head/plan/metrics.parquet")
    hf = pd.read_parquet(workdir / "results/head_to_head/hf/metrics.parquet")
    assert base["step"].tolist() == beside["step"].tolist() == hf["step"].tolist() == [1, 2, 3]
    assert (base["member"] == "megatron").all()
    assert base["tokens"].tolist() == beside["tokens"].tolist()
    assert base["loss"].tolist() == pytest.approx(beside["loss"].tolist(), rel=1e-4)
    assert (hf["samples"] == 16).all()  # train.global_batch_size per HF step
    summary = yaml.safe_load((workdir / "results/summary.yaml").read_text())
    assert summary["steps"] == [3] and summary["hf_trainer"]["steps"] == [3]
    lines = (workdir / "results/summary.txt").read_text().splitlines()
    assert lines == summary["lines"] and len(lines) == 4
    assert lines[0].startswith("measured speedup of the plan over the data-blind baseline: ")
    assert lines[-1].startswith("measured speedup of the plan over the Hugging Face Trainer (padded, group_by_length): ")

    # Turning the comparison off re-runs the baseline alone (and what reads it), not the training.
    off = _configfile(workdir, "off", lambda c: c["train"].update(compare_with_hf_trainer=False))
    assert _would_run(workdir, off, "all") == {"train_baseline", "summary", "plot_summary"}

    lr_config = _configfile(workdir, "lr", lambda c: c.setdefault("train", {}).update(lr=2e-3))
    assert _would_run(workdir, lr_config, "all") == {"train", "train_baseline", "summary", "plot_training",
                                                     "plot_summary", "plot_timeline"}

    # The same run, longer: Snakemake deletes metrics.parquet before the job; the resumed run
    # restores the earlier steps' rows from its checkpoint and moves nothing aside.
    steps_config = _configfile(workdir, "steps", lambda c: c["train"].update(steps=4))
    ran, longer, log, previous = _rerun(workdir, steps_config)
    assert ran == {"train"}
    assert longer["step"].tolist() == [1, 2, 3, 4] and (longer["run_id"] == run_a).all()
    pd.testing.assert_frame_equal(longer.iloc[:3].reset_index(drop=True), first, check_dtype=False)
    assert f"train.steps 3 -> 4: resuming run {run_a} at step 3" in log and previous == []

    # Another LLM: the model stages, the fit, the plan and the training, not the data stages
    # (the load line is re-timed: the LLM's vocabulary is part of how the loader tokenises).
    llm_config = _configfile(workdir, "llm", lambda c: c["model"].update(llm="llama3-tiny"))
    assert _would_run(workdir, llm_config, "train") == {"profile_model", "profile_loading", "fit", "optimize",
                                                        "train"}
    # Another dataset: the data stages, the load line, the fit, the plan and the training.
    data_config = _configfile(workdir, "data", lambda c: c["data"]["demo"].update(n_samples=50))
    assert _would_run(workdir, data_config, "train") == {"make_demo_data", "profile_data", "profile_loading", "fit",
                                                         "optimize", "train"}
