"""The config's planner section forces memory techniques into every plan the planner simulates and
writes (the chosen one and the data-blind baseline); `auto` means off until the planner chooses
them (next issue), and the predictions price them."""

from __future__ import annotations

import numpy as np
import pytest

from dflop.config import Config
from dflop.costmodel.analytic import analytic_cost_model
from dflop.errors import UserError
from dflop.models.handle import ModelHandle
from dflop.plan import Layout, Plan, Techniques
from dflop.planner.cluster import Cluster
from dflop.planner.means import Pool
from dflop.planner.pricing import Pricing
from dflop.planner.search import SearchSettings
from synthetic_mix import llava_ov_mix


def _plan(tp_v: int = 1, tp_l: int = 2) -> Plan:
    return Plan(Layout("disjoint", tp_v, 2, 1, tp_l, 2, 1, 4), (1, 1), (1, 1))


def _settings(**keys) -> SearchSettings:
    return SearchSettings(**SearchSettings.techniques_of(Config.from_dict({"planner": keys}).planner))


def test_auto_means_off():
    assert _settings().with_techniques(_plan()) == _plan()


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_a_forced_recompute_mode_applies_to_every_stage_of_both_modules(mode):
    plan = _settings(recompute=mode, shard_optimizer=True).with_techniques(_plan(tp_l=1))
    assert plan.vision_techniques == Techniques((mode, mode), shard_optimizer=True)
    assert plan.llm_techniques == Techniques((mode, mode), shard_optimizer=True)


def test_sharding_is_forced_also_with_tensor_parallelism():
    plan = _settings(shard_optimizer=True, sequence_parallel=True).with_techniques(_plan(tp_v=1, tp_l=2))
    assert plan.vision_techniques.shard_optimizer and plan.llm_techniques.shard_optimizer
    assert plan.llm_techniques.sequence_parallel


def test_sequence_parallel_only_for_the_llm_and_where_there_is_tensor_parallelism():
    plan = _settings(sequence_parallel=True).with_techniques(_plan(tp_v=2, tp_l=2))
    assert plan.llm_techniques.sequence_parallel and not plan.vision_techniques.sequence_parallel
    assert not _settings(sequence_parallel=True).with_techniques(_plan(tp_l=1)).llm_techniques.sequence_parallel


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
