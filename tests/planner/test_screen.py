"""The vectorized screen against an independent enumeration of every layout and split."""

from dataclasses import replace

import numpy as np
import pytest

from dflop.costmodel.model import CostModel

from dflop.pricing.cluster import Cluster
from dflop.pricing.pool import Pool, TransferSizes
from dflop.planner.means import module_means
from dflop.planner.screen import SearchSpace, layout_of, screen
from dflop.planner.stages import TransferMeans, build_stage_model
from planner_testlib import all_splits, enumerate_layouts

LV, LL, B = 4, 6, 16


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied head"])
def setup(request, cost_model, shapes):
    """The toy model's means, its LM head untied or tied to the embedding (held once by a stage
    holding both: `ModuleMeans.tied`, which the screen's memory must subtract as the stages do)."""
    if request.param:
        cost_model = CostModel([replace(m, tied_param_bytes=m.param_bytes) if m.module == "llm_head" else m
                                for m in cost_model.modules.values()], cost_model.provenance)
    pool = Pool.from_shapes(shapes)
    vision = {t: module_means(cost_model, "vision", t, pool, LV) for t in (1, 2)}
    llm = {t: module_means(cost_model, "llm", t, pool, LL) for t in (1, 2)}
    transfer = TransferMeans.of(pool, TransferSizes(1024.0, 32768.0))
    space = SearchSpace(vision_tp=(1, 2), llm_tp=(1, 2), colocated_tp=(1, 2), shared_tp=(1, 2), microbatches=(1, 2, 4),
                        placements=("disjoint", "colocated"), vision_layers=LV, llm_layers=LL, global_batch=B,
                        mean_tiles=float(pool.n_tiles.mean()))
    return pool, vision, llm, transfer, space


def layouts_of(space, cluster):
    return enumerate_layouts(world=cluster.world_size, global_batch=B, microbatches=space.microbatches,
                             vision_tp=space.vision_tp, llm_tp=space.llm_tp, colocated_tp=space.colocated_tp,
                             vision_layers=LV, llm_layers=LL, mean_tiles=space.mean_tiles,
                             per_node=cluster.gpus_per_node)


@pytest.mark.parametrize("memory", [0.6e9, 1.2e9, 1.5e9, 3e9])  # 1.2e9: a tied head decides some fits
def test_feasibility_and_bounds_match_enumeration(setup, memory):
    pool, vision, llm, transfer, space = setup
    cluster = Cluster(nodes=2, gpus_per_node=2, gpu_memory_bytes=memory, inter_node_bytes_per_s=1e9)
    result = screen(space, vision, llm, cluster, transfer, keep=10_000)
    best = {}
    n = 0
    for lay in layouts_of(space, cluster):
        n += 1
        sm = build_stage_model(lay, vision[lay.tp_v], llm[lay.tp_l], cluster=cluster, global_batch=B, transfer=transfer)
        objectives = [sm.objective_s(s) for s in all_splits(sm) if sm.fits(s)]
        if objectives:
            best[lay] = min(objectives)
    assert result.n_layouts == n
    assert result.n_feasible == len(best)
    kept = {layout_of(r): r.bound_s for r in result.layouts.itertuples()}
    assert set(kept) == set(best)
    for lay, bound in kept.items():
        assert bound <= best[lay] * (1 + 1e-12), lay
    groups = result.groups
    assert groups["n_layouts"].sum() == n and groups["n_fit"].sum() == len(best)



def test_layouts_launchable_only_with_more_vision_stages_are_kept(setup):
    """LLM TP 2 and one vision replica: 1 vision rank leaves the LLM's TP groups straddling nodes,
    2 vision stages (2 ranks) do not, so the screen must not stop at the first stage count."""
    pool, vision, llm, transfer, space = setup
    from dataclasses import replace

    space = replace(space, llm_tp=(2,), colocated_tp=(), placements=("disjoint",), mean_tiles=0.01)
    cluster = Cluster(nodes=2, gpus_per_node=4, gpu_memory_bytes=3e9)
    result = screen(space, vision, llm, cluster, transfer, keep=10_000)
    expected = set(layouts_of(space, cluster))
    assert expected and {lay.pp_v for lay in expected} != {1}
    assert result.n_layouts == len(expected)

def test_keep_returns_the_smallest_bounds(setup):
    pool, vision, llm, transfer, space = setup
    cluster = Cluster(nodes=2, gpus_per_node=2, gpu_memory_bytes=3e9)
    everything = screen(space, vision, llm, cluster, transfer, keep=10_000).layouts
    top = screen(space, vision, llm, cluster, transfer, keep=5).layouts
    assert len(top) == 5
    np.testing.assert_allclose(np.sort(top["bound_s"]), np.sort(everything["bound_s"])[:5])


@pytest.mark.parametrize("per_node", [2, 4, 8])
def test_largest_launchable_vision_dp_equals_a_downward_scan(per_node):
    cluster = Cluster(nodes=16, gpus_per_node=per_node, gpu_memory_bytes=1e9)
    rng = np.random.default_rng(per_node)
    for per_vision in range(1, 9):
        tp_l = rng.choice([t for t in (1, 2, 4, 8) if per_node % t == 0], 60)
        llm_ranks = tp_l * rng.integers(1, 20, 60)
        dp_max = rng.integers(0, 40, 60)
        got = cluster.largest_launchable_vision_dp(dp_max, per_vision, llm_ranks, tp_l)
        for i in range(60):
            scan = next((d for d in range(dp_max[i], 0, -1)
                         if cluster.launchable(d * per_vision + llm_ranks[i], d * per_vision, tp_l[i])), 0)
            assert got[i] == scan
