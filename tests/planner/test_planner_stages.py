"""Per-stage linear costs against the cost model's own stage API, the simulator and closed forms."""

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from dflop.costmodel.model import CostModel
from dflop.plan import in_flight_1f1b
from dflop.pricing.cluster import Cluster
from dflop.plan import Layout
from dflop.pricing.pool import Pool, TransferSizes
from dflop.planner.means import module_means
from dflop.planner.stages import TransferMeans, build_stage_model
from dflop.sim import simulate
from planner_testlib import random_stage_model

TILES, SEQ, VIS_TOKENS = 5, 700, 320


@pytest.fixture(scope="module")
def uniform_pool():
    """Every sample identical, so the mean microbatch is an actual microbatch."""
    n = 50
    return Pool.from_shapes(pd.DataFrame({"sample_id": [f"u{i}" for i in range(n)], "n_tiles": TILES,
                                          "seq_len": SEQ, "vision_tokens": VIS_TOKENS}))


def _model(cost_model, pool, layout, *, sizes=TransferSizes(0.0, 0.0), cluster=None, B=32, lv=6, ll=8):
    cluster = cluster or Cluster(nodes=1, gpus_per_node=8, gpu_memory_bytes=1e12)
    vm = module_means(cost_model, "vision", layout.tp_v, pool, lv)
    lm = module_means(cost_model, "llm", layout.tp_l, pool, ll)
    return build_stage_model(layout, vm, lm, cluster=cluster, global_batch=B, transfer=TransferMeans.of(pool, sizes))


@pytest.mark.parametrize("tp", [1, 2])
def test_disjoint_stages_match_cost_model_api(cost_model, uniform_pool, tp):
    layout = Layout("disjoint", tp, 2, 2, tp, 3, 2, 4)  # 32 samples: 8 per microbatch, 4 per replica
    sm = _model(cost_model, uniform_pool, layout)
    split = np.array([4, 2, 3, 1, 4])
    in_flight = in_flight_1f1b(5, 4)
    times, mems = sm.stage_time_s(split), sm.memory_at(split)
    for k in range(2):
        kw = dict(n_layers=int(split[k]), first=k == 0, last=k == 1, tp=tp)
        assert times[k] == pytest.approx(cost_model.vision_stage_time([TILES] * 4, **kw).total_s, rel=1e-12)
        mem = cost_model.vision_stage_memory([TILES] * 4, in_flight=in_flight[k], **kw).total_bytes
        assert mems[k] == pytest.approx(mem, rel=1e-12)
    for j in range(3):
        kw = dict(n_layers=int(split[2 + j]), first=j == 0, last=j == 2, tp=tp)
        assert times[2 + j] == pytest.approx(cost_model.llm_stage_time([SEQ] * 4, **kw).total_s, rel=1e-12)
        mem = cost_model.llm_stage_memory([SEQ] * 4, in_flight=in_flight[2 + j], **kw).total_bytes
        assert mems[2 + j] == pytest.approx(mem, rel=1e-12)


def test_colocated_first_stage_carries_the_vision_tower(cost_model, uniform_pool):
    layout = Layout("colocated", 1, 1, 2, 1, 2, 2, 2)  # 8 samples per bin
    sm = _model(cost_model, uniform_pool, layout)
    split = np.array([5, 3])
    expect = cost_model.colocated_stage_time([TILES] * 8, [SEQ] * 8, vision_layers=6, llm_layers=5, last=False,
                                             tp_v=1, tp_l=1)
    assert sm.stage_time_s(split)[0] == pytest.approx(expect.total_s, rel=1e-12)
    mem = cost_model.colocated_stage_memory([TILES] * 8, [SEQ] * 8, vision_layers=6, llm_layers=5, last=False,
                                            tp_v=1, tp_l=1, in_flight=2)
    assert sm.memory_at(split)[0] == pytest.approx(mem.total_bytes, rel=1e-12)
    assert sm.plan(split).vision_layers == (6,)


def test_transfers_are_charged_to_the_receiving_stage(cost_model, uniform_pool):
    sizes = TransferSizes(llm_token_bytes=1000.0, vision_tile_bytes=5000.0)
    cluster = Cluster(nodes=2, gpus_per_node=4, gpu_memory_bytes=1e12, intra_node_bytes_per_s=1e9,
                      inter_node_bytes_per_s=1e8)
    layout = Layout("disjoint", 1, 2, 2, 1, 2, 2, 4)  # 4 vision + 4 llm GPUs: modules in their own nodes
    plain = _model(cost_model, uniform_pool, layout, cluster=cluster)
    sent = _model(cost_model, uniform_pool, layout, cluster=cluster, sizes=sizes)
    split = np.array([3, 3, 4, 4])
    extra = sent.stage_time_s(split) - plain.stage_time_s(split)
    nu = 4  # samples per microbatch per replica
    vision_hop = nu * TILES * 5000.0 / 1e9  # vision stages share node 0
    features = nu * VIS_TOKENS * 1000.0 / 1e8  # vision -> llm crosses nodes
    llm_hop = nu * SEQ * 1000.0 / 1e9  # llm stages share node 1
    np.testing.assert_allclose(extra, [vision_hop, vision_hop + features, features + llm_hop, llm_hop], rtol=1e-12)


def test_objective_bounds_the_simulated_1f1b_step():
    """Identical microbatches: sim step <= objective <= reference (m + P - 1) max t, equal when stages are."""
    rng = np.random.default_rng(0)
    for trial in range(40):
        pp_l, m = int(rng.integers(1, 5)), int(rng.integers(1, 9))
        sm = random_stage_model(rng, pp_v=int(rng.integers(0, 3)), pp_l=pp_l, vision_layers=4, llm_layers=6, m=m,
                                latency=0.01)
        split = np.r_[[1] * (sm.n_stages - pp_l), [1] * pp_l]
        t = sm.stage_time_s(split)
        b = sm.coeffs.bwd_fixed + sm.coeffs.bwd_layer * split
        f = t - b
        sim = simulate(np.repeat(f[:, None], m, 1), np.repeat(b[:, None], m, 1), p2p_s=0.01).step_s
        P = sm.n_stages
        assert sim <= sm.objective_s(split) * (1 + 1e-12)
        assert sm.objective_s(split) <= (m + P - 1) * t.max() + 2 * (P - 1) * 0.01 + 1e-12
    flat = random_stage_model(rng, pp_v=0, pp_l=3, vision_layers=1, llm_layers=3, m=5)
    flat = replace(flat, by_mode={"none": replace(flat.coeffs, time_fixed=np.zeros(3), bwd_fixed=np.zeros(3))})
    assert flat.objective_s([1, 1, 1]) == pytest.approx((5 + 3 - 1) * flat.stage_time_s([1, 1, 1])[0], rel=1e-12)


def test_allreduce_and_node_placement_closed_forms():
    c = Cluster(nodes=2, gpus_per_node=4, intra_node_bytes_per_s=100.0, inter_node_bytes_per_s=10.0, p2p_latency_s=0.5)
    assert c.allreduce_s(1000.0, 1, True) == 0.0
    assert c.allreduce_s(1000.0, 4, True) == pytest.approx(2 * 3 / 4 * 1000 / 100 + 2 * 3 * 0.5)
    assert c.allreduce_s(1000.0, 4, False) == pytest.approx(2 * 3 / 4 * 1000 / 10 + 2 * 3 * 0.5)
    assert c.in_one_node(4, 4) and not c.in_one_node(2, 4)
    assert c.dp_group_intra(0, 2, 2, 2)  # stage blocks of 4 ranks aligned with nodes
    assert not c.dp_group_intra(2, 2, 2, 2)  # shifted by 2 ranks: blocks straddle nodes
    assert not c.dp_group_intra(0, 1, 1, 8)  # 8 replicas span both nodes


def test_granularity_is_the_expected_heaviest_of_a_microbatch():
    """E[max of k draws with replacement] / mean, against enumerating every draw of a small pool."""
    import itertools

    from dflop.planner.means import Granularity

    x = np.array([1.0, 2.0, 2.0, 5.0, 11.0])
    g = Granularity.of(x, global_batch=6, microbatches=(2, 3, 6))
    for m in (2, 3, 6):
        k = 6 // m
        exact = np.mean([max(draw) for draw in itertools.product(x, repeat=k)]) / x.mean()
        assert g.ratio[m] == pytest.approx(exact, rel=1e-12)
    assert g.nu_time(np.array([0.5, 4.0]), 2) == pytest.approx([g.ratio[2], 4.0])
    assert Granularity.none().nu_time(0.5, 2) == 0.5


@pytest.mark.parametrize("layout", [Layout("disjoint", 1, 2, 2, 1, 1, 2, 4), Layout("colocated", 1, 1, 2, 1, 1, 2, 2),
                                    Layout("disjoint", 1, 1, 2, 1, 2, 2, 4)], ids=["disjoint", "colocated", "pp_l=2"])
def test_a_tied_lm_head_is_held_once_where_one_stage_holds_both_ends(cost_model, uniform_pool, layout):
    """The planner's stage memory and gradient bytes against the cost model's stage API, with the
    LM head tied to the embedding: held once on an LLM stage that is first and last, on each end of
    a split (the reference `CostModel` is tested against the transformers model's own parameters)."""
    tied = CostModel([replace(m, tied_param_bytes=m.param_bytes) if m.module == "llm_head" else m
                      for m in cost_model.modules.values()], cost_model.provenance)
    sm = _model(tied, uniform_pool, layout)
    n_v, pp_l = layout.n_vision_stages, layout.pp_l
    split = np.array([3, 3][:n_v] + [8 // pp_l] * pp_l)
    in_flight = layout.in_flight()
    per_bin = 32 // (layout.m * layout.dp_l)
    for j in range(pp_l):
        n, last, flight = int(split[n_v + j]), j == pp_l - 1, in_flight[n_v + j]
        if layout.colocated:
            want = tied.colocated_stage_memory([TILES] * per_bin, [SEQ] * per_bin, vision_layers=6, llm_layers=n,
                                               last=last, tp_v=1, tp_l=1, in_flight=flight)
        else:
            want = tied.llm_stage_memory([SEQ] * per_bin, n_layers=n, first=j == 0, last=last, tp=1, in_flight=flight)
        assert sm.memory_at(split)[n_v + j] == pytest.approx(want.total_bytes, rel=1e-12)
        grad = sm.coeffs.grad_fixed[n_v + j] + sm.coeffs.grad_layer[n_v + j] * n
        assert grad == pytest.approx(want.grad_bytes, rel=1e-12)
    untied = _model(cost_model, uniform_pool, layout).memory_at(split)[n_v]
    head_state = cost_model.llm_stage_memory([SEQ], n_layers=0, first=False, last=True, tp=1, in_flight=1).static_bytes
    assert untied - sm.memory_at(split)[n_v] == pytest.approx(head_state if pp_l == 1 else 0.0, rel=1e-12, abs=1e-3)
