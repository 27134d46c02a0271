"""Measured step costs (optimizer, all-reduce, P2P): fitted lines, the JSON round trip, and how the
one pricing path charges them, each against a hand computation."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from dflop.costmodel.fit import fit_step_costs
from dflop.costmodel.jsonio import cost_model_to_dict, cost_model_from_dict, load_cost_model, save_cost_model
from dflop.costmodel.model import BytesLine, CostModel, StepCosts
from dflop.costmodel.profile_table import summarize_profile
from dflop.costmodel.synthetic import synthetic_profile
from dflop.errors import UserError
from dflop.plan import Layout, Plan, Techniques
from dflop.pricing.cluster import Cluster
from dflop.pricing.pool import Pool, TransferSizes
from dflop.pricing.pricing import Pricing
from planner_testlib import toy_cost_model, toy_shapes

SIZES = np.array([4096.0, 65536.0, 2**20, 2**24])


def _rows(kind, ranks, const_ms, ms_per_byte, sizes=SIZES):
    return pd.DataFrame({"kind": kind, "ranks": ranks, "bytes": sizes, "ms": const_ms + sizes * ms_per_byte})


def test_lines_through_exact_measurements_are_recovered():
    rows = pd.concat([_rows("optimizer", 1, 0.4, 2e-6), _rows("allreduce", 2, 0.3, 1e-6),
                      _rows("allreduce", 4, 0.5, 3e-6), _rows("p2p", 2, 0.2, 5e-7),
                      _rows("allreduce", 8, 0.9, 1e-6, sizes=SIZES[:1])])  # one size: no line
    costs = fit_step_costs(rows)
    assert costs.optimizer.const_s == pytest.approx(0.4e-3) and costs.optimizer.per_byte_s == pytest.approx(2e-9)
    assert sorted(costs.allreduce) == [2, 4]
    assert costs.allreduce[4](2**20) == pytest.approx((0.5 + 2**20 * 3e-6) * 1e-3)
    assert costs.p2p.const_s == pytest.approx(0.2e-3) and costs.p2p.per_byte_s == pytest.approx(5e-10)
    assert fit_step_costs(None) == StepCosts()


def test_profile_table_reads_optimizer_and_link_rows():
    profile = synthetic_profile(patches_per_tile=16, preset="llava_ov/siglip-tiny/qwen2.5-tiny")
    profile["optim_ms"] = 0.1 + profile["param_bytes"] * 1e-6
    links = _rows("p2p", 2, 0.2, 1e-6).rename(columns={"kind": "module", "ranks": "batch", "ms": "fwd_ms"})
    table = pd.concat([profile, links.assign(device=profile["device"].iloc[0], dtype=profile["dtype"].iloc[0],
                                             preset=profile["preset"].iloc[0])], ignore_index=True)
    summary = summarize_profile(table)
    optimizer = summary.step_costs[summary.step_costs["kind"] == "optimizer"]
    params = profile[profile["param_bytes"] > 0].groupby(["module", "tp"])["param_bytes"].median()
    assert len(optimizer) == len(params)  # one point per module with parameters
    assert np.allclose(optimizer["ms"], 0.1 + optimizer["bytes"] * 1e-6)
    assert set(summary.shapes["module"]) == set(profile["module"])  # link rows are not modules
    bad = table.copy()
    bad.loc[bad.index[-1], "fwd_ms"] = -1.0
    with pytest.raises(UserError, match="p2p measurement at 16777216.0 bytes over 2 ranks"):
        summarize_profile(bad, source="prof.parquet")


def test_step_costs_round_trip_exactly(tmp_path):
    base = toy_cost_model(tp_degrees=(1,))
    costs = StepCosts(optimizer=BytesLine(4.1e-4, 1.3e-9), allreduce={2: BytesLine(6e-4, 1.1e-9)},
                      p2p=BytesLine(3e-5, 7e-10))
    model = CostModel(base.modules.values(), base.provenance, costs)
    save_cost_model(model, tmp_path / "c.json")
    assert load_cost_model(tmp_path / "c.json").step_costs == costs
    data = cost_model_to_dict(model)
    data["step_costs"]["p2p"]["const_s"] = -1.0
    with pytest.raises(UserError, match="step_costs/p2p/const_s"):
        cost_model_from_dict(data, source="c.json")
    assert "step_costs" not in cost_model_to_dict(base)  # an unmeasured model writes none
    data = cost_model_to_dict(model)
    data["step_costs"]["allreduce"].append(dict(data["step_costs"]["allreduce"][0]))
    with pytest.raises(UserError, match="step_costs/allreduce lists a group size twice"):
        cost_model_from_dict(data, source="c.json")


def _pricing(costs: StepCosts, layout: Layout, *, device="cpu", gpus_per_node=8, shard=False, cost_device="cpu"):
    base = toy_cost_model(tp_degrees=(1,))
    model = CostModel(base.modules.values(), replace(base.provenance, device=cost_device), costs)
    plan = Plan.uniform(layout, 4, 4)
    if shard:
        plan = plan.with_techniques(plan.vision_techniques, Techniques(("none",) * layout.pp_l, shard_optimizer=True))
    cluster = Cluster(nodes=2, gpus_per_node=gpus_per_node, gpu_memory_bytes=80e9, intra_node_bytes_per_s=100e9,
                      inter_node_bytes_per_s=10e9, p2p_latency_s=20e-6, device=device)
    sizes = TransferSizes.for_model(llm_hidden=64, vision_hidden=32, vision_tokens_per_tile=16, dtype="float32")
    return Pricing(plan, model, cluster, sizes), model


MEASURED = StepCosts(optimizer=BytesLine(4e-4, 1e-9), allreduce={2: BytesLine(6e-4, 2e-9)}, p2p=BytesLine(3e-4, 5e-10))


def test_pricing_charges_the_measured_sync_optimizer_and_hops_inside_a_node():
    layout = Layout("disjoint", 1, 1, 1, 1, 2, 2, 2)  # vision on 1 rank, LLM pp 2 x dp 2: 5 ranks, one node
    pricing, model = _pricing(MEASURED, layout)
    plain, _ = _pricing(StepCosts(), layout)
    # by hand from the toy modules' parameter bytes (grads in the same dtype: same bytes)
    p = {name: model.module(name, 1).param_bytes for name in ("vision_embed", "vision_layer", "projector",
                                                                "llm_embed", "llm_layer", "llm_head")}
    vision = p["vision_embed"] + 4 * p["vision_layer"] + p["projector"]
    llm = [p["llm_embed"] + 2 * p["llm_layer"], 2 * p["llm_layer"] + p["llm_head"]]
    optimizer = [4e-4 + 1e-9 * b for b in (vision, *llm)]
    sync = [plain.allreduce_s[0]] + [6e-4 + 2e-9 * b for b in llm]  # vision dp 1: no all-reduce, the cluster's 0
    assert plain.allreduce_s[0] == 0.0
    assert np.allclose(pricing.allreduce_s, np.add(sync, optimizer), rtol=1e-12)
    assert pricing.p2p_s == 3e-4 and plain.p2p_s == 20e-6
    batch = Pool.from_shapes(toy_shapes(16, seed=1))
    hop = batch.seq_len * 64 * 4 * 5e-10  # LLM hidden x float32 bytes x the measured per-byte
    got, unmeasured = pricing.batch(batch).costs, plain.batch(batch).costs
    assert np.allclose(got.llm_fwd[1] - unmeasured.llm_fwd[1], hop - batch.seq_len * 64 * 4 / 100e9)


def test_measured_costs_stay_where_they_were_measured():
    layout = Layout("disjoint", 1, 1, 1, 1, 2, 2, 2)
    plain, _ = _pricing(StepCosts(), layout, device="cuda")
    cuda_cluster, _ = _pricing(MEASURED, layout, device="cuda")  # a CPU profile says nothing about GPUs
    assert np.array_equal(cuda_cluster.allreduce_s, plain.allreduce_s) and cuda_cluster.p2p_s == plain.p2p_s
    # across nodes (4 GPUs per node: the 5 ranks span two) the cluster's numbers price the hops
    spread, _ = _pricing(MEASURED, layout, gpus_per_node=4)
    spread_plain, _ = _pricing(StepCosts(), layout, gpus_per_node=4)
    assert spread.p2p_s == spread_plain.p2p_s
    # a sharded module holds 1/dp of the parameters: its optimizer step is priced on those
    sharded, model = _pricing(MEASURED, layout, shard=True)
    unsharded, _ = _pricing(MEASURED, layout)
    llm_params = np.array([model.module("llm_embed", 1).param_bytes + 2 * model.module("llm_layer", 1).param_bytes,
                           2 * model.module("llm_layer", 1).param_bytes + model.module("llm_head", 1).param_bytes])
    # ... and its sync is one reduce-scatter and one all-gather call (one FSDP group per stage), not buckets
    assert np.allclose(unsharded.allreduce_s[1:] - sharded.allreduce_s[1:], 1e-9 * llm_params / 2 - 6e-4, rtol=1e-12)


def test_colocated_stage_pays_the_optimizer_of_the_tower_and_its_llm_layers():
    layout = Layout("colocated", 1, 1, 2, 1, 2, 2, 2)
    pricing, model = _pricing(MEASURED, layout)
    p = {name: model.module(name, 1).param_bytes for name in ("vision_embed", "vision_layer", "projector",
                                                                "llm_embed", "llm_layer", "llm_head")}
    stage0 = p["vision_embed"] + 4 * p["vision_layer"] + p["projector"] + p["llm_embed"] + 2 * p["llm_layer"]
    stage1 = 2 * p["llm_layer"] + p["llm_head"]
    # the trainer buckets each module's gradients apart (`GradientSync._plan_buckets`): the stage holding
    # the tower and the first LLM layers pays the all-reduce constant twice, the next once
    by_hand = [6e-4 * calls + 2e-9 * b + 4e-4 + 1e-9 * b for calls, b in zip((2, 1), (stage0, stage1))]
    assert np.allclose(pricing.allreduce_s, by_hand, rtol=1e-12)


def test_unmeasured_group_sizes_and_groups_across_nodes_use_the_cluster():
    # dp 4 was not measured (only 2 ranks profiled): the cluster's ring all-reduce, plus the optimizer
    layout = Layout("colocated", 1, 1, 4, 1, 1, 4, 1)
    measured, model = _pricing(MEASURED, layout)
    plain, _ = _pricing(StepCosts(), layout)
    params = sum(model.module(n, 1).param_bytes for n in ("vision_embed", "projector", "llm_embed", "llm_head"))
    params += 4 * (model.module("vision_layer", 1).param_bytes + model.module("llm_layer", 1).param_bytes)
    assert np.allclose(measured.allreduce_s, plain.allreduce_s + 4e-4 + 1e-9 * params, rtol=1e-12)
    # dp 2 groups that leave a node (1 GPU per node): the cluster's inter-node numbers
    layout = Layout("colocated", 1, 1, 2, 1, 1, 2, 1)
    across, _ = _pricing(MEASURED, layout, gpus_per_node=1)
    across_plain, _ = _pricing(StepCosts(), layout, gpus_per_node=1)
    assert np.allclose(across.allreduce_s, across_plain.allreduce_s + 4e-4 + 1e-9 * params, rtol=1e-12)


@pytest.mark.parametrize("layout", [Layout("colocated", 1, 1, 2, 1, 1, 2, 2), Layout("disjoint", 1, 2, 1, 1, 2, 2, 2)],
                         ids=["colocated pp_l=1", "disjoint pp 2+2"])
def test_a_stages_optimizer_is_one_call_plus_its_modules_measured_steps(layout):
    """A profile with per-module optimizer steps and the one-element step: each module's share is its
    step less the call (per layer for a layer stacked n_layers deep), a stage pays the call once
    plus its modules' shares, a tied head's weight once where the embedding is on the stage too
    (by hand from the profile's numbers); the bytes line is no longer what prices it."""
    from dflop.costmodel.fit import fit_profile

    profile = synthetic_profile(patches_per_tile=16, preset="llava_ov/siglip-tiny/qwen2.5-tiny")
    step_ms = {"vision_embed": 0.3, "vision_layer": 1.1, "projector": 0.5, "llm_embed": 0.2, "llm_layer": 1.9,
               "llm_head": 0.7}
    profile["optim_ms"] = profile["module"].map(step_ms).fillna(0.0)
    profile["optim_call_ms"] = 0.05
    profile["n_layers"] = np.where(profile["module"] == "llm_layer", 2, profile["n_layers"])  # a stack of 2 layers
    head = profile["module"] == "llm_head"
    profile.loc[head, "tied_bytes"] = profile.loc[head, "param_bytes"] / 2  # half the head is the tied table
    profile["tied_bytes"] = profile["tied_bytes"].fillna(0.0)
    cost, _ = fit_profile(summarize_profile(profile))
    share = {m: (ms - 0.05) * 1e-3 for m, ms in step_ms.items()}
    share["llm_layer"] /= 2
    assert cost.module("llm_layer", 1).optimizer_s == pytest.approx(share["llm_layer"], rel=1e-12)
    assert cost.step_costs.optimizer_call_s == pytest.approx(0.05e-3)
    cost = CostModel(cost.modules.values(), cost.provenance,
                     replace(cost.step_costs, optimizer=BytesLine(1.0, 1.0), allreduce={}))  # a line that would show
    cluster = Cluster(nodes=1, gpus_per_node=8, gpu_memory_bytes=80e9, device=cost.provenance.device)
    plan = Plan.uniform(layout, 4, 4)
    sizes = TransferSizes.for_model(llm_hidden=64, vision_hidden=32, vision_tokens_per_tile=16, dtype="float32")
    pricing = Pricing(plan, cost, cluster, sizes)
    tied_share = share["llm_head"] / 2
    vision = [share["vision_embed"] * (k == 0) + n * share["vision_layer"] + share["projector"] * (k == len(
        plan.vision_layers) - 1) for k, n in enumerate(plan.vision_layers)]
    llm = [share["llm_embed"] * (j == 0) + n * share["llm_layer"] + share["llm_head"] * (j == layout.pp_l - 1)
           - tied_share * (layout.pp_l == 1) for j, n in enumerate(plan.llm_layers)]
    optimizer = np.array(([vision[0] + llm[0]] + llm[1:]) if layout.colocated else vision + llm) + 0.05e-3
    plain = Pricing(plan, CostModel(cost.modules.values(), cost.provenance, StepCosts()), cluster, sizes)
    assert np.allclose(pricing.allreduce_s - plain.allreduce_s, optimizer, rtol=1e-12)


def test_the_step_pays_its_world_all_reduces_and_the_tied_tables_sum():
    """By hand: a world inside one node whose all-reduce was measured pays two of its constants (the
    loss totals, the global norm) on every stage; with a tied embedding on two LLM stages (pp_l 2)
    those two stages also sum the table's gradient over their pair (the measured 2-rank line) and
    sync it in its own data-parallel bucket (one more constant)."""
    costs = StepCosts(allreduce={2: BytesLine(6e-4, 2e-9), 4: BytesLine(9e-4, 3e-9)})
    layout = Layout("colocated", 1, 1, 2, 1, 2, 2, 2)  # world 4: LLM stages of 2 replicas
    untied, model = _pricing(costs, layout)
    head = model.module("llm_head", 1)
    tied_model = CostModel([replace(m, tied_param_bytes=m.param_bytes) if m.module == "llm_head" else m
                            for m in model.modules.values()], model.provenance, costs)
    tied = Pricing(untied.plan, tied_model, untied.cluster, untied.sizes)
    plain, _ = _pricing(StepCosts(), layout)
    p = {name: model.module(name, 1).param_bytes for name in ("vision_embed", "vision_layer", "projector",
                                                                "llm_embed", "llm_layer", "llm_head")}
    stages = [p["vision_embed"] + 4 * p["vision_layer"] + p["projector"] + p["llm_embed"] + 2 * p["llm_layer"],
              2 * p["llm_layer"] + p["llm_head"]]
    world = 2 * 9e-4
    by_hand = [6e-4 * calls + 2e-9 * b + world for calls, b in zip((2, 1), stages)]
    assert np.allclose(untied.allreduce_s, by_hand, rtol=1e-12)
    pair = 6e-4 + 2e-9 * head.param_bytes  # float32: the gradient's bytes are the parameter's
    assert np.allclose(tied.allreduce_s - untied.allreduce_s, [pair + 6e-4, pair + 6e-4], rtol=1e-12)
    # the world spread over two nodes (2 GPUs a node; each data-parallel pair still in one): the
    # world's all-reduce was not measured there, so the step pays none
    spread, _ = _pricing(costs, layout, gpus_per_node=2)
    pairs_only, _ = _pricing(StepCosts(allreduce={2: costs.allreduce[2]}), layout, gpus_per_node=2)
    assert np.allclose(spread.allreduce_s, pairs_only.allreduce_s, rtol=1e-12)
    assert np.allclose(untied.allreduce_s - spread.allreduce_s, world, rtol=1e-12)
    assert np.all(plain.allreduce_s < untied.allreduce_s)
