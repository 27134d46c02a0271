"""Which rank's forward a sample's measured load is added to, on CPU (`decode_seconds`): the rank the
pricing charges it to (`Pricing.load_s`), each sample once, at its microbatch's position."""

import numpy as np

from dflop.data.training import LoadedSample
from dflop.plan import Layout, Plan
from dflop.runtime.loading import decode_seconds
from dflop.runtime.topology import Topology
from dflop.scheduler.online import StepPlan

# 6 samples; batch index i is pool row 10 + i and took (i + 1) ms to load; 0 and 3 are text-only
TILES = (0, 2, 5, 0, 1, 3)
LOADED = {10 + i: LoadedSample(10 + i, load_s=(i + 1) * 1e-3) for i in range(6)}
BINS = (((0, 1), (2,)), ((3, 4), (5,)))  # position p, LLM replica r
SHARES = (((1,), (2,)), ((4,), (5,)))  # position p, vision replica v: the samples with tiles


def _plan() -> StepPlan:
    return StepPlan(step=1, rows=tuple(10 + i for i in range(6)), n_tiles=TILES, seq_len=(9,) * 6,
                    feature_rows=(0,) * 6, bins=BINS, vision_shares=SHARES, microbatch_ids=(1, 0))


def test_colocated_stage_zero_pays_every_sample_of_its_bins():
    plan = Plan.uniform(Layout("colocated", 1, 1, 2, 1, 2, 2, 2), 2, 2)  # ranks: stage 0 x 2 replicas, stage 1 x 2
    by_rank = [decode_seconds(_plan(), Topology(plan, rank, 4), LOADED) for rank in range(4)]
    assert np.allclose(by_rank[0], [1e-3 + 2e-3, 4e-3 + 5e-3])  # replica 0: samples 0, 1 then 3, 4
    assert np.allclose(by_rank[1], [3e-3, 6e-3])
    assert not by_rank[2].any() and not by_rank[3].any()  # stage 1 decodes nothing
    assert np.isclose(sum(s.sum() for s in by_rank), sum(s.load_s for s in LOADED.values()))


def test_disjoint_vision_pays_its_pixels_and_the_llm_the_text_only_samples():
    plan = Plan.uniform(Layout("disjoint", 1, 1, 2, 1, 1, 2, 2), 2, 2)  # ranks 0-1 vision, 2-3 LLM
    by_rank = [decode_seconds(_plan(), Topology(plan, rank, 4), LOADED) for rank in range(4)]
    assert np.allclose(by_rank[0], [2e-3, 5e-3]) and np.allclose(by_rank[1], [3e-3, 6e-3])
    assert np.allclose(by_rank[2], [1e-3, 4e-3])  # text-only samples 0 and 3 on LLM replica 0
    assert not by_rank[3].any()
    assert np.isclose(sum(s.sum() for s in by_rank), sum(s.load_s for s in LOADED.values()))


def test_a_later_vision_stage_decodes_nothing():
    plan = Plan.uniform(Layout("disjoint", 1, 2, 1, 1, 1, 1, 2), 2, 2)  # ranks 0-1 vision stages 0 and 1, rank 2 LLM
    step = StepPlan(step=1, rows=tuple(10 + i for i in range(6)), n_tiles=TILES, seq_len=(9,) * 6,
                    feature_rows=(0,) * 6, bins=(((0, 1, 2),), ((3, 4, 5),)), vision_shares=(((1, 2),), ((4, 5),)),
                    microbatch_ids=(0, 1))
    by_rank = [decode_seconds(step, Topology(plan, rank, 3), LOADED) for rank in range(3)]
    assert np.allclose(by_rank[0], [2e-3 + 3e-3, 5e-3 + 6e-3]) and not by_rank[1].any()
    assert np.allclose(by_rank[2], [1e-3, 4e-3])
