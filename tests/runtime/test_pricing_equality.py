"""One pricing path: for the same plan and global batch, the trainer's prediction (its online
scheduler's ``predicted_step_s``, what metrics.parquet records) is the planner's (what plan.yaml
records, `simulate_batch` / `evaluate_plan`), number for number.

Both sides are built as the product builds them: the trainer's scheduler by `step_planner` on
`training_pricing` with the cluster plan.yaml records (`plan_cluster`: the workflow's train rule
passes the trainer only the cluster's device keys, so the config it sees has default bandwidths),
the planner's by `simulate_batch` on the cluster and transfer sizes of the search. Any second
pricing path (transfers or all-reduces left out on one side, another cost model, another memory
limit, the config's cluster instead of the plan's) makes the numbers differ. Covered with a fitted
cost model and without one (the trainer's FLOP-count stand-in).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dflop.config import Config
from dflop.costmodel.analytic import analytic_cost_model
from dflop.errors import UserError
from dflop.costmodel.fit import fit_profile
from dflop.costmodel.profile_table import summarize_profile
from dflop.costmodel.synthetic import synthetic_profile
from dflop.models.handle import ModelHandle
from dflop.plan import Layout, Plan, plan_from_dict
from dflop.pricing.cluster import Cluster
from dflop.planner.expected import evaluate_plan, simulate_batch
from dflop.scheduler.settings import SchedulerSettings
from dflop.pricing.pool import Pool, TransferSizes
from dflop.scheduler.online import GlobalBatches
from dflop.runtime.settings import TrainSettings
from dflop.runtime.trainer import plan_cluster, step_planner, training_pricing
from synthetic_mix import llava_ov_mix

MODEL = {"arch": "llava_ov", "vision": "siglip-tiny", "llm": "qwen2.5-tiny"}


@pytest.fixture(scope="module")
def fitted():
    profile = synthetic_profile(patches_per_tile=16, preset="llava_ov/siglip-tiny/qwen2.5-tiny")
    return fit_profile(summarize_profile(profile))[0]


@pytest.mark.parametrize("costs", ["fitted", "stand-in"])
@pytest.mark.parametrize("layout", [Layout("disjoint", 1, 1, 2, 1, 2, 1, 4),   # vision | two LLM stages
                                    Layout("colocated", 1, 1, 2, 1, 1, 2, 2),  # vision inside LLM stage 0
                                    Layout("disjoint", 1, 1, 2, 1, 2, 1, 4, schedule="zb-h1")])
def test_trainer_and_planner_predict_the_same_step(fitted, layout, costs):
    # The plan was made for this cluster; the trainer's config has only the defaults.
    cluster = Cluster.from_section(Config.from_dict({"cluster": {"gpus_per_node": 8, "gpu_memory_gb": 80,
                                                                 "inter_node_gbps": 10}}).cluster)
    cfg = Config.from_dict({"model": MODEL, "train": {"global_batch_size": 16}, "scheduler": {"budget_ms": 50}})
    assert Cluster.from_section(cfg.cluster) != cluster
    settings = TrainSettings.from_config(cfg, adaptive_correction=False)
    model = ModelHandle.resolve(cfg.model)
    plan = Plan.uniform(layout, model.n_vision_layers, model.n_llm_layers)
    plan_file = plan_from_dict({**plan.to_dict(16), "cluster": cluster.to_config()}, "plan.yaml")
    shapes = llava_ov_mix(200, seed=4)
    cost = fitted if costs == "fitted" else None

    # The trainer's side: the scheduler rank 0 runs, on the trainer's pricing.
    pricing = training_pricing(plan_file.plan, model, cost, plan_cluster(plan_file, settings))
    batches = GlobalBatches(len(shapes), 16, settings.seed)
    planner = step_planner(settings, pricing, shapes, batches, model.sample_rules())

    # The planner's side: plan.yaml's machinery, on the search's cluster and transfer sizes.
    if cost is None:  # what `dflop simulate` prices with when there is no profile
        cost = analytic_cost_model(model.config, tp_degrees=[1], dtype=model.spec.dtype, preset=model.spec.preset)
    fitted = cost
    info = model.info
    sizes = TransferSizes.for_model(llm_hidden=info.llm_hidden, vision_hidden=info.vision_hidden,
                                    vision_tokens_per_tile=info.vision_tokens_per_tile,
                                    dtype=fitted.provenance.dtype)
    scheduler = SchedulerSettings.of_config(replace(settings.scheduler, ilp="never"))
    pool = Pool.from_shapes(shapes)
    try:
        trainer_steps, planner_steps = [], []
        for step in range(3):
            online = planner.get(step, timeout_s=60.0)
            part, timeline = simulate_batch(plan, fitted, pool.take(batches.rows(step)), cluster, sizes, scheduler,
                                            seed=settings.seed + step)
            trainer_steps.append(online.predicted_step_s)
            # ZB-H1: the partition (scored as 1F1B) timed under ZB-H1 with the batch's W share
            planner_steps.append(timeline.step_s if layout.schedule == "zb-h1" else part.step_s)
            if layout.schedule == "zb-h1":
                assert timeline.step_s < part.step_s  # not the 1F1B step
            assert online.member == part.member
        assert trainer_steps == planner_steps, (trainer_steps, planner_steps)
        assert np.all(np.asarray(trainer_steps) > 0)
        # ... and the planner's expected step of these batches is their mean.
        ev = evaluate_plan(plan, fitted, pool, [batches.rows(s) for s in range(3)], cluster, sizes, scheduler,
                           seed=settings.seed)
        assert ev.mean_s == pytest.approx(np.mean(planner_steps), rel=1e-12)
    finally:
        planner.close()


def test_the_trainers_stand_in_prices_sequence_parallel_activations():
    """Without a cost model the trainer prices a sequence-parallel LLM with the SP saving
    (`sequence_parallel_saving` per token per layer, the closed form the SP memory test measures),
    nothing else changed."""
    from dflop.costmodel.activations import sequence_parallel_saving

    cfg = Config.from_dict({"model": MODEL})
    model = ModelHandle.resolve(cfg.model)
    cluster = Cluster.from_section(cfg.cluster)
    plan = Plan.uniform(Layout("colocated", 2, 1, 1, 2, 1, 1, 2), model.n_vision_layers, model.n_llm_layers)
    batch = Pool.from_shapes(llava_ov_mix(8, seed=2))
    off = training_pricing(plan, model, None, cluster).batch(batch).costs
    on = training_pricing(plan.with_forced_techniques(sequence_parallel=True), model, None, cluster).batch(batch).costs
    nbytes = 2 if model.spec.dtype == "bfloat16" else 4
    saving = sequence_parallel_saving(model.info.llm_hidden, 2, nbytes) * model.n_llm_layers * batch.seq_len
    np.testing.assert_allclose(off.llm_act_bytes[0] - on.llm_act_bytes[0], saving, rtol=1e-9)
    np.testing.assert_array_equal(off.llm_fwd, on.llm_fwd)


@pytest.mark.parametrize("layout", [Layout("disjoint", 1, 1, 2, 1, 2, 1, 4), Layout("colocated", 1, 1, 2, 1, 1, 2, 2)])
def test_the_padded_baselines_prediction_pays_its_padding(fitted, layout):
    """The trainer's padded baseline (`scheduler.pad_to_longest`) predicts the step of its own bins
    with every sample's sequence raised to its bin's longest, as the executor runs it: rebuilt here
    from the StepPlan's bins (not from the baseline's bin rule), priced per sample and simulated
    (1F1B, the pricing's send latency and all-reduces). Priced packed, the prediction missed the
    padding: bench_trainer's padded variant measured 1.98x its prediction, the packed ones 1.42x."""
    from dataclasses import replace

    from dflop.scheduler.evaluate import simulate_times, stage_times

    cfg = Config.from_dict({"model": MODEL, "train": {"global_batch_size": 16},
                            "scheduler": {"policy": "baseline", "pad_to_longest": True}})
    settings = TrainSettings.from_config(cfg, adaptive_correction=False)
    model = ModelHandle.resolve(cfg.model)
    plan = Plan.uniform(layout, model.n_vision_layers, model.n_llm_layers)
    pricing = training_pricing(plan, model, fitted, Cluster.from_section(cfg.cluster))
    shapes = llava_ov_mix(200, seed=4)
    batches = GlobalBatches(len(shapes), 16, settings.seed)
    planner = step_planner(settings, pricing, shapes, batches, model.sample_rules())
    try:
        for step in range(3):
            online = planner.get(step)
            batch = Pool.from_shapes(shapes.iloc[list(online.rows)].reset_index(drop=True))
            microbatch, replica = np.zeros(len(batch), dtype=np.int64), np.zeros(len(batch), dtype=np.int64)
            longest = batch.seq_len.copy()
            for position, bins in enumerate(online.bins):
                for r, members in enumerate(bins):
                    members = list(members)
                    microbatch[members], replica[members] = online.microbatch_ids[position], r
                    longest[members] = batch.seq_len[members].max()
            assert (longest > batch.seq_len).any()  # this batch has padding to pay
            lay = plan.layout

            def step_s(pool):
                times = stage_times(pricing.batch(pool).costs, microbatch, replica, lay.m, lay.dp_l,
                                    lay.vision_replicas)
                return simulate_times(times, np.asarray(online.microbatch_ids), p2p_s=pricing.p2p_s,
                                      allreduce_s=pricing.allreduce_s).step_s

            assert online.predicted_step_s == pytest.approx(step_s(replace(batch, seq_len=longest)), rel=1e-9)
            assert online.predicted_step_s > step_s(batch) * 1.01
    finally:
        planner.close()


def test_the_trainers_scheduler_takes_only_usable_rows():
    """Rows of a global batch are priced without a second check (`Pool.from_shapes(checked=True)`),
    so a table with a failed sample must be refused up front: priced, it would train a sample the
    profiler could not read; filtered per batch (as before), the costs would cover fewer samples
    than the batch."""
    cfg = Config.from_dict({"model": MODEL, "train": {"global_batch_size": 16}})
    settings = TrainSettings.from_config(cfg, adaptive_correction=False)
    model = ModelHandle.resolve(cfg.model)
    plan = Plan.uniform(Layout("colocated", 1, 1, 2, 1, 1, 2, 2), model.n_vision_layers, model.n_llm_layers)
    plan_file = plan_from_dict({**plan.to_dict(16), "cluster": Cluster.from_section(cfg.cluster).to_config()},
                               "plan.yaml")
    pricing = training_pricing(plan_file.plan, model, None, plan_cluster(plan_file, settings))
    shapes = llava_ov_mix(40, seed=1)
    shapes["status"] = "ok"
    shapes.loc[7, "status"] = "error: unreadable image"
    with pytest.raises(UserError, match="status is not ok"):
        step_planner(settings, pricing, shapes, GlobalBatches(len(shapes), 16, 0), model.sample_rules())
    planner = step_planner(settings, pricing, shapes.drop(index=7).reset_index(drop=True),
                           GlobalBatches(39, 16, 0), model.sample_rules())
    planner.close()
