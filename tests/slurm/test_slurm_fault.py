"""Fault on Slurm: scancel the training job step mid-run, re-run the same snakemake command, and the
training resumes from the last checkpoint and finishes with every step exactly once."""

import re
import shutil
import subprocess
import time

import pandas as pd
import pytest
import yaml

from slurm_testlib import NODES, env, hostnames, run_snakemake, snakemake_command, tail, train_rule_exists

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS, CHECKPOINT_EVERY = 12, 4  # two checkpoints the kill can follow, each with steps after it


def _running_train_job() -> str | None:
    out = subprocess.run(["squeue", "-h", "-t", "running", "-o", "%i|%k"], env=env(), capture_output=True,
                         text=True).stdout
    jobs = [line.split("|")[0] for line in out.splitlines() if line.split("|")[1].strip() == "rule_train"]
    return jobs[0] if jobs else None


def _training_step(job_id: str) -> str | None:
    """The job step that runs on every node: the srun of the torchrun agents."""
    out = subprocess.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i|%N"], env=env(), capture_output=True,
                         text=True).stdout
    for line in out.splitlines():
        step, nodes = line.split("|")
        if re.fullmatch(rf"{job_id}\.\d+", step) and sorted(hostnames(nodes)) == sorted(NODES):
            return step
    return None


def _saved_rows(folder) -> pd.DataFrame:
    """The metrics rows the run saved before its checkpoints (MetricsWriter's part files)."""
    from dflop.runtime.metrics import PART_PREFIX
    parts = sorted(folder.glob(f"{PART_PREFIX}*.parquet"))
    return pd.concat([pd.read_parquet(p) for p in parts], ignore_index=True) if parts else pd.DataFrame({"step": []})


def _last_logged_step(log) -> int:
    """The last step rank 0 logged (its log line is written as the step ends)."""
    steps = re.findall(rf"step (\d+)/{STEPS} loss", log.read_text()) if log.exists() else []
    return int(steps[-1]) if steps else 0


def test_scancel_mid_run_then_rerun_resumes_from_the_checkpoint(slurm_chain, tmp_path):
    if not train_rule_exists():
        pytest.skip("train rule not yet in workflow")
    from dflop.runtime.checkpoint import complete_checkpoints  # torch: only when the test runs

    # The chain's working copy with its planned inputs, a longer training and no training output yet.
    workdir = tmp_path / "wc"
    shutil.copytree(slurm_chain.workdir, workdir, symlinks=True)
    shutil.rmtree(workdir / "results/train")
    shutil.rmtree(workdir / ".snakemake/slurm_logs", ignore_errors=True)
    config = yaml.safe_load((workdir / "config/config.yaml").read_text())
    config["train"].update(steps=STEPS, checkpoint_every=CHECKPOINT_EVERY)
    (workdir / "config/config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    ckpt = workdir / "results/train/checkpoints"
    saved_metrics = ckpt / "metrics"  # rows saved at each checkpoint, published at the end
    log = workdir / "logs/train.log"

    first = subprocess.Popen(snakemake_command("train"), cwd=workdir, env=env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    killed = None
    deadline = time.monotonic() + 600
    try:
        while killed is None and time.monotonic() < deadline and first.poll() is None:
            done = complete_checkpoints(ckpt)
            # Kill past a checkpoint, with steps done after it that the re-run must not lose or repeat.
            if done and done[-1][0] >= CHECKPOINT_EVERY and _last_logged_step(log) > done[-1][0]:
                job = _running_train_job()
                step = _training_step(job) if job else None
                if step:
                    subprocess.run(["scancel", step], env=env(), check=True)
                    killed = step
            time.sleep(0.2)
        output, _ = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert killed, f"training finished or stalled before it could be killed mid-run:\n{tail(workdir / 'logs/train.log')}"
    assert first.returncode != 0, f"snakemake succeeded although its train job step {killed} was cancelled:\n{output[-3000:]}"
    assert not (workdir / "results/train/metrics.parquet").exists()

    resume_step = complete_checkpoints(ckpt)[-1][0]
    assert CHECKPOINT_EVERY <= resume_step < STEPS
    before = _saved_rows(saved_metrics)
    kept = before[before["step"] <= resume_step].reset_index(drop=True)
    assert kept["step"].tolist() == list(range(1, resume_step + 1))

    rerun = run_snakemake(workdir, "train")  # the same command, again
    assert rerun.returncode == 0, rerun.stdout[-6000:]
    assert "has been submitted with SLURM jobid" in rerun.stdout
    metrics = pd.read_parquet(workdir / "results/train/metrics.parquet")
    assert metrics["step"].tolist() == list(range(1, STEPS + 1)), "lost or repeated step rows"
    # Rows up to the checkpoint are the first run's own (wall times never repeat), so training resumed
    # there instead of starting over; and the re-run's first step is the one after the checkpoint.
    pd.testing.assert_frame_equal(metrics[metrics["step"] <= resume_step].reset_index(drop=True)[kept.columns], kept)
    logged = [int(s) for s in re.findall(rf"step (\d+)/{STEPS} loss", (workdir / "logs/train.log").read_text())]
    assert logged == list(range(resume_step + 1, STEPS + 1)), logged
