"""Shared fixtures. Data layer: one demo dataset per test session (it takes a few seconds)."""

import sys
from pathlib import Path

import numpy as np
import pytest


@pytest.fixture(scope="session")
def demo_manifest(tmp_path_factory) -> Path:
    """Path of demo.json of a default demo dataset (300 samples, seed 0); treat it as read-only."""
    from dflop.data.demo import make_demo_data

    return make_demo_data(tmp_path_factory.mktemp("demo"), n_samples=300, seed=0)


@pytest.fixture(scope="session")
def demo_workdir(tmp_path_factory) -> Path:
    """A working copy after one demo run of the whole workflow (`all`; 60 samples, 3 training
    steps); treat it as read-only: copy it (`shutil.copytree`) to change it."""
    from workflow_run import demo_run

    return demo_run(tmp_path_factory.mktemp("demo_run"))


# The benchmarks' tooling (synthetic mix and costs, the scheduler grid, the portfolio's win table)
# lives in benchmarks/, not in the library; its tests, and tests that use the synthetic mix, import
# it from there.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.fixture(scope="session")
def mix_pool():
    """4000 samples of the generated LLaVA-OV-like mix (seed 7)."""
    from synthetic_mix import llava_ov_mix

    return llava_ov_mix(4000, seed=7)


@pytest.fixture
def make_costs(mix_pool):
    """costs(n, seed, layout=None) -> (shapes, BatchCosts) for n samples drawn from the mix, with the
    scheduler benchmarks' synthetic per-sample costs."""
    from synthetic_costs import AnalyticCostModel, StageLayout, batch_costs_from_shapes

    def make(n, seed=0, layout=None):
        rng = np.random.default_rng(seed)
        shapes = mix_pool.iloc[rng.choice(len(mix_pool), n, replace=False)].reset_index(drop=True)
        return shapes, batch_costs_from_shapes(shapes, layout or StageLayout(), AnalyticCostModel())
    return make
