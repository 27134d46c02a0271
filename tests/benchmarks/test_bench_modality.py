"""benchmarks/bench_scheduler_modality.py: the per-modality work shares and the with/without run."""

import numpy as np
import pytest

from dflop.costmodel.types import BatchCosts
from synthetic_costs import AnalyticCostModel, StageLayout, batch_costs_from_shapes
from synthetic_mix import llava_ov_mix


@pytest.fixture(scope="module")
def bench():
    import bench_scheduler_modality  # benchmarks/ is on sys.path (tests/conftest.py)

    return bench_scheduler_modality


def test_modality_shares_add_up_by_modality(bench):
    pool = llava_ov_mix(400, seed=3)
    layout, costs_fn = StageLayout(), AnalyticCostModel()
    shares = bench.modality_shares(pool, layout, costs_fn)
    costs: BatchCosts = batch_costs_from_shapes(pool, layout, costs_fn)
    vision = (costs.vision_fwd + costs.vision_bwd)[0]      # the one vision stage
    llm = (costs.llm_fwd + costs.llm_bwd).sum(axis=0) / costs.pp_llm  # equal LLM stages: any one is the mean
    for modality, row in shares.drop(index="all").iterrows():
        mine = (pool["modality"] == modality).to_numpy()
        assert row.samples == pytest.approx(mine.mean())
        assert row.vision_work == pytest.approx(vision[mine].sum() / vision.sum())
        assert row.llm_work == pytest.approx(llm[mine].sum() / llm.sum())
    assert shares.loc["text", "vision_work"] == 0
    assert shares.loc["all", "vision_per_llm"] == pytest.approx(vision.sum() / llm.sum())
    assert np.allclose(shares.drop(index="all")[["samples", "vision_work", "llm_work"]].sum(), 1.0)


def test_run_compares_the_mix_with_and_without_the_modality(bench):
    _, summary = bench.run(((64, 8, 8),), batches=1, seed=0, drop="video", mix_size=2000)
    assert list(summary.dataset) == ["llava_ov_mix", "without_video"]
    assert (summary.vs_best_baseline <= 1 + 1e-9).all()


def test_unknown_modality_is_a_one_line_error(bench):
    with pytest.raises(SystemExit, match="--drop 'audio': the mix has no such modality"):
        bench.main(["--grid", "64:8:8", "--batches", "1", "--drop", "audio"])
