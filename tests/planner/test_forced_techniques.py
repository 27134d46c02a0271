"""The config's planner section: `auto` lets the planner choose the memory techniques, a value forces
one on (where it applies) or off for the chosen plan and the baselines alike; the predictions
price the techniques a plan names."""

from __future__ import annotations

import numpy as np
import pytest

from dflop.config import Config
from dflop.costmodel.analytic import analytic_cost_model
from dflop.errors import UserError
from dflop.models.handle import ModelHandle
from dflop.plan import Layout, Plan
from dflop.pricing.cluster import Cluster
from dflop.pricing.pool import Pool
from dflop.pricing.pricing import Pricing
from dflop.planner.search import SearchSettings
from dflop.planner.technique_choice import TechniqueSpace
from synthetic_mix import llava_ov_mix


def _space(**keys) -> TechniqueSpace:
    return SearchSettings.from_config(Config.from_dict({"planner": keys}).planner).technique_space


def test_auto_lets_the_planner_choose_everything():
    space = _space()
    assert space.modes == ("none", "selective", "full")
    assert space.leanest(dp_v=2, dp_l=2, tp_l=2) == (True, True, True)
    assert space.may_switch_off() == (True, True)


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_a_forced_recompute_mode_is_the_only_one_searched(mode):
    assert _space(recompute=mode).modes == (mode,)


def test_forced_on_techniques_stay_on_where_they_apply_and_forced_off_never_appear():
    on = _space(shard_optimizer=True, sequence_parallel=True)
    assert on.leanest(dp_v=2, dp_l=4, tp_l=2) == (True, True, True) and on.may_switch_off() == (False, False)
    assert on.leanest(dp_v=1, dp_l=1, tp_l=1) == (False, False, False)  # no replicas to shard over, no TP
    off = _space(shard_optimizer=False, sequence_parallel=False)
    assert off.leanest(dp_v=2, dp_l=4, tp_l=2) == (False, False, False)


def test_config_refuses_unknown_values():
    with pytest.raises(UserError, match="planner.recompute"):
        Config.from_dict({"planner": {"recompute": "some"}})
    with pytest.raises(UserError, match="planner.shard_optimizer"):
        Config.from_dict({"planner": {"shard_optimizer": "yes"}})


def test_the_pricing_charges_the_plan_techniques():
    """Against the cost model's own per-stage answers: full recompute keeps less and takes longer
    on every stage; a sharded optimizer holds less state (`training_state_bytes`)."""
    model = ModelHandle.resolve(Config.from_dict({"model": {"arch": "llava_ov", "vision": "siglip-tiny",
                                                            "llm": "qwen2.5-tiny"}}).model)
    cost = analytic_cost_model(model.config, tp_degrees=[1], dtype="float32")
    cluster = Cluster.from_section(Config.from_dict({}).cluster)
    plan = Plan.uniform(Layout("disjoint", 1, 1, 2, 1, 2, 2, 2), model.n_vision_layers, model.n_llm_layers)
    batch = Pool.from_shapes(llava_ov_mix(16, seed=1))
    off = Pricing.of(plan, cost, model, cluster).batch(batch).costs
    full = Pricing.of(plan.with_forced_techniques("full"), cost, model, cluster).batch(batch).costs
    sharded = Pricing.of(plan.with_forced_techniques(shard_optimizer=True), cost, model, cluster).batch(batch).costs
    with_tiles = batch.n_tiles > 0
    assert (full.llm_act_bytes < off.llm_act_bytes).all() and (full.llm_bwd > off.llm_bwd).all()
    assert (full.vision_act_bytes[:, with_tiles] < off.vision_act_bytes[:, with_tiles]).all()
    np.testing.assert_array_equal(full.llm_fwd, off.llm_fwd)  # recomputation runs in the backward
    # the per-microbatch budget for activations grows by exactly the state a sharded rank does not hold
    state = cost.state_bytes
    for terms, limit_off, limit_sharded, in_flight in (
            (cost.llm_stage_terms([1], n_layers=1, first=True, last=False, tp=1), off.llm_mem_limit_bytes[0],
             sharded.llm_mem_limit_bytes[0], plan.layout.in_flight()[1]),):
        n_params = terms.static.param_bytes / state.param
        saved = n_params * (state.optimizer / 2 - state.param / 2)  # dp 2: half the moments, plus a param shard
        assert limit_sharded - limit_off == pytest.approx(saved / in_flight, rel=1e-9)
