"""The planner's linear stage model and the one pricing path (`Pricing`) price a plan alike.

The MILP chooses a split from `StageModel`'s ``fixed + per_layer * n`` coefficients; the plan is then
judged by `Pricing` (per-sample costs, transfers, tails). For the mean microbatch (``nu`` samples of
the pool's mean costs) the two must give every stage the same time, memory and tail, on any layout.
Random layouts, splits, recompute modes, techniques, clusters and measured step costs, seeded.

Pricing's side is computed from what the scheduler sees (`Pricing.batch` over the whole pool):
a stage's mean microbatch takes its constant plus nu times the mean per-sample seconds, and holds
``memory + in_flight * (nu * mean per-sample bytes - limit)`` (`dflop.planner.expected.peak_memory`
for a bin of mean samples).

Not compared, and why:
- the heaviest-sample memory (the stage model's second bound; the scheduler checks real bins);
- transients of two modules on one stage: the scheduler prices a stage's transient by a bound linear
  in the samples (the largest constant plus each sample's largest term, `StageTerms`), the stage
  model by the largest module at the mean; only the LM head carries transients here, so the two
  coincide;
- a CPU cluster's sample loads: `Pricing` charges them, the stage model does not (the clusters here
  have no load line).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dflop.costmodel.model import TRANSIENT, BytesLine, CostModel, StepCosts
from dflop.profiling.columns import RECOMPUTE_TARGETS
from dflop.plan import RECOMPUTE_MODES, Layout
from dflop.planner.means import module_means
from dflop.planner.stages import TransferMeans, build_stage_model
from dflop.pricing.cluster import Cluster
from dflop.pricing.pool import Pool, TransferSizes
from dflop.pricing import stage
from dflop.pricing.pricing import Pricing
from planner_testlib import toy_cost_model, toy_shapes

VISION_LAYERS, LLM_LAYERS = 6, 8
LLM_HIDDEN = 64
CASES = 240


def _cost_model(rng) -> CostModel:
    """The toy model with recompute costs on the layers (slower backward, fewer bytes), a transient
    on the LM head, a tied head (or not), measured module optimizer steps (one module's sometimes
    missing) and random measured step costs."""
    base = toy_cost_model(tp_degrees=(1, 2))
    unmeasured = rng.choice(["", "", "llm_embed", "vision_layer", "llm_head"])
    tied = rng.choice([0.0, 0.25, 0.5])
    modules = []
    for m in base.modules.values():
        coef = dict(m.coef)
        if m.module in ("vision_layer", "llm_layer"):
            for k, mode in enumerate(mode for mode in RECOMPUTE_MODES if mode != "none"):
                bwd, act = RECOMPUTE_TARGETS[mode]
                coef[bwd] = tuple(c * (1.2 + 0.3 * k + 0.1 * rng.random()) for c in m.coef["bwd_ms"])
                coef[act] = tuple(c * (0.5 - 0.3 * k) * rng.random() for c in m.coef["act_bytes"])
        if m.module == "llm_head":
            coef[TRANSIENT] = tuple(rng.uniform(1e3, 1e6) for _ in m.coef["act_bytes"])
        optimizer_s = None if m.module == unmeasured else float(rng.uniform(1e-5, 1e-3) + 1e-11 * m.param_bytes)
        modules.append(replace(m, coef=coef, optimizer_s=optimizer_s,
                               tied_param_bytes=tied * m.param_bytes if m.module == "llm_head" else 0.0))
    sizes = sorted({int(x) for x in rng.choice([2, 3, 4, 6, 8, 12, 16, 24], size=4)})
    steps = StepCosts(
        optimizer=BytesLine(float(rng.uniform(1e-4, 1e-3)), float(rng.uniform(1e-10, 1e-9))),
        allreduce={g: BytesLine(float(rng.uniform(1e-4, 1e-3)), float(rng.uniform(1e-10, 1e-9))) for g in sizes},
        p2p=BytesLine(float(rng.uniform(1e-5, 1e-4)), float(rng.uniform(1e-10, 1e-9))) if rng.random() < 0.7 else None,
        optimizer_call_s=float(rng.uniform(1e-5, 1e-4)) if rng.random() < 0.7 else None)
    return CostModel(modules, replace(base.provenance, device="cpu"), steps)


def _layout(rng) -> Layout:
    m = int(rng.integers(1, 9))
    tp_l, pp_l, dp_l = int(rng.choice([1, 2])), int(rng.integers(1, 5)), int(rng.integers(1, 5))
    if rng.random() < 0.4:
        return Layout("colocated", tp_l, 1, dp_l, tp_l, pp_l, dp_l, m)
    return Layout("disjoint", int(rng.choice([1, 2])), int(rng.integers(1, 4)), int(rng.integers(1, 5)), tp_l, pp_l,
                  dp_l, m)


def _split(rng, total: int, stages: int) -> np.ndarray:
    """`total` layers over `stages` stages, each at least one, at random."""
    cuts = np.sort(rng.choice(np.arange(1, total), size=stages - 1, replace=False))
    return np.diff(np.r_[0, cuts, total])


def _cluster(rng, layout: Layout) -> Cluster:
    gpus_per_node = int(rng.choice([2, 4, 8, 16]))
    nodes = -(-layout.world_size // gpus_per_node) + int(rng.integers(0, 2))
    return Cluster(nodes=nodes, gpus_per_node=gpus_per_node, gpu_memory_bytes=80e9,
                   intra_node_bytes_per_s=float(rng.uniform(50e9, 300e9)),
                   inter_node_bytes_per_s=float(rng.uniform(5e9, 50e9)), p2p_latency_s=float(rng.uniform(0, 5e-5)),
                   device="cpu")


def _mean_microbatch(pricing: Pricing, pool: Pool, global_batch: int) -> tuple[np.ndarray, np.ndarray]:
    """[P] seconds (forward + backward) and peak bytes per rank of every stage on the mean microbatch,
    as `Pricing` prices the pool's samples (vision stages first)."""
    lay = pricing.plan.layout
    c = pricing.batch(pool).costs
    in_flight = np.asarray(lay.in_flight(), dtype=np.float64)
    memory = pricing.cluster.gpu_memory_bytes
    times, mems = [], []
    for side, nu in (("vision", global_batch / (lay.m * lay.dp_v)), ("llm", global_batch / (lay.m * lay.dp_l))):
        fwd, bwd = getattr(c, f"{side}_fwd"), getattr(c, f"{side}_bwd")
        const = getattr(c, f"{side}_fwd_const") + getattr(c, f"{side}_bwd_const")
        per_sample, limit = getattr(c, f"{side}_mem_bytes"), getattr(c, f"{side}_mem_limit_bytes")
        for k in range(len(const)):
            f = in_flight[len(times)]
            times.append(const[k] + nu * float(np.mean(fwd[k] + bwd[k])))
            mems.append(memory + f * (nu * float(np.mean(per_sample[k])) - limit[k]))
    return np.array(times), np.array(mems)


def _case(seed: int):
    rng = np.random.default_rng(seed)
    cost, layout = _cost_model(rng), _layout(rng)
    cluster = _cluster(rng, layout)
    pool = Pool.from_shapes(toy_shapes(int(rng.integers(40, 120)), seed=seed))
    global_batch = int(rng.integers(layout.m * layout.dp_l, 4 * layout.m * layout.dp_l + 1))
    shard = (bool(rng.random() < 0.5) and layout.dp_v > 1, bool(rng.random() < 0.5) and layout.dp_l > 1)
    sp = bool(rng.random() < 0.5) and layout.tp_l > 1
    sizes = TransferSizes.for_model(llm_hidden=LLM_HIDDEN, vision_hidden=32, vision_tokens_per_tile=16, dtype="float32")
    vision = module_means(cost, "vision", layout.tp_v, pool, VISION_LAYERS, modes=RECOMPUTE_MODES)
    llm = module_means(cost, "llm", layout.tp_l, pool, LLM_LAYERS, modes=RECOMPUTE_MODES,
                       sequence_parallel_hidden=LLM_HIDDEN if sp else 0)
    sm = build_stage_model(layout, vision, llm, cluster=cluster, global_batch=global_batch,
                           transfer=TransferMeans.of(pool, sizes), shard=shard, dtype="float32",
                           step_costs=cost.step_costs_on(cluster.device))
    n_v = layout.n_vision_stages
    n = np.r_[_split(rng, VISION_LAYERS, n_v) if n_v else np.zeros(0, dtype=int), _split(rng, LLM_LAYERS, layout.pp_l)]
    modes = [str(rng.choice(sm.modes)) for _ in range(sm.n_stages)]
    pricing = Pricing(sm.plan(n, modes), cost, cluster, sizes)
    return sm, n, modes, pricing, pool, global_batch


@pytest.mark.parametrize("block", range(4))
def test_every_stage_costs_the_same_in_the_stage_model_and_in_pricing(block):
    for seed in range(block * CASES // 4, (block + 1) * CASES // 4):
        sm, n, modes, pricing, pool, global_batch = _case(seed)
        times, mems = _mean_microbatch(pricing, pool, global_batch)
        c = sm.coeffs_of(modes)
        where = f"seed {seed}: {pricing.plan.describe()}"
        assert np.allclose(sm.stage_time_s(n, modes), times, rtol=1e-9, atol=0), where
        assert np.allclose(c.mem_mean_fixed + c.mem_mean_layer * n, mems, rtol=1e-9, atol=0), where
        assert np.allclose(sm.allreduce_at(n), pricing.allreduce_s, rtol=1e-9, atol=0), where
        assert sm.latency_s == pricing.p2p_s, where


def test_the_random_cases_cover_what_they_claim():
    """The seeds reach both placements, several stages per module, every recompute mode, sharding,
    sequence parallelism, tied heads, unmeasured modules and measured all-reduce lines in use."""
    seen = set()
    for seed in range(CASES):
        sm, n, modes, pricing, _, _ = _case(seed)
        lay, plan, cost = pricing.plan.layout, pricing.plan, pricing.cost
        seen.add(lay.placement)
        seen.update(f"mode {m}" for m in modes)
        seen.add("pp_v > 1" if lay.pp_v > 1 else "pp_v 1")
        seen.add("pp_l > 1" if lay.pp_l > 1 else "pp_l 1")
        if plan.llm_techniques.shard_optimizer and lay.dp_l > 1:
            seen.add("sharded")
        if plan.llm_techniques.sequence_parallel:
            seen.add("sp")
        if cost.tied_llm_state(lay.tp_l).grad_bytes > 0 and lay.pp_l > 1:
            seen.add("tied across stages")
        if any(m.optimizer_s is None for m in cost.modules.values()):
            seen.add("unmeasured module")
        if cost.step_costs.allreduce.get(lay.dp_l) is not None and lay.dp_l > 1:
            seen.add("measured all-reduce")
    assert {"disjoint", "colocated", *(f"mode {m}" for m in RECOMPUTE_MODES), "pp_v > 1", "pp_l > 1", "sharded",
            "sp", "tied across stages", "unmeasured module", "measured all-reduce"} <= seen


def test_a_tail_term_added_in_the_one_place_moves_both_sides(monkeypatch):
    """A new cost written once, in `dflop.pricing.stage`'s tail (here 1 ms per stage plus 1 ns per
    gradient byte), reaches the stage model and `Pricing` alike: every stage's tail moves by the same
    seconds on both sides. Fails where either side composes its tail apart from `stage_tails`
    (as the stage model's own `tail` did before; checked by pointing it at `dflop.pricing.tail`)."""
    seeds = range(0, CASES, 12)

    def tails():
        out = []
        for seed in seeds:
            sm, n, _, pricing, _, _ = _case(seed)
            out.append((sm.allreduce_at(n), pricing.allreduce_s, pricing.states.grad_bytes))
        return out

    before = tails()
    real = stage.stage_tails_s

    def with_new_term(layout, grad_bytes, *args, **kwargs):
        return real(layout, grad_bytes, *args, **kwargs) + 1e-3 + 1e-9 * np.asarray(grad_bytes, dtype=np.float64)

    monkeypatch.setattr(stage, "stage_tails_s", with_new_term)
    for seed, (sm_was, pricing_was, grads), (sm_now, pricing_now, _) in zip(seeds, before, tails()):
        moved = 1e-3 + 1e-9 * grads
        assert np.allclose(pricing_now - pricing_was, moved, rtol=1e-6, atol=0), seed
        assert np.allclose(sm_now - sm_was, moved, rtol=1e-6, atol=0), seed
