"""Helpers for the Slurm end-to-end tests: the local cluster, a user's working copy, snakemake runs,
and what Slurm itself recorded about each job (scontrol, the slurmd logs)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from workflow_run import copy_checkout, smaller_demo

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = REPO / "tests/slurm/cluster.sh"
PROFILE = REPO / "tests/slurm/profile"
SLURM_DIR = Path(os.environ.get("DFLOP_SLURM_DIR", "/tmp/dflop-slurm"))  # as in cluster.sh
NODES = ("dflop-node1", "dflop-node2")
_SUBMITTED = re.compile(r"has been submitted with SLURM jobid (\d+) \(log: (\S+?)\)")


@dataclass(frozen=True)
class Submission:
    """One sbatch the Snakemake Slurm plugin made: the rule, the Slurm job id and its log file."""

    rule: str
    job_id: str
    log: Path


def env() -> dict:
    """Environment of a user who activated the project's environment and the test cluster."""
    out = dict(os.environ)
    out["PATH"] = f"{Path(sys.executable).parent}:{out['PATH']}:/usr/sbin:/sbin"  # rules call dflop/python
    out["SLURM_CONF"] = str(SLURM_DIR / "slurm.conf")
    return out


def train_rule_exists() -> bool:
    return any(re.search(r"^rule train:", p.read_text(), re.M) for p in (REPO / "workflow/rules").glob("*.smk"))


def working_copy(root: Path) -> Path:
    """A user's checkout with the tests' smaller demo (`smaller_demo`: what the chain does, not how
    long), planned for the test cluster's two nodes of one process each, so the train rule is a
    2-node job."""
    def two_nodes(config: dict) -> None:
        smaller_demo(config)
        config["cluster"].update(nodes=len(NODES), gpus_per_node=1)

    return copy_checkout(root, two_nodes)


def snakemake_command(*targets: str) -> list[str]:
    """What the user types: snakemake --profile <the test profile> TARGET."""
    return [sys.executable, "-m", "snakemake", "--profile", str(PROFILE), *targets]


def run_snakemake(workdir: Path, *targets: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    return subprocess.run(snakemake_command(*targets), cwd=workdir, env=env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


def submissions(output: str) -> list[Submission]:
    """Every Slurm submission reported in a snakemake run's output (the plugin names the rule in the log path)."""
    found = []
    for job_id, log in _SUBMITTED.findall(output):
        rule = next(part[len("rule_"):] for part in Path(log).parts if part.startswith("rule_"))
        found.append(Submission(rule, job_id, Path(log)))
    return found


def executed_rules(output: str) -> tuple[set[str], set[str]]:
    """(rules run as cluster jobs, rules run locally) in a snakemake run's output."""
    remote = set(re.findall(r"^rule (\w+):", output, re.M))
    local = set(re.findall(r"^localrule (\w+):", output, re.M))
    return remote, local


def scontrol_job(job_id: str) -> dict[str, str]:
    """`scontrol show job` as key -> value (the cluster keeps finished jobs for MinJobAge=3600 s)."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=env(), capture_output=True, text=True,
                         check=True).stdout
    return dict(re.findall(r"(\w[\w/:]*)=(\S*)", out))


def step_nodes(job_id: str) -> dict[str, set[str]]:
    """Steps of a job (finished ones too) -> nodes whose slurmd launched its tasks, from the slurmd logs."""
    steps: dict[str, set[str]] = {}
    for node in NODES:
        log = SLURM_DIR / "log" / f"slurmd-{node}.log"
        text = log.read_text() if log.exists() else ""
        for step in re.findall(rf"launch task StepId={job_id}\.(\d+) ", text):
            steps.setdefault(step, set()).add(node)
    return steps


def hostnames(nodelist: str) -> list[str]:
    return subprocess.run(["scontrol", "show", "hostnames", nodelist], env=env(), capture_output=True, text=True,
                          check=True).stdout.split()


def tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else f"({path} missing)"
