"""Runtime fixtures: shapes of a small demo dataset for each architecture, and small training pools.

A pool is a shapes.parquet with a handful of chosen samples (every modality the architecture
supports), so a global batch of the whole pool exercises images, multi-image posts, videos and
text-only samples in one step.
"""

from __future__ import annotations

import pytest

from dflop.config import Config
from dflop.data.demo import make_demo_data
from dflop.profiling.data_profiler import profile_data
from trainer_reference import MODELS, config_dict, pick_pool


@pytest.fixture(scope="session")
def runtime_demo(tmp_path_factory):
    """demo.json of a 60-sample demo dataset (seed 0)."""
    return make_demo_data(tmp_path_factory.mktemp("runtime_demo"), n_samples=60, seed=0)


@pytest.fixture(scope="session")
def demo_shapes(runtime_demo, tmp_path_factory):
    """arch -> shapes.parquet of the demo dataset under that architecture's tiny model."""
    out = {}
    for arch in MODELS:
        path = tmp_path_factory.mktemp(f"shapes_{arch}") / "shapes.parquet"
        profile_data(Config.from_dict(config_dict(arch, runtime_demo)), shapes_path=path,
                     histograms_path=path.with_name("histograms.parquet"), workers=1, progress=False)
        out[arch] = path
    return out


@pytest.fixture(scope="session")
def pools(demo_shapes, tmp_path_factory):
    """arch -> 8-sample pool: 2 samples of each modality."""
    root = tmp_path_factory.mktemp("pools")
    mix = {"image": 2, "multi_image": 2, "video": 2, "text": 2}
    return {arch: pick_pool(demo_shapes[arch], root / f"{arch}.parquet", mix) for arch in MODELS}
