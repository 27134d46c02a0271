"""Shared fixtures. Data layer: one demo dataset per test session (it takes a few seconds)."""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

_OWN_CACHE_DIR = pytest.StashKey[str]()


def pytest_configure(config):
    """The run's own cache directory (dflop/cache.py: the converted Qwen2.5 tokenizer), private to
    this run and never the user's ~/.cache. Made by the process that starts the xdist workers, which
    inherit it with the environment, as does every process they start."""
    if "DFLOP_CACHE_DIR" not in os.environ:
        os.environ["DFLOP_CACHE_DIR"] = config.stash[_OWN_CACHE_DIR] = tempfile.mkdtemp(prefix="dflop-test-cache-")


def pytest_unconfigure(config):
    own = config.stash.get(_OWN_CACHE_DIR, None)
    if own is not None:
        shutil.rmtree(own, ignore_errors=True)
        os.environ.pop("DFLOP_CACHE_DIR", None)


# Work units of `pytest -n N` (`make test` runs N = 2 workers): a test file is one unit, so its
# module fixtures are built once; the files built on one session-wide chain are one unit, so the chain
# runs once (and the Slurm test cluster has one owner). Units go out in collection order: the chains
# first, then files with slow tests, then the rest, so the longest units do not start last.
CHAIN_UNITS = {  # unit -> the files (or folders) whose tests use its chain
    "demo_run": ("tests/report/test_report_workflow.py", "tests/workflow/test_reruns_workflow.py",
                 "tests/workflow/test_snakemake.py", "tests/test_docs.py"),  # demo_workdir
    "slurm": ("tests/slurm/",),  # slurm_cluster, slurm_chain
}
CHAIN_FIXTURES = {"demo_workdir": "demo_run", "slurm_cluster": "slurm"}


def work_unit(nodeid: str) -> str:
    """The work unit of a test, from its node id (all that xdist's scheduler sees)."""
    path = nodeid.split("::", 1)[0]
    for unit, prefixes in CHAIN_UNITS.items():
        if path.startswith(prefixes):
            return unit
    return path


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent without it
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnitScheduling(LoadScopeScheduling):
        """xdist's per-module scheduling, by `work_unit` (its own --dist loadgroup marks are not
        honoured under pytest 9.2, whose node ids xdist 3.8 can no longer suffix)."""

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False  # keep the collection order below, not largest-first
    return WorkUnitScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    chains = list(CHAIN_UNITS)
    slow_units = {work_unit(item.nodeid) for item in items if item.get_closest_marker("slow")}

    def rank(item):
        unit = work_unit(item.nodeid)
        return chains.index(unit) if unit in chains else len(chains) + (unit not in slow_units)

    items.sort(key=rank)  # stable: the file order is kept within a rank


@pytest.hookimpl(tryfirst=True)  # before any fixture is set up: the chain is not built for nothing
def pytest_runtest_setup(item):
    """A test on a shared chain must be in the chain's work unit (else each worker runs the chain)."""
    for fixture, unit in CHAIN_FIXTURES.items():
        if fixture in item.fixturenames and work_unit(item.nodeid) != unit:
            pytest.fail(f"{item.nodeid} uses {fixture}: add its file to CHAIN_UNITS[{unit!r}] in "
                        "tests/conftest.py, so that the chain runs once", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread_per_worker():
    """Under xdist, each worker computes on one thread: N workers fill N cores, none spin-waits."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


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
