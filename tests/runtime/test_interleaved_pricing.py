"""The trainer's prediction for an interleaved 1F1B plan: every LLM model chunk priced as a stage
of its own, the step simulated with the simulator's interleaved schedule over the chunks.

The references are independent of the pricing's bookkeeping: the chunks' costs are those of the
one-chunk plan whose stages are the chunks (same layers, embedding, head and hops), and the step is
`simulate_dp(..., schedule="interleaved")` of bin times summed here by hand.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dflop.config import Config
from dflop.models.handle import ModelHandle
from dflop.plan import Layout, Plan
from dflop.pricing.cluster import Cluster
from dflop.pricing.pool import Pool
from dflop.runtime.trainer import training_pricing
from dflop.scheduler.evaluate import simulate_times, stage_times
from dflop.sim import simulate_dp
from synthetic_mix import llava_ov_mix

MODEL = {"arch": "llava_ov", "vision": "siglip-tiny", "llm": "qwen2.5-tiny"}


@pytest.mark.parametrize("placement,pp_v", [("disjoint", 1), ("colocated", 1)])
def test_interleaved_plan_is_priced_per_chunk_and_simulated_interleaved(placement, pp_v):
    """Fails if a chunk misses its hop or its embedding / head, a rank row is not its chunks' sum,
    a chunk pays another rank's tail, or the step is simulated as 1F1B of the ranks."""
    # one node: the one-chunk twin's 4 LLM ranks get the same links as the interleaved plan's 2
    cfg = Config.from_dict({"model": MODEL, "cluster": {"gpus_per_node": 8}})
    model = ModelHandle.resolve(cfg.model)
    cluster = Cluster.from_section(cfg.cluster)
    pp, v, m, layers = 2, 2, 4, (1, 0, 1, 0)  # rank 0: embedding and both layers; rank 1: the head
    interleaved = Plan(Layout(placement, 1, pp_v, 1, 1, pp, 1, m, "interleaved", v), (2,), layers)
    one_chunk = Plan(Layout(placement, 1, pp_v, 1, 1, pp * v, 1, m), (2,), layers)  # the chunks as stages
    pool = Pool.from_shapes(llava_ov_mix(16, seed=3))
    priced = training_pricing(interleaved, model, None, cluster).batch(pool)
    reference = training_pricing(one_chunk, model, None, cluster).batch(pool)
    costs, chunks = priced.costs, priced.costs.llm_chunks

    assert chunks is not None and chunks.chunks == v
    for name in ("fwd", "bwd", "fwd_const", "bwd_const"):
        np.testing.assert_array_equal(getattr(chunks, name), getattr(reference.costs, f"llm_{name}"))
    for r in range(pp):
        np.testing.assert_allclose(costs.llm_fwd[r], chunks.fwd[r] + chunks.fwd[r + pp])
        np.testing.assert_allclose(costs.llm_bwd_const[r], chunks.bwd_const[r] + chunks.bwd_const[r + pp])
    np.testing.assert_array_equal(costs.vision_fwd, reference.costs.vision_fwd)
    assert priced.allreduce_s.shape == (interleaved.layout.n_stages,)

    # A partition: sample i in microbatch i mod m (one replica); bins summed by hand.
    microbatch = np.arange(costs.n_samples) % m
    replica = np.zeros_like(microbatch)
    order = np.array([2, 0, 3, 1])
    times = stage_times(costs, microbatch, replica, m, 1, 1)

    def per_mb(x, const):
        if not len(const):  # colocated: no vision stage of its own
            return np.zeros((0, m))
        return np.stack([[x[s, microbatch == j].sum() + const[s] for j in range(m)] for s in range(len(const))])

    vf = per_mb(costs.vision_fwd, costs.vision_fwd_const)
    vb = per_mb(costs.vision_bwd, costs.vision_bwd_const)
    lf = per_mb(chunks.fwd, chunks.fwd_const)[None]
    lb = per_mb(chunks.bwd, chunks.bwd_const)[None]
    # a tail on the last rank only: it ends with chunk 1's backward (after chunk 2's on rank 0)
    tails = np.zeros(interleaved.layout.n_stages)
    tails[-1] = 1.0
    n_v = interleaved.layout.n_vision_stages
    chunk_tails = np.concatenate([tails[:n_v], [tails[n_v + c % pp] for c in range(pp * v)]])
    expected = simulate_dp(vf, vb, lf, lb, order=order, p2p_s=1e-4, allreduce_s=chunk_tails,
                           schedule="interleaved", chunks=v)
    got = simulate_times(times, order, p2p_s=1e-4, allreduce_s=tails)
    assert got.schedule == "interleaved" and got.step_s == pytest.approx(expected.step_s, rel=1e-12)
    as_1f1b = simulate_dp(vf, vb, per_mb(costs.llm_fwd, costs.llm_fwd_const)[None],
                          per_mb(costs.llm_bwd, costs.llm_bwd_const)[None], order=order, p2p_s=1e-4,
                          allreduce_s=tails)
    assert as_1f1b.step_s != pytest.approx(got.step_s, rel=1e-9)


def test_a_rank_whose_chunks_recompute_differently_is_priced_by_chunk_for_time_and_at_most_for_memory():
    """A hand-written plan may give a rank's chunks different recompute modes (the equivalence
    test's does). Its times are each chunk's own (the chunk recomputing fully pays a forward more
    in its backward); its memory is the rank's in the mode that saves least: the same plan with
    every chunk of that rank in that mode. Fails if pricing refuses such a plan or prices a rank's
    memory in a mode that saves more than one of its chunks does."""
    cfg = Config.from_dict({"model": MODEL, "cluster": {"gpus_per_node": 8}})
    model = ModelHandle.resolve(cfg.model)
    cluster = Cluster.from_section(cfg.cluster)
    lay = Layout("colocated", 1, 1, 1, 1, 2, 1, 4, "interleaved", 2)
    mixed = Plan(lay, (2,), (1, 1, 1, 1)).with_forced_techniques("none")
    mixed = mixed.with_techniques(mixed.vision_techniques, replace(mixed.llm_techniques,
                                                                   recompute=("none", "full", "full", "full")))
    none_on_rank0 = mixed.with_techniques(mixed.vision_techniques, replace(
        mixed.llm_techniques, recompute=("none", "full", "none", "full")))
    full = mixed.with_techniques(mixed.vision_techniques, replace(mixed.llm_techniques, recompute=("full",) * 4))
    pool = Pool.from_shapes(llava_ov_mix(16, seed=3))
    got, same_memory, same_chunk2 = (training_pricing(p, model, None, cluster).batch(pool).costs
                                     for p in (mixed, none_on_rank0, full))
    np.testing.assert_array_equal(got.llm_mem_bytes, same_memory.llm_mem_bytes)
    np.testing.assert_array_equal(got.llm_mem_limit_bytes, same_memory.llm_mem_limit_bytes)
    np.testing.assert_array_equal(got.llm_chunks.bwd[2], same_chunk2.llm_chunks.bwd[2])
    assert (got.llm_chunks.bwd[2] > same_memory.llm_chunks.bwd[2]).all()  # full recompute on chunk 2
