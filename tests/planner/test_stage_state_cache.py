"""The stage model's cached state lines (`stages._state_lines`) equal `stage_state_lines` computed
afresh, for layouts that share a cache key and layouts that must not: different DP degrees and m
(the key leaves them out: the state does not read them), and different TP degrees, stage counts
and placements (the key holds them). A key holding too little (say, without the modules' state
functions, one per TP degree) hands one TP degree's state to another, and this test fails."""

import numpy as np
import pytest

from dflop.costmodel.analytic import analytic_cost_model
from dflop.models.builder import model_config
from dflop.plan import Layout
from dflop.planner.means import module_means
from dflop.planner.stages import TransferMeans, build_stage_model
from dflop.pricing.cluster import Cluster
from dflop.pricing.pool import Pool
from dflop.pricing.stage import modules_state_of, stage_state_lines
from dflop.planner.milp import stage_times_by_layers
from synthetic_mix import llava_ov_mix

MODES = ("none", "selective", "full")
# (placement, tp_v, pp_v, dp_v, tp_l, pp_l, dp_l, m): pairs that differ only in dp / m share a key
LAYOUTS = [Layout("disjoint", 1, 2, 2, 1, 3, 2, 4), Layout("disjoint", 1, 2, 4, 1, 3, 1, 8),
           Layout("disjoint", 2, 2, 2, 2, 3, 2, 4), Layout("disjoint", 2, 1, 2, 1, 3, 2, 4),
           Layout("disjoint", 1, 2, 2, 1, 2, 2, 4), Layout("colocated", 1, 1, 2, 1, 3, 2, 4),
           Layout("colocated", 2, 1, 1, 2, 3, 1, 2), Layout("colocated", 1, 1, 4, 1, 3, 4, 4)]


@pytest.fixture(scope="module")
def means():
    cost = analytic_cost_model(model_config("llava_ov", "siglip-small", "qwen2.5-small"), tp_degrees=(1, 2),
                               dtype="bfloat16")
    pool = Pool.from_shapes(llava_ov_mix(200, seed=0))
    return ({tp: module_means(cost, "vision", tp, pool, 6, modes=MODES) for tp in (1, 2)},
            {tp: module_means(cost, "llm", tp, pool, 8, modes=MODES) for tp in (1, 2)})


def test_cached_state_lines_equal_fresh_ones(means):
    vision, llm = means
    cluster = Cluster(nodes=2, gpus_per_node=8, gpu_memory_bytes=1e11)
    for _ in range(2):  # the second pass reads every key from the cache
        for lay in LAYOUTS:
            v, l = vision[lay.tp_v], llm[lay.tp_l]
            sm = build_stage_model(lay, v, l, cluster=cluster, global_batch=48, transfer=TransferMeans(1e5, 2e5, 3e5),
                                   dtype="bfloat16")
            state, per_layer = stage_state_lines(lay, modules_state_of(v.state, l.state), v.n_layers)
            for mode in sm.modes:  # the coefficients carry the state's bytes and optimizer seconds
                c = sm.by_mode[mode]
                for got, want in ((c.grad_fixed, state.grad_bytes), (c.grad_layer, per_layer.grad_bytes),
                                  (c.optim_fixed, state.optimizer_s), (c.optim_layer, per_layer.optimizer_s)):
                    assert np.array_equal(got, want, equal_nan=True), lay


def test_stage_times_by_layers_reads_every_mode(means):
    """`stage_times_by_layers` (coefficients gathered by assignment) against the broadcast form it replaced."""
    vision, llm = means
    cluster = Cluster(nodes=2, gpus_per_node=8, gpu_memory_bytes=3e8)  # tight: some modes do not fit
    names = ("time_fixed", "time_layer", "mem_mean_fixed", "mem_mean_layer", "mem_max_fixed", "mem_max_layer")
    for lay in LAYOUTS:
        sm = build_stage_model(lay, vision[lay.tp_v], llm[lay.tp_l], cluster=cluster, global_batch=48,
                               transfer=TransferMeans(1e5, 2e5, 3e5), dtype="bfloat16")
        P = sm.n_stages
        L = max(sm.vision_layers if sm.is_vision.any() else 0, sm.llm_layers)
        n = np.arange(1, L + 1, dtype=np.float64)
        k = np.array([[np.broadcast_to(getattr(c, f), (P,)) for f in names] for c in sm.by_mode.values()],
                     dtype=np.float64)[..., None]
        t = k[:, 0] + k[:, 1] * n
        mem = np.maximum(k[:, 2] + k[:, 3] * n, k[:, 4] + k[:, 5] * n)
        out = np.where(mem <= sm.memory_bytes * (1 + 1e-9), t, np.inf).min(axis=0)
        module = np.where(sm.is_vision, sm.vision_layers, sm.llm_layers)[:, None]
        want = np.where(n[None, :] <= module, out, np.inf)
        assert np.array_equal(stage_times_by_layers(sm), want), lay
