import itertools

import numpy as np
import pytest

from dflop.scheduler.evaluate import simulate_times, stage_times
from dflop.scheduler.partition import POLICIES, partition
from dflop.scheduler.portfolio import PortfolioSettings
from dflop.scheduler.simsearch import order_moves, sim_search, swap_pairs


def _step(costs, bin_of, order, m, dp):
    return simulate_times(stage_times(costs, bin_of // dp, bin_of % dp, m, dp, dp), order).step_s


def test_order_moves_are_all_single_moves():
    moves = order_moves(np.array([2, 0, 1, 3]))
    assert len(moves) == 12 and len({m.tobytes() for m in moves}) == 9   # a->a+1 equals a+1->a
    for m in moves:
        assert sorted(m.tolist()) == [0, 1, 2, 3]


def test_swap_pairs_respect_span():
    bin_of = np.arange(6)          # dp 2, m 3: samples 2b and 2b + 1 share microbatch b
    order = np.array([2, 0, 1])
    pairs = swap_pairs(bin_of, order, 2, 1)
    pos = {2: 0, 0: 1, 1: 2}
    for i, k in pairs:
        assert abs(pos[i // 2] - pos[k // 2]) <= 1
    assert len(pairs) == 15 - 4    # all 15 pairs but microbatch 2 <-> microbatch 1 (2 positions apart)


@pytest.mark.parametrize("seed", range(4))
def test_result_is_simulated_never_worse_and_a_local_optimum(make_costs, seed):
    """Brute force on a tiny instance (one sample per bin): the returned step is the simulation of
    the returned partition, never above the start, and no single order move or swap within the span
    improves it (each neighbour re-simulated independently with `simulate_times`)."""
    m, dp = 4, 2
    _, costs = make_costs(m * dp, seed=100 + seed)
    rng = np.random.default_rng(seed)
    start, start_order = rng.permutation(m * dp), rng.permutation(m)
    bin_of, order, step = sim_search(costs, start, start_order, m, dp, dp, max_evals=10**7)
    assert sorted(bin_of.tolist()) == list(range(m * dp))
    assert step == pytest.approx(_step(costs, bin_of, order, m, dp), rel=1e-12)
    assert step <= _step(costs, start, start_order, m, dp) * (1 + 1e-12)
    for o in order_moves(order):
        assert _step(costs, bin_of, o, m, dp) >= step * (1 - 1e-9)
    for i, k in swap_pairs(bin_of, order, dp, 1):
        b = bin_of.copy()
        b[i], b[k] = b[k], b[i]
        assert _step(costs, b, order, m, dp) >= step * (1 - 1e-9)


def test_close_to_brute_force_optimum_on_tiny_instance(make_costs):
    """m = 3, dp = 2, 6 samples: every assignment in every order (6! grids x 3! orders, with
    replicas/positions as grid cells). The search from the batch order must land within 3 % of
    the true optimum (it reaches it on these seeds)."""
    m, dp = 3, 2
    for seed in range(3):
        _, costs = make_costs(m * dp, seed=200 + seed)
        best = min(_step(costs, np.asarray(perm), np.arange(m), m, dp)
                   for perm in itertools.permutations(range(m * dp)))  # order = relabelling of rows
        _, _, step = sim_search(costs, np.arange(m * dp), np.arange(m), m, dp, dp, max_evals=10**7, span=2)
        assert best <= step * (1 + 1e-12)
        assert step <= best * 1.03, (seed, step / best)


def test_partition_uses_it_at_one_sample_per_bin(make_costs):
    """At 1 sample per bin (m = 8, dp = 8) the member wins (on this batch 1.12 -> 1.06 x the table
    bound); still never worse than a baseline, and off in greedy_partition."""
    from dflop.scheduler.partition import greedy_partition
    m, dp = 8, 8
    shapes, costs = make_costs(m * dp, seed=3)
    ours = partition(costs, m, dp, dp, ilp="never")
    without = partition(costs, m, dp, dp, ilp="never", settings=PortfolioSettings(exclude=frozenset({"sim_search"})))
    assert ours.member == "sim_search" and ours.step_s < without.step_s
    assert ours.step_s == pytest.approx(_step(costs, ours.microbatch * dp + ours.replica, ours.order, m, dp))
    assert ours.step_s <= 0.97 * without.step_s
    for policy in POLICIES[1:]:
        base = partition(costs, m, dp, dp, policy=policy, lengths=shapes.text_tokens.to_numpy())
        assert ours.step_s <= base.step_s * (1 + 1e-9)
    assert greedy_partition(costs, m, dp, dp).member != "sim_search"


def test_second_start_is_never_worse_and_sometimes_wins(make_costs):
    """`sim_search` from the two fastest distinct members keeps the faster result: on every batch
    (m = 8, dp = 8) two starts are never slower than one, never slower than any member they could
    start from, and the reported step is the simulation of the reported partition. Local search ends
    where its start leads it, so on some batch the second start must end strictly faster (else it
    costs time for nothing); on these three it does on one (seed 0)."""
    m, dp = 8, 8
    gains = []
    for seed in range(3):
        _, costs = make_costs(m * dp, seed=seed)
        one = partition(costs, m, dp, dp, ilp="never", settings=PortfolioSettings(sim_starts=1))
        two = partition(costs, m, dp, dp, ilp="never", settings=PortfolioSettings(sim_starts=2))
        assert two.step_s <= one.step_s * (1 + 1e-12)
        assert two.step_s <= min(step for member, step in two.candidates if member != "sim_search") * (1 + 1e-12)
        assert two.step_s == pytest.approx(_step(costs, two.microbatch * dp + two.replica, two.order, m, dp))
        gains.append(one.step_s / two.step_s)
    assert max(gains) > 1 + 1e-6
