"""`snakemake --profile <slurm test profile> train` on a real (local) Slurm cluster: every rule is an
sbatch job that Slurm ran to completion, the train rule is one job on both nodes with a torchrun
agent per node, and metrics.parquet has every step."""

import re
import subprocess

import pandas as pd
import pytest
import yaml

from slurm_testlib import NODES, env, executed_rules, hostnames, scontrol_job, snakemake_command, step_nodes, \
    submissions, tail

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_every_rule_output_exists_and_nothing_is_left_to_do(slurm_chain):
    workdir = slurm_chain.workdir
    summary = subprocess.run([*snakemake_command("--summary", slurm_chain.target)], cwd=workdir, env=env(),
                             capture_output=True, text=True, check=True).stdout
    rows = [line.split("\t") for line in summary.splitlines() if "\t" in line][1:]  # after the header
    rules = {row[2] for row in rows}
    assert {"make_demo_data", "profile_data", "profile_model", "fit", "optimize"} <= rules
    for output, _date, rule, _log, status, plan in rows:
        assert (workdir / output).exists(), f"{rule}: {output} missing"
        assert status == "ok" and plan == "no update", f"{rule}: {output}: {status}, {plan}"
    dry = subprocess.run([*snakemake_command("--dry-run", slurm_chain.target)], cwd=workdir, env=env(),
                         capture_output=True, text=True, check=True)
    assert "Nothing to be done" in dry.stdout + dry.stderr


def test_sbatch_ran_every_rule(slurm_chain):
    remote, local = executed_rules(slurm_chain.output)
    assert not local, f"rules run outside Slurm: {sorted(local)}"
    jobs = submissions(slurm_chain.output)
    assert sorted(j.rule for j in jobs) == sorted(remote), "one sbatch per rule"
    for job in jobs:
        info = scontrol_job(job.job_id)
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (job, info)
        assert info["WorkDir"] == str(slurm_chain.workdir)
        assert info["Comment"] == f"rule_{job.rule}"
        assert info["StdOut"] == str(job.log)
        log = job.log.read_text()
        # The job step re-ran Snakemake for exactly this rule, on a node of the test cluster.
        assert re.search(rf"^rule {job.rule}:", log, re.M), tail(job.log)
        assert set(hostnames(info["NodeList"])) <= set(NODES)


def test_train_is_one_job_on_both_nodes_with_an_agent_per_node(slurm_chain):
    if slurm_chain.target != "train":
        pytest.skip("train rule not yet in workflow")
    (train,) = [j for j in submissions(slurm_chain.output) if j.rule == "train"]
    info = scontrol_job(train.job_id)
    assert info["NumNodes"] == "2" and sorted(hostnames(info["NodeList"])) == sorted(NODES), info
    # Snakemake runs the rule in step 0 on the first node; the launcher's srun is a step with a task on
    # every node (one torchrun agent each), as the slurmd of each node logged.
    steps = step_nodes(train.job_id)
    assert any(nodes == set(NODES) for nodes in steps.values()), f"steps and their nodes: {steps}"
    log = (slurm_chain.workdir / "logs/train.log").read_text()
    assert re.search(r"--nnodes 2 --rdzv-backend c10d --rdzv-endpoint dflop-node1:\d+", log), log[:2000]


def test_metrics_have_every_step_once(slurm_chain):
    if slurm_chain.target != "train":
        pytest.skip("train rule not yet in workflow")
    workdir = slurm_chain.workdir
    steps = yaml.safe_load((workdir / "config/config.yaml").read_text())["train"]["steps"]
    metrics = pd.read_parquet(workdir / "results/train/metrics.parquet")
    assert metrics["step"].tolist() == list(range(1, steps + 1))
    assert metrics["loss"].notna().all() and (metrics["step_s"] > 0).all()
    assert (workdir / "results/train/final").is_dir()
