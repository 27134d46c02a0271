"""The HF/LLaVA padded baseline: a microbatch's samples cost what its longest sample costs, each.

References are independent of the padding code: the bins are written out by hand for the
Megatron cut (contiguous replica slices, contiguous microbatches), and the padded price of a bin
is the cost model's own stage terms on ``[Lmax] * k``. The 1F1B simulation is shared with the
packed baseline, so padding can only slow a step (more work per bin, same bins) and changes
nothing when every sample has the same length.
"""

from dataclasses import replace

import numpy as np
import pytest

from dflop.plan import Layout, Plan
from dflop.pricing.cluster import Cluster
from dflop.planner.expected import evaluate_plan, sample_batches
from dflop.scheduler.settings import SchedulerSettings
from dflop.scheduler.padded import price
from dflop.pricing.pool import Pool, TransferSizes
from dflop.pricing.pricing import Pricing
from dflop.planner.search import SearchSettings, search
from dflop.planner.space import ModelShape
from planner_testlib import toy_cost_model, toy_shapes

LV, LL = 2, 6
SHAPE = ModelShape(vision_layers=LV, llm_layers=LL, vision_tp_degrees=(1, 2), llm_tp_degrees=(1, 2), vision_heads=4, llm_heads=4,
                   llm_kv_heads=2, vocab_size=1000, llm_hidden=256, vision_hidden=128, vision_tokens_per_tile=64,
                   llm_tokens_per_tile=64)
SIZES = TransferSizes.for_model(llm_hidden=256, vision_hidden=128, vision_tokens_per_tile=64, dtype="float32")
CLUSTER = Cluster(nodes=1, gpus_per_node=8, gpu_memory_bytes=80e9)
# disjoint: 1 vision stage, 2 LLM stages of 3 layers, dp_l 2, m 2 -> 4 bins of 2 of a batch of 8
PLAN = Plan(Layout("disjoint", 1, 1, 1, 1, 2, 2, 2), (LV,), (3, 3))
# Megatron's cut of 8 samples, by hand: replica 0 takes 0-3, replica 1 takes 4-7, each cut into
# microbatches of 2 -> the LLM bins are the consecutive pairs.
BINS = [[0, 1], [2, 3], [4, 5], [6, 7]]


def _pool(seq_len, tiles=(0, 3, 1, 0, 16, 2, 5, 0)):
    n = len(seq_len)
    tiles = np.asarray(tiles[:n], dtype=np.int64)
    return Pool(np.array([f"s{i}" for i in range(n)]), tiles, np.asarray(seq_len, dtype=np.int64), tiles * 64)


def test_a_padded_bin_costs_k_samples_of_its_longest():
    cost = toy_cost_model()
    batch = _pool([40, 700, 90, 90, 1500, 30, 200, 260])
    no_transfers = TransferSizes(0.0, 0.0)  # so the priced costs are the cost model's terms alone
    c = price(Pricing(PLAN, cost, CLUSTER, no_transfers), batch, "padded").costs
    for samples in BINS:
        lmax = int(batch.seq_len[samples].max())
        for j, n_layers in enumerate(PLAN.llm_layers):
            ref = cost.llm_stage_terms([lmax] * len(samples), n_layers=n_layers, first=j == 0, last=j == 1, tp=1)
            assert c.llm_fwd[j, samples].sum() == pytest.approx(ref.fwd_s.sum(), rel=1e-12)
            assert c.llm_bwd[j, samples].sum() == pytest.approx(ref.bwd_s.sum(), rel=1e-12)
            assert c.llm_act_bytes[j, samples].sum() == pytest.approx(ref.act_bytes.sum(), rel=1e-12)
    # the vision tower is not padded: every sample's own tiles
    vision = cost.vision_stage_terms(batch.n_tiles, n_layers=LV, first=True, last=True, tp=1)
    np.testing.assert_allclose(c.vision_fwd[0], vision.fwd_s, rtol=1e-12)
    np.testing.assert_allclose(c.vision_act_bytes[0], vision.act_bytes, rtol=1e-12)


@pytest.fixture(scope="module")
def sampled():
    pool = Pool.from_shapes(toy_shapes(300, seed=1))
    return pool, sample_batches(len(pool), 3, 8, seed=0)


@pytest.mark.parametrize("layout", [PLAN.layout, Layout("colocated", 1, 1, 2, 1, 1, 2, 2),
                                    Layout("colocated", 1, 1, 1, 1, 2, 1, 4)])
def test_padding_never_speeds_a_step_and_is_free_at_equal_lengths(sampled, layout):
    pool, batches = sampled
    cost = toy_cost_model()
    plan = Plan.uniform(layout, LV, LL)

    def steps(p, policy):
        ev = evaluate_plan(plan, cost, p, batches, CLUSTER, SIZES, SchedulerSettings.planning().with_policy(policy))
        assert ev.ok and ev.policy == policy
        return ev

    packed, padded = steps(pool, "megatron"), steps(pool, "padded")
    assert np.all(padded.step_s >= packed.step_s * (1 - 1e-12))
    assert np.any(padded.step_s > packed.step_s * 1.01)  # the toy pool's lengths vary a lot
    assert np.all(padded.memory_bytes >= packed.memory_bytes * (1 - 1e-12))
    same = replace(pool, seq_len=np.full(len(pool), 333))
    np.testing.assert_allclose(steps(same, "padded").step_s, steps(same, "megatron").step_s, rtol=1e-12)
    np.testing.assert_allclose(steps(same, "padded").memory_bytes, steps(same, "megatron").memory_bytes, rtol=1e-12)


def test_search_reports_both_baselines(sampled):
    pool, _ = sampled
    cluster = Cluster(nodes=1, gpus_per_node=4, gpu_memory_bytes=3e9)
    result = search(toy_cost_model(), SHAPE, pool, cluster,
                    SearchSettings.from_config(global_batch=8, microbatches=(1, 2, 4), sample_batches=2, top_k=4))
    packed, padded = result.baseline.evaluation, result.padded_baseline.evaluation
    assert packed.policy == "megatron" and padded.policy == "padded"
    rows = result.candidates
    for kind, ev in (("baseline", packed), ("baseline_padded", padded)):
        mine = rows[rows["kind"] == kind]
        chosen = mine[mine["status"] == "chosen"]
        assert len(chosen) == 1 and chosen["step_mean_s"].iloc[0] == pytest.approx(ev.mean_s, rel=1e-12)
        assert (mine["status"] == "simulated").sum() >= 1  # a choice among layouts, under this policy
        lay = ev.plan.layout
        assert (chosen["m"].iloc[0], chosen["dp_l"].iloc[0], chosen["pp_l"].iloc[0]) == (lay.m, lay.dp_l, lay.pp_l)
        assert ev.plan.llm_layers == (LL // lay.pp_l,) * lay.pp_l and 8 % (lay.m * lay.dp_l) == 0
    # both searches simulate the same best-ranked layouts, and padding slows each of them
    assert padded.mean_s >= packed.mean_s



def test_a_nan_memory_does_not_fit(sampled):
    """`nan > limit` is False: a NaN activation size (a cost model built in code; the readers refuse
    one in a file) used to "fit" and evaluate to a plan with step times and NaN memory."""
    from dflop.costmodel.model import CostModel, ModuleCosts

    pool, batches = sampled
    cost = toy_cost_model()
    layer = cost.modules[("llm_layer", 1)]
    nan_act = {**layer.coef, "act_bytes": tuple(np.nan for _ in layer.coef["act_bytes"])}
    modules = [m if m is not layer else ModuleCosts(m.module, m.tp, m.features, nan_act, m.param_bytes, m.n_shapes,
                                                    m.profiled_batch, m.profiled_seq_len)
               for m in cost.modules.values()]
    ev = evaluate_plan(PLAN, CostModel(modules, cost.provenance), pool, batches, CLUSTER, SIZES,
                       SchedulerSettings.planning().with_policy("megatron"))
    assert not ev.ok and "needs an undefined (NaN) amount of memory on llm stage" in ev.failure, ev.failure
