"""A user's checkout with a small demo config, and Snakemake run on it as a user would."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import yaml

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]


def env() -> dict:
    out = dict(os.environ)
    out["PATH"] = f"{Path(sys.executable).parent}:{out['PATH']}"  # the rules call dflop / python from the env
    return out


def run_snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([*SNAKEMAKE, *args], cwd=workdir, env=env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def copy_checkout(root: Path, change: Callable[[dict], None]) -> Path:
    """A user's checkout under `root` (workflow/, config/, environment.yml) with `change` applied
    to its config/config.yaml."""
    for name in ("workflow", "config"):
        shutil.copytree(REPO / name, root / name)
    shutil.copy(REPO / "environment.yml", root / "environment.yml")
    config = yaml.safe_load((root / "config/config.yaml").read_text())
    change(config)
    (root / "config/config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return root


def smaller_demo(config: dict) -> None:
    """The demo config made quick for tests: 60 samples, a short model and load profile on one process, 2
    training steps."""
    config["data"]["demo"]["n_samples"] = 60
    config["data"]["workers"] = 1  # 60 samples take a second: a pool's forks cost more than they save
    config["data"]["load_profile_samples"] = 3
    config["data"]["load_profile_seconds"] = 0  # two passes: the tests check the chain, not the profile's level
    # The model profile's coarse grid only (a budget it always exceeds: no refinement rounds, however
    # quiet the machine), each shape timed `repeats` times (no extra runs for light shapes): the
    # tests check the chain, not the cost model's precision. The grid is the one it was: the memory
    # the plan predicts (which sets the demo's microbatches) comes from the same shapes.
    # One profiling process (co_runners 1): no torchrun and no second rank or loader timing beside it.
    # Profiling on a loaded machine is test_model_profiler_tp.py's and test_load_profiler.py's.
    config["profile"] = {"repeats": 2, "warmup": 1, "max_seq_len": 256, "max_tiles": 8, "time_budget_s": 1,
                         "min_measure_ms": 0, "co_runners": 1}
    config.setdefault("train", {}).update(steps=2, checkpoint_every=2)


def working_copy(root: Path) -> Path:
    """A user's checkout with the smaller demo (`smaller_demo`)."""
    return copy_checkout(root, smaller_demo)


def demo_run(root: Path) -> Path:
    """`snakemake --profile profiles/local all` in a fresh working copy under `root` (the demo, with
    3 training steps: one after the warm-up, so the summary measures both speedups)."""
    workdir = copy_checkout(root, lambda config: (smaller_demo(config), config["train"].update(steps=3)))
    run_snakemake(workdir, "--profile", str(REPO / "profiles/local"), "--cores", "2", "all")
    return workdir
