"""Fixtures of the Slurm tests: the local test cluster and one run of the whole chain through it.

Both need root (the cluster script installs Slurm and runs its daemons). Without root, or when the
cluster cannot start, the tests are skipped with the reason; set DFLOP_REQUIRE_SLURM=1 (CI as root)
to make that a failure instead.
"""

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from slurm_testlib import CLUSTER_SCRIPT, run_snakemake, train_rule_exists, working_copy


def _unavailable(reason: str):
    if os.environ.get("DFLOP_REQUIRE_SLURM") == "1":
        pytest.fail(f"DFLOP_REQUIRE_SLURM=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_cluster():
    """The test cluster, started by this session unless it was up already (then left up)."""
    if os.geteuid() != 0:
        _unavailable("the local Slurm test cluster needs root (tests/slurm/cluster.sh installs and runs slurmctld/slurmd)")
    was_up = subprocess.run(["bash", str(CLUSTER_SCRIPT), "status"], capture_output=True).returncode == 0
    try:
        up = subprocess.run(["bash", str(CLUSTER_SCRIPT), "up"], capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        _unavailable("tests/slurm/cluster.sh up did not finish in 15 minutes")
    if up.returncode != 0:
        last = (up.stderr.strip().splitlines() or ["(no output)"])[-1]
        _unavailable(f"cannot start the local Slurm cluster: {last}")
    yield
    if not was_up:
        subprocess.run(["bash", str(CLUSTER_SCRIPT), "down"], capture_output=True, timeout=300)


@dataclass(frozen=True)
class ChainRun:
    """A working copy after `snakemake --profile tests/slurm/profile TARGET` and that run's output."""

    workdir: Path
    target: str
    output: str


@pytest.fixture(scope="session")
def slurm_chain(slurm_cluster, tmp_path_factory) -> ChainRun:
    """The whole chain (train, or optimize while there is no train rule) run once through Slurm."""
    target = "train" if train_rule_exists() else "optimize"
    workdir = working_copy(tmp_path_factory.mktemp("slurm_chain"))
    proc = run_snakemake(workdir, target)
    if proc.returncode != 0:
        pytest.fail(f"snakemake --profile tests/slurm/profile {target} failed (exit {proc.returncode}):\n"
                    f"{proc.stdout[-6000:]}")
    return ChainRun(workdir, target, proc.stdout)
