"""The trainer's prediction for an interleaved 1F1B plan: every LLM model chunk priced as a stage
of its own, the step simulated with the simulator's interleaved schedule over the chunks.

The references are independent of the pricing's bookkeeping: the chunks' costs are those of the
one-chunk plan whose stages are the chunks (same layers, embedding, head and hops), and the step is
`simulate_dp(..., schedule="interleaved")` of bin times summed here by hand.
"""

from __future__ import annotations

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
