"""The whole search (screen + MILP + simulation) against brute force, and the constraints of its plans."""

import numpy as np
import pytest

from dflop.errors import UserError
from dflop.pricing.cluster import Cluster
from dflop.planner.expected import evaluate_plan, sample_batches
from dflop.pricing.pool import Pool, TransferSizes
from dflop.planner.search import SearchSettings, prepare_means, search
from dflop.planner.space import ModelShape, build_space
from dflop.planner.stages import TransferMeans, build_stage_model
from planner_testlib import all_splits, enumerate_layouts, toy_cost_model, toy_shapes

LV, LL, B, K = 2, 5, 8, 3
SHAPE = ModelShape(vision_layers=LV, llm_layers=LL, vision_tp_degrees=(1, 2), llm_tp_degrees=(1, 2), vision_heads=4, llm_heads=4,
                   llm_kv_heads=2, vocab_size=1000, llm_hidden=256, vision_hidden=128, vision_tokens_per_tile=64,
                   llm_tokens_per_tile=64)
# (GPU memory, GPUs, GPUs per node, vision time factor): tight and loose memory, vision-light and -heavy
CASES = [(1.6e9, 2, 2, 1.0), (1.0e9, 4, 2, 1.0), (2.0e9, 4, 2, 8.0)]


@pytest.fixture(scope="module")
def pool():
    return Pool.from_shapes(toy_shapes(300, seed=1))


def brute_force(cost, pool, cluster, settings):
    """Simulate every split of every layout on the same batches; the lowest mean step (ties: fewer GPUs)."""
    space, _ = build_space(SHAPE, cost, cluster, placements=settings.planner.placements, microbatches=settings.planner.microbatches,
                           global_batch=B, mean_tiles=float(pool.n_tiles.mean()))
    means = prepare_means(cost, SHAPE, pool, space)
    vision, llm = means.for_times()
    sizes = TransferSizes.for_model(llm_hidden=256, vision_hidden=128, vision_tokens_per_tile=64, dtype="float32")
    transfer = TransferMeans.of(pool, sizes)
    batches = sample_batches(len(pool), K, B, settings.seed)
    best = None
    for lay in enumerate_layouts(world=cluster.world_size, global_batch=B, microbatches=space.microbatches,
                                 vision_tp=space.vision_tp, llm_tp=space.llm_tp, colocated_tp=space.colocated_tp,
                                 vision_layers=LV, llm_layers=LL, mean_tiles=space.mean_tiles,
                                 per_node=cluster.gpus_per_node):
        sm = build_stage_model(lay, vision[lay.tp_v], llm[lay.tp_l], cluster=cluster, global_batch=B, transfer=transfer)
        for split in all_splits(sm):
            if not sm.fits(split):
                continue
            ev = evaluate_plan(sm.plan(split), cost, pool, batches, cluster, sizes, settings.scheduler,
                               seed=settings.seed)
            if ev.ok and (best is None or (ev.mean_s, lay.world_size) < (best.mean_s, best.plan.layout.world_size)):
                best = ev
    return best


@pytest.mark.slow
@pytest.mark.parametrize("memory,world,per_node,vision_factor", CASES)
def test_choice_equals_brute_force(pool, memory, world, per_node, vision_factor):
    cost = toy_cost_model(scale={"vision_layer": vision_factor, "vision_embed": vision_factor})
    cluster = Cluster(nodes=world // per_node, gpus_per_node=per_node, gpu_memory_bytes=memory,
                      inter_node_bytes_per_s=2e9)
    exact = SearchSettings.from_config(global_batch=B, microbatches=(1, 2, 4), sample_batches=K, top_k=10_000, racing=False)
    result = search(cost, SHAPE, pool, cluster, exact)
    best = brute_force(cost, pool, cluster, exact)
    assert result.chosen.plan == best.plan
    assert result.chosen.mean_s == pytest.approx(best.mean_s, rel=1e-12)
    # the default racing + top_k on the same space lands on the same plan here
    raced = search(cost, SHAPE, pool, cluster, SearchSettings.from_config(global_batch=B, microbatches=(1, 2, 4),
                                                               sample_batches=K, top_k=4))
    assert raced.chosen.mean_s <= best.mean_s * 1.02


@pytest.mark.parametrize("memory,world,per_node,vision_factor", CASES)
def test_every_simulated_plan_respects_the_constraints(pool, memory, world, per_node, vision_factor):
    cost = toy_cost_model(scale={"vision_layer": vision_factor, "vision_embed": vision_factor})
    cluster = Cluster(nodes=world // per_node, gpus_per_node=per_node, gpu_memory_bytes=memory)
    result = search(cost, SHAPE, pool, cluster, SearchSettings.from_config(global_batch=B, microbatches=(1, 2, 4),
                                                               sample_batches=2, top_k=6))
    rows = result.candidates
    ran = rows[(rows["level"] == "layout") & rows["batches"].fillna(0).gt(0)]
    assert len(ran) and ((ran["status"] == "chosen") & (ran["kind"] == "plan")).sum() == 1
    for r in ran.itertuples():
        assert r.world_size <= world
        assert per_node % r.tp_v == 0 and per_node % r.tp_l == 0  # TP inside a node
        vision_ranks = 0 if r.placement == "colocated" else r.tp_v * r.pp_v * r.dp_v
        assert vision_ranks % r.tp_l == 0  # so every LLM TP group sits in one node
        assert r.world_size <= per_node or r.world_size % per_node == 0  # torchrun: same ranks on every node
        assert r.tp_v in SHAPE.vision_tp_degrees and r.tp_l in SHAPE.llm_tp_degrees  # TP divides the heads
        assert sum(r.llm_layers) == LL and sum(r.vision_layers) == LV
        assert min(r.llm_layers) >= 1 and len(r.llm_layers) == r.pp_l
        assert r.m * r.dp_l <= B
        assert r.peak_memory_gb * 1e9 <= memory * (1 + 1e-9)
        if r.placement == "colocated":
            assert (r.tp_v, r.pp_v, r.dp_v) == (r.tp_l, 1, r.dp_l)
        else:
            assert r.tp_v * r.pp_v * r.dp_v + r.tp_l * r.pp_l * r.dp_l == r.world_size
    chosen = result.chosen
    assert np.all(chosen.memory_bytes <= memory)
    for base in rows[(rows["kind"] == "baseline") & (rows["status"] == "chosen")].itertuples():
        assert LL % base.pp_l == 0 and B % (base.m * base.dp_l) == 0  # uniform split, fixed-count microbatches
        assert base.llm_layers == [LL // base.pp_l] * base.pp_l


def test_nothing_fits_names_the_smallest_shortfall(pool):
    """The message's numbers are the minimum over every layout and split of the largest stage memory
    (memory techniques off; with them on, the message says it used them)."""
    cost = toy_cost_model()
    cluster = Cluster(nodes=1, gpus_per_node=2, gpu_memory_bytes=0.5e9)
    with pytest.raises(UserError, match="0.5 GB per GPU even with sharded optimizer, sequence parallelism:"):
        search(cost, SHAPE, pool, cluster, SearchSettings.from_config(global_batch=B, microbatches=(1, 2, 4)))
    settings = SearchSettings.from_config(global_batch=B, microbatches=(1, 2, 4), recompute="none", shard_optimizer=False,
                              sequence_parallel=False)
    with pytest.raises(UserError) as err:
        search(cost, SHAPE, pool, cluster, settings)
    space, _ = build_space(SHAPE, cost, cluster, placements=settings.planner.placements, microbatches=settings.planner.microbatches,
                           global_batch=B, mean_tiles=float(pool.n_tiles.mean()))
    means = prepare_means(cost, SHAPE, pool, space)
    vision, llm = means.for_times()
    transfer = TransferMeans.of(pool, TransferSizes(256 * 4, 64 * 128 * 4))
    need = min(build_stage_model(lay, vision[lay.tp_v], llm[lay.tp_l], cluster=cluster, global_batch=B,
                                 transfer=transfer).memory_at(split).max()
               for lay in enumerate_layouts(world=2, global_batch=B, microbatches=space.microbatches,
                                            vision_tp=space.vision_tp, llm_tp=space.llm_tp,
                                            colocated_tp=space.colocated_tp, vision_layers=LV, llm_layers=LL,
                                            mean_tiles=space.mean_tiles)
               for split in all_splits(build_stage_model(lay, vision[lay.tp_v], llm[lay.tp_l], cluster=cluster,
                                                         global_batch=B, transfer=transfer)))
    message = str(err.value)
    assert "\n" not in message and message.startswith("no plan fits in 0.5 GB per GPU")
    assert f"needs {need / 1e9:.3g} GB" in message and f"({(need - 0.5e9) / 1e9:.3g} GB short)" in message


def test_degree_rejections_are_explained(pool):
    cost = toy_cost_model(tp_degrees=(1, 2))
    shape = ModelShape(**{**SHAPE.__dict__, "llm_tp_degrees": (1,), "vision_tp_degrees": (1, 2, 4)})
    cluster = Cluster(nodes=1, gpus_per_node=4, gpu_memory_bytes=3e9)
    result = search(cost, shape, pool, cluster, SearchSettings.from_config(global_batch=B, microbatches=(1, 2, 16), top_k=2,
                                                               sample_batches=1))
    deg = result.candidates[result.candidates["level"] == "degree"]
    reasons = set(zip(deg["reason"], deg["tp_v"].fillna(0), deg["tp_l"].fillna(0), deg["m"].fillna(0)))
    assert ("tp_not_dividing_heads", 0, 2, 0) in reasons  # llm tp=2 does not divide its heads
    assert ("tp_not_profiled", 4, 0, 0) in reasons  # vision tp=4 divides the heads but was not profiled
    assert ("divisibility", 0, 0, 16) in reasons  # m=16 > global batch 8
    assert all(d for d in deg["detail"])


def test_launchable_means_whole_nodes_and_llm_tp_groups_inside_a_node():
    cluster = Cluster(nodes=2, gpus_per_node=8, gpu_memory_bytes=1e9)
    # part of one node, or whole nodes: torchrun starts the same number of ranks on every node
    assert cluster.launchable(5, 0, 1) and cluster.launchable(16, 0, 1)
    assert not cluster.launchable(12, 0, 1)
    # disjoint: 3 vision ranks then TP-2 LLM groups would put ranks 7 and 8 (two nodes) in one group
    assert not cluster.launchable(16, 3, 2) and cluster.launchable(16, 4, 2)
    assert list(cluster.launchable([8, 11, 16], [2, 2, 2], 2)) == [True, False, True]


def test_a_recorded_cluster_reads_back_and_bad_records_name_the_key():
    from dflop.config import Config
    from dflop.errors import UserError

    cluster = Cluster.from_section(Config.from_dict({"cluster": {"nodes": 2, "gpu_memory_gb": 40}}).cluster)
    assert Cluster.from_record(cluster.to_config(), "plan.yaml") == cluster
    for key, value in (("gpu_memory_gb", 0), ("intra_node_gbps", -1), ("nodes", True)):
        with pytest.raises(UserError, match=rf"p\.yaml: cluster\.{key} must be a number > 0"):
            Cluster.from_record({**cluster.to_config(), key: value}, "p.yaml")
    assert Cluster.from_record({**cluster.to_config(), "p2p_latency_us": 0}, "p.yaml").p2p_latency_s == 0
