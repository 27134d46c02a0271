"""The portfolio registry: each member runs exactly where its predicate says, and the portfolio is
never slower than any member or baseline it holds."""

import numpy as np
import pytest

from dflop.scheduler import portfolio
from dflop.scheduler.partition import POLICIES, greedy_partition, partition
from dflop.scheduler.portfolio import REGISTRY, PortfolioSettings, Situation, active_members

S = PortfolioSettings()
# (n, m, dp): 1, 2, 4, 8 and 16 samples per bin, dp_llm 1 and > 1, few and many microbatches.
LAYOUTS = [(16, 4, 4), (32, 4, 4), (64, 4, 4), (64, 16, 4), (64, 8, 8), (128, 8, 8), (96, 8, 3), (64, 4, 1),
           (64, 16, 1), (256, 16, 2), (256, 32, 8), (48, 1, 3)]


def _names(part):
    return [name for name, _ in part.candidates]


def test_predicates_say_what_the_settings_say():
    """Each gate, checked against its definition over a grid of situations."""
    by_name = {mem.name: mem for mem in REGISTRY}
    for n in (8, 16, 32, 64, 128, 512):
        for m in (1, 2, 4, 8, 16, 32):
            for dp in (1, 2, 4, 8):
                if m * dp > n:
                    continue
                sit = Situation(n, m, dp, dp, 4, 0.5)
                per_bin = n / (m * dp)
                names = {mem.name for mem in active_members(sit, S)}
                assert {"greedy", "lpt1d", "length_grouped", "batch_order"} <= names
                assert ("greedy_regrouped1" in names) == (dp > 1)
                for name in ("lockstep", "lockstep_regrouped"):
                    assert (name in names) == (dp > 1 and per_bin <= S.lockstep_max_items_per_bin)
                low, high = S.profile_items_per_bin
                assert ("profile" in names) == (dp > 1 and low <= per_bin <= high)
                ends = m >= 2 and (4 - 1) / (m + 4 - 1) >= S.ends_min_bubble
                assert all((name in names) == ends for name in by_name if name.startswith("greedy_ends"))
                assert portfolio.sim_applies(sit, S) == (per_bin <= S.sim_max_items_per_bin)
                fallback = {mem.name for mem in active_members(sit, PortfolioSettings(greedy_path_only=True))}
                assert fallback == {name for name in names if by_name[name].greedy_path}
                assert "profile" not in fallback


@pytest.mark.parametrize("n,m,dp", LAYOUTS)
def test_partition_runs_exactly_the_members_that_apply(make_costs, n, m, dp):
    """The candidates `partition` reports are the applicable members (profile may decline: None),
    plus sim_search only where it applies; the ILP only when asked for."""
    _, costs = make_costs(n, seed=n + 7 * m + dp)
    part = partition(costs, m, dp, dp)
    sit = Situation(n, m, dp, dp, costs.pp_vision + costs.pp_llm, portfolio.cost_skew(costs))
    expected = [mem.name for mem in active_members(sit, S)]
    names = _names(part)
    built = [name for name in names if name not in ("sim_search", "ilp")]
    assert built == [name for name in expected if name in built]
    assert set(expected) - set(built) <= {"profile"}
    assert "sim_search" not in names or portfolio.sim_applies(sit, S)
    assert "ilp" not in names and part.ilp_status == "not_run"     # opt-in
    assert part.step_s == min(step for _, step in part.candidates)
    fallback = greedy_partition(costs, m, dp, dp)
    assert set(_names(fallback)) <= {mem.name for mem in REGISTRY if mem.greedy_path}
    assert part.step_s <= fallback.step_s * (1 + 1e-12)


@pytest.mark.parametrize("n,m,dp", LAYOUTS)
def test_never_slower_than_the_baselines_it_holds(make_costs, n, m, dp):
    """lpt1d, length_grouped and batch_order are the baselines' splits, reordered by simulation
    among orders that include batch order: the portfolio never loses to a baseline."""
    shapes, costs = make_costs(n, seed=3 * n + m + dp)
    lengths = shapes.text_tokens.to_numpy()
    ours = partition(costs, m, dp, dp, lengths=lengths, seed=2)
    for policy in POLICIES[1:]:
        base = partition(costs, m, dp, dp, policy=policy, lengths=lengths, seed=2)
        assert ours.step_s <= base.step_s * (1 + 1e-12), policy
    fallback = greedy_partition(costs, m, dp, dp)
    for policy in ("megatron", "lpt1d"):   # llava_group needs the lengths, which the fallback has not
        assert fallback.step_s <= partition(costs, m, dp, dp, policy=policy).step_s * (1 + 1e-12)


@pytest.mark.parametrize("n", [64, 128])
def test_excluding_a_member_removes_it_and_never_speeds_the_candidates_up(make_costs, n):
    """Without sim_search the portfolio is the fastest of its members, so excluding one never makes
    it faster. (With sim_search it can: the search then starts elsewhere, and local search is not
    monotone in its start; the win table measures such removals, it does not assume them.)"""
    _, costs = make_costs(n, seed=21)
    no_sim = frozenset({"sim_search"})
    full = partition(costs, 8, 8, 8, settings=PortfolioSettings(exclude=no_sim))
    assert "sim_search" not in _names(full)
    for name in set(_names(full)):
        part = partition(costs, 8, 8, 8, settings=PortfolioSettings(exclude=no_sim | {name}))
        assert name not in _names(part)
        assert part.step_s >= full.step_s * (1 - 1e-12)


def test_ilp_is_opt_in(make_costs):
    """Off by default; "auto" runs it only where its gate says; "always" everywhere; never slower."""
    _, costs = make_costs(32, seed=4)
    assert partition(costs, 4, 2, 2).ilp_status == "not_run"
    sit = Situation(32, 4, 2, 2, costs.pp_vision + costs.pp_llm, portfolio.cost_skew(costs))
    auto = partition(costs, 4, 2, 2, ilp="auto", budget_s=0.3)
    assert (auto.ilp_status != "not_run") == portfolio.ilp_applies(sit, S)
    tight = PortfolioSettings(ilp_max_vars=10)        # 32 x 8 binaries: over the gate
    assert partition(costs, 4, 2, 2, ilp="auto", settings=tight).ilp_status == "not_run"
    always = partition(costs, 4, 2, 2, ilp="always", budget_s=0.3, settings=tight)
    assert always.ilp_status != "not_run"
    assert always.step_s <= partition(costs, 4, 2, 2).step_s * (1 + 1e-12)
    with pytest.raises(ValueError, match="ilp must be one of"):
        partition(costs, 4, 2, 2, ilp="sometimes")


def test_greedy_path_runs_no_lp_and_no_search(make_costs, monkeypatch):
    """The fallback must stay milliseconds: the profile LP, sim_search and the ILP never run."""
    def boom(*a, **k):
        raise AssertionError("expensive member ran on the greedy path")

    monkeypatch.setattr(portfolio, "profile_partition", boom)
    monkeypatch.setattr(portfolio, "sim_search", boom)
    monkeypatch.setattr(portfolio, "solve_ilp", boom)
    for n, m, dp in ((64, 8, 4), (64, 8, 8), (32, 4, 2)):
        _, costs = make_costs(n, seed=n)
        part = greedy_partition(costs, m, dp, dp)
        assert np.isfinite(part.step_s)


def test_a_member_out_of_room_is_skipped_not_the_batch(make_costs, monkeypatch):
    """The demo's crash (issue 22): with tight memory, the greedy packing order ran out of room on
    one batch (the correction's re-weighted costs) and the whole partition raised, although batch
    order fitted. Now such a member is dropped; the batch fails only when no member fits it."""
    from dflop.scheduler.greedy import MemoryGuardError

    def out_of_room(*a, **k):
        raise MemoryGuardError("sample index 0: fits in no bin under the per-stage memory limits")

    monkeypatch.setattr(portfolio, "greedy_2d_many", out_of_room)
    _, costs = make_costs(32, seed=3)
    part = greedy_partition(costs, 4, 2, 2)
    assert np.isfinite(part.step_s) and part.member in {"batch_order", "length_grouped", "lpt1d", "llava_group"}
    assert sorted(np.concatenate([b for mb in part.bins() for b in mb]).tolist()) == list(range(32))

    raising = portfolio.Member("a", lambda *_: True, out_of_room)
    offered = np.zeros(4, dtype=int)
    errors = []
    built = portfolio.build(None, [raising, portfolio.Member("c", lambda *_: True, lambda ctx: offered)], errors)
    assert [name for name, _ in built] == ["c"] and len(errors) == 1
    with pytest.raises(MemoryGuardError):  # without a place for the errors, the first one is raised
        portfolio.build(None, [raising])


def test_a_batch_no_member_fits_is_a_memory_error(make_costs):
    """When the orders that did not run out of room break the limit anyway (dropped by `score`),
    the batch is a MemoryGuardError, which the planner turns into a rejected layout (an
    IndexError on the empty candidate list crashed `dflop optimize` on the demo's first try)."""
    from dataclasses import replace

    from dflop.scheduler.greedy import MemoryGuardError

    _, costs = make_costs(32, seed=3)
    assert costs.llm_act_bytes.min() > 0
    # Room for the largest sample alone, but 32 samples in 4 x 2 bins need about 4 per bin.
    tight = replace(costs, llm_mem_limit_bytes=costs.llm_act_bytes.max(axis=1) * 1.01)
    with pytest.raises(MemoryGuardError, match="fits in no bin"):
        greedy_partition(tight, 4, 2, 2)
