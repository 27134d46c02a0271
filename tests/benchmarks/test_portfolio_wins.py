"""The win table: its portfolio for any member subset is `partition` with the others excluded, and
it sees a member that earns its place and one that does not."""

import numpy as np
import pytest

from dflop.scheduler import baselines, portfolio
from dflop.scheduler.partition import partition
from dflop.scheduler.portfolio import REGISTRY, Member, PortfolioSettings
from portfolio_wins import SIM, eliminate, make_instance, member_names, row_table, win_table

# 1 sample per bin (sim_search runs), 2 per bin (profile runs), 16 per bin with light ends.
LAYOUTS = [(64, 8, 8), (128, 8, 8), (64, 4, 1)]


@pytest.fixture
def batches(make_costs):
    return [(make_costs(n, seed=10 * k + b)[1], m, dp, b) for k, (n, m, dp) in enumerate(LAYOUTS) for b in range(2)]


def _insts(batches, **kw):
    return [make_instance(costs, m, dp, batch=b, dataset="mix", **kw) for costs, m, dp, b in batches]


def test_subset_step_is_partition_with_the_others_excluded(batches):
    insts = _insts(batches)
    names = member_names(insts)
    for inst, (costs, m, dp, b) in zip(insts, batches):
        full = partition(costs, m, dp, dp, seed=b)
        assert inst.step(frozenset(names)) == full.step_s
        winner = full.member
        starts = [c.member for c in portfolio.sim_starts(inst.cands, PortfolioSettings().sim_starts)]
        for drop in ({winner}, {"greedy"}, set(starts), {SIM}, {winner, SIM}):
            settings = PortfolioSettings(exclude=frozenset(drop))
            assert inst.step(frozenset(names) - drop) == partition(costs, m, dp, dp, seed=b, settings=settings).step_s


def test_a_member_that_wins_earns_and_its_removal_shows(batches, monkeypatch):
    insts = _insts(batches)
    table = win_table(insts, member_names(insts)).set_index("member")
    for name, row in table.iterrows():                       # margins are over the runner-up
        assert (row.wins == 0) == np.isnan(row.margin_median)
        assert row.wins == 0 or row.margin_max > 1.001
    assert table.loc["profile", "earns"] and table.loc[SIM, "earns"]
    # Take "profile" out of the registry: the table no longer lists it, and the rows it won are slower.
    monkeypatch.setattr(portfolio, "REGISTRY", tuple(mem for mem in REGISTRY if mem.name != "profile"))
    without = _insts(batches)
    assert "profile" not in member_names(without)
    after = row_table(insts, member_names(insts), member_names(without)).set_index(["n", "m", "dp"])
    assert after.loc[(128, 8, 8), "ratio"] > 1.001           # 2 per bin: where profile runs
    assert np.allclose(after.loc[(64, 8, 8), "ratio"], 1.0)   # 1 per bin: it does not


def test_a_copy_of_a_member_earns_nothing_and_is_eliminated(batches, monkeypatch):
    """A tie earns no place: with batch_order registered twice, each copy alone costs nothing to
    remove, and elimination keeps exactly one of them."""
    copy = Member("batch_order_copy", lambda sit, s: True, lambda c: baselines.megatron(c.sit.n, c.sit.m, c.sit.dp_llm))
    monkeypatch.setattr(portfolio, "REGISTRY", REGISTRY + (copy,))
    insts = _insts(batches)
    names = member_names(insts)
    table = win_table(insts, names).set_index("member")
    assert table.loc["batch_order_copy", "wins"] == 0 and not table.loc["batch_order_copy", "earns"]
    assert table.loc["batch_order_copy", "row_loss_max"] == 0.0
    kept, removed = eliminate(insts, names)
    assert ("batch_order" in kept) + ("batch_order_copy" in kept) <= 1
    assert "batch_order_copy" in removed.member.tolist()
    final = win_table(insts, kept)
    assert final.earns.all() and set(final.member) == set(kept)
    # Every member kept is needed: removing any one of them slows some row down measurably.
    rows = row_table(insts, names, kept)
    assert (rows.ratio <= 1.001).all()                      # what was removed cost under the threshold per row


def test_win_table_counts_are_consistent(batches):
    insts = _insts(batches)
    table = win_table(insts, member_names(insts))
    assert (table.wins + table.ties <= table.batches_run).all()
    assert (table.rows_won <= table.rows_run).all()
    # One winner per batch at most (wins are strict by the threshold).
    assert table.wins.sum() <= len(insts)
    assert list(table.member) == member_names(insts)
    assert table.earns.tolist() == ((table.rows_hurt >= 1) | (table.fb_rows_hurt >= 1)).tolist()
    off_path = table.member.isin(["profile", SIM])            # not on the greedy path: no fallback loss
    assert table[off_path].fb_row_loss_max.isna().all() and table[~off_path].fb_row_loss_max.notna().all()


def test_fallback_step_is_greedy_partition(batches):
    from dflop.scheduler.partition import greedy_partition

    insts = _insts(batches)
    names = frozenset(member_names(insts))
    for inst, (costs, m, dp, b) in zip(insts, batches):
        assert inst.step(names, fallback=True) == greedy_partition(costs, m, dp, dp).step_s


def test_gate_gains_compare_the_gated_portfolio_with_one_gate_opened(batches):
    """Built with every gate open, the members the default gates allow reproduce `partition`'s
    default answer, and all of them `partition` with the gates open; a listed gain is that of a
    member the default gates keep out of the row."""
    from portfolio_wins import OPEN_GATES, gate_gains

    insts = _insts(batches, settings=OPEN_GATES)
    by_name = {mem.name: mem for mem in REGISTRY}
    for inst, (costs, m, dp, b) in zip(insts, batches):
        gated = frozenset(c.member for c in inst.cands if by_name[c.member].applies(inst.ctx.sit, PortfolioSettings()))
        assert inst.step(gated | {SIM}) == partition(costs, m, dp, dp, seed=b).step_s
        assert inst.step(frozenset(member_names(insts))) == partition(costs, m, dp, dp, seed=b, settings=OPEN_GATES).step_s
    gains = gate_gains(insts, threshold=0.0)
    for row in gains.itertuples():
        sits = [i.ctx.sit for i in insts if (i.n, i.m, i.dp) == (row.n, row.m, row.dp)]
        assert not all(by_name[row.member].applies(sit, PortfolioSettings()) for sit in sits)
