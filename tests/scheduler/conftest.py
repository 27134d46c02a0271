import numpy as np
import pytest

from dflop.scheduler.costs import AnalyticCostModel, StageLayout, batch_costs_from_shapes
from dflop.scheduler.synthetic import llava_ov_mix


@pytest.fixture(scope="session")
def pool():
    return llava_ov_mix(4000, seed=7)


@pytest.fixture
def make_costs(pool):
    """costs(n, seed, layout=None) -> (shapes, BatchCosts) for n samples drawn from the mix."""
    def make(n, seed=0, layout=None):
        rng = np.random.default_rng(seed)
        shapes = pool.iloc[rng.choice(len(pool), n, replace=False)].reset_index(drop=True)
        return shapes, batch_costs_from_shapes(shapes, layout or StageLayout(), AnalyticCostModel())
    return make
