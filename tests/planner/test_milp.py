"""The layer-split MILP against brute-force enumeration of every split."""

from dataclasses import replace

import numpy as np
import pytest

from dflop.planner.milp import solve_split
from dflop.planner.stages import min_peak_split, split_bound_s
from planner_testlib import all_splits, random_stage_model

CASES = [  # pp_v, pp_l, vision layers, llm layers, m, dp
    (0, 2, 3, 6, 4, 1), (0, 3, 2, 7, 8, 2), (1, 2, 4, 6, 2, 1), (2, 2, 5, 6, 4, 2), (2, 3, 4, 7, 1, 1),
    (1, 4, 3, 8, 16, 3),
]


def brute_force(sm):
    best = None
    for n in all_splits(sm):
        if sm.fits(n):
            obj = sm.objective_s(n)
            if best is None or obj < best[0]:
                best = (obj, n)
    return best


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_milp_optimum_equals_brute_force(case, seed):
    pp_v, pp_l, lv, ll, m, dp = case
    sm = random_stage_model(np.random.default_rng(seed), pp_v=pp_v, pp_l=pp_l, vision_layers=lv, llm_layers=ll,
                            m=m, dp=dp, latency=0.01)
    best = brute_force(sm)
    res = solve_split(sm, rel_gap=0.0)
    if best is None:
        assert res.status == "infeasible" and res.split is None
        return
    assert res.status == "optimal"
    assert sm.fits(res.split) and res.split.sum() == (0 if pp_v == 0 else lv) + ll
    assert res.objective_s == pytest.approx(best[0], rel=1e-9)
    assert res.bound_s <= res.objective_s * (1 + 1e-9)


@pytest.mark.parametrize("case", CASES)
def test_split_bound_is_a_lower_bound_and_tight_without_tail(case):
    pp_v, pp_l, lv, ll, m, dp = case
    for seed in range(3):
        sm = random_stage_model(np.random.default_rng(10 + seed), pp_v=pp_v, pp_l=pp_l, vision_layers=lv,
                                llm_layers=ll, m=m, dp=dp)
        best = brute_force(sm)
        bound = split_bound_s(sm)
        if best is None:
            assert bound == np.inf or bound > 0
            continue
        assert bound <= best[0] * (1 + 1e-12)
        if dp == 1:  # no all-reduce tail: water-filling under the memory caps is exact
            assert bound == pytest.approx(best[0], rel=1e-12)


@pytest.mark.parametrize("case", CASES)
def test_min_peak_split_minimises_the_largest_stage_memory(case):
    pp_v, pp_l, lv, ll, m, dp = case
    sm = random_stage_model(np.random.default_rng(5), pp_v=pp_v, pp_l=pp_l, vision_layers=lv, llm_layers=ll, m=m,
                            dp=dp, memory=1.0)
    split, mem = min_peak_split(sm)
    assert mem.max() == pytest.approx(min(sm.memory_at(n).max() for n in all_splits(sm)), rel=1e-12)
    assert np.array_equal(mem, sm.memory_at(split))


def test_infeasible_split_reports_infeasible():
    sm = random_stage_model(np.random.default_rng(0), pp_v=1, pp_l=2, vision_layers=2, llm_layers=4, m=2)
    sm = replace(sm, memory_bytes=0.2)  # below some stage's fixed memory
    res = solve_split(sm)
    assert res.status == "infeasible" and not res.has_solution
    assert brute_force(sm) is None
