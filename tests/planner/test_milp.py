"""The layer-split MILP against brute-force enumeration of every split."""

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

import dflop.planner.milp as milp
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


def heaviest_bound_instance(case, seed):
    """A stage model whose heaviest-sample memory row keeps the MILP from the memory-free optimum.

    The random times of `random_stage_model`, memory rebuilt so that the stage holding the most
    layers in the memory-free optimum (in a module with more than one stage) can hold one layer
    fewer under the heaviest-sample row, and every other stage can hold its whole module. The
    mean-microbatch row has half the heaviest row's bytes per layer, so it never binds.
    """
    pp_v, pp_l, lv, ll, m, dp = case
    rng = np.random.default_rng(seed)
    sm = random_stage_model(rng, pp_v=pp_v, pp_l=pp_l, vision_layers=lv, llm_layers=ll, m=m, dp=dp, latency=0.01)
    free = min(all_splits(sm), key=sm.objective_s)
    caps = np.where(sm.is_vision, lv, ll).astype(float)
    stages_in_module = np.where(sm.is_vision, pp_v, pp_l)
    s = int(np.argmax(np.where(stages_in_module > 1, free, 0)))
    caps[s] = free[s] - 1
    fixed = rng.uniform(0.05, 0.3, sm.n_stages)
    per_layer = (1.0 - fixed) / (caps + 0.5)        # n layers fit iff n <= cap
    coeffs = replace(sm.coeffs, mem_max_fixed=fixed, mem_max_layer=per_layer, mem_mean_fixed=fixed,
                     mem_mean_layer=0.5 * per_layer)
    return replace(sm, by_mode={"none": coeffs}, memory_bytes=1.0)


# (case, seed) where the bound binds: no memory-free optimum fits (asserted in the test)
BINDING = [((0, 3, 3, 9, 4, 1), 1), ((0, 3, 3, 9, 4, 1), 2), ((0, 3, 3, 9, 4, 1), 3), ((0, 4, 3, 10, 8, 2), 0),
           ((0, 4, 3, 10, 8, 2), 1), ((1, 3, 4, 8, 2, 1), 1), ((2, 2, 6, 6, 4, 2), 0), ((2, 2, 6, 6, 4, 2), 1),
           ((2, 3, 5, 8, 2, 1), 3), ((1, 4, 3, 9, 16, 3), 0), ((1, 4, 3, 9, 16, 3), 1)]


@pytest.mark.parametrize("case,seed", BINDING)
def test_milp_respects_the_heaviest_sample_memory_bound_where_it_binds(case, seed):
    """The random instances above rarely let memory bind; here the heaviest-sample row is what
    separates the optimum from the memory-free one, and the MILP must land on the brute-force
    best among the splits that satisfy it."""
    sm = heaviest_bound_instance(case, seed)
    c = sm.coeffs
    splits = list(all_splits(sm))
    objective = np.array([sm.objective_s(n) for n in splits])
    heaviest_ok = np.array([np.all(c.mem_max_fixed + c.mem_max_layer * n <= sm.memory_bytes) for n in splits])
    mean_ok = np.array([np.all(c.mem_mean_fixed + c.mem_mean_layer * n <= sm.memory_bytes) for n in splits])
    assert mean_ok[heaviest_ok].all() and heaviest_ok.any()
    best = objective[heaviest_ok].min()
    assert best > objective.min() * (1 + 1e-6), "the heaviest-sample bound must bind"
    assert mean_ok[objective <= objective.min() * (1 + 1e-12)].all()   # the mean row alone would allow it

    res = solve_split(sm, rel_gap=0.0)
    assert res.status == "optimal"
    assert np.all(c.mem_max_fixed + c.mem_max_layer * res.split <= sm.memory_bytes)
    assert sm.fits(res.split)
    assert res.objective_s == pytest.approx(best, rel=1e-9)


def test_infeasible_split_reports_infeasible():
    sm = random_stage_model(np.random.default_rng(0), pp_v=1, pp_l=2, vision_layers=2, llm_layers=4, m=2)
    sm = replace(sm, memory_bytes=0.2)  # below some stage's fixed memory
    res = solve_split(sm)
    assert res.status == "infeasible" and not res.has_solution
    assert brute_force(sm) is None


@pytest.mark.parametrize("case", CASES)
def test_cutoff_proves_exactly_the_splits_above_it(case):
    """solve_split(cutoff_s=c) returns status "cutoff" iff no split fits with objective <= c (brute
    force), and otherwise the same split and objective as the solve without a cutoff."""
    pp_v, pp_l, lv, ll, m, dp = case
    for seed in range(3):
        sm = random_stage_model(np.random.default_rng(20 + seed), pp_v=pp_v, pp_l=pp_l, vision_layers=lv,
                                llm_layers=ll, m=m, dp=dp, latency=0.01)
        best = brute_force(sm)
        if best is None:
            continue
        plain = solve_split(sm, rel_gap=0.0)
        below = solve_split(sm, rel_gap=0.0, cutoff_s=best[0] * (1 - 1e-6))
        assert below.status == "cutoff" and below.split is None and below.bound_s == best[0] * (1 - 1e-6)
        above = solve_split(sm, rel_gap=0.0, cutoff_s=best[0] * (1 + 1e-6))
        assert above.status == plain.status == "optimal"
        assert np.array_equal(above.split, plain.split) and above.objective_s == plain.objective_s


def too_small(kind):
    """A stage model no split fits: "fixed", below a stage's fixed memory; "sum", every stage fits
    one layer but together they hold fewer than the LLM's layers (only the sum is short)."""
    sm = random_stage_model(np.random.default_rng(0), pp_v=1, pp_l=2, vision_layers=2, llm_layers=4, m=2)
    if kind == "fixed":
        return replace(sm, memory_bytes=0.2)
    fixed, per_layer = np.full(3, 0.2), np.full(3, 0.5)   # 0.2 + 0.5 n <= 1 iff n <= 1
    c = replace(sm.coeffs, mem_mean_fixed=fixed, mem_mean_layer=per_layer, mem_max_fixed=fixed,
                mem_max_layer=per_layer)
    return replace(sm, by_mode={"none": c}, memory_bytes=1.0)


@pytest.mark.parametrize("kind", ["fixed", "sum"])
@pytest.mark.parametrize("cutoff_s", [0.0, 1e9])
def test_cutoff_on_an_infeasible_model_reports_infeasible(kind, cutoff_s):
    """With the cutoff row HiGHS reports infeasible for this layout whatever the cutoff, but no
    split fits at all: it is infeasible, not cut (a cut row would claim its optimum >= the cutoff)."""
    sm = too_small(kind)
    assert brute_force(sm) is None
    if kind == "sum":
        assert sm.fits(np.ones(sm.n_stages, int))  # one layer each fits: only the sum is short
    res = solve_split(sm, cutoff_s=cutoff_s)
    assert res.status == "infeasible" and not res.has_solution and res.bound_s is None


def test_plain_solve_after_the_cutoff_gets_only_the_time_left(monkeypatch):
    """The cutoff proof and the plain solve share one time_limit_s: on a clock where the proof took
    3 s of 5, the plain solve is given 2 s (a layout must not take twice the limit)."""
    sm = random_stage_model(np.random.default_rng(1), pp_v=1, pp_l=3, vision_layers=4, llm_layers=7, m=4, dp=2)
    plain = solve_split(sm, rel_gap=0.0)
    clock = iter([100.0])  # solve_split's start; every later reading 3 s on
    monkeypatch.setattr(milp, "time", SimpleNamespace(perf_counter=lambda: next(clock, 103.0)))
    given, solve = [], milp._solve

    def spy(sm, time_limit_s, rel_gap):
        given.append(time_limit_s)
        return solve(sm, time_limit_s, rel_gap)

    monkeypatch.setattr(milp, "_solve", spy)
    res = solve_split(sm, time_limit_s=5.0, rel_gap=0.0, cutoff_s=2 * plain.objective_s)
    assert given == [pytest.approx(2.0)]
    assert res.status == "optimal" and np.array_equal(res.split, plain.split) and res.solve_s == pytest.approx(3.0)


def test_a_split_the_cutoff_proof_found_is_kept_when_no_time_is_left_for_the_plain_solve(monkeypatch):
    """When the proof spends the time limit, the plain solve gets none and finds nothing; the split
    the proof found (at or below the cutoff) is returned instead of losing the layout, with its
    objective the brute-force best (the proof ran to optimality here) and status time_limit."""
    sm = random_stage_model(np.random.default_rng(1), pp_v=1, pp_l=3, vision_layers=4, llm_layers=7, m=4, dp=2)
    best = brute_force(sm)
    out_of_time = milp.SplitResult("time_limit", None, None, None, 0.0)
    monkeypatch.setattr(milp, "_solve", lambda sm, time_limit_s, rel_gap: out_of_time)
    res = solve_split(sm, rel_gap=0.0, cutoff_s=2 * best[0])
    assert res.status == "time_limit" and res.has_solution and sm.fits(res.split)
    assert res.objective_s == pytest.approx(best[0], rel=1e-9) and res.objective_s <= 2 * best[0]
    assert res.bound_s is not None and res.bound_s <= res.objective_s * (1 + 1e-9)
