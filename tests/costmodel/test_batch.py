"""BatchCosts is additive: any grouping of samples reproduces the CostModel's stage predictions
(memory: exactly without transients; with them, a bound at least the stage's exact peak, equal to
it where one module's transient is the largest on every sample)."""

from dataclasses import replace

import numpy as np
import pytest

from dflop.costmodel.fit import fit_profile
from dflop.costmodel.model import CostModel
from dflop.plan import in_flight_1f1b
from dflop.costmodel.profile_table import summarize_profile
from dflop.costmodel.synthetic import synthetic_profile
from dflop.errors import UserError
from dflop.costmodel.batch import batch_costs


@pytest.fixture(scope="module")
def model():
    profile = synthetic_profile(tp_degrees=(1, 2), noise=0.02, seed=3)
    return fit_profile(summarize_profile(profile))[0]


def _random_batch(rng, n):
    tiles = rng.choice([0, 0, 1, 4, 10, 32], size=n)
    seq_len = rng.integers(20, 3000, size=n) + tiles * 50
    return tiles, seq_len


def _without_transients(model: CostModel) -> CostModel:
    return CostModel([replace(m, coef={k: v for k, v in m.coef.items() if not k.startswith("transient")})
                      for m in model.modules.values()], model.provenance, model.step_costs)


@pytest.mark.parametrize("transients", [False, True])
def test_any_grouping_reproduces_stage_predictions(model, transients):
    model = model if transients else _without_transients(model)
    assert model.has_transients == transients

    def check_memory(memory, guarded, last_llm=False):
        """guarded: the peak the memory guard allows this group (`expected.peak_memory`'s form)."""
        if not transients:
            assert memory.total_bytes == pytest.approx(guarded, rel=1e-12)
            return
        assert memory.transient_bytes > 0 and guarded >= memory.total_bytes * (1 - 1e-12)
        if last_llm:  # the LM head's transient is the largest on every sample and per microbatch
            assert guarded == pytest.approx(memory.total_bytes, rel=1e-12)

    rng = np.random.default_rng(0)
    tiles, seq_len = _random_batch(rng, 40)
    vision_layers, llm_layers = [10, 9, 8], [7, 7, 6, 4]
    in_flight = in_flight_1f1b(7, 8)
    limit = 80e9
    costs = batch_costs(model, tiles, seq_len, vision_layers_per_stage=vision_layers, llm_layers_per_stage=llm_layers,
                              tp_v=1, tp_l=2, mem_limit_bytes=limit, in_flight_per_stage=in_flight)
    assert costs.vision_fwd.shape == (3, 40) and costs.llm_fwd.shape == (4, 40)
    for _ in range(5):
        group = rng.choice(40, size=rng.integers(1, 15), replace=False)
        for k, layers in enumerate(vision_layers):
            kw = dict(n_layers=layers, first=k == 0, last=k == 2, tp=1)
            stage = model.vision_stage_time(tiles[group], **kw)
            assert costs.vision_fwd_const[k] + costs.vision_fwd[k, group].sum() == pytest.approx(stage.fwd_s, rel=1e-12)
            assert costs.vision_bwd_const[k] + costs.vision_bwd[k, group].sum() == pytest.approx(stage.bwd_s, rel=1e-12)
            memory = model.vision_stage_memory(tiles[group], in_flight=in_flight[k], **kw)
            slack = costs.vision_mem_limit_bytes[k] - costs.vision_mem_bytes[k, group].sum()
            check_memory(memory, limit - in_flight[k] * slack)
        for j, layers in enumerate(llm_layers):
            kw = dict(n_layers=layers, first=j == 0, last=j == 3, tp=2)
            stage = model.llm_stage_time(seq_len[group], **kw)
            assert costs.llm_fwd_const[j] + costs.llm_fwd[j, group].sum() == pytest.approx(stage.fwd_s, rel=1e-12)
            assert costs.llm_bwd_const[j] + costs.llm_bwd[j, group].sum() == pytest.approx(stage.bwd_s, rel=1e-12)
            memory = model.llm_stage_memory(seq_len[group], in_flight=in_flight[3 + j], **kw)
            slack = costs.llm_mem_limit_bytes[j] - costs.llm_mem_bytes[j, group].sum()
            check_memory(memory, limit - in_flight[3 + j] * slack, last_llm=j == 3)
            assert costs.llm_mem_bytes[j, group].sum() >= costs.llm_act_bytes[j, group].sum()


def test_text_only_samples_cost_nothing_on_vision_stages(model):
    costs = batch_costs(model, [0, 3], [100, 400], vision_layers_per_stage=[12], llm_layers_per_stage=[12],
                              tp_v=1, tp_l=1, mem_limit_bytes=np.inf, in_flight_per_stage=[2, 1])
    assert costs.vision_fwd[0, 0] == 0 and costs.vision_act_bytes[0, 0] == 0
    assert costs.vision_fwd[0, 1] > 0
    assert np.all(np.isinf(costs.llm_mem_limit_bytes))


def test_colocated_layout_folds_the_vision_tower_into_llm_stage_0(model):
    rng = np.random.default_rng(1)
    tiles, seq_len = _random_batch(rng, 12)
    costs = batch_costs(model, tiles, seq_len, vision_layers_per_stage=[27], llm_layers_per_stage=[12, 12],
                              tp_v=2, tp_l=2, mem_limit_bytes=80e9, in_flight_per_stage=[2, 1], colocated=True)
    assert costs.pp_vision == 0 and costs.vision_fwd.shape == (0, 12) and costs.pp_llm == 2
    group = np.array([0, 3, 5, 11])
    stage = model.colocated_stage_time(tiles[group], seq_len[group], vision_layers=27, llm_layers=12, last=False,
                                       tp_v=2, tp_l=2)
    assert costs.llm_fwd_const[0] + costs.llm_fwd[0, group].sum() == pytest.approx(stage.fwd_s, rel=1e-12)
    memory = model.colocated_stage_memory(tiles[group], seq_len[group], vision_layers=27, llm_layers=12, last=False,
                                          tp_v=2, tp_l=2, in_flight=2)
    slack = costs.llm_mem_limit_bytes[0] - costs.llm_mem_bytes[0, group].sum()
    assert 80e9 - 2 * slack >= memory.total_bytes  # the guard's bound of the larger transient
    plain = _without_transients(model)
    costs = batch_costs(plain, tiles, seq_len, vision_layers_per_stage=[27], llm_layers_per_stage=[12, 12],
                        tp_v=2, tp_l=2, mem_limit_bytes=80e9, in_flight_per_stage=[2, 1], colocated=True)
    memory = plain.colocated_stage_memory(tiles[group], seq_len[group], vision_layers=27, llm_layers=12, last=False,
                                          tp_v=2, tp_l=2, in_flight=2)
    slack = costs.llm_mem_limit_bytes[0] - costs.llm_mem_bytes[0, group].sum()
    assert memory.total_bytes == pytest.approx(80e9 - 2 * slack, rel=1e-12)
    # the subset keeps the additive structure (the scheduler's contract)
    sub = costs.subset(group)
    assert sub.llm_fwd[0].sum() == pytest.approx(costs.llm_fwd[0, group].sum())


def test_layout_mistakes_are_one_line_errors(model):
    kw = dict(tp_v=1, tp_l=1, mem_limit_bytes=1e9)
    with pytest.raises(UserError, match=r"^n_tiles has 2 samples but seq_len has 1$"):
        batch_costs(model, [1, 2], [5], vision_layers_per_stage=[1], llm_layers_per_stage=[1],
                          in_flight_per_stage=[2, 1], **kw)
    with pytest.raises(UserError, match=r"in_flight_per_stage has 2 entries, expected 3 \(disjoint: pp_v \+ pp_l\)"):
        batch_costs(model, [1], [5], vision_layers_per_stage=[1], llm_layers_per_stage=[1, 1],
                          in_flight_per_stage=[2, 1], **kw)
    with pytest.raises(UserError, match="vision_layers_per_stage must have one entry, got 2"):
        batch_costs(model, [1], [5], vision_layers_per_stage=[1, 1], llm_layers_per_stage=[1],
                          in_flight_per_stage=[1], colocated=True, **kw)
    with pytest.raises(UserError, match=r"^in_flight_per_stage\[1\] must be >= 1, got 0$"):
        batch_costs(model, [1], [5], vision_layers_per_stage=[1], llm_layers_per_stage=[1],
                          in_flight_per_stage=[1, 0], **kw)
    with pytest.raises(UserError, match=r"^no profile for vision_layer at tp=4; profiled tp: 1, 2$"):
        batch_costs(model, [1], [5], vision_layers_per_stage=[1], llm_layers_per_stage=[1],
                          in_flight_per_stage=[2, 1], tp_v=4, tp_l=1, mem_limit_bytes=1e9)
