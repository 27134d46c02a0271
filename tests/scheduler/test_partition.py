import itertools

import numpy as np
import pytest

from dflop.costmodel.types import BatchCosts
from dflop.scheduler import baselines
from synthetic_costs import StageLayout
from dflop.scheduler.evaluate import scalar_costs, simulate_times, stage_times
from dflop.scheduler.greedy import MemoryGuard, MemoryGuardError, greedy_2d, greedy_2d_many, local_search, proxy
from dflop.scheduler.ilp import pipeline_estimate, solve_ilp
from dflop.scheduler.partition import POLICIES, partition


def _check_valid(part, n):
    assert part.microbatch.shape == (n,) and part.replica.shape == (n,)
    assert part.microbatch.min() >= 0 and part.microbatch.max() < part.m
    assert part.replica.min() >= 0 and part.replica.max() < part.dp_llm
    assert sorted(part.order.tolist()) == list(range(part.m))
    bins = part.bins()
    assert sorted(np.concatenate([b for mb in bins for b in mb]).tolist()) == list(range(n))
    assert all(len(b) for mb in bins for b in mb), "no bin may be empty"


@pytest.mark.parametrize("n,m,dp", [(64, 4, 1), (64, 4, 4), (96, 8, 2), (200, 16, 4)])
def test_dflop_partition_valid_simulated_and_no_worse_than_baselines(make_costs, n, m, dp):
    shapes, costs = make_costs(n, seed=n + m + dp)
    ours = partition(costs, m, dp, dp, ilp="never")
    _check_valid(ours, n)
    # The reported step is the simulation of the reported assignment and order.
    st = stage_times(costs, ours.microbatch, ours.replica, m, dp, dp)
    assert ours.step_s == pytest.approx(simulate_times(st, ours.order).step_s)
    assert ours.step_s >= 0.9 * ours.lower_bound_s
    for policy in POLICIES[1:]:
        base = partition(costs, m, dp, dp, policy=policy, lengths=shapes.text_tokens.to_numpy())
        _check_valid(base, n)
        assert ours.step_s <= base.step_s * (1 + 1e-9), policy


def test_one_dimensional_lpt_meets_design_claim(make_costs):
    # DESIGN §7: with >= 16 items per bin, LPT lands within 0.5% of max(sum/bins, max item).
    _, costs = make_costs(1024, seed=5)
    m, dp = 16, 4
    sc = scalar_costs(costs, m, dp, dp)
    sc1d = type(sc)(np.zeros_like(sc.vision), sc.llm, 0.0, 0.0)
    guard = MemoryGuard.from_costs(costs, dp)
    got = proxy(sc1d, local_search(sc1d, greedy_2d(sc1d, m, dp, guard), m, dp, guard), m, dp)
    assert got <= 1.005 * max(sc.llm.sum() / (m * dp), sc.llm.max())


@pytest.mark.parametrize("guarded", [False, True])
def test_batched_greedy_equals_separate_runs(make_costs, guarded):
    """The weightings run in lockstep share numpy calls, never state: row k is the lone run."""
    _, costs = make_costs(180, seed=11)
    m, dp = 6, 3
    sc = scalar_costs(costs, m, dp, dp)
    guard = MemoryGuard.from_costs(costs, dp)
    if guarded:   # limits that bind: 1.3x a perfectly even share
        guard = MemoryGuard(guard.llm_bytes, 1.3 * guard.llm_bytes.sum(axis=1) / (m * dp), guard.vision_bytes,
                            1.3 * guard.vision_bytes.sum(axis=1) / m, True)
    weights = [None, np.r_[0.8, np.ones(m - 2), 0.6], np.linspace(0.5, 1.0, m)]
    together = greedy_2d_many(sc, m, dp, guard, weights)
    for row, w in zip(together, weights):
        np.testing.assert_array_equal(row, greedy_2d(sc, m, dp, guard, w))
    if guarded:
        mb, rep = together[0] // dp, together[0] % dp
        for k in range(costs.pp_llm):
            assert np.bincount(mb * dp + rep, weights=guard.llm_bytes[k]).max() <= guard.llm_limit[k]


def test_local_search_never_raises_the_proxy(make_costs):
    for seed in range(5):
        _, costs = make_costs(150, seed=seed)
        m, dp = 8, 3
        sc = scalar_costs(costs, m, dp, dp)
        guard = MemoryGuard.from_costs(costs, dp)
        g = greedy_2d(sc, m, dp, guard)
        assert proxy(sc, local_search(sc, g, m, dp, guard), m, dp) <= proxy(sc, g, m, dp) + 1e-12


def _tiny_costs(seed, n=7):
    rng = np.random.default_rng(seed)
    vf = rng.uniform(0, 1, (1, n)) * (rng.uniform(size=n) > 0.3)
    lf = rng.uniform(0.1, 1, (2, n))
    return BatchCosts(vf, 2 * vf, lf, 2 * lf, np.full(1, 0.01), np.full(1, 0.02), np.full(2, 0.01),
                      np.full(2, 0.02), np.ones((2, n)), np.ones((1, n)), np.full(2, np.inf), np.full(1, np.inf))


@pytest.mark.parametrize("seed", range(3))
def test_ilp_finds_brute_force_optimum_on_tiny_instances(seed):
    costs = _tiny_costs(seed)
    m, dp = 2, 2
    n_bins = m * dp
    best = min(pipeline_estimate(costs, np.array(a), m, dp, 1)
               for a in itertools.product(range(n_bins), repeat=costs.n_samples))
    warm = baselines.megatron(costs.n_samples, m, dp)
    res = solve_ilp(costs, m, dp, 1, warm, time_limit_s=30, max_nodes=100000)
    assert res.status == "optimal"
    assert res.objective_s == pytest.approx(best, rel=1e-6)
    assert res.objective_s <= res.warm_objective_s


def test_ilp_never_returns_worse_than_its_warm_start(make_costs):
    for seed in range(2):
        _, costs = make_costs(16, seed=seed)
        m, dp = 4, 2
        warm = baselines.megatron(16, m, dp)
        res = solve_ilp(costs, m, dp, dp, warm, time_limit_s=1.0, max_nodes=20)
        assert res.bin_of is not None
        assert pipeline_estimate(costs, res.bin_of, m, dp, dp) <= pipeline_estimate(costs, warm, m, dp, dp) + 1e-12
        with_ilp = partition(costs, m, dp, dp, ilp="always", budget_s=0.5)
        without = partition(costs, m, dp, dp, ilp="never")
        assert with_ilp.step_s <= without.step_s + 1e-12
        assert with_ilp.ilp_status != "not_run"


def test_ilp_failure_falls_back_to_greedy(make_costs, monkeypatch):
    import dflop.scheduler.partition as P

    def broken(*a, **k):
        return P.solve_ilp.__wrapped__(*a, **k) if hasattr(P.solve_ilp, "__wrapped__") else _raise()

    def _raise():
        raise RuntimeError("solver crashed")

    _, costs = make_costs(32, seed=1)
    monkeypatch.setattr("dflop.scheduler.ilp.highspy.Highs", lambda: _raise())
    part = partition(costs, 4, 2, 2, ilp="always")
    assert part.ilp_status.startswith("failed: RuntimeError: solver crashed")
    assert part.step_s == pytest.approx(partition(costs, 4, 2, 2, ilp="never").step_s)


def test_memory_guard_respected_and_errors_name_the_sample(make_costs):
    _, free = make_costs(64, seed=2)
    m, dp = 4, 2
    bins_bytes = np.bincount(baselines.megatron(64, m, dp), weights=free.llm_act_bytes[0], minlength=m * dp)
    limit = float(free.llm_act_bytes[0].sum() / (m * dp) * 1.15)  # tight: 15% over the mean bin
    assert bins_bytes.max() > limit  # the data-blind split would not fit
    layout = StageLayout(llm_mem_limit_bytes=limit)  # same limit on each of the 3 equal LLM stages
    _, costs = make_costs(64, seed=2, layout=layout)
    part = partition(costs, m, dp, dp)
    assert part.memory_ok
    for mb in part.bins():
        for b in mb:
            assert (costs.llm_act_bytes[:, b].sum(axis=1) <= costs.llm_mem_limit_bytes + 1e-6).all()
    assert not partition(costs, m, dp, dp, policy="megatron").memory_ok
    tiny = StageLayout(llm_mem_limit_bytes=1.0)
    shapes, costs = make_costs(16, seed=3, layout=tiny)
    with pytest.raises(MemoryGuardError, match="sample index 0: needs .* on LLM stage 0"):
        partition(costs, 2, 2, 2)


def test_deterministic_and_bad_arguments(make_costs):
    _, costs = make_costs(128, seed=4)
    a = partition(costs, 8, 2, 2, seed=3)
    b = partition(costs, 8, 2, 2, seed=3)
    assert a.same_assignment(b) and a.step_s == b.step_s and a.member == b.member
    with pytest.raises(ValueError, match="policy must be one of"):
        partition(costs, 8, 2, 2, policy="random")
    with pytest.raises(ValueError, match="cannot fill m \\* dp_llm"):
        partition(costs, 64, 4, 4)
    with pytest.raises(ValueError, match="lengths must have one entry per sample"):
        partition(costs, 8, 2, 2, policy="llava_group", lengths=np.ones(3))


def test_baselines_follow_their_definitions():
    bins = baselines.megatron(10, 2, 2)  # replica 0: samples 0-4 (mb 0: 0-2, mb 1: 3-4)
    assert bins.tolist() == [0, 0, 0, 2, 2, 1, 1, 1, 3, 3]
    cost = np.array([5.0, 4, 3, 3, 3, 1])
    lpt = baselines.lpt1d(cost, 1, 2)
    assert sorted([cost[lpt == b].sum() for b in (0, 1)]) == [9.0, 10.0]
    rng = np.random.default_rng(0)
    mm = rng.uniform(size=64) > 0.3
    llava = baselines.llava_group(rng.uniform(1, 100, 64), mm, 8, 2, seed=0)
    mixed = [j for j in range(8) if len(set(mm[llava // 2 == j])) > 1]
    assert len(mixed) <= 2  # only the leftover megabatch mixes modalities


def test_lockstep_search_lowers_sum_of_heaviest_bins_and_keeps_counts(make_costs):
    from dflop.scheduler.greedy import lockstep_search

    _, costs = make_costs(256, seed=9)
    m, dp = 16, 8
    sc = scalar_costs(costs, m, dp, dp)
    guard = MemoryGuard.from_costs(costs, dp)
    start = local_search(sc, greedy_2d(sc, m, dp, guard), m, dp, guard)

    def lockstep(bin_of):  # independent recomputation from the assignment
        L = np.bincount(bin_of, weights=sc.llm, minlength=m * dp).reshape(m, dp) + sc.llm_const
        V = np.bincount(bin_of // dp, weights=sc.vision, minlength=m) + sc.vision_const
        T = np.maximum(V, L.max(axis=1))
        return T.sum(), T.max()

    out = lockstep_search(sc, start, m, dp)
    assert lockstep(out)[0] < lockstep(start)[0]
    assert lockstep(out)[1] <= lockstep(start)[1] + 1e-12
    np.testing.assert_array_equal(np.bincount(out, minlength=m * dp), np.bincount(start, minlength=m * dp))


def test_balance_replicas_keeps_microbatches_and_evens_replica_totals():
    """Every microbatch keeps its bins (only which replica runs which changes), and the LPT deal
    leaves replica totals at most one bin apart (max - min <= heaviest bin); the deal it replaces
    here gives replica 0 the heaviest bin of every microbatch."""
    from dflop.scheduler.portfolio import balance_replicas

    rng = np.random.default_rng(4)
    m, dp = 12, 4
    cost = np.sort(rng.lognormal(0.0, 0.8, m * dp))[::-1].copy()   # one sample per bin
    bin_of = np.arange(m * dp)                                     # sorted groups, heaviest on replica 0
    out = balance_replicas(bin_of, cost, m, dp)
    assert sorted(out.tolist()) == list(range(m * dp))
    np.testing.assert_array_equal(out // dp, bin_of // dp)
    totals = np.bincount(out % dp, weights=cost, minlength=dp)
    before = np.bincount(bin_of % dp, weights=cost, minlength=dp)
    assert totals.max() - totals.min() <= cost.max() + 1e-12
    assert totals.max() < before.max()
    assert totals.sum() == pytest.approx(cost.sum())

    # Several samples per bin: bins move whole (samples that shared a bin still share one).
    samples = rng.integers(0, m * dp, 5 * m * dp)
    samples[: m * dp] = np.arange(m * dp)                          # no bin empty
    moved = balance_replicas(samples, rng.lognormal(0.0, 0.8, len(samples)), m, dp)
    for b in range(m * dp):
        assert len(set(moved[samples == b].tolist())) == 1 and moved[samples == b][0] // dp == b // dp


def test_candidate_orders_include_a_mountain():
    """One candidate starts at the lightest microbatch, ends at the second lightest, and every
    neighbour in between is at most two places apart in weight rank (rising, then falling)."""
    from dflop.scheduler.ordering import candidate_orders

    w = np.random.default_rng(5).permutation(np.arange(1.0, 10.0))   # weight = rank + 1
    mountains = [o for o in candidate_orders(w)
                 if sorted(o.tolist()) == list(range(9)) and w[o[0]] == 1.0 and w[o[-1]] == 2.0
                 and np.abs(np.diff(w[o])).max() <= 2]
    assert len(mountains) == 1
    assert w[mountains[0]].tolist() == [1, 3, 5, 7, 9, 8, 6, 4, 2]
