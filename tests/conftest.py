"""Shared fixtures. Data layer: one demo dataset per test session (it takes a few seconds)."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo_manifest(tmp_path_factory) -> Path:
    """Path of demo.json of a default demo dataset (300 samples, seed 0); treat it as read-only."""
    from dflop.data.demo import make_demo_data

    return make_demo_data(tmp_path_factory.mktemp("demo"), n_samples=300, seed=0)


@pytest.fixture(scope="session")
def demo_workdir(tmp_path_factory) -> Path:
    """A working copy after one demo run of the whole workflow (`all`; 60 samples, 2 training
    steps); treat it as read-only: copy it (`shutil.copytree`) to change it."""
    from workflow_run import demo_run

    return demo_run(tmp_path_factory.mktemp("demo_run"))
