"""Global batches, vision shares and step plans (what rank 0 broadcasts)."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest

from dflop.errors import UserError
from dflop.plan import plan_from_dict
from dflop.scheduler.online import GlobalBatches, StepPlanner, share_by_cost
from dflop.shapes import numpy_backed
from synthetic_costs import AnalyticCostModel, StageLayout, batch_costs_from_shapes


def test_global_batches_are_seeded_and_cover_each_epoch_once():
    batches = GlobalBatches(n_samples=50, batch_size=8, seed=3)
    assert batches.per_epoch == 6
    epoch0 = np.concatenate([batches.rows(s) for s in range(6)])
    assert len(set(epoch0)) == 48 and epoch0.max() < 50
    assert not np.array_equal(batches.rows(0), batches.rows(6))  # a new permutation per epoch
    again = GlobalBatches(50, 8, seed=3)
    assert all(np.array_equal(batches.rows(s), again.rows(s)) for s in range(14))
    assert not np.array_equal(GlobalBatches(50, 8, seed=4).rows(0), batches.rows(0))
    with pytest.raises(UserError, match="global_batch_size is 8 but the data has only 5"):
        GlobalBatches(5, 8, 0)


def test_global_batches_rows_are_each_epochs_own_permutation_in_any_order():
    """Rows against a generator seeded afresh for every call (what `rows` computed before it kept
    the last epoch's order): steps asked across epochs and back, and a caller that writes into
    the rows it got does not change the next answer."""
    batches = GlobalBatches(n_samples=30, batch_size=7, seed=5)  # 4 batches per epoch, 2 samples left over

    def reference(step):
        epoch, index = divmod(step, 4)
        return np.random.default_rng([5, epoch]).permutation(30)[index * 7:(index + 1) * 7]

    for step in [0, 1, 5, 4, 2, 9, 3, 8, 0]:
        rows = batches.rows(step)
        np.testing.assert_array_equal(rows, reference(step))
        rows[:] = -1
        np.testing.assert_array_equal(batches.rows(step), reference(step))


def test_string_columns_become_objects_and_nothing_else_changes():
    import pyarrow as pa

    table = pa.table({"sample_id": ["a", "b", "c"], "dataset": ["d", "d", "e"], "n_tiles": pa.array([0, 5, 1], pa.int32()),
                      "seq_len": [10, 20, 30]})
    shapes = table.to_pandas()
    assert shapes["sample_id"].dtype != object  # pandas 3: Arrow-backed strings (else this checks nothing)
    plain = numpy_backed(shapes)
    assert plain["sample_id"].dtype == object and plain["dataset"].dtype == object
    assert plain["n_tiles"].dtype == shapes["n_tiles"].dtype and plain["seq_len"].dtype == shapes["seq_len"].dtype
    assert list(plain.columns) == list(shapes.columns)
    for column in shapes.columns:
        assert plain[column].tolist() == shapes[column].tolist()
    assert plain.iloc[[2, 0]]["sample_id"].tolist() == ["c", "a"]


def _best_split(costs: np.ndarray, k: int) -> float:
    """Brute force: the smallest possible largest share."""
    best = np.inf
    for assignment in itertools.product(range(k), repeat=len(costs)):
        loads = np.bincount(assignment, weights=costs, minlength=k)
        best = min(best, loads.max())
    return best


@pytest.mark.parametrize("seed", range(6))
def test_vision_shares_are_within_lpt_bound_of_the_optimum(seed):
    rng = np.random.default_rng(seed)
    costs = rng.lognormal(0, 1, size=7)
    for k in (2, 3):
        shares = share_by_cost(range(7), costs, k)
        assert sorted(i for s in shares for i in s) == list(range(7))
        largest = max(costs[list(s)].sum() for s in shares)
        assert largest <= (4 / 3 - 1 / (3 * k)) * _best_split(costs, k) + 1e-12  # Graham's LPT bound


def _pool(n=24, seed=0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    tiles = rng.choice([0, 1, 5, 17, 32], size=n)
    seq = rng.integers(40, 900, size=n)
    return pd.DataFrame({"sample_id": [f"s{i}" for i in range(n)], "dataset": "d", "n_tiles": tiles,
                         "vision_tokens": tiles * 10, "seq_len": seq + tiles * 10})


def _planner(placement="disjoint", policy="dflop", vision_dp=2):
    plan = plan_from_dict({"vision": {"tp": 1, "pp": 1, "dp": vision_dp if placement == "disjoint" else 2,
                                      "layers_per_stage": [2]},
                           "llm": {"tp": 1, "pp": 2, "dp": 2, "layers_per_stage": [1, 1]},
                           "placement": placement, "microbatches": 3, "global_batch_size": 12,
                           "world_size": 4 + (vision_dp if placement == "disjoint" else 0)}).plan
    layout = StageLayout(vision_layer_share=(1.0,), llm_layer_share=(0.5, 0.5))
    pool = _pool()
    return StepPlanner(pool, GlobalBatches(len(pool), 12, seed=1), plan,
                       lambda rows: batch_costs_from_shapes(pool.iloc[rows].reset_index(drop=True), layout,
                                                            AnalyticCostModel()),
                       lambda s: s["vision_tokens"].to_numpy(), policy=policy, budget_s=0.05, total_steps=4), pool


@pytest.mark.parametrize("placement", ["disjoint", "colocated"])
@pytest.mark.parametrize("policy", ["dflop", "megatron"])
def test_step_plan_covers_the_batch_once(placement, policy):
    planner, pool = _planner(placement, policy)
    try:
        for step in range(2):
            plan = planner.get(step)
            assert plan.step == step and len(plan.rows) == 12
            assert list(plan.rows) == list(planner.batches.rows(step))
            assert list(plan.n_tiles) == pool["n_tiles"].to_numpy()[list(plan.rows)].tolist()
            in_bins = sorted(i for mb in plan.bins for b in mb for i in b)
            assert in_bins == list(range(12)) and len(plan.bins) == 3 and all(len(mb) == 2 for mb in plan.bins)
            for mb, shares in zip(plan.bins, plan.vision_shares):
                with_tiles = sorted(i for b in mb for i in b if plan.n_tiles[i] > 0)
                assert sorted(i for s in shares for i in s) == with_tiles
                if placement == "colocated":
                    assert [list(s) for s in shares] == [[i for i in b if plan.n_tiles[i] > 0] for b in mb]
            if policy == "megatron":
                assert plan.member == "megatron"
            elif step == 0:  # the first step waits for the portfolio; later ones may fall back
                assert not plan.member.startswith("fallback")
    finally:
        planner.close()


@pytest.mark.parametrize("policy", ["dflop", "megatron"])
def test_a_step_asked_again_or_out_of_order_gets_its_own_batch(policy):
    """Rank 0 keeps each submitted batch's rows until `get` takes them; a step asked a second
    time, after a later step, or after `replan` must still get its own global batch."""
    planner, pool = _planner("colocated", policy)
    try:
        for step in (0, 2, 1, 1):
            plan = planner.get(step)
            assert list(plan.rows) == list(planner.batches.rows(step))
            assert list(plan.seq_len) == pool["seq_len"].to_numpy()[list(plan.rows)].tolist()
        replaced = planner.replan(plan, planner.batches.rows(3))
        assert list(replaced.rows) == list(planner.batches.rows(3))
        again = planner.get(1)
        assert list(again.seq_len) == pool["seq_len"].to_numpy()[list(planner.batches.rows(1))].tolist()
    finally:
        planner.close()


def test_baseline_cuts_contiguous_equal_counts():
    planner, _ = _planner(policy="megatron")
    try:
        plan = planner.get(0)
    finally:
        planner.close()
    assert [list(b) for mb in plan.bins for b in mb] == [[0, 1], [6, 7], [2, 3], [8, 9], [4, 5], [10, 11]]


def test_plans_carry_the_profiled_and_the_corrected_prediction():
    """A correction that scales every cost by c (and adds a step overhead o) gives, for whatever
    partition the scheduler picks, corrected = c * profiled + o (1F1B is linear in the stage times,
    and this planner charges no send latency or all-reduce); the profiled prediction and its bound
    stay unscaled even though the gate is on and the scheduler solved with the corrected costs."""
    planner, _ = _planner()
    c, o = 3.0, 0.25
    corr = planner.correction
    try:
        plain = planner.get(0)
        assert np.isnan(plain.corrected_step_s) and not plain.correction_active  # nothing learned yet
        for mod in ("vision", "llm"):
            corr.factors_[mod][:] = c
        corr.n_obs_, corr.active, corr.step_overhead_s_ = 1, True, o
        later = [planner.get(step) for step in (1, 2, 3)]
    finally:
        planner.close()
    for p in later:
        assert p.corrected_step_s == pytest.approx(c * p.predicted_step_s + o, rel=1e-9)
        assert p.predicted_step_s >= p.lower_bound_s * (1 - 1e-9)
        assert p.predicted_step_s < 2 * p.lower_bound_s  # not the corrected (c x) step over the profiled bound
    assert any(p.correction_active for p in later)  # steps solved ahead, before the change, are not


def test_zb_h1_plan_predicts_its_zb_h1_step():
    """A zb-h1 plan's predicted step is its partition timed under ZB-H1 with the batch's W share,
    the simulator called directly on the partition's stage times (`dflop.sim.simulate_dp`), as the
    planner prices it (`schedule_timeline`); the same batches under the 1F1B plan keep 1F1B's step.
    Bug caught: the prediction left as the partition's 1F1B step (the schedule or the W share not
    passed to the simulation), or a W share other than the batch's."""
    from dflop.scheduler.evaluate import stage_times
    from dflop.sim import simulate_dp

    doc = {"vision": {"tp": 1, "pp": 1, "dp": 2, "layers_per_stage": [2]},
           "llm": {"tp": 1, "pp": 2, "dp": 1, "layers_per_stage": [1, 1], "schedule": "zb-h1"},
           "placement": "disjoint", "microbatches": 2, "global_batch_size": 12, "world_size": 4}
    layout = StageLayout(vision_layer_share=(1.0,), llm_layer_share=(0.5, 0.5))
    pool = _pool()
    costs_fn = lambda rows: batch_costs_from_shapes(pool.iloc[rows].reset_index(drop=True), layout, AnalyticCostModel())
    frac_fn = lambda rows: 0.2 + 0.5 * float(pool["seq_len"].to_numpy()[rows].mean()) / 1200  # data-dependent
    zb = plan_from_dict(doc).plan
    with pytest.raises(ValueError, match="zb-h1 plan needs wgrad_frac_fn"):
        StepPlanner(pool, GlobalBatches(len(pool), 12, seed=1), zb, costs_fn, lambda s: s["vision_tokens"].to_numpy())
    doc["llm"]["schedule"] = "1f1b"
    plain = plan_from_dict(doc).plan
    planners = {p: StepPlanner(pool, GlobalBatches(len(pool), 12, seed=1), p, costs_fn,
                               lambda s: s["vision_tokens"].to_numpy(), policy="megatron", total_steps=3,
                               wgrad_frac_fn=frac_fn, p2p_s=1e-3) for p in (zb, plain)}
    try:
        for step in range(3):
            got = {p: sp.get(step) for p, sp in planners.items()}
            rows = np.array(got[zb].rows)
            assert got[zb].bins == got[plain].bins  # megatron: the same fixed-count partition
            costs = costs_fn(rows)
            part = planners[zb]._costs[step][2]
            t = stage_times(costs, part.microbatch, part.replica, part.m, part.dp_llm, part.dp_vision)
            ref = {s: simulate_dp(t.vision_fwd, t.vision_bwd, t.llm_fwd, t.llm_bwd, order=part.order, p2p_s=1e-3,
                                  schedule=s, wgrad_frac=frac_fn(rows)).step_s for s in ("zb-h1", "1f1b")}
            assert got[zb].predicted_step_s == pytest.approx(ref["zb-h1"], rel=1e-12)
            assert got[plain].predicted_step_s == pytest.approx(ref["1f1b"], rel=1e-12)
            assert ref["zb-h1"] < ref["1f1b"] * (1 - 1e-3)
            other = simulate_dp(t.vision_fwd, t.vision_bwd, t.llm_fwd, t.llm_bwd, order=part.order, p2p_s=1e-3,
                                schedule="zb-h1", wgrad_frac=0.5).step_s
            assert other != pytest.approx(ref["zb-h1"], rel=1e-9)  # the W share matters here
    finally:
        for sp in planners.values():
            sp.close()
