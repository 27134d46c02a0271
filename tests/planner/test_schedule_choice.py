"""The planner chooses the LLM pipeline schedule (`planner.schedules`): a non-1F1B schedule where it
predicts a gain, 1F1B where the others do not fit, and only 1F1B unless the setting allows more.

The cases are built from first principles on a 4-GPU node where only one microbatch count is
allowed: with m = p = 4 the 1F1B bubble is (p - 1) / (m + p - 1) = 3/7 of the step, which ZB-H1's
weight-gradient passes fill; with a memory limit between the 1F1B plan's peak and ZB-H1's (which
holds min(m, p) microbatches on every LLM stage, 1F1B p - s), only 1F1B fits. The reference for
each choice is the plan's own evaluation (`evaluate_plan`) under every schedule it could run.
"""

from dataclasses import replace

import pytest

from dflop.costmodel.model import CostModel
from dflop.errors import UserError
from dflop.plan import Layout, Plan
from dflop.planner.expected import evaluate_plan, sample_batches
from dflop.planner.search import SearchSettings, schedule_options, search
from dflop.planner.space import ModelShape
from dflop.pricing.cluster import Cluster
from dflop.pricing.pool import Pool, TransferSizes
from planner_testlib import toy_cost_model, toy_shapes

SHAPE = ModelShape(vision_layers=2, llm_layers=16, vision_tp_degrees=(1,), llm_tp_degrees=(1,), vision_heads=4, llm_heads=4,
                   llm_kv_heads=2, vocab_size=1000, llm_hidden=256, vision_hidden=128, vision_tokens_per_tile=64,
                   llm_tokens_per_tile=64)
SIZES = TransferSizes.for_model(llm_hidden=256, vision_hidden=128, vision_tokens_per_tile=64, dtype="float32")
ALL = ("1f1b", "interleaved", "zb-h1")
K = 3


@pytest.fixture(scope="module")
def pool():
    return Pool.from_shapes(toy_shapes(300, seed=1))


@pytest.fixture(scope="module")
def cost():
    return toy_cost_model(tp_degrees=(1,))


def run(cost, pool, memory, schedules, batch=4, m=4, **techniques):
    cluster = Cluster(nodes=1, gpus_per_node=4, gpu_memory_bytes=memory, inter_node_bytes_per_s=2e9)
    settings = SearchSettings.from_config(global_batch=batch, microbatches=(m,), sample_batches=K,
                                          placements=("colocated",), schedules=schedules, **techniques)
    return search(cost, SHAPE, pool, cluster, settings), cluster


def as_1f1b(plan: Plan) -> Plan:
    """The same layout and per-rank split under 1F1B."""
    lay, tech = plan.layout, plan.llm_techniques
    return Plan(lay.with_schedule("1f1b"), plan.vision_layers, plan.llm_rank_layers,
                vision_techniques=plan.vision_techniques,
                llm_techniques=type(tech)(plan.llm_rank_recompute(), tech.shard_optimizer, tech.sequence_parallel))


def evaluations(plan, cost, pool, cluster, batch):
    batches = sample_batches(len(pool), K, batch, 0)
    return {o: evaluate_plan(plan if o == ("1f1b", 1) else plan.with_schedule(*o), cost, pool, batches, cluster, SIZES)
            for o in [("1f1b", 1)] + schedule_options(plan, ALL)}


def test_tiny_m_picks_a_schedule_that_fills_the_bubble(cost, pool):
    """m = p: the planner leaves 1F1B for a schedule its simulation prices faster on the same split.
    Bug caught: a variant timed with 1F1B's step (no gain seen) or never offered."""
    result, cluster = run(cost, pool, 80e9, ALL)
    chosen = result.chosen
    lay = chosen.plan.layout
    assert lay.pp_l == 4 and lay.m == 4 and lay.schedule != "1f1b"
    evs = evaluations(as_1f1b(chosen.plan), cost, pool, cluster, 4)
    assert chosen.mean_s == pytest.approx(evs[(lay.schedule, lay.chunks)].mean_s)
    assert chosen.mean_s < 0.9 * evs[("1f1b", 1)].mean_s
    # the "without" run is the same code with the setting at its default: 1F1B everywhere
    plain, _ = run(cost, pool, 80e9, ("1f1b",))
    assert plain.chosen.plan.layout.schedule == "1f1b"
    assert plain.chosen.mean_s == pytest.approx(evs[("1f1b", 1)].mean_s)
    # the data-blind (Megatron packed) baseline is tuned over the same schedules: never slower
    assert result.baseline.evaluation.mean_s <= plain.baseline.evaluation.mean_s * (1 + 1e-12)
    tried = result.candidates.query("kind == 'baseline'")
    assert set(tried["schedule"].dropna()) > {"1f1b"}


def test_memory_that_forbids_the_extra_in_flight_keeps_1f1b(cost, pool):
    """At 2 GB, no memory technique allowed, the 1F1B plan fits and its ZB-H1 and interleaved
    versions (more microbatches in flight on the later stages) do not. Bug caught: ZB-H1's memory priced with 1F1B's in-flight
    counts (its postponed weight gradients' inputs forgotten): the planner then picks ZB-H1. (The
    screen's own memory check is defence in depth: without it the race's 1F1B comparison still
    drops the variant, so this test passes.)"""
    result, cluster = run(cost, pool, 2e9, ALL, recompute="none", shard_optimizer=False, sequence_parallel=False)
    plan = result.chosen.plan
    assert plan.layout.schedule == "1f1b" and plan.layout.pp_l == 4
    evs = evaluations(plan, cost, pool, cluster, 4)
    assert evs[("1f1b", 1)].ok and len(evs) > 1
    assert all(not ev.ok and ev.failure.startswith("memory") for o, ev in evs.items() if o != ("1f1b", 1))


def test_never_slower_than_the_same_split_under_1f1b(cost, pool):
    """m = 2p with interleaving allowed: the screen (an LPT partition) can favour interleaving where
    the online scheduler's partitions, tuned on 1F1B simulations, favour 1F1B; the chosen plan's
    step is at most its split's 1F1B step on the same batches whichever way it goes. Bug caught:
    the screened schedule replacing 1F1B unchecked (here interleaving, about 10% slower)."""
    result, cluster = run(cost, pool, 80e9, ("1f1b", "interleaved"), batch=8, m=8)
    plan = result.chosen.plan
    evs = evaluations(as_1f1b(plan), cost, pool, cluster, 8)
    assert result.chosen.mean_s <= evs[("1f1b", 1)].mean_s * (1 + 1e-12)
    if plan.layout.schedule == "interleaved":
        assert len(plan.llm_layers) == plan.layout.pp_l * plan.layout.chunks


def test_options_need_pipeline_ranks_and_layers_per_chunk():
    one = Plan(Layout("colocated", 1, 1, 1, 1, 1, 1, 4), (2,), (16,))
    assert schedule_options(one, ALL) == []
    thin = Plan(Layout("colocated", 1, 1, 1, 1, 2, 1, 4), (2,), (2, 3))
    assert schedule_options(thin, ALL) == [("zb-h1", 1), ("interleaved", 2)]
    odd = Plan(Layout("colocated", 1, 1, 1, 1, 2, 1, 3), (2,), (8, 8))
    assert schedule_options(odd, ALL) == [("zb-h1", 1)]  # m not a multiple of pp: no interleaving


def test_schedules_setting_must_list_1f1b():
    with pytest.raises(UserError, match="planner.schedules must list 1f1b"):
        SearchSettings.from_config(schedules=("zb-h1",))
    with pytest.raises(UserError, match="planner.schedules"):
        SearchSettings.from_config(schedules=("1f1b", "gpipe"))


def with_full_recompute(cost: CostModel) -> CostModel:
    """The toy model with full-recompute costs on its layer modules: the backward plus one more
    forward, a tenth of the activations."""
    out = []
    for m in cost.modules.values():
        if m.module.endswith("_layer"):
            c = m.coef
            full = {"bwd_ms:full": tuple(b + f for b, f in zip(c["bwd_ms"], c["fwd_ms"])),
                    "act_bytes:full": tuple(0.1 * a for a in c["act_bytes"])}
            m = replace(m, coef={**c, **full})
        out.append(m)
    return CostModel(out, cost.provenance)


def test_full_recompute_never_takes_zb_h1(cost, pool):
    """m = p with every stage under full recomputation (``planner.recompute: full``): ZB-H1's W then
    recomputes the checkpointed forward, which the cost model does not price, so neither the search
    nor the Megatron-style baseline may choose it, although its (optimistic) evaluation is the
    fastest. Bug caught: the guard (`schedule_priced`) dropped from `_choose_schedules` or
    `baseline_schedules`: ZB-H1 is then chosen (reference: each schedule's own `evaluate_plan`)."""
    cost = with_full_recompute(cost)
    result, cluster = run(cost, pool, 80e9, ALL, recompute="full")
    plan = result.chosen.plan
    assert plan.layout.pp_l == 4 and plan.layout.schedule != "zb-h1"
    assert set(plan.llm_rank_recompute()) == {"full"}
    evs = evaluations(as_1f1b(plan), cost, pool, cluster, 4)
    assert evs[("zb-h1", 1)].ok and evs[("zb-h1", 1)].mean_s < min(ev.mean_s for o, ev in evs.items() if o[0] != "zb-h1")
    assert result.chosen.mean_s == pytest.approx(evs[(plan.layout.schedule, plan.layout.chunks)].mean_s)
    assert result.baseline.evaluation.plan.layout.schedule != "zb-h1"
    tried = result.candidates.query("kind == 'baseline'")
    assert "zb-h1" not in set(tried["schedule"].dropna()) and set(tried["schedule"].dropna()) > {"1f1b"}
