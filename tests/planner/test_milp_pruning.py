"""The MILP objective's lower bound (`milp.objective_bound_s`) against brute force, and the search
that skips layouts by it against the same search solving every kept layout."""

import itertools
import re
from dataclasses import replace

import numpy as np
import pytest

import dflop.planner.search as search_module
from dflop.pricing.cluster import Cluster
from dflop.pricing.pool import Pool, TransferSizes
from dflop.planner.milp import objective_bound_s, some_split_fits, tail_bound_s
from dflop.planner.search import SearchSettings, bin_granularity, prepare_means, search
from dflop.planner.space import build_space
from dflop.planner.stages import TransferMeans, split_bound_s
from dflop.plan import Layout
from planner_testlib import all_splits, random_stage_model, toy_cost_model, toy_shapes
from test_search import SHAPE

MODES = ("none", "selective", "full")
CASES = [  # pp_v, pp_l, vision layers, llm layers, m, dp
    (0, 2, 3, 6, 4, 2), (0, 3, 2, 7, 8, 2), (1, 2, 4, 6, 2, 3), (2, 2, 5, 6, 4, 2), (2, 3, 4, 7, 1, 2),
    (1, 4, 3, 8, 16, 3), (1, 1, 4, 6, 4, 2), (0, 1, 3, 6, 2, 3),
]


def brute_force(sm):
    """Least `objective_s` over every split and per-stage mode that fits (None when nothing fits)."""
    best = None
    for n in all_splits(sm):
        for modes in itertools.product(sm.modes, repeat=sm.n_stages):
            if sm.fits(n, modes):
                obj = sm.objective_s(n, modes)
                best = obj if best is None else min(best, obj)
    return best


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("memory", [1.0, 0.45])
def test_objective_bound_is_below_the_optimum_and_exact_for_a_single_split(case, memory):
    pp_v, pp_l, lv, ll, m, dp = case
    for seed in range(4):
        sm = random_stage_model(np.random.default_rng(seed), pp_v=pp_v, pp_l=pp_l, vision_layers=lv, llm_layers=ll,
                                m=m, dp=dp, latency=0.01, modes=MODES)
        # memory: the GPU limit as a share of the random model's bytes (0.45 forces recompute or infeasibility)
        sm = replace(sm, memory_bytes=memory)
        best, bound = brute_force(sm), objective_bound_s(sm)
        assert some_split_fits(sm) == (best is not None)  # what tells solve_split's cutoff from infeasible
        if best is None:
            assert bound == np.inf
            continue
        assert bound <= best * (1 + 1e-12)
        assert bound >= split_bound_s(sm) * (1 - 1e-12)  # never weaker than the bound it replaces
        if sm.n_stages == (1 if pp_v == 0 else 2):  # one split: modes, bottleneck, sum and tail all exact
            assert bound == pytest.approx(best, rel=1e-6)  # the tail bisection stops at 1e-7 of the tail


def test_tail_bound_by_hand():
    """Two LLM stages, one mode: A >= 1 + 0.5 n0 and A >= 0.2 n1 - (0.1 + 0.3 n0), n0 + n1 = 10.
    The least A over real n0 >= 1: 1 + 0.5 n0 = 0.2 (10 - n0) - 0.1 - 0.3 n0 gives n0 = 0.9 < 1, so
    n0 = 1 and A = max(1.5, 0.2 * 9 - 0.4) = 1.5."""
    sm = random_stage_model(np.random.default_rng(0), pp_v=0, pp_l=2, vision_layers=3, llm_layers=10, m=2, dp=2)
    c = sm.by_mode["none"]
    sm = replace(sm, by_mode={"none": replace(c, bwd_fixed=np.array([0.1, 0.0]), bwd_layer=np.array([0.3, 0.3]))},
                 ar_fixed=np.array([1.0, 0.0]), ar_layer=np.array([0.5, 0.2]))
    assert tail_bound_s(sm) == pytest.approx(1.5, rel=1e-6)
    sm = replace(sm, ar_fixed=np.array([0.0, 3.0]))  # now the second stage binds: A >= 3 + 0.2 (10 - n0) - 0.1 - 0.3 n0
    # and A >= 0.5 n0: equal at 0.5 n0 = 4.9 - 0.5 n0, n0 = 4.9, A = 2.45
    assert tail_bound_s(sm) == pytest.approx(2.45, rel=1e-6)


LV, LL, B = 2, 5, 8


@pytest.fixture(scope="module")
def pool():
    return Pool.from_shapes(toy_shapes(300, seed=1))


def _unpruned(monkeypatch):
    """The search with every bound at -inf: no layout can be skipped, so every kept layout is solved."""
    screen = search_module.screen

    def no_bounds(*args, **kw):
        r = screen(*args, **kw)
        return replace(r, layouts=r.layouts.assign(bound_s=-np.inf))

    monkeypatch.setattr(search_module, "screen", no_bounds)
    monkeypatch.setattr(search_module, "objective_bound_s", lambda sm: -np.inf)


def _top(rows, k):
    plans = rows[(rows["kind"] == "plan") & (rows["level"] == "layout") & rows["mean_shape_step_s"].notna()]
    plans = plans.sort_values("mean_shape_step_s")
    return [tuple(r) for r in plans[["placement", "tp_v", "pp_v", "dp_v", "tp_l", "pp_l", "dp_l", "m"]]
            .head(k).itertuples(index=False)]


@pytest.mark.parametrize("memory,vision_factor", [(1.0e9, 1.0), (2.0e9, 8.0)])
def test_pruned_search_keeps_the_plan_and_the_best_set(pool, monkeypatch, memory, vision_factor):
    cost = toy_cost_model(scale={"vision_layer": vision_factor, "vision_embed": vision_factor})
    cluster = Cluster(nodes=2, gpus_per_node=4, gpu_memory_bytes=memory, inter_node_bytes_per_s=2e9)
    settings = SearchSettings.from_config(global_batch=B, microbatches=(1, 2, 4), sample_batches=2, top_k=2, prescreen=3,
                              rel_gap=0.0, max_milps=100_000)
    want = settings.n_prescreen
    pruned = search(cost, SHAPE, pool, cluster, settings)
    rows = pruned.candidates
    skipped = rows[rows["reason"] == "milp_bound"]
    assert len(skipped) >= 3  # the instance exercises the pruning
    assert pruned.stats["milp_pruned"] == len(skipped) and pruned.stats["top_k_proven"]
    assert set(skipped["status"]) == {"pruned"} and skipped["bound_s"].notna().all()

    # every skipped layout's true optimum (brute force on its leanest stage model) >= the objective it was skipped against
    leanest = _leanest_stage_model(cost, cluster, pool, settings)
    for r in skipped.itertuples():
        sm = leanest(Layout(r.placement, r.tp_v, r.pp_v, r.dp_v, r.tp_l, r.pp_l, r.dp_l, r.m))
        against = float(re.search(r">= (\S+) s", r.detail).group(1))
        best = brute_force(sm)
        assert best is None or best >= against * (1 - 1e-5)  # the detail prints 6 digits
        assert best is None or best >= r.bound_s * (1 - 1e-12)

    _unpruned(monkeypatch)
    full = search(cost, SHAPE, pool, cluster, replace(settings, milp_cutoff=False))
    assert full.stats["milp_pruned"] == 0 and not (full.candidates["reason"] == "milp_bound").any()
    assert full.stats["milps"] > pruned.stats["milps"]
    assert full.chosen.plan == pruned.chosen.plan
    assert full.chosen.mean_s == pruned.chosen.mean_s
    assert _top(full.candidates, want) == _top(rows, want)
    ran = lambda df: set(_top(df[df["batches"].fillna(0) > 0], 10_000))  # noqa: E731 (the simulated plans)
    assert ran(full.candidates) == ran(rows)


CUT_CLUSTER = Cluster(nodes=2, gpus_per_node=4, gpu_memory_bytes=1.0e9, inter_node_bytes_per_s=2e9)
CUT_SETTINGS = SearchSettings.from_config(global_batch=B, microbatches=(1, 2, 4), sample_batches=2, top_k=2, prescreen=3,
                              rel_gap=0.0, max_milps=100_000)


def test_milp_cutoff_keeps_the_plan_and_the_best_set(pool, monkeypatch):
    """With every lower bound at -inf, each kept layout reaches HiGHS: the cutoff (once want objectives
    are known) must then prune exactly layouts whose brute-force optimum is above the objective they
    were cut against, and leave the chosen plan and the best set as the search without it."""
    cost, cluster, settings = toy_cost_model(), CUT_CLUSTER, CUT_SETTINGS
    _unpruned(monkeypatch)
    with_cut = search(cost, SHAPE, pool, cluster, settings)
    without = search(cost, SHAPE, pool, cluster, replace(settings, milp_cutoff=False))
    rows = with_cut.candidates
    cut = rows[rows["milp_status"] == "cutoff"]
    assert len(cut) >= 3 and set(cut["reason"]) == {"milp_bound"} and set(cut["status"]) == {"pruned"}
    assert (cut["milp_solve_s"] > 0).all() and not (without.candidates["milp_status"] == "cutoff").any()
    assert with_cut.stats["milps"] == without.stats["milps"]  # the cut ones are MILP entries too
    assert with_cut.chosen.plan == without.chosen.plan and with_cut.chosen.mean_s == without.chosen.mean_s
    assert _top(rows, settings.n_prescreen) == _top(without.candidates, settings.n_prescreen)

    leanest = _leanest_stage_model(cost, cluster, pool, settings)
    for r in cut.itertuples():
        best = brute_force(leanest(Layout(r.placement, r.tp_v, r.pp_v, r.dp_v, r.tp_l, r.pp_l, r.dp_l, r.m)))
        assert best is None or best > r.bound_s * (1 - 1e-9)
        assert float(re.search(r">= (\S+) s", r.detail).group(1)) == pytest.approx(r.bound_s, rel=1e-5)


def test_solver_counts_include_the_cut_layouts(pool, monkeypatch):
    """plan.yaml's solver block (milps, statuses, time_s) counts every layout that reached HiGHS,
    the ones cut by the cutoff proof too: its time is in time_s, so it must be in the counts."""
    _unpruned(monkeypatch)
    result = search(toy_cost_model(), SHAPE, pool, CUT_CLUSTER, CUT_SETTINGS)
    rows, st = result.candidates, result.stats
    entries = rows[(rows["kind"] == "plan") & rows["milp_status"].notna()]  # solved + cut
    assert (entries["milp_status"] == "cutoff").sum() >= 3
    assert st["milp_statuses"] == entries["milp_status"].value_counts().to_dict()
    assert st["milps"] == len(entries) == sum(st["milp_statuses"].values())
    assert st["milp_s"] == pytest.approx(entries["milp_solve_s"].sum(), rel=1e-12)


def _leanest_stage_model(cost, cluster, pool, settings):
    """layout -> its stage model at the leanest technique setting, built as the search builds it
    (the model whose brute-force optimum a pruned layout's bound must not exceed)."""
    space, _ = build_space(SHAPE, cost, cluster, placements=settings.planner.placements, microbatches=settings.planner.microbatches,
                           global_batch=B, mean_tiles=float(pool.n_tiles.mean()))
    means = prepare_means(cost, SHAPE, pool, space, settings.technique_space)
    sizes = TransferSizes.for_model(llm_hidden=SHAPE.llm_hidden, vision_hidden=SHAPE.vision_hidden,
                                    vision_tokens_per_tile=SHAPE.vision_tokens_per_tile, dtype=cost.provenance.dtype)
    kw = dict(cluster=cluster, global_batch=B, transfer=TransferMeans.of(pool, sizes),
              granularity=bin_granularity(cost, pool, space))
    return lambda lay: means.stage_model(lay, means.leanest(lay), **kw)
