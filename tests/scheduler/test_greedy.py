"""The 2-D greedy and its local search against closed forms and brute force on 1-D instances.

With no vision cost the bottleneck proxy is the largest bin's LLM load, and `greedy_2d` is LPT:
samples by decreasing cost, each to the least loaded bin. LPT's worst case is Graham's bound,
makespan <= (4/3 - 1/(3 b)) x optimum on b bins, reached by his instance (two items each of
2b - 1 down to b + 1, three of b: LPT 4b - 1, optimum 3b). References: that bound and instance,
and the optimum by enumerating every assignment.
"""

import numpy as np
import pytest

from dflop.scheduler.evaluate import ScalarCosts
from dflop.scheduler.greedy import MemoryGuard, greedy_2d, local_search, proxy

LAYOUTS = [(1, 2), (2, 1), (1, 3), (3, 1), (2, 2)]   # (m, dp): bins = m x dp


def _one_dimensional(llm) -> ScalarCosts:
    return ScalarCosts(np.zeros(len(llm)), np.asarray(llm, dtype=np.float64), 0.0, 0.0)


def _no_guard(n) -> MemoryGuard:
    return MemoryGuard(np.zeros((1, n)), np.full(1, np.inf), np.zeros((0, n)), np.zeros(0), False)


def _optimum(llm, bins) -> float:
    """Smallest largest bin load over every assignment of the items to the bins (bins are
    interchangeable, so item 0 goes to bin 0)."""
    llm = np.asarray(llm, dtype=np.float64)
    rest = np.arange(bins ** (len(llm) - 1))[:, None] // bins ** np.arange(len(llm) - 1) % bins
    assign = np.c_[np.zeros(len(rest), dtype=np.int64), rest]
    loads = np.stack([(assign == b) @ llm for b in range(bins)], axis=1)
    return float(loads.max(axis=1).min())


def _graham(bins) -> np.ndarray:
    return np.array([2 * bins - 1 - i // 2 for i in range(2 * (bins - 1))] + [bins] * 3, dtype=np.float64)


@pytest.mark.parametrize("m,dp", LAYOUTS)
def test_greedy_is_within_grahams_lpt_bound_of_the_optimum(m, dp):
    """On random 1-D instances (6-8 items; integer, uniform and heavy-tailed costs) the greedy's
    largest bin is within (4/3 - 1/(3 b)) of the brute-force optimum; on the instance that is
    list scheduling's worst case in input order (b (b - 1) unit items and one of b, optimum b) it
    is optimal."""
    bins = m * dp
    bound = 4 / 3 - 1 / (3 * bins)
    rng = np.random.default_rng(bins * 10 + m)
    worst = 0.0
    for trial in range(40):
        n = int(rng.integers(6, 9)) if bins < 4 else 8
        llm = [rng.integers(1, 10, n).astype(float), rng.uniform(0.1, 1.0, n), rng.lognormal(0.0, 1.0, n)][trial % 3]
        sc = _one_dimensional(llm)
        got = proxy(sc, greedy_2d(sc, m, dp, _no_guard(n)), m, dp)
        opt = _optimum(llm, bins)
        assert opt <= got * (1 + 1e-12)
        assert got <= bound * opt * (1 + 1e-12), (trial, llm.tolist(), got / opt)
        worst = max(worst, got / opt)
    assert worst > 1.0   # the instances are not all easy: greedy is not an exact solver
    llm = np.r_[np.ones(bins * (bins - 1)), bins]
    sc = _one_dimensional(llm)
    assert proxy(sc, greedy_2d(sc, m, dp, _no_guard(len(llm))), m, dp) == pytest.approx(bins)


@pytest.mark.parametrize("bins", [2, 3, 4, 5, 8])
def test_local_search_repairs_grahams_lpt_worst_case(bins):
    """Greedy (LPT) ends at 4b - 1 on Graham's instance, the optimum is 3b (brute force where
    small): the local search must strictly improve it, and here reaches the optimum, whether the
    bins are microbatches or replicas."""
    llm = _graham(bins)
    if bins <= 4:
        assert _optimum(llm, bins) == 3 * bins
    sc = _one_dimensional(llm)
    for m, dp in ((bins, 1), (1, bins)):
        guard = _no_guard(len(llm))
        start = greedy_2d(sc, m, dp, guard)
        assert proxy(sc, start, m, dp) == pytest.approx(4 * bins - 1)
        out = local_search(sc, start, m, dp, guard)
        assert out.shape == start.shape and 0 <= out.min() and out.max() < m * dp
        assert proxy(sc, out, m, dp) == pytest.approx(3 * bins)


@pytest.mark.parametrize("bins", [2, 3, 4])
def test_portfolio_greedy_member_is_searched(bins):
    """In `partition` the "greedy" member is the greedy followed by the local search: on Graham's
    instance as one microbatch over `bins` replicas (no vision cost, one LLM stage, no overheads,
    so the simulated step is the largest bin's load) it reaches the optimum 3b, while the plain
    LPT member ("lpt1d") stays at 4b - 1."""
    from dflop.costmodel.types import BatchCosts
    from dflop.scheduler.partition import partition

    llm = _graham(bins)
    n, zero = len(llm), np.zeros((1, len(llm)))
    costs = BatchCosts(zero, zero, llm[None] / 3, 2 * llm[None] / 3, np.zeros(1), np.zeros(1), np.zeros(1),
                       np.zeros(1), np.ones((1, n)), np.ones((1, n)), np.full(1, np.inf), np.full(1, np.inf))
    steps = dict(partition(costs, 1, bins, bins, ilp="never").candidates)
    assert steps["lpt1d"] == pytest.approx(4 * bins - 1)
    assert steps["greedy"] == pytest.approx(3 * bins)


def test_local_search_helpers_equal_the_numpy_reductions_they_replace():
    """`_largest_of` (in-place pairwise maxima) and `_all_rows` (one row: its view) give exactly
    np.maximum.reduce and .all(axis=0), inf and NaN included, so local_search's moves are unchanged."""
    from dflop.scheduler.greedy import _all_rows, _largest_of

    rng = np.random.default_rng(0)
    a, b, c = rng.normal(size=(3, 5, 7))
    a[0, 0], b[1, 1], c[2, 2] = np.inf, np.nan, -np.inf
    col = rng.normal(size=(5, 1))
    want = np.maximum.reduce([np.broadcast_to(col, a.shape), a, b, c])
    assert np.array_equal(_largest_of(a, col, b, c), want, equal_nan=True)
    for rows in (1, 3):
        ok = rng.random((rows, 5, 7)) < 0.7
        assert np.array_equal(_all_rows(ok), ok.all(axis=0))
