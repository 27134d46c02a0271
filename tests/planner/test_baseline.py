"""The data-blind baseline against brute force over every data-blind layout.

Every speed-up the planner reports is measured against this baseline, so a baseline that keeps a
slow layout inflates every claim. The reference here simulates every layout `baseline_layouts`
lists (uniform split, fixed-count microbatches) with the same evaluate function and takes the
fastest that fits.
"""

import numpy as np
import pytest

from dflop.plan import Layout, Plan
from dflop.planner.baseline import baseline_layouts, search_baseline
from dflop.pricing.cluster import Cluster
from dflop.planner.expected import evaluate_plan, sample_batches
from dflop.scheduler.settings import SchedulerSettings
from dflop.pricing.pool import Pool, TransferSizes
from dflop.planner.search import bin_granularity, prepare_means
from dflop.planner.space import ModelShape, build_space
from dflop.planner.stages import TransferMeans, build_stage_model
from planner_testlib import toy_cost_model, toy_shapes

LV, LL, B, K = 2, 6, 8, 2   # 6 LLM layers: uniform splits over pp = 1, 2, 3 (and 6)
SHAPE = ModelShape(vision_layers=LV, llm_layers=LL, vision_tp_degrees=(1, 2), llm_tp_degrees=(1, 2), vision_heads=4, llm_heads=4,
                   llm_kv_heads=2, vocab_size=1000, llm_hidden=256, vision_hidden=128, vision_tokens_per_tile=64,
                   llm_tokens_per_tile=64)
# (GPU memory, GPUs, GPUs per node): memory that rejects some uniform splits and some sampled
# batches, and memory that lets every layout run.
CASES = [(1.6e9, 4, 4), (3.0e9, 4, 2), (1.2e9, 8, 4)]


def _setup(memory, world, per_node):
    pool = Pool.from_shapes(toy_shapes(300, seed=1))
    cost = toy_cost_model()
    cluster = Cluster(nodes=world // per_node, gpus_per_node=per_node, gpu_memory_bytes=memory,
                      inter_node_bytes_per_s=2e9)
    space, _ = build_space(SHAPE, cost, cluster, placements=("colocated",), microbatches=(1, 2, 4), global_batch=B,
                           mean_tiles=float(pool.n_tiles.mean()))
    means = prepare_means(cost, SHAPE, pool, space)
    vision, llm = means.for_times()
    sizes = TransferSizes.for_model(llm_hidden=256, vision_hidden=128, vision_tokens_per_tile=64, dtype="float32")
    transfer = TransferMeans.of(pool, sizes)
    batches = sample_batches(len(pool), K, B, seed=0)

    def evaluate(plan):
        return evaluate_plan(plan, cost, pool, batches, cluster, sizes, SchedulerSettings.planning().with_policy("megatron"))

    return space, means, vision, llm, cluster, transfer, bin_granularity(cost, pool, space), evaluate


@pytest.mark.parametrize("memory,world,per_node", CASES)
def test_baseline_is_the_fastest_data_blind_layout_that_fits(memory, world, per_node):
    space, means, vision, llm, cluster, transfer, granularity, evaluate = _setup(memory, world, per_node)
    layouts, _ = baseline_layouts(space, cluster)
    # Brute force: the uniform split of every layout, simulated when it fits.
    steps = {}
    for lay in layouts:
        plan = Plan(lay, (LV,), (LL // lay.pp_l,) * lay.pp_l)
        sm = build_stage_model(lay, vision[lay.tp_v], llm[lay.tp_l], cluster=cluster, global_batch=B,
                               transfer=transfer, granularity=granularity)
        if sm.fits(sm.split_of(plan)):
            ev = evaluate(plan)
            if ev.ok:
                steps[plan] = ev.mean_s
    assert len(set(steps.values())) >= 2, "the instance must offer a choice between layouts"
    result = search_baseline(space, means, cluster, transfer, granularity, evaluate, simulate=len(layouts))
    assert result.evaluation.plan in steps
    assert result.evaluation.mean_s == pytest.approx(min(steps.values()), rel=1e-12)
    assert result.evaluation.mean_s < max(steps.values())
    chosen = [r for r in result.rows if r["status"] == "chosen"]
    assert len(chosen) == 1 and chosen[0]["pp_l"] == result.evaluation.plan.layout.pp_l


@pytest.mark.parametrize("memory,world,per_node", CASES)
def test_pruned_baseline_is_the_fastest_layout_it_simulated(memory, world, per_node):
    """With `simulate` pruning the choice is the fastest of the layouts actually simulated, and
    every layout it simulated ranks among the best by the mean-shape step."""
    space, means, vision, llm, cluster, transfer, granularity, evaluate = _setup(memory, world, per_node)
    result = search_baseline(space, means, cluster, transfer, granularity, evaluate, simulate=2)
    ran = [r for r in result.rows if r["status"] in ("simulated", "chosen")]
    assert len(ran) >= 1
    best = min(ran, key=lambda r: r["step_mean_s"])
    assert best["status"] == "chosen"
    assert result.evaluation.mean_s == pytest.approx(best["step_mean_s"], rel=1e-12)
    pruned = [r["mean_shape_step_s"] for r in result.rows if r["status"] == "pruned"]
    tried = [r["mean_shape_step_s"] for r in result.rows if "mean_shape_step_s" in r and r["status"] != "pruned"]
    assert not pruned or max(tried) <= min(pruned) * (1 + 1e-12)
    assert np.isfinite(result.evaluation.mean_s)


@pytest.mark.parametrize("memory,world,per_node", CASES[:1])
def test_a_layout_named_in_also_is_simulated_whatever_its_rank(memory, world, per_node):
    """search() passes the padded baseline's layout here so the packed baseline also simulates it:
    the worst-ranked layout, named in `also`, must be simulated even with simulate=1."""
    space, means, vision, llm, cluster, transfer, granularity, evaluate = _setup(memory, world, per_node)
    plain = search_baseline(space, means, cluster, transfer, granularity, evaluate, simulate=1)
    pruned = [r for r in plain.rows if r["status"] == "pruned"]
    assert pruned, "the instance must prune some layout"
    last = pruned[-1]
    layout = Layout("colocated", last["tp_v"], last["pp_v"], last["dp_v"], last["tp_l"], last["pp_l"], last["dp_l"],
                    last["m"])
    result = search_baseline(space, means, cluster, transfer, granularity, evaluate, simulate=1, also=(layout,))
    ran = [r for r in result.rows if r["status"] in ("simulated", "chosen")]
    assert any((r["pp_l"], r["dp_l"], r["m"], r["tp_l"]) == (layout.pp_l, layout.dp_l, layout.m, layout.tp_l)
               for r in ran)


def test_encoder_stage_layouts_by_hand():
    """Megatron-Core's encoder stage: one vision tower (TP 1) per LLM replica, uniform LLM split.
    16 GPUs in 8-GPU nodes, 4 LLM layers, batch 16; worked out by hand: the world must fill whole
    nodes (or part of one), the vision ranks before the LLM must be a multiple of the LLM's TP, dp is
    the largest such count and the largest one dividing the batch, and m x dp divides the batch."""
    from dflop.planner.baseline import _encoder_stage_layouts
    from dflop.planner.screen import SearchSpace

    space = SearchSpace(vision_tp=(1,), llm_tp=(1, 2), colocated_tp=(), shared_tp=(), microbatches=(1, 2, 4),
                        placements=("disjoint",), vision_layers=2, llm_layers=4, global_batch=16, mean_tiles=1.0)
    cluster = Cluster(nodes=2, gpus_per_node=8, gpu_memory_bytes=1e9)
    expected = {("disjoint", 1, 1, 8, 1, 1, 8, m) for m in (1, 2)}           # 2 ranks x 8 = 16 GPUs
    expected |= {("disjoint", 1, 1, 2, 1, 2, 2, m) for m in (1, 2, 4)}       # 3 x 2 = 6 (12, 9, 15 fill no node)
    expected |= {("disjoint", 1, 1, 1, 1, 4, 1, m) for m in (1, 2, 4)}       # 5 x 1 (10, 15 fill no node)
    expected |= {("disjoint", 1, 1, 2, 2, 1, 2, m) for m in (1, 2, 4)}       # tp 2: even vision ranks; 3 x 2 = 6
    got = {(lay.placement, lay.tp_v, lay.pp_v, lay.dp_v, lay.tp_l, lay.pp_l, lay.dp_l, lay.m)
           for lay in _encoder_stage_layouts(space, cluster)}
    assert got == expected
    # An encoder TP above the LLM's is refused by Megatron-Core: vision TP 2 pairs with LLM TP 2 only.
    # 2 + 2 x pp ranks per replica: pp 1 -> dp 4 (16 GPUs); pp 2 -> 6 ranks, dp 2 would be 12 GPUs
    # (no whole node), so dp 1; pp 4 -> 10 ranks, more than a node and not whole nodes: none.
    wider = SearchSpace(vision_tp=(2,), llm_tp=(1, 2), colocated_tp=(), shared_tp=(), microbatches=(1, 2, 4),
                        placements=("disjoint",), vision_layers=2, llm_layers=4, global_batch=16, mean_tiles=1.0)
    got = {(lay.tp_v, lay.tp_l, lay.pp_l, lay.dp_l, lay.m) for lay in _encoder_stage_layouts(wider, cluster)}
    assert got == {(2, 2, 1, 4, m) for m in (1, 2, 4)} | {(2, 2, 2, 1, m) for m in (1, 2, 4)}


def test_sampled_batches_come_in_the_trainers_shuffled_order():
    """The data-blind baseline cuts microbatches from the batch in order, so the planner must see
    batches ordered as the trainer draws them. A pool of two datasets one after the other (150
    cheap samples, then 150 heavy ones): the heaviest of 4 contiguous microbatches holds as many
    heavy samples, on average over batches, as with the trainer's `GlobalBatches`; sorted by pool
    index, one microbatch would hold nearly only heavy samples."""
    from dflop.scheduler.baselines import megatron
    from dflop.scheduler.online import GlobalBatches

    n, batch, m, k = 300, 16, 4, 600
    heavy = np.arange(n) >= 150

    def heaviest_microbatch(rows):
        return np.bincount(megatron(batch, m, 1), weights=heavy[rows], minlength=m).max()

    planned = np.mean([heaviest_microbatch(rows) for rows in sample_batches(n, k, batch, seed=0)])
    trainer = GlobalBatches(n, batch, seed=0)
    trained = np.mean([heaviest_microbatch(trainer.rows(step)) for step in range(k)])
    assert planned == pytest.approx(trained, rel=0.05)
    assert trained < 0.85 * (batch // m)  # the sorted order would give ~ batch // m
