"""A plan the planner chose under interleaved 1F1B or ZB-H1 goes through plan.yaml's writer and
reader unchanged (chunks in chunk order), with its techniques table priced per rank."""

import pytest

from dflop.plan import Layout, Plan, read_plan, write_plan
from dflop.planner.expected import evaluate_plan, sample_batches
from dflop.planner.planfile import plan_document
from dflop.planner.techniques import technique_costs, techniques_record
from dflop.pricing.cluster import Cluster
from dflop.pricing.pool import Pool, TransferSizes
from planner_testlib import toy_cost_model, toy_shapes

SIZES = TransferSizes.for_model(llm_hidden=256, vision_hidden=128, vision_tokens_per_tile=64, dtype="float32")


@pytest.mark.parametrize("schedule, chunks", [("interleaved", 2), ("zb-h1", 1)])
def test_chosen_schedule_round_trips_through_plan_yaml(tmp_path, schedule, chunks):
    """Bug caught: the techniques table reading chunk j's layers as rank j's (interleaved rank 1
    would be priced with chunk 1's 3 layers instead of its 6)."""
    cost, pool = toy_cost_model(tp_degrees=(1,)), Pool.from_shapes(toy_shapes(200, seed=2))
    cluster = Cluster(nodes=1, gpus_per_node=4, gpu_memory_bytes=80e9, inter_node_bytes_per_s=2e9)
    base = Plan(Layout("disjoint", 1, 1, 1, 1, 2, 1, 4), (2,), (7, 6))
    plan = base.with_schedule(schedule, chunks)
    ev = evaluate_plan(plan, cost, pool, sample_batches(len(pool), 2, 8, 0), cluster, SIZES)
    assert ev.ok
    table = technique_costs(plan, cost, pool, cluster, SIZES, global_batch=8)
    plain = technique_costs(base, cost, pool, cluster, SIZES, global_batch=8)
    assert list(table.loc[table["module"] == "llm", "layers"]) == [7, 6]
    doc = plan_document(chosen=ev, mean_shape_step_s=1.0, baseline=None, baseline_mean_shape_s=None, global_batch=8,
                        cluster=cluster, solver={}, evaluation={}, model={"arch": "llava_ov"}, inputs={},
                        techniques=techniques_record(table))
    assert len(table) == len(plain) and list(table["layers"]) == list(plain["layers"])
    path = tmp_path / "plan.yaml"
    write_plan(doc, path)
    back = read_plan(path).plan
    assert back == plan and (back.layout.schedule, back.layout.chunks) == (schedule, chunks)
    assert back.llm_rank_layers == (7, 6)
